"""The unit of a batch's result, shared by the runner and the batcher (no torch here)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from app.errors import ScoringError


@dataclass(frozen=True)
class Segment:
    """Outputs for batch items [start, stop); ``outputs`` None = they failed: ``error`` says
    how (None: one item that did not fit in device memory alone)."""

    start: int
    stop: int
    outputs: dict[str, np.ndarray] | None
    error: ScoringError | None = None


def outputs_between(
    segments: list[Segment], start: int, stop: int
) -> dict[str, np.ndarray] | Segment:
    """Outputs for batch items [start, stop) across a batch's segments (``[stop - start, ...]``
    per output name), or the first failed segment among them."""
    pieces: list[dict[str, np.ndarray]] = []
    for seg in segments:
        lo, hi = max(start, seg.start), min(stop, seg.stop)
        if lo >= hi:
            continue
        if seg.outputs is None:
            return seg
        pieces.append({k: v[lo - seg.start : hi - seg.start] for k, v in seg.outputs.items()})
    if len(pieces) == 1:
        return pieces[0]
    return {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]}
