"""Event-loop lag: how late a periodic timer fires on a worker's event loop, as Prometheus metrics.

Every request of a worker is served by one event loop; a callback that holds it (a long
tokenization, a window split, a large JSON body parsed on the loop) delays every other request
of that worker by as long. The sampler schedules a timer every ``interval_s`` seconds with
``loop.call_at`` and records, when it fires, how late it fired: a stall of S seconds shows as one
lateness of at least S - ``interval_s``. Each tick is one histogram observation (the gauge is
written only when its value changes), 50 ticks a second by default
(``SCORING_LOOP_LAG_INTERVAL_MS``); what costs is the wake-up itself (docs/observability.md).

Metrics (labelled ``pid``, one series per worker):

- ``scoring_event_loop_lag_seconds``: histogram of every tick's lateness (the buckets say how many
  stalls of each length happened; a bucket's count going up between two scrapes bounds the
  longest stall of that time);
- ``scoring_event_loop_lag_max_seconds``: the longest lateness of the last ``window_s`` seconds
  (a sliding-window maximum), a gauge of live workers.

Source: Node.js' ``perf_hooks.monitorEventLoopDelay`` and prom-client's
``nodejs_eventloop_lag_seconds`` (lateness of a timer as the loop's lag); the sliding-window
maximum is the monotonic-deque algorithm.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import AsyncIterator, Callable

from prometheus_client import CollectorRegistry, Gauge, Histogram

#: Seconds; a stall that holds other requests back starts around a few milliseconds.
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: Seconds between ticks: a stall shorter than this may go unseen or show as less.
INTERVAL_S = 0.02
#: Seconds over which ``scoring_event_loop_lag_max_seconds`` is the maximum.
WINDOW_S = 30.0


class WindowMax:
    """The largest value observed in the last ``window_s`` seconds (a monotonic deque: amortised
    O(1) per observation, at most one entry per observation inside the window)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._entries: deque[tuple[float, float]] = deque()  # (time, value), values decreasing

    def observe(self, now: float, value: float) -> float:
        """Add ``value`` seen at ``now`` (seconds, non-decreasing between calls); the maximum
        of the values seen in ``(now - window_s, now]``."""
        entries = self._entries
        while entries and entries[-1][1] <= value:
            entries.pop()
        entries.append((now, value))
        while entries[0][0] <= now - self.window_s:
            entries.popleft()
        return entries[0][1]


class LoopLag:
    """The lag sampler of one event loop, its metrics registered in ``registry`` (None:
    prometheus_client's multiprocess files, as ``app.observability.metrics.ServerMetrics``).

    Args:
        registry: where the two metrics register (module docstring).
        interval_s: seconds between ticks (> 0).
        window_s: seconds of the maximum gauge's window (> 0).

    Raises:
        ValueError: ``interval_s`` or ``window_s`` is not positive.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None,
        interval_s: float = INTERVAL_S,
        window_s: float = WINDOW_S,
    ) -> None:
        if interval_s <= 0 or window_s <= 0:
            raise ValueError(f"interval_s and window_s must be positive, got {interval_s}, {window_s}")
        self.interval_s = interval_s
        pid = str(os.getpid())
        self.histogram = Histogram(
            "scoring_event_loop_lag_seconds",
            "How late the worker's event loop ran a periodic timer (a stall delays every request "
            "of the worker by as long).",
            ["pid"], buckets=LAG_BUCKETS, registry=registry,
        ).labels(pid)  # fmt: skip
        self.longest = Gauge(
            "scoring_event_loop_lag_max_seconds",
            f"The longest event loop lag of the last {window_s:g} s.",
            ["pid"], multiprocess_mode="liveall", registry=registry,
        ).labels(pid)  # fmt: skip
        self._window = WindowMax(window_s)
        self._shown = -1.0
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start ticking on ``loop`` (call it from that loop's thread)."""
        self._loop = loop
        self._schedule(loop.time())

    def stop(self) -> None:
        """Stop ticking (idempotent)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def record(self, now: float, lag_s: float) -> None:
        """One tick's lateness ``lag_s`` (seconds, clamped at 0) seen at loop time ``now``."""
        lag_s = max(0.0, lag_s)
        self.histogram.observe(lag_s)
        longest = self._window.observe(now, lag_s)
        if longest != self._shown:
            self.longest.set(longest)
            self._shown = longest

    def _schedule(self, now: float) -> None:
        assert self._loop is not None
        due = now + self.interval_s
        self._handle = self._loop.call_at(due, self._tick, due)

    def _tick(self, due: float) -> None:
        assert self._loop is not None
        now = self._loop.time()
        self.record(now, now - due)
        self._schedule(now)


def loop_lag_ctx(
    registry: CollectorRegistry | None, interval_s: float = INTERVAL_S
) -> Callable[[object], AsyncIterator[None]]:
    """A ``cleanup_ctx`` of the worker's app (which it does not read): a :class:`LoopLag` on the
    running loop from startup to cleanup."""

    async def ctx(_app: object) -> AsyncIterator[None]:
        sampler = LoopLag(registry, interval_s)
        sampler.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            sampler.stop()

    return ctx
