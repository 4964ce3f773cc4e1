"""The balancing decisions among sibling workers (pure functions of the load table).

Placement is by open connections first (nginx's ``least_conn``), then by recent load (items
queued + in flight, averaged over about ``RECENT_TAU_S``): with keep-alive clients a
connection is the unit the kernel places, and each connection of a closed-loop client carries
about the same load.

- **Accept** (new connections): a worker accepts only while no live sibling is less loaded
  than itself (nginx's ``accept_mutex`` idea, without a mutex: the least-loaded workers accept;
  several equal ones race as before). The least-loaded live worker never pauses, so some
  worker always accepts; a stopped or dead sibling stops counting after ``STALE_S``.
- **Shed** (existing connections): a worker answers one response with ``Connection: close``
  when moving that connection to its least-loaded live sibling narrows the gap: it has two or
  more connections more, or one more and is clearly busier (:func:`clearly_busier`; a busy
  connection moves to an idle worker, so that with fewer connections than workers the load
  rotates over all of them). The client reconnects and the accept rule places the connection
  on a less-loaded worker (gRPC's ``max_connection_age`` idea, applied only while
  unbalanced). At most one per ``SHED_INTERVAL_S`` per worker.

See docs/architecture.md (Balancing) for why this and not request forwarding or SO_REUSEPORT.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable

from app.server.loadtable import READY, Load, LoadTable

log = logging.getLogger(__name__)

#: Minimum time between two shed connections of one worker, seconds.
SHED_INTERVAL_S = 0.1
#: Minimum time between two looks at the load table for shedding, seconds (a response costs a
#: clock read, not a read of every slot).
SHED_CHECK_S = 0.01
#: Time constant of the recent load (an exponentially weighted average of items), seconds.
RECENT_TAU_S = 0.1


def clearly_busier(mine: float, other: float) -> bool:
    """Recent load ``mine`` (items) is at least one item and more than twice ``other``."""
    return mine >= 1.0 and mine > 2.0 * other + 0.5


def _key(load: Load) -> tuple[int, float]:
    return (load.connections, load.recent)


def least_loaded(siblings: Iterable[Load], now: float) -> Load | None:
    """The live (ready, ticking) sibling with the fewest connections, then least recent load."""
    best: Load | None = None
    for load in siblings:
        if load.live(now) and (best is None or _key(load) < _key(best)):
            best = load
    return best


def busier(me: Load, other: Load) -> bool:
    """``me`` has more connections than ``other``, or as many and is clearly busier."""
    if me.connections != other.connections:
        return me.connections > other.connections
    return clearly_busier(me.recent, other.recent)


def may_accept(me: Load, siblings: Iterable[Load], now: float) -> bool:
    """True unless a live sibling is less loaded than ``me`` (:func:`busier`)."""
    best = least_loaded(siblings, now)
    return best is None or not busier(me, best)


def should_shed(me: Load, siblings: Iterable[Load], now: float) -> Load | None:
    """The sibling that should take one of ``me``'s connections, or None (module docstring)."""
    best = least_loaded(siblings, now)
    if best is None:
        return None
    gap = me.connections - best.connections
    if gap >= 2 or (gap == 1 and clearly_busier(me.recent, best.recent)):
        return best
    return None


class Balancer:
    """This worker's side of the table: publishes its load, decides for its listener.

    Args:
        table: the run directory's load table.
        slot: this worker's claimed slot.
        connections: returns the number of open connections now (``web.Server.connections``).
        on_shed: called once per shed connection (metrics), with the sibling's pid.
    """

    def __init__(
        self,
        table: LoadTable,
        slot: int,
        connections: Callable[[], int],
        on_shed: Callable[[int], None] | None = None,
    ) -> None:
        self.table = table
        self.slot = slot
        self.items = 0
        self.recent = 0.0
        self.connections = 0
        self.ready = False
        self._count_connections = connections
        self._on_shed = on_shed
        #: Called at the end of every tick (the balancing gauges).
        self.on_tick: Callable[[], object] | None = None
        self._last_shed = 0.0
        self._next_check = 0.0
        self._changed = time.monotonic()  # last change of ``items``
        self._area = 0.0  # item-seconds since the last tick
        self._tick = self._changed

    def add_items(self, delta: int) -> None:
        """Admission (+items) or completion (-items) of an inference request."""
        now = time.monotonic()
        self._area += self.items * (now - self._changed)
        self._changed = now
        self.items += delta
        self.table.set_items(self.slot, self.items)

    def accepted(self) -> None:
        """A connection was accepted (counted before aiohttp sees it)."""
        self.connections += 1
        self.table.set_connections(self.slot, self.connections)

    def tick(self, state: int) -> None:
        """Publish state, heartbeat and the true connection count (every worker tick)."""
        self.ready = state == READY
        now = time.monotonic()
        self._area += self.items * (now - self._changed)
        self._changed = now
        elapsed = now - self._tick
        if elapsed > 0:
            alpha = 1.0 - math.exp(-elapsed / RECENT_TAU_S)
            self.recent += alpha * (self._area / elapsed - self.recent)
        self._area, self._tick = 0.0, now
        self.table.set_recent(self.slot, self.recent)
        self.connections = self._count_connections()
        self.table.set_connections(self.slot, self.connections)
        self.table.set_state(self.slot, state)
        self.table.beat(self.slot)
        if self.on_tick is not None:
            self.on_tick()

    def me(self) -> Load:
        """This worker's load as siblings see it."""
        return self.table.read(self.slot)

    def siblings(self) -> list[Load]:
        """The other claimed slots (check :meth:`Load.live`)."""
        return [load for load in self.table.snapshot() if load.slot != self.slot]

    def may_accept(self) -> bool:
        """Whether the listener should accept now (:func:`may_accept`); always True while this
        worker is not ready (it is then not listening, or draining)."""
        if not self.ready:
            return True
        return may_accept(self.me(), self.siblings(), time.monotonic())

    def shed_now(self) -> bool:
        """Whether the response being prepared should close its connection (:func:`should_shed`,
        at most once per ``SHED_INTERVAL_S``; the table is looked at most once per
        ``SHED_CHECK_S``)."""
        now = time.monotonic()
        if not self.ready or now < self._next_check or now - self._last_shed < SHED_INTERVAL_S:
            return False
        self._next_check = now + SHED_CHECK_S
        target = should_shed(self.me(), self.siblings(), now)
        if target is None:
            return False
        self._last_shed = now
        self.connections -= 1
        self.table.set_connections(self.slot, self.connections)
        log.debug(
            "balance: shedding a connection (%d open, recent load %.1f items) towards pid %d "
            "(%d open, %.1f)",
            self.connections + 1, self.recent, target.pid, target.connections, target.recent,
        )  # fmt: skip
        if self._on_shed is not None:
            self._on_shed(target.pid)
        return True
