"""Admission by time: a model's measured service rate and the cost of a request's items.

A request is admitted only when the work ahead of it plus its own can finish within its
deadline. With a service rate of ``r`` items/s (a moving average of measured batch compute
times, seeded at warmup), ``q`` items queued and a batch of ``n`` items that started ``t``
seconds ago, a new request of ``b`` items expects to finish after

    wait = max(0, n / r - t) + q / r + b / r (+ the max queue delay)

seconds: Little's law (L = lambda W) read backwards, W = L / lambda. A request whose expected
finish lies past its deadline would only expire in the queue after taking memory and,
worse, the place of one that could finish: it is refused at once (503 + Retry-After, the
backlog in seconds). Sources: BentoML's adaptive batching (it estimates the batch latency
from past batches to decide what to wait for), Triton's ``max_queue_delay_microseconds``
and ``default_queue_policy`` (``default_timeout_microseconds``, reject on timeout).
docs/reliability.md explains the choices.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


class ServiceRate:
    """A model's service rate, items/s: exponentially weighted averages of the items and the
    compute seconds of its batches (so large batches weigh more, as they should), or the last
    batch's rate when that is lower: a slowdown (the CPU taken by a burst of requests to
    refuse) counts at once, a speed-up gradually, because admitting too much costs 504s and
    wasted compute while refusing a little too much costs cheap 503s.

    Args:
        weight: the weight of the newest batch, 0 < weight <= 1.
    """

    def __init__(self, weight: float = 0.2) -> None:
        self._weight = weight
        self._items = 0.0
        self._seconds = 0.0
        self._last = 0.0  # the last batch's rate, items/s

    def observe(self, items: int, seconds: float) -> None:
        """Record one batch of ``items`` that computed in ``seconds``."""
        if items < 1 or seconds <= 0:
            return
        self._last = items / seconds
        if self._seconds == 0.0:
            self._items, self._seconds = float(items), seconds
            return
        w = self._weight
        self._items += w * (items - self._items)
        self._seconds += w * (seconds - self._seconds)

    @property
    def items_per_s(self) -> float | None:
        """The measured rate, items/s; None before the first batch."""
        return min(self._items / self._seconds, self._last) if self._seconds > 0 else None

    def seconds_for(self, items: float) -> float:
        """Expected compute seconds for ``items`` items; 0 while the rate is unknown."""
        rate = self.items_per_s
        return items / rate if rate else 0.0


def cumulative_costs(inputs: Mapping[str, np.ndarray]) -> np.ndarray:
    """Cost of a request's items in bytes, cumulative: int64 ``[B + 1]``, ``[0] = 0``, so the
    cost of items ``[i, j)`` is ``c[j] - c[i]``.

    An item's cost is its input bytes over every input: ``nbytes / B`` for a numeric array,
    the summed lengths of its elements for a BYTES (object) array.
    """
    size = len(next(iter(inputs.values())))
    per_item = np.zeros(size, dtype=np.int64)
    for arr in inputs.values():
        if arr.dtype == object:
            lengths = np.fromiter((len(v) for v in arr.reshape(-1)), dtype=np.int64, count=arr.size)
            per_item += lengths.reshape(size, -1).sum(axis=1)
        else:
            per_item += arr.nbytes // max(1, size)
    out = np.zeros(size + 1, dtype=np.int64)
    np.cumsum(per_item, out=out[1:])
    return out


def items_within(costs: np.ndarray, start: int, stop: int, budget: float) -> int:
    """How many items from ``start`` (at most ``stop - start``) fit within ``budget`` bytes."""
    end = int(np.searchsorted(costs, costs[start] + budget, side="right")) - 1
    return max(0, min(end, stop) - start)
