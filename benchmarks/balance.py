"""Balancing: persistent connections over sibling workers, and one large request.

For each model (MiniLM with ``--items`` items per request, the feed-ranker with
``--ranker-items``) it starts gunicorn with ``--workers`` workers on 127.0.0.1
(``SCORING_TORCH_THREADS`` per worker, default 1) and drives it in a closed loop with persistent
connections (one aiohttp session with a connector limit of c: c connections opened once and
reused) at each level c, for ``--duration`` seconds each: items/s, p50/p99 latency, and each
worker's share of the items (from ``scoring_worker_items_total{pid}`` in /metrics, not from
timing). Then, on an idle server with 1 and with 2 workers, the latency of one request of
``--large-items`` MiniLM items (median of ``--large-repeats``), which scatter/gather splits
over the workers.

Writes a JSON record of every figure (``--out``) and the Markdown tables beside it (``.md``).

    python -m benchmarks.balance --out docs/benchmarks/balance-cpu.json
    python -m benchmarks.balance --no-balance --large-repeats 0 --out docs/benchmarks/balance-off-cpu.json

Each level stops by itself after ``--duration`` seconds; traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks import driver, payloads, report, server
from benchmarks.server import MINILM, RANKER
from tests.support.gunicorn import worker_items, worker_shares


def balance_parser(doc: str | None, levels: str, levels_help: str, out: str) -> argparse.ArgumentParser:
    """The options of both balancing benchmarks (this one and :mod:`benchmarks.grpc_balance`):
    the server's, the concurrency levels, seconds per level, items per request of each model,
    and where the record goes (``out`` by default)."""
    parser = server.parser(doc, models=f"{MINILM},{RANKER}", torch_threads=1)
    parser.add_argument("--levels", type=server.levels, default=server.levels(levels), help=levels_help)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per level")
    parser.add_argument("--items", type=int, default=8, help="MiniLM items per request")
    parser.add_argument("--ranker-items", type=int, default=1, help="feed-ranker items per request")
    parser.add_argument("--out", type=Path, default=Path(out), help="JSON record; tables beside it (.md)")
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser``'s arguments; every server started afterwards runs ``--torch-threads`` per
    worker (``SCORING_TORCH_THREADS``)."""
    args = parser.parse_args(argv)
    os.environ["SCORING_TORCH_THREADS"] = str(args.torch_threads)
    return args


def items_for(args: argparse.Namespace, model: str) -> int:
    """Items per request of ``model`` (``--items`` for MiniLM, ``--ranker-items`` otherwise)."""
    return int(args.items if model == MINILM else args.ranker_items)


def levels_for(
    repo: Path, model: str, items: int, workers: int, levels: list[int], seconds: float
) -> dict[str, Any]:
    url_path = f"/v2/models/{model}/infer"
    with tempfile.TemporaryDirectory() as tmp, server.start(Path(tmp), repo, model, workers) as srv:
        srv.wait_ready(300, count=workers)
        data = payloads.v2_bodies(repo, model, items, 32)
        asyncio.run(driver.drive(srv.url + url_path, data, items, 2, min(2.0, seconds)))  # warm up
        rows = []
        for c in levels:
            before = worker_items(srv.scrape())
            row = asyncio.run(driver.drive(srv.url + url_path, data, items, c, seconds))
            row["worker_share"] = worker_shares(before, worker_items(srv.scrape()))
            rows.append(row)
            print(f"{model} c={c}: {row}", flush=True)
    return {"model": model, "items_per_request": items, "workers": workers, "levels": rows}


async def one_request(url: str, body: bytes) -> float:
    """One request on a fresh connection; its latency, ms.

    Raises:
        SystemExit: the request failed.
    """
    async with aiohttp.ClientSession() as session:
        answer = await driver.post(session, url, body)
    if answer.status != 200:
        raise SystemExit(f"large request: {answer.error}")
    return answer.latency_s * 1000


