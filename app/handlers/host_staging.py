"""Where a text batch's padded arrays are written before they reach the device.

On the CPU the arrays are fresh numpy arrays that torch shares (``torch.from_numpy``, no copy):
reusing them would be unsafe under the staged pipeline, where batch N+1 is padded while batch N
still reads its tensors, and a few kilobytes cost a microsecond to allocate. On a CUDA device
they are views of **page-locked (pinned) host buffers reused from batch to batch**: only a copy
from pinned memory runs asynchronously with ``non_blocking=True``, and pinning memory per tensor
per batch (``Tensor.pin_memory()``) costs a ``cudaHostAlloc`` each time. Each preparing thread
has a ring of :data:`SLOTS` buffers; a buffer is written again only once the copy that read it
last has finished (a CUDA event recorded after it, waited on by the host), so the copy of one
batch overlaps the padding of the next and never reads a half-written buffer.

Source: PyTorch's "pinned memory buffers" notes (CUDA semantics) and the ``pin_memory`` staging
of its DataLoader; text-embeddings-inference copies its batches from host buffers it keeps.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from app.handlers.tokenizing import Alloc

__all__ = ["SLOTS", "HostStaging"]

#: Buffers per preparing thread: one being copied while the next is written.
SLOTS = 2
#: A buffer's first size, int64 elements (3 arrays of 32 x 256 tokens).
_FIRST_ELEMENTS = 3 * 32 * 256

#: Writes a batch's arrays with the given allocator: one ``{name: int64 array}`` per part
#: (a length group's inputs, the items' indices...).
Build = Callable[[Alloc], list[dict[str, npt.NDArray[np.int64]]]]


class _Slot:
    """One pinned buffer, grown as needed, and the event of the last copy that read it."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.event: Any = None
        self.used = 0

    def alloc(self, shape: tuple[int, ...]) -> npt.NDArray[np.int64]:
        count = math.prod(shape)
        assert self.buffer is not None
        view = self.buffer[self.used : self.used + count].numpy().reshape(shape)
        self.used += count
        return view

    def reserve(self, elements: int) -> None:
        if self.buffer is None or self.buffer.numel() < elements:
            size = max(elements, _FIRST_ELEMENTS, 2 * (self.buffer.numel() if self.buffer is not None else 0))
            self.buffer = torch.empty(size, dtype=torch.int64, pin_memory=True)
        self.used = 0


class HostStaging:
    """Pads a batch into host arrays and moves them to ``device`` (module docstring). Safe to use
    from several threads at once (each has its own buffers).

    Args:
        device: where the model runs.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._local = threading.local()

    def to_device(self, build: Build, elements: int) -> list[dict[str, torch.Tensor]]:
        """``build(alloc)`` writes the batch's int64 arrays (made by ``alloc``, at most
        ``elements`` int64 values in all); returns them as tensors on the device, part by part
        (on a GPU copied on the current stream, asynchronously)."""
        if not self.pinned:
            return [{k: torch.from_numpy(v) for k, v in part.items()} for part in build(_fresh)]
        slot = self._next_slot()
        if slot.event is not None:
            slot.event.synchronize()  # the copy that read this buffer last has finished
        slot.reserve(elements)
        parts = build(slot.alloc)
        out = [
            {k: torch.from_numpy(v).to(self.device, non_blocking=True) for k, v in part.items()}
            for part in parts
        ]
        slot.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        slot.event.record(torch.cuda.current_stream(self.device))
        return out

    def _next_slot(self) -> _Slot:
        ring: list[_Slot] | None = getattr(self._local, "ring", None)
        if ring is None:
            ring = self._local.ring = [_Slot() for _ in range(SLOTS)]
            self._local.turn = 0
        turn: int = (self._local.turn + 1) % SLOTS
        self._local.turn = turn
        return ring[turn]


def _fresh(shape: tuple[int, ...]) -> npt.NDArray[np.int64]:
    return np.empty(shape, dtype=np.int64)
