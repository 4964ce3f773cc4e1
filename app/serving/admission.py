"""Admission: whether a model version takes one more request now, behind a small interface.

A serving unit (:mod:`app.serving.unit`) asks its policy before a request's items join the
queue, and tells it how long each batch took. (Before that, whatever the policy, an item that
alone exceeds a batch's bytes or tokens is refused with 413: the batch budget's rule,
:func:`app.serving.queue.check_item_bounds`.) Two policies, chosen per model in ``model.toml``
(``admission``):

``measured_rate`` (the default): **admission by time.** With a batch costing ``t(n) = o + n c``
seconds (:class:`ServiceRate`), ``q`` items queued ahead (at the request's priority level and
above), a batch of ``n`` items that started ``s`` seconds ago and batches of at most ``M``
items, a request of ``b`` items expects to finish after

    wait = max(0, t(n) - s) + ceil((q + b) / M) o + (q + b) c (+ the max queue delay)

seconds (Little's law read backwards, W = L / lambda). Past ``admission_headroom`` of its time
to deadline it is refused at once: 503 + Retry-After (the backlog in seconds). A request that
could not finish within that share of its deadline even alone, at the rate the model runs (its
fitted line, without a past overload's lag), is refused at once with 504, busy or idle: waiting
would not help it, and what an idle model admits finishes in time. The cost unit is the
model's (tokens, padding included, for a model that prices its items).

``capacity``: **capacity plus deadline**, as text-embeddings-inference (a permit per queued
request) and Triton's queue policy (``max_queue_size``, reject on timeout): refused only when
the queue cannot hold the items; a request whose deadline passes while it waits gets its 504
from the queue.

**The service rate** (:class:`ServiceRate`): what a batch costs in seconds, ``t(n) = o + n c``
for a batch of cost ``n`` (items, or for a model that prices its items the tokens its forward
calls compute, padding included), fitted by exponentially weighted least squares over its
batches and seeded by its calibration at load.

Sources: BentoML's adaptive batching (a batch's latency estimated from past batches), Triton's
``default_queue_policy``, TEI's ``queue.rs``; docs/reliability.md explains the choices, with the
figures that chose each rule (*Admission by time*).
"""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from app.errors import DeadlineExceeded, QueueFull, ScoringError

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

    def measured_s(self, items: float, batches: int = 1) -> float:
        """Seconds for ``items`` in ``batches`` batches at the fitted line (the calibration at
        load, then what the batches ran at), without :attr:`lag` (a past overload's factor);
        0 while unknown. What a request alone is judged at."""
        if self.item_s is None or items <= 0:
            return 0.0
        return batches * self.overhead_s + items * self.item_s

    def describe(self, unit: str) -> str:
        """The fitted line in words, for messages: ``"<per second> <unit>/s and <o> ms a batch"``
        (the overhead left out while the fit has none)."""
        per_s = 1 / self.item_s if self.item_s else 0.0
        overhead = f" and {self.overhead_s * 1000:.3g} ms a batch" if self.overhead_s > 0 else ""
        return f"{per_s:.0f} {unit}/s{overhead}"



#: Requests whose sizes :meth:`MeasuredRate.refuse_early` remembers.
RECENT_REQUESTS = 32


def overdue_slack_s() -> float:
    """How far past its expected time a running batch may be before what waits behind it is
    stretched: four of the interpreter's thread switch intervals. An inference thread that wants
    the interpreter lock back from a busy event loop waits whole switch intervals, so a fast
    model's batch can take twenty times its expected time without being slow; stretching the
    backlog by that ratio refused a model that kept up (docs/benchmarks.md, *Figures behind the
    code's choices*)."""
    return 4 * sys.getswitchinterval()


class Running(Protocol):
    """A batch running: when it started (``loop.time()`` seconds) and its cost."""

    @property
    def started(self) -> float: ...
    @property
    def cost(self) -> float: ...


