"""Per-model inference statistics of this worker, as Triton's statistics extension reports them.

A :class:`ModelStats` is a :class:`app.serving.batcher.BatchObserver`: the batcher tells it of
every batch run and every request refused, and it keeps cumulative counts and nanoseconds.
Counts are per worker process (each gunicorn worker has its own batcher); the answer of
``GET /v2/models/stats`` names the worker's pid. Prometheus (``/metrics``) is the place for
figures summed over workers.

How the batcher's events map to Triton's fields (one batch of ``items`` items from
``requests`` requests, waiting ``queue_s`` for its oldest request, computing ``compute_s``):

- ``inference_count`` += items, ``execution_count`` += 1;
- ``success.count`` += requests, ``success.ns`` += requests x (queue + compute);
- ``queue`` += requests, requests x queue_s (the oldest request's wait: an upper bound);
- ``compute_infer`` += requests, requests x compute_s (every request waited the whole batch);
  ``compute_input``/``compute_output``: the same counts, 0 ns (conversion runs inside the model
  call; perf_analyzer requires the three counts to be equal);
- ``batch_stats[items]``: count += 1, compute_infer ns += compute_s;
- a refused request (queue full, deadline, client gone, out of memory): ``fail.count`` += 1.

A request larger than ``max_batch_size`` spans several batches and counts in each.

Source: triton-inference-server/server ``docs/protocol/extension_statistics.md``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from app.serving.observer import BatchObserver

_NS = 1_000_000_000


@dataclass
class Duration:
    """Triton's ``$duration_stat``: how many, and their cumulative nanoseconds."""

    count: int = 0
    ns: int = 0

    def add(self, count: int, seconds: float) -> None:
        """Count ``count`` events that took ``seconds`` in all."""
        self.count += count
        self.ns += int(seconds * _NS)

    def as_dict(self) -> dict[str, int]:
        """``{"count", "ns"}``."""
        return {"count": self.count, "ns": self.ns}


@dataclass
class ModelStats:
    """Cumulative statistics of one model version in this worker (see the module docstring)."""

    inference_count: int = 0
    execution_count: int = 0
    #: Milliseconds since the epoch of the last batch run; 0 = never.
    last_inference_ms: int = 0
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    #: Batch size (items) -> model calls of that size and their compute time.
    batches: dict[int, Duration] = field(default_factory=dict)

    def batch_done(self, items: int, requests: int, queue_s: float, compute_s: float) -> None:
        """One batch of ``items`` items from ``requests`` requests ran (seconds waited, computed)."""
        self.inference_count += items
        self.execution_count += 1
        self.last_inference_ms = int(time.time() * 1000)
        self.success.add(requests, requests * (queue_s + compute_s))
        self.queue.add(requests, requests * queue_s)
        self.compute_infer.add(requests, requests * compute_s)
        self.batches.setdefault(items, Duration()).add(1, compute_s)

    def padding(self, real_tokens: int, padded_tokens: int) -> None:
        """Not recorded here (Prometheus has the counters)."""

    def rejected(self, reason: str) -> None:
        """One request was refused or dropped (``reason``: queue_full, deadline, ...)."""
        self.fail.add(1, 0.0)

    def queue_depth(self, items: int) -> None:
        """Not recorded here (Prometheus has the gauge)."""

    def as_triton(self, name: str, version: str) -> dict[str, Any]:
        """Triton's ``$model_stat`` object for this model version."""
        zero = Duration().as_dict()
        # perf_analyzer requires equal compute_input/infer/output counts.
        no_time = {"count": self.compute_infer.count, "ns": 0}
        return {
            "name": name,
            "version": version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": self.success.as_dict(),
                "fail": self.fail.as_dict(),
                "queue": self.queue.as_dict(),
                "compute_input": no_time,
                "compute_infer": self.compute_infer.as_dict(),
                "compute_output": no_time,
                "cache_hit": zero,
                "cache_miss": zero,
            },
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": {"count": d.count, "ns": 0},
                    "compute_infer": d.as_dict(),
                    "compute_output": {"count": d.count, "ns": 0},
                }
                for size, d in sorted(self.batches.items())
            ],
            "memory_usage": [],
        }


class FanOut:
    """A :class:`BatchObserver` that passes every event to each of ``observers`` in order."""

    def __init__(self, *observers: BatchObserver) -> None:
        self.observers = observers

    def batch_done(self, items: int, requests: int, queue_s: float, compute_s: float) -> None:
        """See :meth:`BatchObserver.batch_done`."""
        for o in self.observers:
            o.batch_done(items, requests, queue_s, compute_s)

    def padding(self, real_tokens: int, padded_tokens: int) -> None:
        """See :meth:`BatchObserver.padding`."""
        for o in self.observers:
            o.padding(real_tokens, padded_tokens)

    def rejected(self, reason: str) -> None:
        """See :meth:`BatchObserver.rejected`."""
        for o in self.observers:
            o.rejected(reason)

    def queue_depth(self, items: int) -> None:
        """See :meth:`BatchObserver.queue_depth`."""
        for o in self.observers:
            o.queue_depth(items)
