#!/usr/bin/env python
"""Dynamic batching benchmark: served throughput and latency vs the in-process ceiling.

For one model of a repository it measures

1. the in-process ceiling: ``ModelRunner.forward`` at batch 1 (latency) and at the
   model's max batch size (items/s), in this process, no HTTP;
2. the served figures: gunicorn with N workers on 127.0.0.1, driven by an aiohttp
   client at each concurrency level for a fixed time, with dynamic batching on (the
   model's own ``model.toml``) and off (``max_batch_size = 1``).

It writes a JSON file of every figure and prints a Markdown table. Traffic goes
only to 127.0.0.1; each level stops after ``--duration`` seconds.

    python scripts/benchmark.py --model feed-ranker --concurrency 1,4,16,64 --duration 10
    python scripts/benchmark.py --model all-MiniLM-L6-v2 --concurrency 1,8,32,64

Source: the method follows Triton's perf_analyzer (closed-loop concurrency levels,
p50/p99 latency, throughput) and its dynamic batcher guide.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from app.models.repository import read_config  # noqa: E402
from scripts import harness  # noqa: E402

SENTENCES = [
    "Ten tips for a faster morning commute by bike",
    "The city council approved the new park budget on Tuesday",
    "How to cook perfect rice every single time",
    "Local team wins the championship after a dramatic overtime",
    "A beginner's guide to investing in index funds",
    "Scientists discover a new species of deep sea fish",
    "Why sleep matters more than you think for learning",
    "The best hiking trails within two hours of the city",
    "Stock markets rally as inflation cools for a third month",
    "Simple stretches to relieve back pain at your desk",
    "A review of the latest noise cancelling headphones",
    "Five easy vegetarian dinners for busy weeknights",
]
QUERY = "healthy cooking and outdoor sports"
#: The model.toml lines that batching "off" replaces (cuda_graph_batch_sizes goes: its sizes
#: may exceed the new max_batch_size of 1).
BATCHING_KEYS = ("max_batch_size", "max_queue_delay_ms", "warmup_batch_sizes", "cuda_graph_batch_sizes")


def sentence(rng: random.Random) -> str:
    """A distinct headline-like text (two headlines and a number): batches do not dedupe."""
    return f"{rng.choice(SENTENCES)}; {rng.choice(SENTENCES).lower()} ({rng.randrange(10_000)})"


def payload(model: str, datatype_inputs: list[Any], items: int, rng: random.Random) -> bytes:
    """A V2 inference request body with ``items`` rows of realistic data."""
    inputs = []
    for spec in datatype_inputs:
        if spec.datatype == "BYTES":
            if spec.optional and spec.name != "query":
                continue
            data: list[Any] = [QUERY if spec.name == "query" else sentence(rng) for _ in range(items)]
            inputs.append({"name": spec.name, "shape": [items, 1], "datatype": "BYTES", "data": data})
        else:
            shape = [items, *spec.shape]
            values = np.random.default_rng(rng.randrange(1 << 30)).normal(size=shape).astype(np.float32)
            inputs.append(
                {
                    "name": spec.name,
                    "shape": shape,
                    "datatype": spec.datatype,
                    "data": values.ravel().tolist(),
                }
            )
    return json.dumps({"inputs": inputs}).encode()


def timed(call: Callable[[], object], seconds: float) -> list[float]:
    """Seconds each ``call()`` took, called back to back for ``seconds`` (at least 5 calls)."""
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 5:
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def in_process(model_dir: Path, items: int, seconds: float) -> dict[str, float]:
    """Ceiling figures: forward() latency at ``items`` and throughput at max batch size."""
    import torch

    from app.models.runner import ModelRunner, synthetic_inputs

    config = read_config(model_dir)
    runner = ModelRunner(config)
    runner.load(torch.device("cuda:0" if torch.cuda.is_available() else "cpu"))
    runner.warmup()
    rng = random.Random(0)
    body = json.loads(payload(config.name, config.inputs, config.max_batch_size, rng))
    batch = synthetic_inputs(config.inputs, config.max_batch_size)
    for tensor in body["inputs"]:
        arr = np.array(tensor["data"], dtype=object if tensor["datatype"] == "BYTES" else np.float32)
        if tensor["datatype"] == "BYTES":
            arr = np.array([s.encode() for s in arr], dtype=object)
        batch[tensor["name"]] = arr.reshape(tensor["shape"])
    small = {k: v[:items] for k, v in batch.items()}
    lat = timed(lambda: runner.forward(small), seconds)
    big = timed(lambda: runner.forward(batch), seconds)
    return {
        "torch_threads": torch.get_num_threads(),
        "latency_p50_ms": harness.percentiles([t * 1000 for t in lat], (50,))[0],
        "max_batch_size": config.max_batch_size,
        "ceiling_items_per_s": config.max_batch_size / harness.percentiles(big, (50,))[0],
    }


def server(
    tmp: Path,
    repo: Path,
    model: str,
    workers: int,
    env: dict[str, str] | None = None,
    root: Path = ROOT,
) -> harness.Gunicorn:
    """gunicorn on 127.0.0.1 serving ``model`` of repository ``repo``; ``SCORING_*`` settings of
    this environment pass through (e.g. ``SCORING_MAX_PROCESSES_PER_GPU``), ``env`` over them;
    ``root``: the checkout whose server runs (``harness.Gunicorn``)."""
    settings = {
        "SCORING_MODEL_REPOSITORY": str(repo),
        "SCORING_MODELS": model,
        "SCORING_WORKERS": str(workers),
        "SCORING_ACCESS_LOG": "",
        "SCORING_LOG_LEVEL": "warning",
        **(env or {}),
    }
    return harness.Gunicorn(tmp, settings, clean_env=False, root=root)


async def drive(
    url: str, bodies: list[bytes], items: int, concurrency: int, seconds: float
) -> dict[str, Any]:
    """Closed loop: ``concurrency`` clients send back-to-back for ``seconds``."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        sent = list(range(concurrency))

        def request(i: int) -> Awaitable[harness.Answer]:
            body = bodies[sent[i] % len(bodies)]
            sent[i] += concurrency
            return harness.post(session, url, body)

        begin = time.perf_counter()
        answers = await harness.closed_loop(request, concurrency, begin + seconds)
        elapsed = time.perf_counter() - begin
    ok = [a.latency_s * 1000 for a in answers if a.status == 200]
    p50, p99 = harness.percentiles(ok, (50, 99))
    return {
        "concurrency": concurrency,
        "requests": len(ok),
        "errors": len(answers) - len(ok),
        "items_per_s": len(ok) * items / elapsed,
        "p50_ms": p50,
        "p99_ms": p99,
    }


