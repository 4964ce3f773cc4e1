"""A model's service rate: what a batch costs in seconds, ``t(n) = o + n c`` for a batch of cost
``n`` (items, or for a model that prices its items the tokens its forward calls compute, padding
included), fitted by exponentially weighted least squares over its batches and seeded by its
calibration at load. Admission by time (:mod:`app.serving.admission`) reads it; why each rule,
with the figures that chose it: docs/reliability.md, *Admission by time*. Source: BentoML's
adaptive batching (a batch's latency estimated from past batches).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

#: Batches a :class:`ServiceRate` sees before it fits a slope and an overhead, and before its
#: :attr:`ServiceRate.lag` moves (docs/architecture.md, *Tuned numbers*).
SETTLED_BATCHES = 8
#: Once settled, a batch enters the fit as at most this many times the fit's prediction.
OUTLIER_RATIO = 4.0


class ServiceRate:
    """A model's batch cost, ``t(n) = overhead_s + n * item_s`` seconds for a batch of ``n``
    items (its cost: items, or padded tokens), fitted by exponentially weighted least squares.

    The calibration at load (:meth:`seed`: two batches timed alone after warmup) gives the
    overhead and ``item_s`` at once and is kept as :attr:`calibrated`; without it the first batch
    seeds ``item_s``. Until :data:`SETTLED_BATCHES` batches only the overhead moves (and the
    slope comes down to the line through the origin and the mean where the batches ran faster
    than the seed); then the slope is refitted while recent batch sizes differ enough, never
    steeper than that line, and a batch enters the fit as at most :data:`OUTLIER_RATIO` times
    its prediction. :attr:`lag` (>= 1) multiplies every prediction: raised at once when two
    batches in a row were slower than the fit says, brought back towards 1 by the others. Why
    each rule (figures): docs/reliability.md, *Admission by time*.

    Args:
        weight: the weight of the newest batch, 0 < weight <= 1.
    """

    def __init__(self, weight: float = 0.2) -> None:
        self._decay = 1.0 - weight
        self._weight = weight
        #: Recent batches' time over the fit's prediction, >= 1.
        self.lag = 1.0
        self._batches = 0
        self._last_ratio = 1.0
        # Weighted sums: count, n, t, n^2, n*t.
        self._s0 = self._sn = self._st = self._snn = self._snt = 0.0
        self.item_s: float | None = None
        self.overhead_s = 0.0
        #: ``(overhead_s, item_s)`` from the calibration at load (:meth:`seed`), None without.
        self.calibrated: tuple[float, float] | None = None

    def seed(self, points: Sequence[tuple[float, float]]) -> None:
        """Seed the fit with calibration batches ``(cost, seconds)`` timed alone after warmup
        (``app.serving.runner.ModelRunner.calibrate``): through two of costs apart (more than
        10 % of their mean) the line gives the overhead and ``item_s`` at once, so that the
        first long request is judged at what its cost takes rather than at what a short batch's
        overhead made each unit cost; else ``item_s`` is the largest batch's time over its cost
        (overhead 0). The line is kept as :attr:`calibrated`."""
        points = sorted((n, t) for n, t in points if n >= 1 and t > 0)
        if not points:
            return
        for n, t in points:
            self._accumulate(n, t)
        self._batches += len(points)
        mean_n, mean_t = self._sn / self._s0, self._st / self._s0
        var_n = self._snn / self._s0 - mean_n * mean_n
        slope = (self._snt / self._s0 - mean_n * mean_t) / var_n if var_n > (0.1 * mean_n) ** 2 else 0.0
        if slope > 0:
            self.item_s = min(slope, mean_t / mean_n)
            self.overhead_s = max(0.0, mean_t - self.item_s * mean_n)
        else:
            self.item_s, self.overhead_s = points[-1][1] / points[-1][0], 0.0
        self.calibrated = self.overhead_s, self.item_s

    def _accumulate(self, items: float, seconds: float) -> None:
        d = self._decay
        self._s0 = d * self._s0 + 1.0
        self._sn = d * self._sn + items
        self._st = d * self._st + seconds
        self._snn = d * self._snn + items * items
        self._snt = d * self._snt + items * seconds

    def observe(self, items: float, seconds: float) -> None:
        """Record one batch of ``items`` (its cost) that took ``seconds``."""
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
        self._accumulate(items, seconds)
        if self.item_s is None:
            self.item_s = seconds / items
            return
        mean_n, mean_t = self._sn / self._s0, self._st / self._s0
        var_n = self._snn / self._s0 - mean_n * mean_n
        if self._batches >= SETTLED_BATCHES and var_n > (0.1 * mean_n) ** 2:
            slope = min((self._snt / self._s0 - mean_n * mean_t) / var_n, mean_t / mean_n)
            if slope > 0:
                self.item_s = slope
        # Never steeper than the line through the origin and the mean, settled or not: a seed
        # taken from one small batch (its overhead counted as items) would otherwise stay while
        # batches of one size give no slope, and refuse long after the real batches ran faster.
        self.item_s = min(self.item_s, mean_t / mean_n)
        self.overhead_s = max(0.0, mean_t - self.item_s * mean_n)

    def seconds_for(self, items: float, batches: int = 1) -> float:
        """Expected seconds for ``items`` items in ``batches`` batches (the fit times
        :attr:`lag`); 0 while unknown or empty."""
        if self.item_s is None or items <= 0:
            return 0.0
        return self.lag * (batches * self.overhead_s + items * self.item_s)

    def fastest_s(self, items: float, batches: int = 1) -> float:
        """Seconds for ``items`` in ``batches`` batches at the fastest the model has run: the
        calibrated line or the fit, whichever is faster, without :attr:`lag` (0 while unknown)."""
        best = math.inf
        if self.calibrated is not None:
            best = batches * self.calibrated[0] + items * self.calibrated[1]
        if self.item_s is not None:
            best = min(best, batches * self.overhead_s + items * self.item_s)
        return best if best != math.inf else 0.0
