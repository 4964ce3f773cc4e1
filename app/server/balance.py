"""The balancing decisions among sibling workers (pure functions of the load table).

Placement is by open connections first (nginx's ``least_conn``), then by items queued + in
flight: with keep-alive clients a connection is the unit the kernel places, and each
connection of a closed-loop client carries about the same load.

- **Accept** (new connections): a worker accepts only while no ready sibling is less loaded
  than itself (nginx's ``accept_mutex`` idea, without a mutex: the least-loaded workers accept;
  several equal ones race as before). The least-loaded ready worker never pauses, so some
  worker always accepts.
- **Shed** (existing connections): a worker with at least two connections more than its
  least-loaded ready sibling answers one response with ``Connection: close``; the client
  reconnects and the accept rule above places that connection on the sibling (gRPC's
  ``max_connection_age`` idea, applied only while unbalanced). At most one per
  ``SHED_INTERVAL_S`` per worker, so that a reconnect lands before the next decision.

See docs/architecture.md (Balancing) for why this and not forwarding or SO_REUSEPORT.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from app.server.loadtable import READY, Load, LoadTable

log = logging.getLogger(__name__)

#: Minimum time between two shed connections of one worker, seconds.
SHED_INTERVAL_S = 0.1


def least_loaded(siblings: Iterable[Load], now: float) -> Load | None:
    """The live (ready, ticking) sibling with the fewest connections, then fewest items."""
    best: Load | None = None
    for load in siblings:
        if not load.live(now):
            continue
        if best is None or (load.connections, load.items) < (best.connections, best.items):
            best = load
    return best


def busier(me: Load, other: Load, margin_items: int) -> bool:
    """``me`` has more connections than ``other``, or as many and more than ``margin_items``
    items more queued + in flight."""
    if me.connections != other.connections:
        return me.connections > other.connections
    return me.items > other.items + margin_items


def may_accept(me: Load, siblings: Iterable[Load], now: float, margin_items: int) -> bool:
    """True unless a live sibling is clearly less loaded than ``me``."""
    best = least_loaded(siblings, now)
    return best is None or not busier(me, best, margin_items)


def should_shed(me: Load, siblings: Iterable[Load], now: float) -> Load | None:
    """The sibling that should take one of ``me``'s connections (two or more fewer than ``me``,
    so moving one narrows the gap), or None."""
    best = least_loaded(siblings, now)
    if best is not None and me.connections >= best.connections + 2:
        return best
    return None


#: Items (queued + in flight) by which a worker with as many connections as its least-loaded
#: sibling must exceed it to stop accepting.
MARGIN_ITEMS = 8


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
        self.connections = 0
        self.ready = False
        self._count_connections = connections
        self._on_shed = on_shed
        self._last_shed = 0.0

    def add_items(self, delta: int) -> None:
        """Admission (+items) or completion (-items) of an inference request."""
        self.items += delta
        self.table.set_items(self.slot, self.items)

    def accepted(self) -> None:
        """A connection was accepted (counted before aiohttp sees it)."""
        self.connections += 1
        self.table.set_connections(self.slot, self.connections)

    def tick(self, state: int) -> None:
        """Publish state, heartbeat and the true connection count (every worker tick)."""
        self.ready = state == READY
        self.connections = self._count_connections()
        self.table.set_connections(self.slot, self.connections)
        self.table.set_state(self.slot, state)
        self.table.beat(self.slot)

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
        return may_accept(self.me(), self.siblings(), time.monotonic(), MARGIN_ITEMS)

    def shed_now(self) -> bool:
        """Whether the response being prepared should close its connection (:func:`should_shed`,
        at most once per ``SHED_INTERVAL_S``)."""
        now = time.monotonic()
        if not self.ready or now - self._last_shed < SHED_INTERVAL_S:
            return False
        target = should_shed(self.me(), self.siblings(), now)
        if target is None:
            return False
        self._last_shed = now
        self.connections -= 1
        self.table.set_connections(self.slot, self.connections)
        log.debug(
            "balance: shedding a connection (%d open) towards pid %d (%d open, %d items)",
            self.connections + 1, target.pid, target.connections, target.items,
        )  # fmt: skip
        if self._on_shed is not None:
            self._on_shed(target.pid)
        return True
