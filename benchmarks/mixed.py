"""Mixed-length texts: all-MiniLM-L6-v2 served against sentence-transformers' own ``encode()``.

Feed items mix titles (5-15 words) and descriptions (40-200 words)
(:func:`benchmarks.payloads.feed_texts`, seeded, words drawn from the model's vocabulary).
The anchor is what a user would otherwise run, in process with the same processes and threads
as the server:

1. **encode() throughput**: ``--workers`` processes (spawned), each with ``--torch-threads``
   torch threads, each ``SentenceTransformer.encode()``-ing its share of ``--anchor-texts``
   texts at its default batch size (32; encode sorts its input by length, so its padding is
   small): all the texts over the slowest process's time, items/s;
2. **encode() of one request**: one process, p50 of ``encode()`` over ``--items`` texts at a
   time, ms.

Then the server: gunicorn with ``--workers`` workers (``SCORING_TORCH_THREADS`` =
``--torch-threads``) serving the repository's all-MiniLM-L6-v2, closed-loop aiohttp clients at
each ``--concurrency`` level for ``--duration`` seconds, each request V2 JSON with ``--items``
texts, the feed's query and ``outputs`` asking only for ``score``. Each row: items/s answered
200, p50/p99 of the 200s, the count of every other status, and the ratio to the anchor (c = 1:
its p50 over the one-request time).

    python -m benchmarks.mixed --out docs/benchmarks/mixed-minilm-cpu.json
    python -m benchmarks.mixed --concurrency 8 --duration 3 --anchor-texts 64 --out out/smoke.json

Targets (CPU): served items/s >= 0.8 x the encode() figure at c = 8 and c = 64; c = 1 p50
<= 1.2 x the one-request time. Traffic goes only to 127.0.0.1; every level stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks import driver, payloads, report, server
from benchmarks.server import MINILM


def _encoder(repository: Path, threads: int) -> Any:
    """all-MiniLM-L6-v2 of ``repository`` as a ``SentenceTransformer`` on the CPU, with the
    ``max_seq_length`` its ``model.toml`` gives and ``threads`` torch threads."""
    import torch
    from sentence_transformers import SentenceTransformer

    from app.handlers.sentence_embedding import resolve_model_dir
    from app.models.repository import read_config

    torch.set_num_threads(threads)
    config = read_config(repository / MINILM)
    model = SentenceTransformer(
        str(resolve_model_dir(config.parameters, config.path)),
        device="cpu",
        local_files_only=True,
        model_kwargs={"dtype": torch.float32},  # as the handler: not the stored dtype
    )
    if "max_seq_length" in config.parameters:
        model.max_seq_length = int(config.parameters["max_seq_length"])
    return model


def _encode_share(
    repository: Path, threads: int, texts: Sequence[str], ready: Any, go: Any, results: Any
) -> None:
    """One anchor process: load, warm up, wait for the others, encode ``texts``; puts
    (texts, seconds) on ``results``."""
    model = _encoder(repository, threads)
    model.encode(list(texts[:64]))
    ready.put(True)
    go.wait()
    began = time.perf_counter()
    model.encode(list(texts))
    results.put((len(texts), time.perf_counter() - began))


def _one_request(
    repository: Path, threads: int, texts: Sequence[str], items: int, seconds: float, results: Any
) -> None:
    """One anchor process: p50 of ``encode()`` of ``items`` texts at a time (ms)."""
    model = _encoder(repository, threads)
    groups = [list(texts[i : i + items]) for i in range(0, len(texts) - items + 1, items)]
    model.encode(groups[0])
    calls = iter(range(1 << 30))
    times = driver.timed(lambda: model.encode(groups[next(calls) % len(groups)]), seconds)
    results.put(driver.percentiles([t * 1000 for t in times], (50,))[0])


def anchor(repository: Path, texts: Sequence[str], args: argparse.Namespace) -> dict[str, Any]:
    """The in-process figures (see the module docstring), each in fresh spawned processes."""
    spawn = multiprocessing.get_context("spawn")
    ready, results, go = spawn.Queue(), spawn.Queue(), spawn.Event()
    shares = [texts[i :: args.workers] for i in range(args.workers)]
    procs = [
        spawn.Process(target=_encode_share, args=(repository, args.torch_threads, share, ready, go, results))
        for share in shares
    ]
    for proc in procs:
        proc.start()
    for _ in procs:
        ready.get(timeout=300)
    go.set()
    done = [results.get(timeout=3600) for _ in procs]
    for proc in procs:
        proc.join()
    encode_items_per_s = sum(n for n, _ in done) / max(s for _, s in done)
    one = spawn.Process(
        target=_one_request,
        args=(repository, args.torch_threads, texts, args.items, args.one_request_s, results),
    )
    one.start()
    one_request_ms = results.get(timeout=600)
    one.join()
    return {
        "processes": args.workers,
        "torch_threads": args.torch_threads,
        "texts": len(texts),
        "encode_items_per_s": round(encode_items_per_s, 1),
        "one_request_p50_ms": round(one_request_ms, 2),
    }


async def level(
    url: str, bodies: Sequence[bytes], items: int, concurrency: int, seconds: float
) -> dict[str, Any]:
    """One closed-loop level: items/s of the 200s, their p50/p99 (ms) and every status's count
    (0: a wire error)."""
    body_for = driver.cycling(bodies, concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        begin = time.perf_counter()
        answers = await driver.closed_loop(
            lambda i: driver.post(session, url, body_for(i)), concurrency, begin + seconds
        )
        elapsed = time.perf_counter() - begin
    row = driver.figures(answers, items, concurrency, elapsed)
    row["statuses"] = dict(sorted(Counter(str(a.status) for a in answers).items()))
    return row


def markdown(result: dict[str, Any]) -> str:
    """The caption and the table of a result."""
    a = result["anchor"]
    caption = (
        f"**all-MiniLM-L6-v2, mixed-length texts** on {report.machine_label()}, {result['workers']} "
        f"workers x {a['torch_threads']} torch thread(s), {result['items_per_request']} texts per "
        f"request, {result['duration_s']:.0f} s per level ({result['date']}). In process "
        f"(encode(), {a['processes']} processes): {a['encode_items_per_s']:.1f} items/s; one request "
        f"{a['one_request_p50_ms']:.1f} ms."
    )
    rows = [
        (
            r["concurrency"],
            f"{r['items_per_s']:.1f}",
            f"{r['of_anchor']:.2f}",
            f"{r['p50_ms']:.1f}",
            f"{r['p99_ms']:.1f}",
            ", ".join(f"{s}: {n}" for s, n in r["statuses"].items() if s != "200") or "-",
        )
        for r in result["served"]
    ]
    header = ("concurrency", "items/s", "of encode()", "p50 ms", "p99 ms", "other answers")
    return caption + "\n\n" + report.table(header, rows, "rrrrrl")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = server.parser(__doc__, torch_threads=1)
    parser.add_argument("--concurrency", type=server.levels, default=[1, 4, 8, 64])
    parser.add_argument("--duration", type=float, default=15.0, help="seconds per level")
    parser.add_argument("--items", type=int, default=8, help="texts per request")
    parser.add_argument("--texts", type=int, default=2000, help="texts the requests cycle over")
    parser.add_argument("--anchor-texts", type=int, default=1000, help="texts encode() runs over")
    parser.add_argument("--one-request-s", type=float, default=10.0, help="timing of one request")
    parser.add_argument("--out", type=Path, default=Path("out/mixed-minilm.json"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    texts = payloads.feed_texts(payloads.model_words(args.repository), args.texts)
    result: dict[str, Any] = report.record(
        workers=args.workers, items_per_request=args.items, duration_s=args.duration
    )
    result["anchor"] = anchor(args.repository, texts[: args.anchor_texts], args)
    print(f"in process: {result['anchor']}", flush=True)
    bodies = payloads.feed_bodies(texts, args.items)
    env = {"SCORING_TORCH_THREADS": str(args.torch_threads)}
    with (
        tempfile.TemporaryDirectory() as tmp,
        server.start(Path(tmp), args.repository, MINILM, args.workers, env) as srv,
    ):
        srv.wait_ready(300, count=args.workers)
        url = f"{srv.url}/v2/models/{MINILM}/infer"
        asyncio.run(level(url, bodies, args.items, 2, 3.0))  # warm up
        result["served"] = []
        for c in args.concurrency:
            row = asyncio.run(level(url, bodies, args.items, c, args.duration))
            base = (
                result["anchor"]["one_request_p50_ms"] if c == 1 else result["anchor"]["encode_items_per_s"]
            )
            row["of_anchor"] = round((row["p50_ms"] if c == 1 else row["items_per_s"]) / base, 3)
            print(f"c={c}: {row}", flush=True)
            result["served"].append(row)
    report.publish(args.out, result, markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
