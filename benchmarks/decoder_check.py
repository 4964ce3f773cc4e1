"""Step 4 of the GPU run (issue 52): a 7B Llama-architecture sequence classifier, as the
moderation seed ran TrustSafeAI/RADAR-Vicuna-7B: posts cut into pieces of at most 300
characters on word boundaries, each piece classified, in batches of 32, bfloat16.

    python -m benchmarks.decoder_check --out $OUT/decoder_check.json     # CUDA: Llama-2-7B's shape
    python -m benchmarks.decoder_check --size tiny --seconds 2          # CPU rehearsal, seconds

The weights are random, made on the device (no download): the arithmetic is the real model's
(``LlamaForSequenceClassification``, 32 layers, hidden 4096, 6.61 B parameters). The model is
served **through the server's handler** (``app.handlers.sequence_classification``), loaded from
:data:`RADAR_TOML` (the RADAR-style model.toml of docs/text-models.md: ``truncation =
"pieces"``, ``piece_chars = 300``, bfloat16) with a small model of the same vocabulary and labels
as its folder, whose weights :meth:`SequenceClassificationHandler.use_model` then replaces with
the 7B built on the device (saving 13.5 GB to load them again would take the run's time). So the
figures include what a worker's inference thread does per batch: the pieces cut and tokenized
by the handler's ``split_windows`` (as the window stage runs it, ahead of the timed loop),
padding into pinned buffers, the cost model's length groups (measured on the 7B at its
``use_model``), the last-token pooling and the copy back; not HTTP, not the queue, not the staged
pipeline's overlap (a server overlaps a batch's padding and copy back with the next forward).

Pieces: 1,500-word posts of the demo MiniLM's vocabulary (:func:`posts_of`), cut by the handler
(``app.models.windows.piece_spans``: at most 300 characters on word boundaries); tokenized by
MiniLM's WordPiece tokenizer (installed with the demo; an English word piece is about as long as
a Llama token: the mean tokens per piece is reported). Batches of ``--batch`` pieces in post
order.

Figures, written to ``--out`` after each phase (a run cut short keeps what it measured):
``plan`` (weights and activations by :mod:`app.models.memory`) against ``memory`` (torch's
allocated bytes after the load, its peak over the batches, and the CUDA context: NVML's used
bytes less torch's reserved ones); ``items_per_s`` (pieces), real and padded ``tokens_per_s``;
``mfu``: the forward's FLOPs (2 x matmul parameters per token, plus attention's
4 x layers x hidden x T per token) per second over the card's dense bfloat16 peak
(``--peak-tflops``, else :data:`PEAK_BF16_TFLOPS` by the device's name), on real tokens
(``mfu``) and on padded ones (``hardware_utilization``); and the seed's figure, 15 ms a piece
on one A100 (66.7 pieces/s), as ``x_seed``.
"""

from __future__ import annotations

import argparse
import itertools
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks import payloads, report

