"""Regression check: this checkout's server against another checkout's, same client, in
alternating rounds.

Starts gunicorn (2 workers, the feed-ranker alone, V2 JSON, one item per request) from each
checkout in turn, ``--rounds`` times, the side that goes first alternating from round to round
(baseline then this checkout, this checkout then baseline, ...), and drives each with the same
closed-loop client (:func:`benchmarks.driver.drive`): ``--seconds`` at one connection (p50
latency, ms) and at 64 (items/s). Alternating rounds and orders spread the machine's drift over
both sides (with the baseline always first, a machine slowing through the run made this
checkout look 8 % slower at c = 64 in one run and 1.4 % in a run the other way round);
the medians are compared. Each server runs with its own checkout on
``PYTHONPATH`` and its own ``gunicorn.conf.py``, so only the server differs.

    git worktree add /tmp/baseline <commit>        # the checkout to compare with
    cp model_repository/feed-ranker/model.pt2 /tmp/baseline/model_repository/feed-ranker/
    python -m benchmarks.regression --baseline /tmp/baseline --rounds 8 --out regression.json

Traffic goes only to 127.0.0.1; every run is bounded by ``--seconds``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import driver, payloads, report, server

#: 32 different one-item feed-ranker requests, cycled.
BODIES = payloads.v2_bodies(server.DEMO_REPOSITORY, server.RANKER, 1, 32)
URL_PATH = f"/v2/models/{server.RANKER}/infer"


def measure(checkout: Path, seconds: float, env: dict[str, str] | None = None) -> dict[str, float]:
    """One round on one checkout's server (``env``: more of its environment): p50 ms at c = 1,
    items/s at c = 64."""
    repository = checkout / "model_repository"
    with (
        tempfile.TemporaryDirectory() as tmp,
        server.start(Path(tmp), repository, server.RANKER, 2, env, root=checkout) as srv,
    ):
        srv.wait_ready(300, count=2)
        url = srv.url + URL_PATH
        asyncio.run(driver.drive(url, BODIES, 1, 8, 2.0))  # warm both workers
        one = asyncio.run(driver.drive(url, BODIES, 1, 1, seconds))
        many = asyncio.run(driver.drive(url, BODIES, 1, 64, seconds))
    return {"c1_p50_ms": round(one["p50_ms"], 3), "c64_items_per_s": round(many["items_per_s"], 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", type=Path, required=True, help="checkout of the server to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0, help="per concurrency level")
    parser.add_argument("--out", type=Path, help="JSON file for the results")
    args = parser.parse_args(argv)
    sides = {"baseline": args.baseline.resolve(), "this tree": server.ROOT}
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for turn in range(args.rounds):
        order = list(sides.items()) if turn % 2 == 0 else list(reversed(sides.items()))
        for name, checkout in order:
            rounds[name].append(measure(checkout, args.seconds))
            print(name, rounds[name][-1], flush=True)
    medians = {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for name, runs in rounds.items()
    }
    result: dict[str, Any] = report.record(baseline=str(sides["baseline"]), rounds=rounds, medians=medians)
    print(markdown(result))
    report.write_json(args.out, result)


def markdown(result: dict[str, Any]) -> str:
    """Round by round and the medians: c = 1 p50 and c = 64 items/s of both sides."""
    base, this = result["rounds"]["baseline"], result["rounds"]["this tree"]
    rows: list[tuple[object, ...]] = [
        (i + 1, b["c1_p50_ms"], t["c1_p50_ms"], b["c64_items_per_s"], t["c64_items_per_s"])
        for i, (b, t) in enumerate(zip(base, this, strict=True))
    ]
    mb, mt = result["medians"]["baseline"], result["medians"]["this tree"]
    rows.append(("median", mb["c1_p50_ms"], mt["c1_p50_ms"], mb["c64_items_per_s"], mt["c64_items_per_s"]))
    header = (
        "round",
        "baseline c = 1 p50 ms",
        "this c = 1 p50 ms",
        "baseline c = 64 items/s",
        "this c = 64 items/s",
    )
    return report.table(header, rows, "lrrrr")


if __name__ == "__main__":
    main()
