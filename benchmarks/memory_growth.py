"""Memory growth: each worker's RSS once warm, and after ``--requests`` requests of each API in
turn (docs/reliability.md, *Memory growth*).

Starts gunicorn on 127.0.0.1 with the stress run's models (``benchmarks.stress.repository``:
feed-ranker, all-MiniLM-L6-v2 and the response cache, a BERT classifier and cross-encoder) and
``--workers`` workers, sends ``--warmup`` requests of every API, then ``--requests`` requests of
one API after the other (``benchmarks.stress.apis``: V2 JSON, V2 binary, V1, embeddings, rerank,
classify, gRPC to the feed-ranker and to the classifier), ``--concurrency`` closed-loop
clients, requests drawn in turn from a pool of ``--pool`` distinct ones (the response cache
hits, misses and evicts). After the warm-up and after each API, once the clients are gone,
each worker's RSS and anonymous memory (``RssAnon``: the heap, without the files mapped, such as
the cache's store) is sampled. Reports, per API, the growth of the workers' RSS summed, in MB
and in KB per 1,000 requests, and the statuses; from warm to the end, each worker's.

Triton's ``L0_memory_growth`` is the model (repetitions of each request, a bound on the growth);
no valgrind here: RSS is what an operator's dashboards see.

    python -m benchmarks.memory_growth --json memory.json              # 200,000 per API (hours on 2 CPUs)
    python -m benchmarks.memory_growth --requests 2000 --warmup 500     # a smoke run

Traffic goes only to 127.0.0.1; it stops by itself. A worker that is replaced during the run
(it should not be) makes its figures meaningless: the run then fails.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks import driver, report, server
from benchmarks.stress import apis, monitor, repository, target
from tests.support.gunicorn import Gunicorn


async def drive(
    srv: Gunicorn, api: apis.Api, calls: list[apis.Call], count: int, concurrency: int
) -> Counter[str]:
    """``count`` requests of ``api`` (``calls`` in turn) from ``concurrency`` closed-loop
    clients; the statuses (HTTP status, or the gRPC status name)."""
    statuses: Counter[str] = Counter()
    turn = itertools.count()

    def next_call() -> apis.Call | None:
        n = next(turn)
        return calls[n % len(calls)] if n < count else None

    if api.protocol == "grpc":
        import grpc

        async with grpc.aio.insecure_channel(srv.grpc_url) as channel:
            method = channel.unary_unary(apis.GRPC_INFER)

            async def grpc_client() -> None:
                while (call := next_call()) is not None:
                    try:
                        await method(call.body, timeout=60)
                        statuses["OK"] += 1
                    except grpc.aio.AioRpcError as exc:
                        statuses[exc.code().name] += 1

            await asyncio.gather(*(grpc_client() for _ in range(concurrency)))
        return statuses
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def http_client() -> None:
            while (call := next_call()) is not None:
                answer = await driver.post(session, srv.url + call.path, call.body, dict(call.headers))
                statuses[str(answer.status)] += 1

        await asyncio.gather(*(http_client() for _ in range(concurrency)))
    return statuses


def idle_sample(srv: Gunicorn, phase: str) -> dict[int, monitor.Sample]:
    """Each worker's sample once its open connections stopped falling (the clients gone)."""
    time.sleep(2.0)
    return {s.pid: s for s in monitor.measure(srv.workers(), time.monotonic(), phase)}


def growth_mb(before: dict[int, monitor.Sample], after: dict[int, monitor.Sample], field: str) -> float:
    """The workers' ``field`` (``rss`` or ``anon``) summed, after minus before, MB."""
    return float(sum(getattr(after[pid], field) - getattr(before[pid], field) for pid in after)) / monitor.MB


def run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    repository.build(folder)
    words = apis.words_of(repository.tokenizer_file(folder).read_text())
    chosen = [apis.APIS[name] for name in args.apis]
    pools = {api.name: apis.pool(api, args.pool, words) for api in chosen}
    srv = target.start_server(folder, repository.repository_of(folder), args.workers, redis_url="")
    rows = []
    try:
        srv.wait_ready(600, count=args.workers)
        for api in chosen:
            asyncio.run(drive(srv, api, pools[api.name], args.warmup, args.concurrency))
        warm = before = idle_sample(srv, "warm")
        print(f"warm: {_workers(warm)}", flush=True)
        for api in chosen:
            began = time.monotonic()
            statuses = asyncio.run(drive(srv, api, pools[api.name], args.requests, args.concurrency))
            after = idle_sample(srv, api.name)
            if set(after) != set(warm):
                raise RuntimeError(f"workers replaced during {api.name}: {sorted(warm)} -> {sorted(after)}")
            mb, anon = growth_mb(before, after, "rss"), growth_mb(before, after, "anon")
            rows.append({
                "api": api.name, "requests": args.requests, "seconds": round(time.monotonic() - began, 1),
                "statuses": dict(statuses), "rss_growth_mb": round(mb, 1), "anon_growth_mb": round(anon, 1),
                "kb_per_1000": round(mb * 1024 / (args.requests / 1000), 2), "workers_mb": _workers(after),
            })  # fmt: skip
            print(_line(rows[-1]), flush=True)
            before = after
        return {
            "warm_mb": _workers(warm),
            "end_mb": _workers(before),
            "total_growth_mb": round(growth_mb(warm, before, "rss"), 1),
            "apis": rows,
        }
    finally:
        srv.stop(120)


def _workers(samples: dict[int, monitor.Sample]) -> dict[str, float]:
    return {str(pid): round(s.rss / monitor.MB, 1) for pid, s in sorted(samples.items())}


def _line(row: dict[str, Any]) -> str:
    return (
        f"{row['api']:<12} {row['requests']:>8} requests in {row['seconds']:>7.1f} s  "
        f"RSS {row['rss_growth_mb']:+7.1f} MB ({row['kb_per_1000']:+.2f} KB/1,000)  "
        f"anon {row['anon_growth_mb']:+7.1f} MB  {row['statuses']}"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--requests", type=int, default=200_000, help="requests of each API")
    parser.add_argument("--warmup", type=int, default=5_000, help="requests of each API before the baseline")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--pool", type=int, default=4096, help="distinct requests of each API")
    parser.add_argument("--apis", type=server.comma_list(apis.APIS), default=list(apis.APIS))
    parser.add_argument("--json", type=Path, help="write the results here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="memory-growth-"))
    results = run(args, folder)
    print(f"from warm to the end: {results['warm_mb']} -> {results['end_mb']} MB "
          f"({results['total_growth_mb']:+.1f} MB summed)")  # fmt: skip
    argv_text = " ".join(argv if argv is not None else sys.argv[1:])
    report.write_json(
        args.json, report.record(command=f"python -m benchmarks.memory_growth {argv_text}", **results)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
