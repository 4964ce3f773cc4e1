"""gRPC balancing: ONE channel (one HTTP/2 connection) with c calls in flight.

A gRPC channel is pinned to the worker that accepted its connection; with balancing on, that
worker forwards whole requests to a clearly less-loaded sibling (app.server.forward). For each
model (MiniLM with ``--items`` items per request, the feed-ranker with ``--ranker-items``) it
starts gunicorn with ``--workers`` workers on 127.0.0.1 (``SCORING_TORCH_THREADS`` per worker,
default 1), balancing on and then off (``SCORING_BALANCE=0``), and drives one ``grpc.aio``
channel in a closed loop at each level c (c calls in flight, raw tensor contents as the stock
clients send) for ``--duration`` seconds: items/s, p50/p99 latency, each worker's share of the
items (``scoring_worker_items_total{pid}`` in /metrics) and the requests forwarded
(``scoring_forwarded_requests_total``).

Writes a JSON record of every figure (``--out``) and the Markdown tables beside it (``.md``).

    python -m benchmarks.grpc_balance --out docs/benchmarks/grpc-balance-cpu.json

Each level stops by itself after ``--duration`` seconds; traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import driver, payloads, report, server
from benchmarks.balance import balance_parser, items_for, levels_markdown, parse
from tests.support.gunicorn import Gunicorn, worker_items, worker_shares

_FORWARDED_LINE = re.compile(r"^scoring_forwarded_requests_total\{[^}]*\} ([0-9.e+]+)$", re.M)


def counts(srv: Gunicorn) -> tuple[dict[int, float], float]:
    """From one /metrics scrape: items computed per worker pid, and requests forwarded (all
    workers)."""
    text = srv.scrape()
    return worker_items(text), sum(float(n) for n in _FORWARDED_LINE.findall(text))


def run(
    repo: Path, model: str, items: int, workers: int, balance: bool, levels: list[int], seconds: float
) -> dict[str, Any]:
    os.environ["SCORING_BALANCE"] = "1" if balance else "0"
    inputs, rng = payloads.inputs_of(repo, model), random.Random(0)
    messages = [payloads.grpc_request(model, payloads.tensors(inputs, items, rng)) for _ in range(32)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp, server.start(Path(tmp), repo, model, workers) as srv:
        srv.wait_ready(300, count=workers)
        asyncio.run(driver.drive_grpc(srv.grpc_url, messages, items, 2, min(2.0, seconds)))  # warm up
        for c in levels:
            before, forwarded_before = counts(srv)
            row = asyncio.run(driver.drive_grpc(srv.grpc_url, messages, items, c, seconds))
            after, forwarded_after = counts(srv)
            row["worker_share"] = worker_shares(before, after)
            row["forwarded"] = forwarded_after - forwarded_before
            rows.append(row)
            print(f"{model} balance={balance} c={c}: {row}", flush=True)
    return {
        "model": model,
        "items_per_request": items,
        "workers": workers,
        "balance": balance,
        "levels": rows,
    }


def main(argv: list[str] | None = None) -> None:
    levels = "calls in flight on the one channel"
    parser = balance_parser(__doc__, "1,2,4,8,16", levels, "out/grpc-balance.json")
    parser.add_argument("--balance", type=server.comma_list(("on", "off")), default=["on", "off"])
    args = parse(parser, argv)
    runs = [
        run(args.repository, m, items_for(args, m), args.workers, mode == "on", args.levels, args.duration)
        for m in args.models
        for mode in args.balance
    ]
    result = report.record(torch_threads=args.torch_threads, duration_s=args.duration, runs=runs)
    tables = levels_markdown(result, " over one gRPC channel", "calls in flight", forwarded=True)
    report.publish(args.out, result, tables)


if __name__ == "__main__":
    main()
