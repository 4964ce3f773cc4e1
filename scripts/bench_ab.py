#!/usr/bin/env python
"""Regression check: this tree's server against another checkout's, same client, alternating.

Starts gunicorn (2 workers, the feed-ranker alone, V2 JSON, one item per request) from each
checkout in turn, ``--rounds`` times (baseline, then this tree, then baseline, ...), and drives
each with the same closed-loop client (``harness.closed_loop``): ``--seconds`` at one
connection (p50 latency, ms) and at 64 (items/s). Alternating rounds spread the machine's drift
over both sides; the medians are compared. Each server runs with its own checkout on
``PYTHONPATH`` and its own ``gunicorn.conf.py``, so only the server differs.

    git worktree add /tmp/baseline 410e91a      # the checkout to compare with
    cp model_repository/feed-ranker/model.pt2 /tmp/baseline/model_repository/feed-ranker/
    python scripts/bench_ab.py --baseline /tmp/baseline --rounds 3 --out docs/benchmarks/ab-cpu.json

Traffic goes only to 127.0.0.1; every run is bounded by ``--seconds``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts import harness  # noqa: E402
from scripts.benchmark import server  # noqa: E402

URL_PATH = "/v2/models/feed-ranker/infer"
#: 32 different one-item feed-ranker requests, cycled.
BODIES = [
    json.dumps(
        {
            "inputs": [
                {
                    "name": "features",
                    "shape": [1, 32],
                    "datatype": "FP32",
                    "data": [(i * 7 + j) % 10 / 10 for j in range(32)],
                }
            ]
        }
    ).encode()
    for i in range(32)
]


def start(checkout: Path, tmp: Path) -> harness.Gunicorn:
    """gunicorn from ``checkout`` (2 workers, its feed-ranker) on a free loopback port, ready."""
    srv = server(tmp, checkout / "model_repository", "feed-ranker", 2, root=checkout)
    srv.wait_ready(300, count=2)
    return srv


async def drive(url: str, connections: int, seconds: float) -> tuple[float, float]:
    """Closed loop over ``connections`` keep-alive connections: (items/s, p50 ms)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections)) as session:
        sent = list(range(connections))

        def request(i: int) -> Awaitable[harness.Answer]:
            body = BODIES[sent[i] % len(BODIES)]
            sent[i] += connections
            return harness.post(session, url + URL_PATH, body)

        begin = time.perf_counter()
        answers = await harness.closed_loop(request, connections, begin + seconds)
        elapsed = time.perf_counter() - begin
    ok = [a.latency_s * 1000 for a in answers if a.status == 200]
    return len(ok) / elapsed, harness.percentiles(ok, (50,))[0]


def measure(checkout: Path, seconds: float) -> dict[str, float]:
    """One round on one checkout: p50 ms at c = 1, items/s at c = 64."""
    with tempfile.TemporaryDirectory() as tmp, start(checkout, Path(tmp)) as srv:
        asyncio.run(drive(srv.url, 8, 2.0))  # warm both workers
        _, p50 = asyncio.run(drive(srv.url, 1, seconds))
        rate, _ = asyncio.run(drive(srv.url, 64, seconds))
    return {"c1_p50_ms": round(p50, 3), "c64_items_per_s": round(rate, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", type=Path, required=True, help="checkout of the server to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0, help="per concurrency level")
    parser.add_argument("--out", type=Path, help="JSON file for the results")
    args = parser.parse_args()
    sides = {"baseline": args.baseline.resolve(), "this tree": ROOT}
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, checkout in sides.items():
            rounds[name].append(measure(checkout, args.seconds))
            print(name, rounds[name][-1], flush=True)
    result: dict[str, Any] = {
        "machine": harness.machine(),
        "date": time.strftime("%Y-%m-%d"),
        "rounds": rounds,
    }
    result["medians"] = {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for name, runs in rounds.items()
    }
    print(json.dumps(result["medians"], indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
