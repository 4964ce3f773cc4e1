"""The CUDA streams of a batch's three stages, and the events that order them, so that the copies
of one batch overlap the kernels of another (nothing on the CPU). Source: PyTorch's CUDA
semantics notes (streams, ``wait_event``, the caching allocator's per-stream blocks)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch


class Streams:
    """The CUDA streams of the three stages, and the events that order them (None on the CPU).

    ``prepare`` copies to the device on the copy stream and records ``ready``; ``predict``
    makes the compute stream wait for it, launches the kernels and records ``done``;
    ``finish`` makes the copy-back stream wait for ``done`` and copies to the host. Tensors
    stay referenced (by the batch in flight) until ``finish`` has synchronised, so the caching
    allocator never hands their memory to another stream too early.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.copy_in = torch.cuda.Stream(device) if self.cuda else None  # type: ignore[no-untyped-call]
        self.compute = torch.cuda.Stream(device) if self.cuda else None  # type: ignore[no-untyped-call]
        self.copy_out = torch.cuda.Stream(device) if self.cuda else None  # type: ignore[no-untyped-call]

    def on(self, stream: Any) -> Any:
        """A context manager making ``stream`` current (nothing on the CPU)."""
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def mark(self, stream: Any) -> Any:
        """An event recorded on ``stream`` now (None on the CPU)."""
        if stream is None:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
        return event

    @staticmethod
    def after(stream: Any, event: Any) -> None:
        """Make ``stream`` wait for ``event`` (device-side; the host does not block)."""
        if stream is not None and event is not None:
            stream.wait_event(event)


class Staged:
    """A batch between stages: the handler's own object, and the event that says it is ready."""

    __slots__ = ("event", "value")

    def __init__(self, value: Any, event: Any) -> None:
        self.value = value
        self.event = event
