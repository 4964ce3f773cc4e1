"""Served: ONNX Runtime against PyTorch, each demo model beside its ONNX twin, in one server.

gunicorn with ``--workers`` workers (``SCORING_TORCH_THREADS`` = ``--torch-threads``: torch's
threads and ONNX Runtime's intra-op threads alike) serving the four models of the repository
(``all-MiniLM-L6-v2`` and ``all-MiniLM-L6-v2-onnx``, ``feed-ranker`` and ``feed-ranker-onnx``),
closed-loop aiohttp clients on 127.0.0.1, V2 JSON:

- **MiniLM**, each payload set (``short``: titles of 5-15 words; ``mix``: the feed's titles
  and descriptions of 5-200 words, :func:`benchmarks.payloads.feed_texts`) at each
  ``--concurrency`` level: requests of ``--items`` texts with the feed's query, asking for
  ``score`` only (as ``benchmarks/mixed.py``), ``--duration`` seconds per model;
- **feed-ranker** at each ``--ranker-concurrency`` level: requests of ``--ranker-items`` rows.

At each point the two twins take turns (PyTorch, ONNX, and again for each of ``--rounds``
rounds; the rows of a point are summed over its rounds), so a machine that slows down during
the run weighs on both. Each row: items/s answered 200, p50/p99 of the 200s, every other
status; then the ONNX/PyTorch ratio of items/s and of p50.

    python -m benchmarks.onnx --out docs/benchmarks/onnx-served-cpu.json
    python -m benchmarks.onnx --duration 2 --concurrency 8 --ranker-concurrency 1 --out out/smoke.json

Targets (CPU, 2 workers, 8 texts per request): ONNX MiniLM items/s >= 1.25 x the
PyTorch MiniLM's at c = 8 and c = 64, on both sets, and c = 1 p50 not worse; the feed-ranker
pair at c = 1 and c = 64, whichever wins. Traffic goes only to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import mixed, payloads, report, server

MINILM, MINILM_ONNX = server.MINILM, f"{server.MINILM}-onnx"
RANKER, RANKER_ONNX = server.RANKER, f"{server.RANKER}-onnx"
MODELS = (MINILM, MINILM_ONNX, RANKER, RANKER_ONNX)


def merge(rows: Sequence[dict[str, Any]], duration_s: float) -> dict[str, Any]:
    """One point's rows (one per round) as one: items/s over all of them, the median of their
    p50s and the worst p99, statuses added up."""
    statuses: Counter[str] = Counter()
    for row in rows:
        statuses.update(row["statuses"])
    return {
        "items_per_s": round(sum(r["items_per_s"] for r in rows) / len(rows), 1),
        "p50_ms": round(sorted(r["p50_ms"] for r in rows)[len(rows) // 2], 2),
        "p99_ms": round(max(r["p99_ms"] for r in rows), 2),
        "statuses": dict(sorted(statuses.items())),
        "seconds": duration_s * len(rows),
    }


def measure(
    url: str,
    pair: tuple[str, str],
    bodies: Sequence[bytes],
    items: int,
    concurrency: int,
    args: argparse.Namespace,
) -> dict[str, dict[str, Any]]:
    """Both twins of ``pair`` at ``concurrency``, in turns over ``args.rounds`` rounds."""
    rows: dict[str, list[dict[str, Any]]] = {model: [] for model in pair}
    for _ in range(args.rounds):
        for model in pair:
            target = url.format(model=model)
            rows[model].append(asyncio.run(mixed.level(target, bodies, items, concurrency, args.duration)))
    return {model: merge(found, args.duration) for model, found in rows.items()}


def markdown(result: dict[str, Any]) -> str:
    """The caption and the table of a result."""
    caption = (
        f"**ONNX Runtime vs PyTorch, served** on {report.machine_label()}, {result['workers']} workers x "
        f"{result['torch_threads']} thread(s), {result['duration_s']:.0f} s per model and point x "
        f"{result['rounds']} round(s), V2 JSON ({result['date']}). MiniLM: {result['items']} texts per "
        f"request with the feed's query; feed-ranker: {result['ranker_items']} row(s) per request."
    )
    rows = []
    for point in result["points"]:
        torch_row, onnx_row = point["torch"], point["onnx"]
        rows.append(
            (
                point["model"],
                point["set"],
                point["concurrency"],
                f"{torch_row['items_per_s']:.1f}",
                f"{onnx_row['items_per_s']:.1f}",
                f"**{point['items_ratio']:.2f}**",
                f"{torch_row['p50_ms']:.1f}",
                f"{onnx_row['p50_ms']:.1f}",
                f"{point['p50_ratio']:.2f}",
                ", ".join(
                    f"{name} {s}: {n}"
                    for name, row in (("torch", torch_row), ("onnx", onnx_row))
                    for s, n in row["statuses"].items()
                    if s != "200"
                )
                or "-",
            )
        )
    header = (
        "model",
        "texts",
        "c",
        "PyTorch items/s",
        "ONNX items/s",
        "ONNX / PyTorch",
        "PyTorch p50 ms",
        "ONNX p50 ms",
        "p50 ratio",
        "other answers",
    )
    return caption + "\n\n" + report.table(header, rows, "llrrrrrrrl")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = server.parser(__doc__, torch_threads=1)
    parser.add_argument("--concurrency", type=server.levels, default=[1, 8, 64], help="MiniLM levels")
    parser.add_argument("--ranker-concurrency", type=server.levels, default=[1, 64])
    parser.add_argument("--duration", type=float, default=15.0, help="seconds per model and point and round")
    parser.add_argument("--rounds", type=int, default=1, help="turns of the two twins at each point")
    parser.add_argument("--items", type=int, default=8, help="MiniLM texts per request")
    parser.add_argument("--ranker-items", type=int, default=1, help="feed-ranker rows per request")
    parser.add_argument("--texts", type=int, default=2000, help="feed texts the requests cycle over")
    parser.add_argument(
        "--sets",
        type=server.comma_list(["short", "mix"]),
        default=["short", "mix"],
        help="MiniLM payload sets",
    )
    parser.add_argument("--out", type=Path, default=Path("out/onnx-served.json"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    texts = payloads.feed_texts(payloads.model_words(args.repository), args.texts)
    sets = {"short": texts[0::2], "mix": texts}
    ranker_bodies = payloads.v2_bodies(args.repository, RANKER, args.ranker_items, 64)
    result: dict[str, Any] = report.record(
        workers=args.workers,
        torch_threads=args.torch_threads,
        duration_s=args.duration,
        rounds=args.rounds,
        items=args.items,
        ranker_items=args.ranker_items,
        points=[],
    )
    env = {"SCORING_TORCH_THREADS": str(args.torch_threads)}
    with (
        tempfile.TemporaryDirectory() as tmp,
        server.start(Path(tmp), args.repository, ",".join(MODELS), args.workers, env) as srv,
    ):
        srv.wait_ready(600, count=args.workers)
        url = srv.url + "/v2/models/{model}/infer"
        plan: list[tuple[tuple[str, str], str, list[bytes], int, list[int]]] = [
            (
                (MINILM, MINILM_ONNX),
                name,
                payloads.feed_bodies(sets[name], args.items),
                args.items,
                args.concurrency,
            )
            for name in args.sets
        ]
        plan.append(((RANKER, RANKER_ONNX), "-", ranker_bodies, args.ranker_items, args.ranker_concurrency))
        for pair, name, bodies, items, levels in plan:
            for model in pair:  # warm up: the first requests of a worker are slower
                asyncio.run(mixed.level(url.format(model=model), bodies, items, 2, 2.0))
            for c in levels:
                rows = measure(url, pair, bodies, items, c, args)
                torch_row, onnx_row = rows[pair[0]], rows[pair[1]]
                point = {
                    "model": pair[0],
                    "set": name,
                    "concurrency": c,
                    "torch": torch_row,
                    "onnx": onnx_row,
                    "items_ratio": round(onnx_row["items_per_s"] / max(torch_row["items_per_s"], 1e-9), 3),
                    "p50_ratio": round(onnx_row["p50_ms"] / max(torch_row["p50_ms"], 1e-9), 3),
                }
                print(point, flush=True)
                result["points"].append(point)
    report.publish(args.out, result, markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
