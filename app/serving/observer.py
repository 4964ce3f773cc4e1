"""What a dynamic batcher reports (:class:`BatchObserver`, implemented by the metrics module)
and what it shows of its running batch (:class:`RunningBatch`, read by the watchdog)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class BatchObserver(Protocol):
    """Receives batching events (the metrics module implements it)."""

    def batch_done(self, items: int, requests: int, queue_s: float, compute_s: float) -> None: ...

    def padding(self, real_tokens: int, padded_tokens: int) -> None:
        """A priced model's batch: its items' own tokens and what it computed (padding included)."""
        ...

    def rejected(self, reason: str) -> None: ...

    def queue_depth(self, items: int) -> None: ...


class NullObserver:
    """Ignores every event (a batcher without metrics)."""

    def batch_done(self, items: int, requests: int, queue_s: float, compute_s: float) -> None:
        pass

    def padding(self, real_tokens: int, padded_tokens: int) -> None:
        pass

    def rejected(self, reason: str) -> None:
        pass

    def queue_depth(self, items: int) -> None:
        pass


@dataclass(frozen=True)
class RunningBatch:
    """The batch on the inference thread now: when it started (``loop.time()``), its size."""

    started: float
    items: int
    request_ids: tuple[str, ...]