class Backlog(Protocol):
    """What a policy reads of its serving unit (``app.serving.unit.ServingUnit``): its name,
    batch bounds (items, tokens), max queue delay (s), queue capacity (items), whether its cost
    unit is tokens, and what is queued and running."""

    name: str
    max_batch_size: int
    max_batch_tokens: int | None
    max_queue_delay_s: float
    queue_capacity: int
    priced: bool

    @property
    def running(self) -> Sequence[Running]:
        """The batches running, oldest first (``app.serving.executor.RunningBatch``)."""
        ...

    @property
    def queued(self) -> Callable[[int | None], tuple[int, float]]:
        """(items, cost) waiting at a level and the levels above it (None: all)."""
        ...


@dataclass(frozen=True)
class Refusal:
    """A request refused: the error its client gets, and the reason counted
    (``queue_full``, ``admission``, ``deadline``)."""

    reason: str
    error: ScoringError


class AdmissionPolicy(Protocol):
    """Whether a model version takes one more request (module docstring)."""

    def refusal(
        self, items: int, cost: float, level: int | None, budget_s: float, now: float, what: str,
        alone: tuple[float, int] | None = None,
    ) -> Refusal | None:  # fmt: skip
        """The refusal of ``items`` more items costing ``cost`` at priority ``level``, with
        ``budget_s`` seconds left to their deadline at loop time ``now``; None = admitted.
        ``alone``: what the request computes in its own batches (cost, padding included, and
        their count; None: ``cost`` padded as recent batches were). With ``cost`` 0 (the least
        it can be: asked before a request is priced) a refusal is certain and the request is
        not remembered."""
        ...

    def refuse_early(self, budget_s: float, now: float, level: int | None) -> Refusal | None:
        """The refusal a request of a size recently seen would get at ``level``, judged before
        its body is decoded (so a refusal under overload costs no decoding); None = decode it."""
        ...

    def seed(self, points: Sequence[tuple[float, float]]) -> None:
        """The calibration at load: batches ``(cost, seconds)`` timed alone after warmup."""
        ...

    def observe(self, cost: float, seconds: float, real_tokens: int) -> None:
        """One batch of ``cost`` (``real_tokens`` of it the items' own, 0 unpriced) took
        ``seconds``."""
        ...

    def backlog_s(self, now: float) -> float:
        """Expected seconds until what is queued and running now is done (0 when unknown)."""
        ...

    def fill_limit(self, cost: float, share: float) -> float:
        """The most a batch may cost once it holds higher-priority items costing ``cost``: lower
        levels may add at most ``share`` to its expected time (``math.inf``: no bound known)."""
        ...


def _full(backlog: Backlog, items: int, retry_after_s: Callable[[], float]) -> Refusal | None:
    queued, _ = backlog.queued(None)
    if queued + items <= backlog.queue_capacity:
        return None
    message = f"model {backlog.name} queue is full ({queued}/{backlog.queue_capacity} items)"
    return Refusal("queue_full", QueueFull(message, retry_after_s=retry_after_s()))


class Capacity:
    """Capacity plus deadline (module docstring): refused only when the queue is full
    (503 + ``Retry-After: 1``); deadlines are the queue's to enforce."""

    def __init__(self, backlog: Backlog) -> None:
        self._backlog = backlog

    def refusal(
        self, items: int, cost: float, level: int | None, budget_s: float, now: float, what: str,
        alone: tuple[float, int] | None = None,
    ) -> Refusal | None:  # fmt: skip
        """See :meth:`AdmissionPolicy.refusal`."""
        return _full(self._backlog, items, lambda: 1.0)

    def seed(self, points: Sequence[tuple[float, float]]) -> None:
        """Nothing is measured."""

    def refuse_early(self, budget_s: float, now: float, level: int | None) -> Refusal | None:
        """Never: the request's size decides, once decoded."""
        return None

    def observe(self, cost: float, seconds: float, real_tokens: int) -> None:
        """Nothing is measured."""

    def backlog_s(self, now: float) -> float:
        """Unknown: 0."""
        return 0.0

    def fill_limit(self, cost: float, share: float) -> float:
        """Unknown: no bound."""
        return math.inf


