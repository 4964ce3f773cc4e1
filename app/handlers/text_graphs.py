"""A text encoder's forward pass as CUDA graphs, one per (strings, tokens) shape.

A small transformer's forward at feed sizes (8 to 32 short texts) is launch-bound on a GPU: the
Python of the Hugging Face modules and a few hundred kernel launches cost more than the kernels
(all-MiniLM-L6-v2 on an H200: 6.9 ms eager for 8 texts, docs/benchmarks.md). Replaying a
captured graph launches them all at once. A graph replays fixed shapes, so the tokenised batch
``[U, T]`` (U distinct strings padded to T tokens) runs in the graph of the smallest bucket
``[R, L]`` with R >= U and L >= T, its tokens padded with zeros (``input_ids`` 0,
``attention_mask`` 0: masked, so a real string's embedding does not see them) and its
padding rows given one visible token (so no attention row is wholly masked). Batches larger than
the largest bucket run eagerly.

The sizes: ``cuda_graph_batch_sizes`` of ``model.toml`` for R (strings per forward call: texts
and queries, each distinct one once) and ``[parameters] cuda_graph_sequence_lengths`` for L
(default: powers of two from 16 tokens up to ``max_seq_length``, and ``max_seq_length``).
Source: vLLM and TensorRT-LLM capture their decoders per batch size and pad to the bucket;
text-embeddings-inference avoids padding with varlen kernels instead; the capture recipe is
PyTorch's CUDA Graphs notes, as in :class:`app.models.torch_formats.GraphBuckets`.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from app.errors import ModelLoadError
from app.models.torch_formats import capture_graph, capturing

__all__ = ["TextBucket", "TextGraphs", "capture_for", "default_sequence_lengths"]

log = logging.getLogger(__name__)

#: Features -> float ``[U, dim]``: the pipeline the graphs capture (and run eagerly above them).
Encode = Callable[[dict[str, torch.Tensor]], torch.Tensor]
#: The shortest token bucket of the default lengths.
SHORTEST_BUCKET = 16


def default_sequence_lengths(max_seq_length: int) -> list[int]:
    """Token buckets: 16, 32, 64, ... below ``max_seq_length``, then ``max_seq_length`` (tokens)."""
    lengths = [SHORTEST_BUCKET << i for i in range(max_seq_length.bit_length())]
    lengths = [n for n in lengths if n < max_seq_length]
    return [*lengths, max_seq_length]


@dataclass(eq=False)
class TextBucket:
    """One captured graph of shape ``[rows, tokens]`` and its static tensors.

    Attributes:
        rows: strings it holds (R).
        tokens: tokens per string it holds (L).
        inputs: int64 ``[R, L]`` per feature name (``input_ids``, ``attention_mask``, ...): a
            batch is copied into these before a replay.
        output: float ``[R, dim]``, the sentence embeddings each replay overwrites.
        replay: launches the graph on the current CUDA stream.
    """

    rows: int
    tokens: int
    inputs: dict[str, torch.Tensor]
    output: torch.Tensor
    replay: Callable[[], object]

    def load(self, features: Mapping[str, torch.Tensor]) -> None:
        """Copy ``features`` (int64 ``[U, T]`` each, U <= rows, T <= tokens) into the static
        inputs, zeros around them, and one visible token in each padding row."""
        rows, tokens = features["attention_mask"].shape
        for name, static in self.inputs.items():
            static.zero_()
            static[:rows, :tokens].copy_(features[name])
        self.inputs["attention_mask"][rows:, 0] = 1


class TextGraphs:
    """``encode`` as CUDA graphs per (rows, tokens) bucket; called like ``encode``.

    Called with a tokenised batch (int64 ``[U, T]`` tensors on the device, the feature names it
    was captured with), it replays the smallest bucket that holds it and returns the first U rows
    of its output, **cloned** (the next replay overwrites them). A batch above every bucket, or
    with other feature names, runs ``encode`` eagerly. Everything runs on the current CUDA stream.
    Not thread-safe: the inference thread calls it, one batch at a time.
    """

    def __init__(self, buckets: Sequence[TextBucket], encode: Encode) -> None:
        self._buckets = sorted(buckets, key=lambda b: (b.rows, b.tokens))
        self.rows = sorted({b.rows for b in self._buckets})
        self.tokens = sorted({b.tokens for b in self._buckets})
        self._by_shape = {(b.rows, b.tokens): b for b in self._buckets}
        self._names = set(self._buckets[0].inputs) if self._buckets else set()
        self._encode = encode

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """The captured ``(rows, tokens)`` shapes, ascending."""
        return [(b.rows, b.tokens) for b in self._buckets]

    def bucket_for(self, rows: int, tokens: int) -> TextBucket | None:
        """The bucket of the fewest rows >= ``rows`` and tokens >= ``tokens``, or None."""
        r = bisect.bisect_left(self.rows, rows)
        t = bisect.bisect_left(self.tokens, tokens)
        if r == len(self.rows) or t == len(self.tokens):
            return None
        return self._by_shape.get((self.rows[r], self.tokens[t]))

    def __call__(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        rows, tokens = features["attention_mask"].shape
        bucket = self.bucket_for(int(rows), int(tokens))
        if bucket is None or set(features) != self._names:
            return self._encode(features)
        bucket.load(features)
        bucket.replay()
        return bucket.output[:rows].clone()

    @classmethod
    def capture(
        cls,
        encode: Encode,
        names: Sequence[str],
        rows: Sequence[int],
        tokens: Sequence[int],
        device: torch.device,
    ) -> TextGraphs:
        """Capture ``encode`` at every (rows, tokens) pair on CUDA ``device``, with int64 inputs
        named ``names`` (each must include ``attention_mask``), largest first into one memory pool
        (:meth:`app.models.torch_formats.GraphBuckets.capture` says why that order and pool).

        Raises:
            RuntimeError: whatever CUDA or PyTorch raised when the pipeline cannot be captured
                (it synchronises with the host, or changes shape with the data).
        """
        buckets = []
        with capturing(device) as (pool, stream):
            for r in sorted(rows, reverse=True):
                for t in sorted(tokens, reverse=True):
                    inputs = {n: torch.zeros((r, t), dtype=torch.int64, device=device) for n in names}
                    inputs["attention_mask"][:, 0] = 1
                    output, replay = capture_graph(lambda: encode(dict(inputs)), pool, stream)  # noqa: B023
                    buckets.append(TextBucket(r, t, inputs, output, replay))
        return cls(buckets, encode)


def capture_for(
    config: Any, encode: Encode, names: Sequence[str], max_seq_length: int, device: torch.device
) -> TextGraphs | None:
    """``encode`` captured at the buckets ``config`` names (``cuda_graph_batch_sizes``; its
    ``[parameters] cuda_graph_sequence_lengths``, default :func:`default_sequence_lengths`) on a
    CUDA ``device``; None where it names none, or on the CPU (one INFO line).

    Raises:
        ValueError: a token bucket over ``max_seq_length``.
        ModelLoadError: the pipeline cannot be captured.
    """
    rows = list(getattr(config, "cuda_graph_batch_sizes", None) or [])
    if not rows:
        return None
    lengths = config.parameters.get("cuda_graph_sequence_lengths") or default_sequence_lengths(max_seq_length)
    if lengths[-1] > max_seq_length:
        raise ValueError(
            f"parameters.cuda_graph_sequence_lengths {lengths} go past max_seq_length {max_seq_length}"
        )
    if device.type != "cuda":
        log.info("model %s: cuda_graph_batch_sizes ignored on %s (CUDA graphs need a CUDA device)",
                 config.name, device)  # fmt: skip
        return None
    try:
        return TextGraphs.capture(encode, names, rows, lengths, device)
    except Exception as exc:
        raise ModelLoadError(
            f"model {config.name}: cannot capture it as CUDA graphs ({exc}); remove "
            "cuda_graph_batch_sizes from its model.toml to run it eagerly"
        ) from exc
