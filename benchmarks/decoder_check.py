"""Step 4 of the GPU run (issue 52): a 7B Llama-architecture sequence classifier, as the
moderation seed ran TrustSafeAI/RADAR-Vicuna-7B: posts cut into pieces of at most 300
characters on word boundaries, each piece classified, in batches of 32, bfloat16.

    python -m benchmarks.decoder_check --out $OUT/decoder_check.json     # CUDA: Llama-2-7B's shape
    python -m benchmarks.decoder_check --size tiny --seconds 2          # CPU rehearsal, seconds

The weights are random, made on the device (no download): the arithmetic is the real model's
(``LlamaForSequenceClassification``, 32 layers, hidden 4096, 6.61 B parameters). The model runs
directly through transformers, not through the server: its base model, its score head on every
position, and the last real token pooled from the mask (:mod:`app.handlers.decoder_math`; the
class's own pooling needs a pad token, which Llama's tokenizer lacks).

Pieces: 1,500-word posts of the demo MiniLM's vocabulary (:func:`posts_of`), cut greedily at
spaces to at most ``--max-chars``; tokenized by MiniLM's WordPiece tokenizer
(installed with the demo; an English word piece is about as long as a Llama token: the mean
tokens per piece is reported) with Llama's BOS id in front. Batches of ``--batch`` pieces in
post order, each padded on the right to its longest piece.

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


def pieces(text: str, max_chars: int) -> list[str]:
    """``text`` cut into pieces of at most ``max_chars`` characters at spaces (a word longer
    than that is cut inside), in order; no piece is empty."""
    out: list[str] = []
    current = ""
    for word in text.split():
        while len(word) > max_chars:
            if current:
                out.append(current)
                current = ""
            out.append(word[:max_chars])
            word = word[max_chars:]
        if not word:
            continue
        if current and len(current) + 1 + len(word) > max_chars:
            out.append(current)
            current = word
        else:
            current = f"{current} {word}" if current else word
    if current:
        out.append(current)
    return out


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


def piece_ids(repository: Path, posts: int, max_chars: int) -> list[list[int]]:
    """Token ids of the pieces of ``posts`` posts (:func:`posts_of`), BOS first."""
    from tokenizers import Tokenizer

    from app.handlers.sentence_embedding import resolve_model_dir
    from app.models.repository import read_config

    config = read_config(repository / "all-MiniLM-L6-v2")
    tokenizer = Tokenizer.from_file(str(resolve_model_dir(config.parameters, config.path) / "tokenizer.json"))
    tokenizer.no_truncation()  # MiniLM's file pads and cuts every text to 128 tokens
    tokenizer.no_padding()
    cut = [p for text in posts_of(payloads.model_words(repository), posts) for p in pieces(text, max_chars)]
    return [[BOS_ID, *e.ids] for e in tokenizer.encode_batch(cut, add_special_tokens=False)]


def batches(rows: Sequence[list[int]], size: int) -> Iterator[list[list[int]]]:
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
    """The classifier with random weights, made on ``device`` in ``dtype`` (no float32 copy of
    the 7B weights ever exists)."""
    import torch
    from transformers import AutoModelForSequenceClassification, LlamaConfig

    config = LlamaConfig(
        **SIZES[size], vocab_size=32000, num_labels=2, bos_token_id=BOS_ID, eos_token_id=2, pad_token_id=None
    )
    with torch.device(device):
        model = AutoModelForSequenceClassification.from_config(config, dtype=dtype)
    return model.eval()


def classify(model: Any, rows: Sequence[list[int]], device: Any) -> Any:
    """Pooled logits ``[len(rows), 2]``: rows padded on the right, the last real token pooled."""
    import torch

    from app.handlers.decoder_math import last_token_pool

    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    ids, mask = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    return last_token_pool(model.score(hidden), mask)


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
    import torch

    from app.models.memory import Architecture, activation_bytes, estimate_parameters, largest_batch

    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    size = args.size or ("7b" if device.type == "cuda" else "tiny")
    dtype = getattr(torch, args.dtype)
    free_before = nvml_free(device)
    rows = piece_ids(args.repository, args.posts, args.max_chars)
    lengths = [len(r) for r in rows]
    result: dict[str, Any] = report.record(
        device=str(device), size=size, dtype=args.dtype, batch=args.batch, max_chars=args.max_chars,
        pieces=len(rows), mean_tokens_per_piece=sum(lengths) / len(rows), max_tokens_per_piece=max(lengths),
    )  # fmt: skip
    report.write_json(args.out, result)
    started = time.perf_counter()
    model = build(size, device, dtype)
    config = model.config.to_dict() | {"architectures": ["LlamaForSequenceClassification"]}
    arch = Architecture.from_config(config)
    parameters = estimate_parameters(arch, config)
    assert parameters == sum(p.numel() for p in model.parameters()), "the plan's formula disagrees"
    rows_planned, seq_planned = largest_batch(args.batch, None, max(lengths))
    result["build_s"] = time.perf_counter() - started
    result["plan"] = {
        "parameters": parameters,
        "weight_bytes": parameters * dtype.itemsize,
        "activation_bytes": activation_bytes(arch, rows_planned, seq_planned, args.dtype, "sdpa"),
        "at": [rows_planned, seq_planned],
    }
    result["memory_after_load"] = measure_memory(torch, device, free_before)
    print(f"built {size} in {result['build_s']:.1f} s: {result['plan']}", flush=True)
    report.write_json(args.out, result)
    result.update(timed(torch, model, rows, args, device, arch, parameters))
    result["memory"] = measure_memory(torch, device, free_before)
    if result["memory"]:  # the plan's two terms against what torch allocated
        loaded = result["memory_after_load"]["allocated_bytes"]
        result["memory"]["weights_measured_bytes"] = loaded
        result["memory"]["activations_measured_bytes"] = result["memory"]["peak_allocated_bytes"] - loaded
    report.write_json(args.out, result)
    print({k: result[k] for k in ("items_per_s", "mfu", "hardware_utilization", "x_seed")}, flush=True)
    return 0


def timed(
    torch: Any,
    model: Any,
    rows: Sequence[list[int]],
    args: argparse.Namespace,
    device: Any,
    arch: Any,
    parameters: int,
) -> dict[str, Any]:
    """Warm-up, then batches for ``args.seconds``: throughput, MFU and the seed's ratio."""
    matmul_parameters = parameters - arch.vocab * arch.hidden  # the embedding is a lookup
    source = batches(rows, args.batch)
    with torch.inference_mode():
        for _ in range(3):
            classify(model, next(source), device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        done = real = padded = 0
        flops = padded_flops = 0.0
        start = time.perf_counter()
        while time.perf_counter() - start < args.seconds:
            batch = next(source)
            logits = classify(model, batch, device)
            lengths = [len(r) for r in batch]
            done += len(batch)
            real += sum(lengths)
            padded += len(batch) * max(lengths)
            flops += forward_flops(matmul_parameters, arch.layers, arch.hidden, lengths)
            padded_flops += forward_flops(
                matmul_parameters, arch.layers, arch.hidden, [max(lengths)] * len(batch)
            )
            if device.type == "cuda" and done % (8 * args.batch) == 0:
                torch.cuda.synchronize(device)  # bound the queue of launched work
        logits.float().cpu()
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
