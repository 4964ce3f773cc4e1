"""Dynamic batching: served throughput and latency against the in-process ceiling.

For one model of a repository it measures

1. the in-process ceiling: ``ModelRunner.forward`` at the request size (p50 latency) and at the
   model's max batch size (items/s), in this process, no HTTP;
2. the served figures: gunicorn with ``--workers`` workers on 127.0.0.1, driven by an aiohttp
   client in a closed loop at each concurrency level for ``--duration`` seconds, V2 JSON
   requests of ``--items`` items, with dynamic batching on (the model's own ``model.toml``) and
   off (``max_batch_size = 1``).

It writes a JSON record of every figure and prints a Markdown table. Traffic goes only to
127.0.0.1; each level stops after ``--duration`` seconds.

    python -m benchmarks.batching --model feed-ranker --concurrency 1,4,16,64 --duration 10
    python -m benchmarks.batching --model all-MiniLM-L6-v2 --concurrency 1,8,32,64

Method: Triton's perf_analyzer (closed-loop concurrency levels, p50/p99 latency, throughput)
and its dynamic batcher guide.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

from app.models.repository import read_config
from benchmarks import driver, payloads, report, server

MODES = ("on", "off")
#: The model.toml lines that batching "off" replaces (cuda_graph_batch_sizes goes: its sizes
#: may exceed the new max_batch_size of 1).
BATCHING_KEYS = ("max_batch_size", "max_queue_delay_ms", "warmup_batch_sizes", "cuda_graph_batch_sizes")


def in_process(repository: Path, model: str, items: int, seconds: float) -> dict[str, Any]:
    """Ceiling figures: ``forward()`` p50 latency at ``items`` and items/s at the max batch
    size, each timed for ``seconds`` (5 calls at least), on CUDA where torch sees it."""
    import torch

    from app.serving.runner import ModelRunner

    config = read_config(repository / model)
    runner = ModelRunner(config)
    runner.load(torch.device("cuda:0" if torch.cuda.is_available() else "cpu"))
    runner.warmup()
    batch = payloads.tensors(payloads.inputs_of(repository, model), config.max_batch_size, random.Random(0))
    big = {t.name: t.array for t in batch}
    small = {name: array[:items] for name, array in big.items()}

    latency = driver.timed(lambda: runner.forward(small), seconds)
    full = driver.timed(lambda: runner.forward(big), seconds)
    return {
        "torch_threads": torch.get_num_threads(),
        "latency_p50_ms": driver.percentiles([t * 1000 for t in latency], (50,))[0],
        "max_batch_size": config.max_batch_size,
        "ceiling_items_per_s": config.max_batch_size / driver.percentiles(full, (50,))[0],
    }


def unbatched(folder: Path) -> None:
    """Turn dynamic batching off in the copied model folder: batches of one, no queue delay."""
    toml = folder / "model.toml"
    lines = [ln for ln in toml.read_text().splitlines() if not ln.startswith(BATCHING_KEYS)]
    lines.insert(1, "max_batch_size = 1\nmax_queue_delay_ms = 0.0\nwarmup_batch_sizes = [1]")
    toml.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = server.parser(__doc__, model=server.RANKER)
    parser.add_argument("--concurrency", type=server.levels, default=[1, 4, 16, 64])
    parser.add_argument("--items", type=int, default=1, help="items (rows) per request")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per level")
    parser.add_argument("--modes", type=server.comma_list(MODES), default=list(MODES), help="batching on,off")
    parser.add_argument("--out", type=Path, help="JSON file for the results")
    args = parser.parse_args(argv)

    result = report.record(
        model=args.model, workers=args.workers, items_per_request=args.items, duration_s=args.duration
    )
    result["in_process"] = in_process(args.repository, args.model, args.items, min(args.duration, 5.0))
    print(f"in-process: {result['in_process']}", flush=True)
    bodies = payloads.v2_bodies(args.repository, args.model, args.items, 512, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            repo = Path(tmp) / mode
            shutil.copytree(args.repository / args.model, repo / args.model, symlinks=True)
            if mode == "off":
                unbatched(repo / args.model)
            with server.start(Path(tmp), repo, args.model, args.workers) as srv:
                srv.wait_ready(300, count=args.workers)
                url = f"{srv.url}/v2/models/{args.model}/infer"
                asyncio.run(driver.drive(url, bodies, args.items, args.concurrency[0], 2.0))  # warm up
                rows = []
                for c in args.concurrency:
                    row = asyncio.run(driver.drive(url, bodies, args.items, c, args.duration))
                    print(f"batching {mode}: {row}", flush=True)
                    rows.append(row)
                result[f"batching_{mode}"] = rows
    result["load_average_at_end"] = report.machine()["load_average"]
    report.write_json(args.out, result)
    print(markdown(result))


def markdown(result: dict[str, Any]) -> str:
    """The results as a caption and a Markdown table."""
    ip = result["in_process"]
    caption = (
        f"**{result['model']}** on {report.machine_label()}, {result['workers']} workers, "
        f"{result['items_per_request']} item(s)/request, {result['duration_s']:.0f} s per level "
        f"({result['date']}). In-process: {ip['latency_p50_ms']:.2f} ms p50 at "
        f"{result['items_per_request']} item(s); ceiling {ip['ceiling_items_per_s']:.0f} items/s at batch "
        f"{ip['max_batch_size']} ({ip['torch_threads']} threads)."
    )
    rows = [
        (
            mode,
            r["concurrency"],
            f"{r['items_per_s']:.0f}",
            f"{r['p50_ms']:.2f}",
            f"{r['p99_ms']:.2f}",
            r["errors"],
        )
        for mode in MODES
        for r in result.get(f"batching_{mode}", [])
    ]
    header = ("batching", "concurrency", "items/s", "p50 ms", "p99 ms", "errors")
    return caption + "\n\n" + report.table(header, rows, "lrrrrr")


if __name__ == "__main__":
    main()
