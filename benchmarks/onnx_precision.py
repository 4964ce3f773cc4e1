"""all-MiniLM-L6-v2 in process: PyTorch against ONNX Runtime float32 and int8 (and float16 on a
GPU), accuracy and speed, through the server's own handler.

Each variant is ``all-MiniLM-L6-v2-onnx`` of the repository (``model.toml``, ``max_seq_length``
256) loaded by ``ModelRunner`` as the server loads it (the call overhead measured at load, so
batches are cut into the same length groups), with ``backend`` and ``onnx_file`` set:

======== ======= ===================
variant  backend onnx_file
======== ======= ===================
torch    torch   -
onnx     onnx    ``model.onnx``
int8     onnx    ``model.int8.onnx``
fp16     onnx    ``model.fp16.onnx`` (``--device cuda`` only, where the file exists)
======== ======= ===================

1. **Accuracy**: each variant's embeddings of ``--texts`` feed texts
   (:func:`benchmarks.payloads.feed_texts`: titles of 5-15 words and descriptions of 40-200,
   words of the model's vocabulary) against the torch float32 pipeline's: the minimum and the
   mean cosine.
2. **Speed**: items/s of ``ModelRunner.forward`` (preprocess, predict, postprocess: what an
   inference thread runs) in batches of ``--batch`` texts, ``--threads`` torch / ONNX Runtime
   intra-op threads, over ``--speed-texts`` texts of each set: **short** (the titles) and the
   **feed mix**. The variants take turns within each of ``--rounds`` rounds (a machine that
   slows down weighs on all alike); the median round is reported, and every round is in the
   JSON record. ``--clock cpu`` divides by the process's CPU time instead of the wall-clock
   time: items per CPU-second, which other processes on a shared machine barely move; with
   ``--threads 1`` (a served worker's thread, ``SCORING_TORCH_THREADS=1``) no idle thread spins
   into it either.

    python -m benchmarks.onnx_precision --out docs/benchmarks/onnx-precision-cpu.json
    python -m benchmarks.onnx_precision --threads 1 --clock cpu --out docs/benchmarks/onnx-precision-cpu1.json
    python -m benchmarks.onnx_precision --texts 64 --speed-texts 64 --rounds 1 --out out/smoke.json

The files come from ``scripts/install`` (``scripts/export_sentence_embedding.py --int8``; add
``--fp16`` on a GPU machine).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import payloads, report, server

MODEL = "all-MiniLM-L6-v2-onnx"
VARIANTS: dict[str, dict[str, Any]] = {
    "torch": {"backend": "torch"},
    "onnx": {"backend": "onnx", "onnx_file": "model.onnx"},
    "int8": {"backend": "onnx", "onnx_file": "model.int8.onnx"},
    "fp16": {"backend": "onnx", "onnx_file": "model.fp16.onnx"},
}


def load(repository: Path, variant: str, device: str) -> Any:
    """The variant as a loaded ``ModelRunner`` on ``device``."""
    import torch

    from app.models.repository import read_config
    from app.serving.runner import ModelRunner

    config = read_config(repository / MODEL)
    parameters = {
        k: v for k, v in config.parameters.items() if k not in ("backend", "onnx_file", "min_cosine")
    }
    config.parameters = {**parameters, **VARIANTS[variant]}
    runner = ModelRunner(config)
    runner.load(torch.device(device))
    return runner


def texts_input(texts: Sequence[str]) -> dict[str, np.ndarray]:
    """``text`` BYTES ``[N, 1]``."""
    array = np.empty((len(texts), 1), dtype=object)
    array[:, 0] = [t.encode() for t in texts]
    return {"text": array}


def embed(runner: Any, texts: Sequence[str], batch: int) -> np.ndarray:
    """Embeddings float32 ``[N, dim]`` of ``texts``, ``batch`` at a time."""
    parts = [
        runner.forward(texts_input(texts[i : i + batch]))["embedding"] for i in range(0, len(texts), batch)
    ]
    return np.concatenate(parts)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine of two ``[N, dim]`` arrays, float64."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    return np.asarray((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)))


#: ``--clock``: wall-clock seconds, or this process's CPU seconds (all its threads).
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def items_per_s(
    runner: Any, texts: Sequence[str], batch: int, clock: Callable[[], float] = time.perf_counter
) -> float:
    """Texts per second of ``clock`` (:data:`CLOCKS`) of :func:`embed` over ``texts`` (one
    warm-up batch first)."""
    runner.forward(texts_input(texts[:batch]))
    began = clock()
    embed(runner, texts, batch)
    return len(texts) / (clock() - began)


def markdown(result: dict[str, Any]) -> str:
    """The caption and the two tables of a result."""
    caption = (
        f"**all-MiniLM-L6-v2 in process** on {report.machine_label()}, {result['device']}, "
        f"{result['threads']} thread(s), batches of {result['batch']} ({result['date']}, load average "
        f"{result['machine']['load_average']:.2f} at the start). Accuracy: cosine to the torch float32 "
        f"pipeline over {result['texts']} feed texts. Speed: median of {result['rounds']} round(s), "
        f"{result['speed_texts']} texts per set, items per "
        f"{'CPU' if result['clock'] == 'cpu' else 'wall-clock'} second."
    )
    torch_speed = result["speed"]["torch"]
    rows = []
    for variant, figures in result["accuracy"].items():
        speed = result["speed"][variant]
        rows.append(
            (
                variant,
                VARIANTS[variant].get("onnx_file", "-"),
                f"{figures['min_cosine']:.5f}",
                f"{figures['mean_cosine']:.5f}",
                f"{speed['short']:.1f}",
                f"{speed['short'] / torch_speed['short']:.2f}x",
                f"{speed['mix']:.1f}",
                f"{speed['mix'] / torch_speed['mix']:.2f}x",
            )
        )
    header = (
        "variant",
        "file",
        "min cosine",
        "mean cosine",
        "short items/s",
        "vs torch",
        "mix items/s",
        "vs torch",
    )
    return caption + "\n\n" + report.table(header, rows, "llrrrrrr")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repository", type=Path, default=server.DEMO_REPOSITORY)
    parser.add_argument("--device", default="cpu", help="cpu or cuda:0 (fp16 runs on CUDA only)")
    parser.add_argument("--threads", type=int, default=2, help="torch and ONNX Runtime intra-op threads")
    parser.add_argument("--batch", type=int, default=32, help="texts per forward call of the runner")
    parser.add_argument("--texts", type=int, default=1000, help="feed texts of the accuracy figures")
    parser.add_argument("--speed-texts", type=int, default=512, help="texts per set of the speed figures")
    parser.add_argument("--rounds", type=int, default=3, help="speed rounds (median reported)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="what speed divides by")
    parser.add_argument("--out", type=Path, default=Path("out/onnx-precision.json"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(args.threads)  # the server's inference thread; ONNX Runtime reads it at load
    folder = args.repository / MODEL
    variants = ["torch", "onnx", "int8"]
    if args.device.startswith("cuda") and (folder / "model.fp16.onnx").is_file():
        variants.append("fp16")
    words = payloads.model_words(args.repository)
    feed = payloads.feed_texts(words, max(args.texts, 2 * args.speed_texts))
    sets = {"short": feed[0::2][: args.speed_texts], "mix": feed[: args.speed_texts]}
    result: dict[str, Any] = report.record(
        device=args.device,
        threads=args.threads,
        batch=args.batch,
        texts=args.texts,
        speed_texts=args.speed_texts,
        rounds=args.rounds,
        clock=args.clock,
    )
    runners = {v: load(args.repository, v, args.device) for v in variants}
    reference = embed(runners["torch"], feed[: args.texts], args.batch)
    result["accuracy"] = {}
    for variant in variants:
        values = cosines(embed(runners[variant], feed[: args.texts], args.batch), reference)
        result["accuracy"][variant] = {"min_cosine": float(values.min()), "mean_cosine": float(values.mean())}
        print(f"accuracy {variant}: {result['accuracy'][variant]}", flush=True)
    rounds: dict[str, dict[str, list[float]]] = {v: {s: [] for s in sets} for v in variants}
    for round_ in range(args.rounds):
        for name, texts in sets.items():
            for variant in variants:
                rounds[variant][name].append(
                    items_per_s(runners[variant], texts, args.batch, CLOCKS[args.clock])
                )
        print(f"round {round_ + 1}: {rounds}", flush=True)
    result["speed_rounds"] = rounds
    result["speed"] = {v: {s: statistics.median(r) for s, r in sets_.items()} for v, sets_ in rounds.items()}
    report.publish(args.out, result, markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