def main() -> None:
    parser = harness.benchmark_parser(__doc__, model="feed-ranker")
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--items", type=int, default=1, help="items (rows) per request")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per level")
    parser.add_argument("--modes", default="on,off", help="batching modes to run: on,off")
    parser.add_argument("--out", type=Path, help="JSON file for the results")
    parser.add_argument("--machine", default=f"{platform.node()} ({os.cpu_count()} CPUs, no GPU)")
    args = parser.parse_args()

    source = args.repository / args.model
    config = read_config(source)
    levels = [int(c) for c in args.concurrency.split(",")]
    result: dict[str, Any] = {
        "model": args.model,
        "machine": args.machine,
        "workers": args.workers,
        "items_per_request": args.items,
        "duration_s": args.duration,
        "date": time.strftime("%Y-%m-%d"),
        "load_average_at_start": os.getloadavg()[0],
    }
    result["in_process"] = in_process(source, args.items, min(args.duration, 5.0))
    print(f"in-process: {result['in_process']}", flush=True)
    rng = random.Random(1)
    bodies = [payload(args.model, config.inputs, args.items, rng) for _ in range(512)]
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            repo = Path(tmp) / mode
            shutil.copytree(source, repo / args.model, symlinks=True)
            toml = repo / args.model / "model.toml"
            if mode == "off":
                text = toml.read_text()
                lines = [
                    ln
                    for ln in text.splitlines()
                    if not ln.startswith(BATCHING_KEYS)
                ]
                lines.insert(1, "max_batch_size = 1\nmax_queue_delay_ms = 0.0\nwarmup_batch_sizes = [1]")
                toml.write_text("\n".join(lines) + "\n")
            with server(Path(tmp), repo, args.model, args.workers) as srv:
                srv.wait_ready(300, count=args.workers)
                url = f"{srv.url}/v2/models/{args.model}/infer"
                asyncio.run(drive(url, bodies, args.items, levels[0], 2.0))  # connection warmup
                rows = []
                for c in levels:
                    row = asyncio.run(drive(url, bodies, args.items, c, args.duration))
                    print(f"batching {mode}: {row}", flush=True)
                    rows.append(row)
                result[f"batching_{mode}"] = rows
    result["load_average_at_end"] = os.getloadavg()[0]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))


def markdown(result: dict[str, Any]) -> str:
    """The results as a Markdown table."""
    ip = result["in_process"]
    lines = [
        f"**{result['model']}** on {result['machine']}, {result['workers']} workers, "
        f"{result['items_per_request']} item(s)/request, {result['duration_s']:.0f} s per level "
        f"({result['date']}). In-process: {ip['latency_p50_ms']:.2f} ms p50 at "
        f"{result['items_per_request']} item(s); ceiling {ip['ceiling_items_per_s']:.0f} items/s at batch "
        f"{ip['max_batch_size']} ({ip['torch_threads']} threads).",
        "",
        "| batching | concurrency | items/s | p50 ms | p99 ms | errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode in ("on", "off"):
        for row in result.get(f"batching_{mode}", []):
            lines.append(
                f"| {mode} | {row['concurrency']} | {row['items_per_s']:.0f} | {row['p50_ms']:.2f} "
                f"| {row['p99_ms']:.2f} | {row['errors']} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
