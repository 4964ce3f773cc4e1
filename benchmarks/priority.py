"""Priority levels under saturation: all-MiniLM-L6-v2 flooded by low-priority clients, one
high-priority client beside them.

The demo MiniLM is served from a repository of its own whose ``model.toml`` adds
``priority_levels = 2`` and ``default_priority_level = 2`` (so the flood needs no parameter) and
``max_batch_tokens = --max-batch-tokens`` (0: none), with ``--workers`` workers. A batch is not
preempted: a high-priority request waits for the batch running when it arrives, then runs in the
next, so what it waits is about one and a half batches, and the token budget bounds a batch.
``--low`` closed-loop clients send V2 JSON requests of ``--items``
feed texts (:func:`benchmarks.payloads.feed_texts`; ``--texts short``: the titles alone) with no
priority (level 2, the lowest), and a client answered 503 waits the answer's ``Retry-After``
before its next request (``--no-honour-retry-after``: it resends at once); ``--high``
closed-loop clients (or, with ``--high-rate``, Poisson arrivals at that rate on connections of
their own) send the same with ``parameters.priority = 1``. After ``--warmup`` seconds,
``--duration`` seconds are counted: per class the answers by status, p50/p99/max of the 200s,
and items/s. The high class's p50 over the low class's is the figure; a low request answered
504 (or a 200 later than its deadline) would be one that starved.

    python -m benchmarks.priority --out docs/benchmarks/priority-minilm-cpu.json

Target: high p50 <= 0.25 x low p50, no low-priority 504. Traffic goes only to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks import driver, payloads, report, server
from benchmarks.server import MINILM

DEADLINE_MS = 5000  # the demo model's timeout_ms


def repository(tmp: Path, max_batch_tokens: int, fill: float | None = None) -> Path:
    """A copy of the demo MiniLM's ``model.toml`` with two priority levels, the token budget
    (0: none) and ``priority_fill`` (None: the default); the weights come from the installed
    package, as in the demo."""
    folder = tmp / "repo" / MINILM
    folder.mkdir(parents=True)
    toml = (server.DEMO_REPOSITORY / MINILM / "model.toml").read_text()
    budget = f"max_batch_tokens = {max_batch_tokens}\n" if max_batch_tokens else ""
    fill_line = f"priority_fill = {fill}\n" if fill is not None else ""
    levels = f"priority_levels = 2\ndefault_priority_level = 2\n{budget}{fill_line}\n"
    toml = toml.replace("[[inputs]]", levels + "[[inputs]]", 1)
    (folder / "model.toml").write_text(toml)
    return folder.parent


async def run(url: str, bodies: list[bytes], args: Any) -> dict[str, dict[str, Any]]:
    """Both classes at once; per class the figures of the counted ``--duration`` seconds."""
    high = [json.dumps({**json.loads(b), "parameters": {"priority": 1}}).encode() for b in bodies]
    start = time.perf_counter()
    counted_from, until = start + args.warmup, start + args.warmup + args.duration
    answers: dict[str, list[driver.Answer]] = {"low": [], "high": []}
    connector = aiohttp.TCPConnector(limit=args.low + args.high)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def client(kind: str, i: int, sources: list[bytes]) -> None:
            n = i
            while time.perf_counter() < until:
                sent = time.perf_counter()
                answer = await driver.post(session, url, sources[n % len(sources)])
                n += args.low + args.high
                if sent >= counted_from:
                    answers[kind].append(answer)
                if args.honour_retry_after and answer.retry_after_s:
                    await asyncio.sleep(min(answer.retry_after_s, max(0.0, until - time.perf_counter())))

        async def arrivals() -> None:  # open loop: Poisson arrivals at --high-rate per second
            rng, sends, n = random.Random(1), [], 0
            own = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))  # no shared pool
            while (now := time.perf_counter()) < until:
                await asyncio.sleep(rng.expovariate(args.high_rate))
                sends.append(asyncio.ensure_future(driver.post(own, url, high[n % len(high)])))
                if now >= counted_from:
                    sends[-1].add_done_callback(lambda f: answers["high"].append(f.result()))
                n += 1
            await asyncio.gather(*sends)
            await own.close()

        closed = [client("high", args.low + i, high) for i in range(args.high)]
        highs = [arrivals()] if args.high_rate else closed
        await asyncio.gather(*(client("low", i, bodies) for i in range(args.low)), *highs)
    out = {}
    for kind, got in answers.items():
        ok = [a.latency_s * 1000 for a in got if a.status == 200]
        p50, p99 = driver.percentiles(ok, (50, 99))
        out[kind] = {
            "clients": args.low if kind != "high" else f"{args.high_rate}/s" if args.high_rate else args.high,
            "statuses": dict(Counter(a.status for a in got)),
            "p50_ms": round(p50, 1),
            "p99_ms": round(p99, 1),
            "max_ms": round(max(ok, default=float("nan")), 1),
            "items_per_s": round(len(ok) * args.items / args.duration, 1),
        }
    return out


def markdown(result: dict[str, Any]) -> str:
    rows = [
        (kind, r["clients"], r["items_per_s"], r["p50_ms"], r["p99_ms"], r["max_ms"], r["statuses"])
        for kind, r in result["classes"].items()
    ]
    header = ("class", "clients", "items/s", "p50 ms", "p99 ms", "max ms", "answers by status")
    return report.table(header, rows, "lrrrrrl") + f"\n\nhigh p50 / low p50: {result['high_over_low_p50']}"


def main(argv: list[str] | None = None) -> None:
    parser = server.parser(__doc__, torch_threads=1)
    parser.add_argument("--low", type=int, default=32)
    parser.add_argument("--high", type=int, default=1, help="closed-loop high-priority clients")
    parser.add_argument("--high-rate", type=float, default=0.0, help="or: open-loop requests/s (Poisson)")
    parser.add_argument("--items", type=int, default=8)
    parser.add_argument("--texts", choices=("mix", "short"), default="mix", help="feed mix, or titles only")
    parser.add_argument("--max-batch-tokens", type=int, default=1024, help="0: no token budget")
    parser.add_argument("--priority-fill", type=float, help="model.toml priority_fill (default: 0.25)")
    parser.add_argument(
        "--honour-retry-after",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a client answered 503 waits its Retry-After before the next request, as HTTP "
        "clients with retries do (--no-honour-retry-after: it resends at once)",
    )
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    texts = payloads.feed_texts(payloads.model_words(server.DEMO_REPOSITORY), 1024)
    texts = texts[0::2] if args.texts == "short" else texts
    bodies = payloads.feed_bodies(texts, args.items, query=None, outputs=("embedding",))
    with tempfile.TemporaryDirectory() as tmp:
        env = {"SCORING_TORCH_THREADS": str(args.torch_threads)}
        repo = repository(Path(tmp), args.max_batch_tokens, args.priority_fill)
        with server.start(Path(tmp), repo, MINILM, args.workers, env) as srv:
            srv.wait_ready(300, count=args.workers)
            classes = asyncio.run(run(srv.url + f"/v2/models/{MINILM}/infer", bodies, args))
    ratio = round(classes["high"]["p50_ms"] / classes["low"]["p50_ms"], 3)
    result = report.record(
        command="python -m benchmarks.priority " + " ".join(sys.argv[1:] if argv is None else argv),
        workers=args.workers, items=args.items, texts=args.texts, max_batch_tokens=args.max_batch_tokens,
        priority_fill=args.priority_fill,
        deadline_ms=DEADLINE_MS, honour_retry_after=args.honour_retry_after, classes=classes,
        high_over_low_p50=ratio,
    )  # fmt: skip
    print(markdown(result))
    report.write_json(args.out, result)


if __name__ == "__main__":
    main()