class MeasuredRate:
    """Admission by time at the measured rate (module docstring).

    Args:
        backlog: the unit's queue and running batches.
        headroom: admit only what is expected to finish within this share of its time to
            deadline (``admission_headroom`` in ``model.toml``; docs/reliability.md).
    """

    def __init__(self, backlog: Backlog, headroom: float = 0.5) -> None:
        self._backlog = backlog
        self.headroom = headroom
        #: The model's batch cost, per cost unit (tokens for a priced model, else items).
        self.rate = ServiceRate()
        #: Padded / real tokens of recent batches (a priced model's padding waste; 1 = none).
        self.padding = 1.0
        self._recent: deque[tuple[int, float]] = deque(maxlen=RECENT_REQUESTS)  # (items, cost)
        self._slack_s = overdue_slack_s()

    def seed(self, points: Sequence[tuple[float, float]]) -> None:
        """See :meth:`AdmissionPolicy.seed` (:meth:`ServiceRate.seed`)."""
        self.rate.seed(points)

    def observe(self, cost: float, seconds: float, real_tokens: int) -> None:
        """See :meth:`AdmissionPolicy.observe`."""
        self.rate.observe(cost, seconds)
        if real_tokens:
            self.padding += 0.2 * (cost / real_tokens - self.padding)

    def backlog_s(
        self, now: float, more_items: int = 0, more_cost: float = 0.0, level: int | None = None
    ) -> float:
        """Expected seconds until the running batches, the queued items at ``level`` and above,
        and ``more_items`` costing ``more_cost`` after them are done, padded as recent batches
        were, plus one max queue delay. A batch running past its expected time (beyond
        :func:`overdue_slack_s`) stretches what waits behind it by the same factor, and is taken
        to need as much again as it has overrun."""
        backlog, rate = self._backlog, self.rate
        rest, overdue = 0.0, 1.0
        for i, batch in enumerate(backlog.running):
            expected_s = rate.seconds_for(batch.cost)
            if i == 0:  # the one computing now; the others wait behind it
                elapsed_s = now - batch.started
                rest = abs(expected_s - elapsed_s)
                overdue = max(1.0, elapsed_s / (expected_s + self._slack_s))
            else:
                rest += expected_s * overdue
        queued_items, queued_cost = backlog.queued(level)
        items = queued_items + more_items
        cost = (queued_cost + more_cost) * self.padding
        batches = math.ceil(items / backlog.max_batch_size)
        if backlog.max_batch_tokens and backlog.priced:
            batches = max(batches, math.ceil(cost / backlog.max_batch_tokens))
        return rest + overdue * rate.seconds_for(cost, batches) + backlog.max_queue_delay_s

    def refusal(
        self, items: int, cost: float, level: int | None, budget_s: float, now: float, what: str,
        alone: tuple[float, int] | None = None,
    ) -> Refusal | None:  # fmt: skip
        """See :meth:`AdmissionPolicy.refusal`: 503 when the queue is full or the backlog would
        not let the items finish within ``headroom`` of ``budget_s``; 504 when they could not
        finish within ``headroom`` of ``budget_s`` even alone, at the rate the model runs
        (:meth:`ServiceRate.measured_s`: the fit, without the lag of a past overload, so that a
        rate learned under load never keeps refusing once the load has gone). An idle model
        admits what its measured rate says can finish, and nothing else."""
        if cost:
            self._recent.append((items, cost))
        return self._judge(items, cost, level, budget_s, now, what, alone)

    def _judge(
        self, items: int, cost: float, level: int | None, budget_s: float, now: float, what: str,
        alone: tuple[float, int] | None = None,
    ) -> Refusal | None:  # fmt: skip
        backlog = self._backlog
        if budget_s <= 0:  # its deadline passed before it got here (its decoding, its pricing)
            late_ms = -budget_s * 1000
            return Refusal(
                "deadline",
                DeadlineExceeded(
                    f"model {backlog.name}: {what} expired before it was admitted (its deadline passed "
                    f"{late_ms:.0f} ms ago)"
                ),
            )
        full = _full(backlog, items, lambda: self._retry_after_s(now))
        if full is not None:
            return full
        idle = not backlog.queued(None)[0] and not backlog.running
        if cost and (not idle or self.rate.calibrated is not None):
            hopeless = self._hopeless(items, cost, budget_s, what, alone)
            if hopeless is not None:
                return hopeless
        if idle or (expected_s := self.backlog_s(now, items, cost, level)) <= self.headroom * budget_s:
            return None
        unit = "tokens" if backlog.priced else "items"
        return Refusal(
            "admission",
            QueueFull(
                f"model {backlog.name} cannot take {what} within its deadline: the backlog and it are "
                f"expected to take {expected_s * 1000:.0f} ms (at {self.rate.describe(unit)}, "
                f"x{self.rate.lag:.2g} lately), over {self.headroom:.0%} of its {budget_s * 1000:.0f} ms "
                "(admission_headroom)",
                retry_after_s=self._retry_after_s(now),
            ),
        )

    def _hopeless(
        self, items: int, cost: float, budget_s: float, what: str, alone: tuple[float, int] | None
    ) -> Refusal | None:
        """504 for a request that could not finish within ``headroom`` of ``budget_s`` even alone,
        at the rate the model runs (:meth:`ServiceRate.measured_s`): the same bar as the backlog's,
        so that a request admitted to an idle model finishes in time (the calibration at load is
        no bound: a model's short warmup batches run faster per token than long texts do)."""
        backlog = self._backlog
        alone_cost, batches = alone or (cost * self.padding, math.ceil(items / backlog.max_batch_size))
        alone_s = self.rate.measured_s(alone_cost, batches)
        if alone_s <= self.headroom * budget_s:
            return None
        unit = "tokens" if backlog.priced else "items"
        return Refusal(
            "deadline",
            DeadlineExceeded(
                f"model {backlog.name} cannot finish {what} within its deadline even alone: expected "
                f"{alone_s * 1000:.0f} ms for {alone_cost:.0f} {unit} in {batches} batch(es) at "
                f"{self.rate.describe(unit)}, over {self.headroom:.0%} of its {budget_s * 1000:.0f} ms "
                "(admission_headroom): send it with a longer deadline or fewer items"
            ),
        )

    def refuse_early(self, budget_s: float, now: float, level: int | None) -> Refusal | None:
        """See :meth:`AdmissionPolicy.refuse_early`. The request's size is not known yet: it is
        taken as the smallest of the last requests (one smaller request lowers the bar for those
        after it). With less than a full batch queued there is no storm to refuse cheaply."""
        if self._backlog.queued(level)[0] < self._backlog.max_batch_size:
            return None
        items, cost = min(self._recent, default=(1, 1.0))
        return self._judge(items, cost, level, budget_s, now, "another request")

    def fill_limit(self, cost: float, share: float) -> float:
        """See :meth:`AdmissionPolicy.fill_limit`: with ``t(n) = o + n c``, the ``n`` at which
        ``t(n) = (1 + share) t(cost)``. Batches that cost mostly their overhead (a GPU's) fill
        up; batches whose time grows with their items (a CPU's) take few lower-level items."""
        item_s = self.rate.item_s
        return cost + share * (self.rate.overhead_s / item_s + cost) if item_s else math.inf

    def _retry_after_s(self, now: float) -> int:
        """Seconds a refused client should wait: the backlog, rounded up, at least 1."""
        return max(1, math.ceil(self.backlog_s(now)))


def policy(name: str, backlog: Backlog, headroom: float = 0.5) -> AdmissionPolicy:
    """The policy ``model.toml``'s ``admission`` names, over ``backlog``.

    Raises:
        ValueError: an unknown name.
    """
    if name == "measured_rate":
        return MeasuredRate(backlog, headroom)
    if name == "capacity":
        return Capacity(backlog)
    raise ValueError(f"admission must be 'measured_rate' or 'capacity', not {name!r}")