#: Dense bfloat16 tensor-core peaks, TFLOP/s, by a substring of torch's device name (the first
#: that matches): NVIDIA's data sheets (H100 SXM and H200 989, H100 NVL 835, H100 PCIe 756,
#: A100 312, L40S 362, L4 121).
PEAK_BF16_TFLOPS = (
    ("H200", 989.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
)
#: The seed's offline figure: 15 ms a piece on one A100.
SEED_PIECES_PER_S = 1000 / 15
#: Llama-2-7B's shape (meta-llama/Llama-2-7b-hf config.json) with RADAR's two labels; and a tiny
#: one of the same class for a CPU rehearsal.
SIZES: dict[str, dict[str, Any]] = {
    "7b": {
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 4096,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
    },
}
BOS_ID = 1
WORDS_PER_POST = 1500
#: The RADAR-style model.toml of docs/text-models.md: pieces of at most 300 characters, batches of
#: 32, bfloat16 (``{dtype}``, ``{batch}``, ``{chars}``: the run's options).
RADAR_TOML = """\
name = "radar"
version = "1"
format = "handler"
handler = "app.handlers.sequence_classification:SequenceClassificationHandler"
max_batch_size = {batch}
max_queue_delay_ms = 5.0
warmup_batch_sizes = [1, {batch}]

[[inputs]]
name = "text"
datatype = "BYTES"
shape = [1]

[[outputs]]
name = "probabilities"
datatype = "FP32"
shape = [2]
labels = ["human", "machine"]

[[outputs]]
name = "score"
datatype = "FP32"
shape = [1]

[[outputs]]
name = "windows"
datatype = "INT64"
shape = [1]

[[outputs]]
name = "tokens"
datatype = "INT64"
shape = [1]

[[outputs]]
name = "pieces"
datatype = "BYTES"
shape = [1]

[parameters]
model_dir = "hf"
dtype = "{dtype}"
max_seq_length = 128
truncation = "pieces"
piece_chars = {chars}
max_windows = 64
score_label = "machine"
"""


def posts_of(words: Sequence[str], posts: int, seed: int = 0) -> list[str]:
    """``posts`` texts of :data:`WORDS_PER_POST` words drawn with Zipf weights by rank (as
    :func:`benchmarks.payloads.feed_texts` draws them), in sentences of 6 to 20 words."""
    rng = random.Random(seed)
    cumulative = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(len(words))))
    texts = []
    for _ in range(posts):
        drawn = rng.choices(words, cum_weights=cumulative, k=WORDS_PER_POST)
        sentences, start = [], 0
        while start < len(drawn):
            stop = start + rng.randint(6, 20)
            sentences.append(" ".join(drawn[start:stop]).capitalize() + ".")
            start = stop
        texts.append(" ".join(sentences))
    return texts


def batches(rows: Sequence[Any], size: int) -> Iterator[list[Any]]:
    """``rows`` in batches of ``size``, round and round (a timed loop takes what it needs).
    Raises ``ValueError`` for fewer rows than one batch."""
    if len(rows) < size:
        raise ValueError(f"{len(rows)} pieces make no batch of {size}: more --posts")
    while True:
        for start in range(0, len(rows) - size + 1, size):
            yield list(rows[start : start + size])


def peak_tflops(device_name: str, given: float | None) -> float | None:
    """The card's dense bfloat16 peak: ``given``, else by name (None: unknown, or a CPU)."""
    if given is not None:
        return given
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in device_name), None)


def forward_flops(matmul_parameters: int, layers: int, hidden: int, lengths: Sequence[int]) -> float:
    """FLOPs of one forward over rows of ``lengths`` tokens: 2 per matmul parameter per token,
    and attention's scores and weighted sum, 4 x hidden x T per token per layer (Kaplan et al.
    2020, table 1; the PaLM paper's MFU, appendix B)."""
    tokens = sum(lengths)
    return 2.0 * matmul_parameters * tokens + 4.0 * layers * hidden * sum(t * t for t in lengths)


def build(size: str, device: Any, dtype: Any) -> Any:
    """The classifier with random weights, made on ``device`` in ``dtype`` (None: float32; no
    float32 copy of the 7B weights ever exists)."""
    import torch
    from transformers import AutoModelForSequenceClassification, LlamaConfig

    config = LlamaConfig(
        **SIZES[size],
        vocab_size=32000,
        id2label={0: "human", 1: "machine"},
        bos_token_id=BOS_ID,
        eos_token_id=2,
        pad_token_id=None,
    )
    with torch.device(device):
        model = AutoModelForSequenceClassification.from_config(config, dtype=dtype or torch.float32)
    return model.eval()


