#!/usr/bin/env python
"""gRPC balancing benchmark: ONE channel (one HTTP/2 connection) with c calls in flight.

A gRPC channel is pinned to the worker that accepted its connection; with balancing on, that
worker forwards whole requests to a clearly less-loaded sibling (app.server.forward). For each
model (MiniLM with ``--items`` items per request, the feed-ranker with ``--ranker-items``) it
starts gunicorn with ``--workers`` workers on 127.0.0.1 (``SCORING_TORCH_THREADS`` per worker,
default 1), balancing on and then off (``SCORING_BALANCE=0``), and drives one ``grpc.aio``
channel in a closed loop at each level c (c calls in flight, raw tensor contents as the stock
clients send) for ``--duration`` seconds: items/s, p50/p99 latency, each worker's share of the
items (``scoring_worker_items_total{pid}`` in /metrics) and the requests forwarded
(``scoring_forwarded_requests_total``).

Writes a JSON file of every figure and prints Markdown tables for docs/benchmarks.md.

    python scripts/bench_grpc_balance.py --out bench_grpc_balance.json

Each level stops by itself after ``--duration`` seconds; traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from app.models.repository import read_config  # noqa: E402
from app.protocols.tensors import tensor_bytes  # noqa: E402
from scripts import harness  # noqa: E402
from scripts.bench_balance import MINILM, balance_parser  # noqa: E402
from scripts.benchmark import payload, server  # noqa: E402

_FORWARDED_LINE = re.compile(r"^scoring_forwarded_requests_total\{[^}]*\} ([0-9.e+]+)$", re.M)


def counts(srv: harness.Gunicorn) -> tuple[dict[str, float], float]:
    """Items answered per worker pid, and requests forwarded (all workers)."""
    text = srv.scrape()
    return harness.worker_items(text), sum(float(n) for n in _FORWARDED_LINE.findall(text))


def requests(repo: Path, model: str, items: int, count: int = 32) -> list[Any]:
    """``count`` ModelInferRequests with raw contents, as tritonclient sends them."""
    from app.grpc.generated import grpc_service_pb2 as pb

    config = read_config(repo / model)
    rng = random.Random(0)
    out = []
    for _ in range(count):
        body = json.loads(payload(model, config.inputs, items, rng))
        message = pb.ModelInferRequest(model_name=model)
        for tensor in body["inputs"]:
            message.inputs.add(name=tensor["name"], datatype=tensor["datatype"], shape=tensor["shape"])
            dtype = object if tensor["datatype"] == "BYTES" else np.float32
            array = np.array(tensor["data"], dtype=dtype).reshape(tensor["shape"])
            if dtype is object:
                array = np.vectorize(lambda s: s.encode(), otypes=[object])(array)
            message.raw_input_contents.append(tensor_bytes(array, tensor["datatype"]))
        out.append(message)
    return out


async def drive(
    url: str, messages: list[Any], items: int, concurrency: int, seconds: float
) -> dict[str, Any]:
    """One channel, ``concurrency`` calls in flight back to back for ``seconds``."""
    import grpc

    from app.grpc.generated import grpc_service_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        sent = list(range(concurrency))

        async def call(i: int) -> harness.Answer:
            message = messages[sent[i] % len(messages)]
            sent[i] += concurrency
            start = time.perf_counter()
            try:
                await stub.ModelInfer(message, timeout=30)
            except grpc.aio.AioRpcError as exc:
                return harness.Answer(0, time.perf_counter() - start, str(exc.code()))
            return harness.Answer(200, time.perf_counter() - start)

        begin = time.perf_counter()
        answers = await harness.closed_loop(call, concurrency, begin + seconds)
        elapsed = time.perf_counter() - begin
    latencies = [a.latency_s * 1000 for a in answers if a.status == 200]
    errors = len(answers) - len(latencies)
    p50, p99 = harness.percentiles(latencies, (50, 99))
    return {
        "concurrency": concurrency,
        "requests": len(latencies),
        "errors": errors,
        "items_per_s": len(latencies) * items / elapsed,
        "p50_ms": p50,
        "p99_ms": p99,
    }


def run(
    repo: Path, model: str, items: int, workers: int, balance: bool, levels: list[int], seconds: float
) -> dict[str, Any]:
    os.environ["SCORING_BALANCE"] = "1" if balance else "0"
    messages = requests(repo, model, items)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, server(Path(tmp), repo, model, workers) as srv:
        srv.wait_ready(300, count=workers)
        asyncio.run(drive(srv.grpc_url, messages, items, 2, min(2.0, seconds)))  # warm up
        for c in levels:
            before, forwarded_before = counts(srv)
            row = asyncio.run(drive(srv.grpc_url, messages, items, c, seconds))
            after, forwarded_after = counts(srv)
            row["worker_share"] = harness.worker_shares(before, after)
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


def markdown(result: dict[str, Any]) -> str:
    lines = []
    for r in result["runs"]:
        lines += [
            f"\n**{r['model']}** over one gRPC channel, {r['items_per_request']} item(s) per request, "
            f"{r['workers']} workers, torch threads {result['torch_threads']} per worker, "
            f"balancing {'on' if r['balance'] else 'off'}\n",
            "| calls in flight | items/s | p50 ms | p99 ms | errors | forwarded "
            "| share of items per worker |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for row in r["levels"]:
            share = " / ".join(f"{100 * s:.0f} %" for s in row["worker_share"].values())
            lines.append(
                f"| {row['concurrency']} | {row['items_per_s']:.0f} | {row['p50_ms']:.2f} "
                f"| {row['p99_ms']:.2f} | {row['errors']} | {row['forwarded']:.0f} | {share} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = balance_parser(__doc__, "1,2,4,8,16", "calls in flight on the one channel")
    parser.add_argument("--balance", default="on,off", help="on, off or on,off")
    parser.add_argument("--out", type=Path, default=Path("bench_grpc_balance.json"))
    args = parser.parse_args()

    os.environ["SCORING_TORCH_THREADS"] = str(args.torch_threads)
    levels = [int(c) for c in args.levels.split(",")]
    runs = [
        run(args.repository, model, args.items if model == MINILM else args.ranker_items, args.workers,
            mode == "on", levels, args.duration)
        for model in args.models.split(",")
        for mode in args.balance.split(",")
    ]  # fmt: skip
    result: dict[str, Any] = {
        "machine": harness.machine(),
        "torch_threads": args.torch_threads,
        "duration_s": args.duration,
        "runs": runs,
    }
    args.out.write_text(json.dumps(result, indent=2))
    table = markdown(result)
    args.out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