def large_request(repo: Path, items: int, repeats: int) -> dict[str, Any]:
    """Median latency of one ``items``-item MiniLM request on an idle server of 1 and of 2
    workers (scatter/gather splits it over both), and their ratio."""
    body = payloads.v2_bodies(repo, MINILM, items, 1)[0]
    out: dict[str, Any] = {"model": MINILM, "items": items, "repeats": repeats}
    for workers in (1, 2):
        with tempfile.TemporaryDirectory() as tmp, server.start(Path(tmp), repo, MINILM, workers) as srv:
            srv.wait_ready(300, count=workers)
            url = srv.url + f"/v2/models/{MINILM}/infer"
            asyncio.run(one_request(url, body))  # warm up
            times = []
            for _ in range(repeats):
                times.append(asyncio.run(one_request(url, body)))
                time.sleep(0.5)  # idle between requests: the recent load decays
            out[f"workers_{workers}_ms"] = driver.percentiles(times, (50,))[0]
        print(f"large request, {workers} worker(s): {out[f'workers_{workers}_ms']:.1f} ms", flush=True)
    out["ratio_2_over_1"] = out["workers_2_ms"] / out["workers_1_ms"]
    return out


def levels_markdown(result: dict[str, Any], transport: str, level: str, forwarded: bool = False) -> str:
    """One caption and table per run of ``result["runs"]``: items/s, latency, errors, (requests
    forwarded,) and each worker's share per level."""
    parts = []
    for run in result["runs"]:
        balance = "on" if run.get("balance", result.get("balance")) else "off"
        parts.append(
            f"**{run['model']}**{transport}, {run['items_per_request']} item(s) per request, "
            f"{run['workers']} workers, torch threads {result['torch_threads']} per worker, "
            f"balancing {balance}"
        )
        header = [level, "items/s", "p50 ms", "p99 ms", "errors", *(["forwarded"] if forwarded else [])]
        rows = [
            (
                r["concurrency"], f"{r['items_per_s']:.0f}", f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}",
                r["errors"], *([f"{r['forwarded']:.0f}"] if forwarded else []),
                report.shares(r["worker_share"]),
            )
            for r in run["levels"]
        ]  # fmt: skip
        header.append("share of items per worker")
        parts.append(report.table(header, rows, "r" * (len(header) - 1) + "l"))
    return "\n\n".join(parts)


def markdown(result: dict[str, Any]) -> str:
    text = levels_markdown(result, "", "connections")
    large = result.get("large")
    if large:
        text += (
            f"\n\nOne request of {large['items']} MiniLM items on an idle server "
            f"(median of {large['repeats']}): "
            f"1 worker {large['workers_1_ms']:.0f} ms, 2 workers {large['workers_2_ms']:.0f} ms "
            f"(ratio {large['ratio_2_over_1']:.2f})."
        )
    return text


def main(argv: list[str] | None = None) -> None:
    parser = balance_parser(__doc__, "1,2,4,8,16,64", "connection counts", "out/balance.json")
    parser.add_argument("--large-items", type=int, default=256)
    parser.add_argument("--large-repeats", type=int, default=5, help="0 skips the large-request figure")
    parser.add_argument("--no-balance", action="store_true", help="SCORING_BALANCE=0 (the comparison)")
    args = parse(parser, argv)
    os.environ["SCORING_BALANCE"] = "0" if args.no_balance else "1"
    runs = [
        levels_for(args.repository, model, items_for(args, model), args.workers, args.levels, args.duration)
        for model in args.models
    ]
    result = report.record(
        torch_threads=args.torch_threads, balance=not args.no_balance, duration_s=args.duration, runs=runs
    )
    if args.large_repeats > 0 and MINILM in args.models:
        result["large"] = large_request(args.repository, args.large_items, args.large_repeats)
    report.publish(args.out, result, markdown(result))


if __name__ == "__main__":
    main()