def radar_model(root: Path, repository: Path, args: argparse.Namespace) -> Path:
    """The model folder the handler loads: :data:`RADAR_TOML` and, as its ``hf`` folder, a tiny
    ``LlamaForSequenceClassification`` of Llama's vocabulary and RADAR's labels with the demo
    MiniLM's tokenizer files (:meth:`SequenceClassificationHandler.use_model` replaces its
    weights)."""
    import shutil

    from app.handlers.text_config import resolve_model_dir
    from app.models.repository import read_config

    folder = root / "radar"
    (folder / "hf").mkdir(parents=True, exist_ok=True)
    build("tiny", "cpu", None).save_pretrained(folder / "hf")
    minilm = read_config(repository / "all-MiniLM-L6-v2")
    source = resolve_model_dir(minilm.parameters, minilm.path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        if (source / name).is_file():
            shutil.copy(source / name, folder / "hf" / name)
    (folder / "model.toml").write_text(
        RADAR_TOML.format(dtype=args.dtype, batch=args.batch, chars=args.max_chars)
    )
    return folder


def serving_handler(folder: Path, device: Any) -> tuple[Any, Any]:
    """The RADAR-style model's handler, loaded on ``device`` as a worker loads it, and its config."""
    from app.handlers.sequence_classification import SequenceClassificationHandler
    from app.models.repository import read_config

    config = read_config(folder)
    handler = SequenceClassificationHandler()
    handler.load(device, config)
    return handler, config


def piece_items(handler: Any, repository: Path, posts: int) -> tuple[list[Any], list[bytes]]:
    """The pieces of ``posts`` posts (:func:`posts_of`) as the window stage makes them
    (``split_windows``): each piece's preparation (its token ids and span) and its text."""
    texts = posts_of(payloads.model_words(repository), posts)
    split = handler.split_windows(texts, None)
    parts = [span.prepared for spans in split for span in spans]
    pieces = [texts[i][s.start : s.stop].encode() for i, spans in enumerate(split) for s in spans]
    return parts, pieces


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--size", choices=sorted(SIZES), default=None, help="default: 7b on CUDA, tiny on CPU"
    )
    parser.add_argument("--device", default=None, help="default: cuda if torch sees one, else cpu")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--batch", type=int, default=32, help="pieces per batch")
    parser.add_argument("--max-chars", type=int, default=300, help="characters per piece, at most")
    parser.add_argument("--posts", type=int, default=64, help=f"posts of {WORDS_PER_POST} words")
    parser.add_argument("--seconds", type=float, default=45.0, help="timed loop, after 3 warm-up batches")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the card's dense bf16 peak")
    parser.add_argument("--repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--out", type=Path, default=None, help="JSON report, rewritten after each phase")
    return parser.parse_args(argv)


def nvml_free(device: Any) -> int | None:
    """NVML's free bytes of ``device`` before this process makes its CUDA context (torch's own
    ``mem_get_info`` would make it first); None on a CPU or without NVML."""
    import gpu_stat

    if device.type != "cuda":
        return None
    try:
        return gpu_stat.query_gpus()[device.index or 0].memory_free
    except (gpu_stat.NvmlUnavailable, IndexError):
        return None


