"""Admission by time: a model's measured service rate and the cost of a request's items.

A request is admitted only when the work ahead of it plus its own can finish within its
deadline. With a batch costing ``t(n) = o + n c`` seconds (fitted from measured batches,
seeded at warmup; :class:`ServiceRate`), ``q`` items queued, a batch of ``n`` items that
started ``s`` seconds ago and batches of at most ``M`` items, a new request of ``b`` items
expects to finish after

    wait = max(0, t(n) - s) + ceil((q + b) / M) o + (q + b) c (+ the max queue delay)

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

#: Batches a :class:`ServiceRate` sees before it fits a slope and an overhead, and before
#: its :attr:`ServiceRate.lag` moves.
SETTLED_BATCHES = 8
#: Once settled, a batch enters the fit as at most this many times the fit's prediction
#: (:attr:`ServiceRate.lag` still sees its whole time).
OUTLIER_RATIO = 4.0


class ServiceRate:
    """A model's batch cost, fitted as ``t(n) = overhead_s + n * item_s`` seconds for a batch
    of ``n`` items, by exponentially weighted least squares over its batches.

    A batch's measured time includes what it costs per batch whatever its size: the hop to
    the inference thread and back, and the event loop's lag before the batcher resumes (large
    under a burst of requests to decode or refuse). A purely proportional rate (items / batch
    seconds) reads that lag as a cost per *item*: under load, small batches then look slow,
    admission lets fewer items in, batches stay small, and the model refuses nearly
    everything (seen with the feed-ranker at 64 connections: 101 items/s estimated for a
    model that serves 20,000). With the affine fit a slow small batch raises the overhead,
    not the cost of every item queued behind it.

    The first observation (the batch timed alone on the inference thread after warmup,
    ``app.serving.lifecycle``) seeds ``item_s`` with no overhead. Until :data:`SETTLED_BATCHES`
    batches have been seen only the overhead moves: a slope through two or three batches
    swings by several times (measured with MiniLM after boot: 0.91 ms per token for a model
    that pays 0.33, so that its first requests were refused as unable to finish even alone).
    After that the slope is refitted while the recent batches differ enough in size to tell
    slope from intercept; otherwise the last slope is kept and only the overhead moves.

    Once settled, a batch enters the fit as at most :data:`OUTLIER_RATIO` times what the fit
    predicted for it. A batch of a few milliseconds can stall for hundreds (the inference
    thread descheduled, or waiting for the GIL behind a busy event loop: measured with the
    feed-ranker under gRPC load, batches of 1-4 ms and one of 260 ms for 104 items), and a
    least-squares slope through one such point read 3.5 ms per item for a model that pays a
    few microseconds: admission then refused requests it would have answered in 30 ms. A
    sustained slowdown still moves the fit (by up to four times per batch, at the weight of
    the newest batch), and :attr:`lag` at once.

    The fit follows a change of pace over several batches; :attr:`lag` follows a slowdown
    within two: the ratio of a batch's time to the settled fit's prediction, raised at once
    when two batches in a row were slower than it says (to the smaller of their two ratios,
    so that one stalled batch does not move it) and brought back towards 1 by the others (by
    ``weight``), multiplies every prediction. When an overload begins, the requests to refuse
    take CPU from the model (measured with the load generator on the same two cores: the same
    batches 1.5 times slower); admission must see that from the first slow batches, not ten
    batches later.

    Args:
        weight: the weight of the newest batch, 0 < weight <= 1.
    """

    def __init__(self, weight: float = 0.2) -> None:
        self._decay = 1.0 - weight
        self._weight = weight
        #: Recent batches' time over the fit's prediction, >= 1 (see the class docstring).
        self.lag = 1.0
        self._batches = 0
        self._last_ratio = 1.0
        # Weighted sums: count, n, t, n^2, n*t.
        self._s0 = self._sn = self._st = self._snn = self._snt = 0.0
        self.item_s: float | None = None
        self.overhead_s = 0.0

    def observe(self, items: float, seconds: float) -> None:
        """Record one batch of ``items`` (its cost: items, or padded tokens for a model that
        prices its items) that took ``seconds``."""
        if items < 1 or seconds <= 0:
            return
        if self._batches >= SETTLED_BATCHES and self.item_s is not None:
            predicted = self.overhead_s + items * self.item_s
            ratio = seconds / predicted
            sustained = min(ratio, self._last_ratio)
            if sustained > self.lag:
                self.lag = sustained
            else:
                self.lag = max(1.0, self.lag + self._weight * (min(ratio, self.lag) - self.lag))
            self._last_ratio = ratio
            seconds = min(seconds, OUTLIER_RATIO * predicted)
        self._batches += 1
        d = self._decay
        self._s0 = d * self._s0 + 1.0
        self._sn = d * self._sn + items
        self._st = d * self._st + seconds
        self._snn = d * self._snn + items * items
        self._snt = d * self._snt + items * seconds
        if self.item_s is None:
            self.item_s = seconds / items
            return
        mean_n, mean_t = self._sn / self._s0, self._st / self._s0
        var_n = self._snn / self._s0 - mean_n * mean_n
        # settled, and sizes that differ enough to separate slope and intercept
        if self._batches >= SETTLED_BATCHES and var_n > (0.1 * mean_n) ** 2:
            # no steeper than the line through the origin and the mean: an intercept < 0
            # would say the slope overshoots
            slope = min((self._snt / self._s0 - mean_n * mean_t) / var_n, mean_t / mean_n)
            if slope > 0:
                self.item_s = slope
        self.overhead_s = max(0.0, mean_t - self.item_s * mean_n)

    @property
    def items_per_s(self) -> float | None:
        """The peak rate, items/s (large batches, overhead amortised); None before any batch."""
        return 1.0 / self.item_s if self.item_s else None

    def seconds_for(self, items: float, batches: int = 1) -> float:
        """Expected seconds for ``items`` items in ``batches`` batches (the fit times
        :attr:`lag`); 0 while unknown or empty."""
        if self.item_s is None or items <= 0:
            return 0.0
        return self.lag * (batches * self.overhead_s + items * self.item_s)


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


class ItemCosts:
    """The input bytes of each item of one request, for the batch cost bound.

    A request whose inputs are all numeric costs the same per item (``nbytes / B`` summed over
    its inputs): that is one integer, with no per-item array (the common case, and the hot
    path of small numeric requests). With a BYTES input the cost varies per item and is kept
    cumulatively (:func:`cumulative_costs`).

    Args:
        inputs: one array per model input, ``[B, ...]``, B >= 1.
    """

    __slots__ = ("cumulative", "each")

    def __init__(self, inputs: Mapping[str, np.ndarray]) -> None:
        #: Bytes per item when every input is numeric, else None.
        self.each: int | None = None
        #: Cumulative bytes, int64 ``[B + 1]``, when some input is BYTES, else None.
        self.cumulative: np.ndarray | None = None
        total = 0
        for arr in inputs.values():
            if arr.dtype.hasobject:
                self.cumulative = cumulative_costs(inputs)
                return
            total += arr.nbytes
        self.each = total // max(1, len(next(iter(inputs.values()))))

    def largest(self) -> int:
        """The bytes of the costliest item."""
        if self.each is not None:
            return self.each
        assert self.cumulative is not None
        return int(np.diff(self.cumulative).max())

    def between(self, start: int, stop: int) -> int:
        """The bytes of items ``[start, stop)``."""
        if self.each is not None:
            return (stop - start) * self.each
        assert self.cumulative is not None
        return int(self.cumulative[stop] - self.cumulative[start])

    def items_within(self, start: int, stop: int, budget: float) -> int:
        """How many items from ``start`` (at most ``stop - start``) fit within ``budget`` bytes."""
        if self.each is not None:
            fit = int(budget // self.each) if self.each else stop - start
            return max(0, min(fit, stop - start))
        assert self.cumulative is not None
        return items_within(self.cumulative, start, stop, budget)
