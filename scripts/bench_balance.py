#!/usr/bin/env python
"""Balancing benchmark: persistent connections over sibling workers, and one large request.

For each model (MiniLM with ``--items`` items per request, the feed-ranker) it starts gunicorn
with ``--workers`` workers on 127.0.0.1 (``SCORING_TORCH_THREADS`` per worker, default 1) and
drives it in a closed loop with persistent connections (one aiohttp session with a connector
limit of c: c connections opened once and reused) at each level c, for ``--duration`` seconds
each: items/s, p50/p99 latency, and each worker's share of the items (from
``scoring_worker_items_total{pid}`` in /metrics, not from timing). Then, on an idle server with
1 and with 2 workers, the latency of one request of ``--large-items`` MiniLM items (median of
``--large-repeats``), which scatter/gather splits over the workers.

Writes a JSON file of every figure and prints Markdown tables for docs/benchmarks.md.

    python scripts/bench_balance.py --out bench_balance.json
    python scripts/bench_balance.py --no-balance --out bench_nobalance.json   # the same, balancing off

Each level stops by itself after ``--duration`` seconds; traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from app.models.repository import read_config  # noqa: E402
from scripts import harness  # noqa: E402
from scripts.benchmark import drive, payload, server  # noqa: E402

MINILM, RANKER = "all-MiniLM-L6-v2", "feed-ranker"


def balance_parser(doc: str | None, levels: str, levels_help: str) -> argparse.ArgumentParser:
    """The options of both balancing benchmarks (this one and ``bench_grpc_balance``): the
    server's, the concurrency levels, seconds per level, items per request of each model."""
    parser = harness.benchmark_parser(doc, models=f"{MINILM},{RANKER}", torch_threads=1)
    parser.add_argument("--levels", default=levels, help=levels_help)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per level")
    parser.add_argument("--items", type=int, default=8, help="MiniLM items per request")
    parser.add_argument("--ranker-items", type=int, default=1, help="feed-ranker items per request")
    return parser


def bodies(repo: Path, model: str, items: int, count: int = 32) -> list[bytes]:
    config = read_config(repo / model)
    rng = random.Random(0)
    return [payload(model, config.inputs, items, rng) for _ in range(count)]


def levels_for(
    repo: Path, model: str, items: int, workers: int, levels: list[int], seconds: float
) -> dict[str, Any]:
    url_model = f"/v2/models/{model}/infer"
    with tempfile.TemporaryDirectory() as tmp, server(Path(tmp), repo, model, workers) as srv:
        srv.wait_ready(300, count=workers)
        data = bodies(repo, model, items)
        asyncio.run(drive(srv.url + url_model, data, items, 2, min(2.0, seconds)))  # warm up
        rows = []
        for c in levels:
            before = harness.worker_items(srv.scrape())
            row = asyncio.run(drive(srv.url + url_model, data, items, c, seconds))
            row["worker_share"] = harness.worker_shares(before, harness.worker_items(srv.scrape()))
            rows.append(row)
            print(f"{model} c={c}: {row}", flush=True)
    return {"model": model, "items_per_request": items, "workers": workers, "levels": rows}


async def one_request(url: str, body: bytes) -> float:
    """One request on a fresh connection; its latency, ms."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        answer = await harness.post(session, url, body)
    if answer.status != 200:
        raise SystemExit(f"large request: {answer.error}")
    return answer.latency_s * 1000


def large_request(repo: Path, items: int, repeats: int) -> dict[str, Any]:
    body = bodies(repo, MINILM, items, count=1)[0]
    out: dict[str, Any] = {"model": MINILM, "items": items, "repeats": repeats}
    for workers in (1, 2):
        with tempfile.TemporaryDirectory() as tmp, server(Path(tmp), repo, MINILM, workers) as srv:
            srv.wait_ready(300, count=workers)
            url = srv.url + f"/v2/models/{MINILM}/infer"
            asyncio.run(one_request(url, body))  # warm up
            times = []
            for _ in range(repeats):
                times.append(asyncio.run(one_request(url, body)))
                time.sleep(0.5)  # idle between requests: recent load decays
            out[f"workers_{workers}_ms"] = harness.percentiles(times, (50,))[0]
        print(f"large request, {workers} worker(s): {out[f'workers_{workers}_ms']:.1f} ms", flush=True)
    out["ratio_2_over_1"] = out["workers_2_ms"] / out["workers_1_ms"]
    return out


def markdown(result: dict[str, Any]) -> str:
    lines = []
    for run in result["runs"]:
        balance = "on" if result["balance"] else "off"
        lines += [
            f"\n**{run['model']}**, {run['items_per_request']} item(s) per request, "
            f"{run['workers']} workers, torch threads {result['torch_threads']} per worker, "
            f"balancing {balance}\n",
            "| connections | items/s | p50 ms | p99 ms | errors | share of items per worker |",
            "| ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for row in run["levels"]:
            share = " / ".join(f"{100 * s:.0f} %" for s in row["worker_share"].values())
            lines.append(
                f"| {row['concurrency']} | {row['items_per_s']:.0f} | {row['p50_ms']:.2f} "
                f"| {row['p99_ms']:.2f} | {row['errors']} | {share} |"
            )
    large = result.get("large")
    if large:
        lines += [
            f"\nOne request of {large['items']} MiniLM items on an idle server "
            f"(median of {large['repeats']}): "
            f"1 worker {large['workers_1_ms']:.0f} ms, 2 workers {large['workers_2_ms']:.0f} ms "
            f"(ratio {large['ratio_2_over_1']:.2f}).",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = balance_parser(__doc__, "1,2,4,8,16,64", "connection counts")
    parser.add_argument("--large-items", type=int, default=256)
    parser.add_argument("--large-repeats", type=int, default=5, help="0 skips the large-request figure")
    parser.add_argument("--no-balance", action="store_true", help="SCORING_BALANCE=0 (the comparison)")
    parser.add_argument("--out", type=Path, default=Path("bench_balance.json"))
    args = parser.parse_args()

    os.environ["SCORING_TORCH_THREADS"] = str(args.torch_threads)
    os.environ["SCORING_BALANCE"] = "0" if args.no_balance else "1"
    levels = [int(c) for c in args.levels.split(",")]
    runs = []
    for model in args.models.split(","):
        items = args.items if model == MINILM else args.ranker_items
        runs.append(levels_for(args.repository, model, items, args.workers, levels, args.duration))
    result: dict[str, Any] = {
        "machine": harness.machine(),
        "torch_threads": args.torch_threads,
        "balance": not args.no_balance,
        "duration_s": args.duration,
        "runs": runs,
    }
    if args.large_repeats > 0 and MINILM in args.models:
        result["large"] = large_request(args.repository, args.large_items, args.large_repeats)
    args.out.write_text(json.dumps(result, indent=2))
    table = markdown(result)
    args.out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