def measure_memory(torch: Any, device: Any, free_before: int | None) -> dict[str, Any]:
    """torch's allocated and peak bytes, and the CUDA context (NVML's used bytes beyond
    ``free_before`` less torch's reserved ones); empty on a CPU."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    context = None if free_before is None else (free_before - free) - reserved
    return {
        "allocated_bytes": torch.cuda.memory_allocated(device),
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
        "reserved_bytes": reserved,
        "context_bytes": context,
        "total_bytes": total,
    }


def main(argv: list[str] | None = None) -> int:
    import tempfile

    import torch

    from app.models.memory import Architecture, activation_bytes, estimate_parameters, largest_batch

    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    size = args.size or ("7b" if device.type == "cuda" else "tiny")
    dtype = getattr(torch, args.dtype)
    free_before = nvml_free(device)
    with tempfile.TemporaryDirectory() as root:
        handler, config = serving_handler(radar_model(Path(root), args.repository, args), device)
    started = time.perf_counter()
    parts, pieces = piece_items(handler, args.repository, args.posts)
    lengths = [len(p[0]) for p in parts]
    result: dict[str, Any] = report.record(
        device=str(device), size=size, dtype=args.dtype, batch=args.batch, max_chars=args.max_chars,
        pieces=len(parts), split_ms_per_post=1000 * (time.perf_counter() - started) / args.posts,
        mean_tokens_per_piece=sum(lengths) / len(parts), max_tokens_per_piece=max(lengths),
    )  # fmt: skip
    report.write_json(args.out, result)
    started = time.perf_counter()
    model = build(size, device, dtype)
    hf_config = model.config.to_dict() | {"architectures": ["LlamaForSequenceClassification"]}
    arch = Architecture.from_config(hf_config)
    parameters = estimate_parameters(arch, hf_config)
    assert parameters == sum(p.numel() for p in model.parameters()), "the plan's formula disagrees"
    handler.use_model(model, config.parameters)
    rows_planned, seq_planned = largest_batch(args.batch, None, max(lengths))
    result["build_s"] = time.perf_counter() - started
    result["cost_model"] = {
        "call_overhead_tokens": handler.cost.overhead,
        "attention_knee_tokens": handler.cost.knee,
    }
    result["plan"] = {
        "parameters": parameters,
        "weight_bytes": parameters * dtype.itemsize,
        "activation_bytes": activation_bytes(arch, rows_planned, seq_planned, args.dtype, "sdpa"),
        "at": [rows_planned, seq_planned],
    }
    result["memory_after_load"] = measure_memory(torch, device, free_before)
    print(f"built {size} in {result['build_s']:.1f} s: {result['plan']}", flush=True)
    report.write_json(args.out, result)
    result.update(
        timed(torch, handler, list(zip(parts, pieces, strict=True)), args, device, arch, parameters)
    )
    result["memory"] = measure_memory(torch, device, free_before)
    if result["memory"]:  # the plan's two terms against what torch allocated
        loaded = result["memory_after_load"]["allocated_bytes"]
        result["memory"]["weights_measured_bytes"] = loaded
        result["memory"]["activations_measured_bytes"] = result["memory"]["peak_allocated_bytes"] - loaded
    report.write_json(args.out, result)
    print({k: result[k] for k in ("items_per_s", "mfu", "hardware_utilization", "x_seed")}, flush=True)
    return 0


def run_batch(handler: Any, batch: Sequence[tuple[Any, bytes]]) -> dict[str, Any]:
    """One batch of pieces through the handler as a worker's inference thread runs it:
    ``preprocess`` of their preparations, ``predict``, ``postprocess`` (the copy back)."""
    import numpy as np

    from app.handlers.tokenizing import prepared_array
    from app.models.base import PREPARED

    texts = np.empty((len(batch), 1), dtype=object)
    texts[:, 0] = [piece for _, piece in batch]
    inputs = {"text": texts, PREPARED: prepared_array([parts for parts, _ in batch])}
    out: dict[str, Any] = handler.postprocess(handler.predict(handler.preprocess(inputs)))
    return out


def timed(
    torch: Any,
    handler: Any,
    items: Sequence[tuple[Any, bytes]],
    args: argparse.Namespace,
    device: Any,
    arch: Any,
    parameters: int,
) -> dict[str, Any]:
    """Warm-up, then batches for ``args.seconds``: throughput, MFU and the seed's ratio."""
    matmul_parameters = parameters - arch.vocab * arch.hidden  # the embedding is a lookup
    source = batches(items, args.batch)
    with torch.inference_mode():
        for _ in range(3):
            run_batch(handler, next(source))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        done = real = padded = 0
        flops = padded_flops = 0.0
        start = time.perf_counter()
        while time.perf_counter() - start < args.seconds:
            batch = next(source)
            run_batch(handler, batch)  # its postprocess copies the results back: waits for the device
            lengths = [len(parts[0]) for parts, _ in batch]
            groups = [[lengths[i] for i in g] for g in handler.cost.groups(lengths)]
            done += len(batch)
            real += sum(lengths)
            padded += sum(max(g) * len(g) for g in groups)
            flops += forward_flops(matmul_parameters, arch.layers, arch.hidden, lengths)
            padded_flops += sum(
                forward_flops(matmul_parameters, arch.layers, arch.hidden, [max(g)] * len(g)) for g in groups
            )
        elapsed = time.perf_counter() - start
    peak = peak_tflops(
        torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", args.peak_tflops
    )
    return {
        "seconds": elapsed,
        "items": done,
        "items_per_s": done / elapsed,
        "ms_per_item": 1000 * elapsed / done,
        "tokens_per_s": real / elapsed,
        "padded_tokens_per_s": padded / elapsed,
        "tflops": flops / elapsed / 1e12,
        "peak_tflops": peak,
        "mfu": None if peak is None else flops / elapsed / 1e12 / peak,
        "hardware_utilization": None if peak is None else padded_flops / elapsed / 1e12 / peak,
        "x_seed": done / elapsed / SEED_PIECES_PER_S,
    }


if __name__ == "__main__":
    raise SystemExit(main())
