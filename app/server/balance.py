"""The balancing and coordination rules among a server's workers, pure functions of the loads
and states the load table holds (:mod:`app.server.loadtable`), and this worker's decisions by
them on the request path: :class:`WorkerConnections` (accept, shed: the transport's) and
:class:`WorkerBalancer` (may a request leave: the data plane's); where a request that leaves goes
is :mod:`app.server.router`'s. The decisions are logged at debug level (``balance: ...``).

Placement is by open connections first (nginx's ``least_conn``), then by recent load (items
queued + in flight, averaged over about ``RECENT_TAU_S``): with keep-alive clients a connection
is the unit the kernel places, and each connection of a closed-loop client carries about the
same load.

- **Accept** (new connections, :func:`may_accept`): a worker accepts only while no live sibling
  is less loaded than itself (nginx's ``accept_mutex`` idea, without a mutex: the least-loaded
  workers accept; several equal ones race as before). The least-loaded live worker never
  pauses, so some worker always accepts; a stopped or dead sibling stops counting after
  ``STALE_S``.
- **Shed** (existing connections, :func:`should_shed`): a worker answers one response with
  ``Connection: close`` when moving that connection to its least-loaded live sibling narrows
  the gap: it has two or more connections more, or one more and is clearly busier
  (:func:`clearly_busier`: a recent load of at least one item and more than twice the
  sibling's, + 0.5; a busy connection moves to an idle worker, so that with fewer connections
  than workers the load rotates over all of them). The client reconnects and the accept rule
  places the connection on a less-loaded worker (gRPC's ``max_connection_age`` idea, applied
  only while unbalanced). At most one per ``SHED_INTERVAL_S`` per worker; the table is looked
  at at most once per ``SHED_CHECK_S``.
- **Leave** (requests): a request is cut into shards when it is split (:func:`splits`: scatter
  on and more items than one batch holds), over this worker and its least-loaded live siblings
  (:func:`pick_siblings`); one on a pinned (gRPC) connection that is not split, and would wait
  at least ``MIN_WAIT_S`` here, goes whole to a sibling when this worker is clearly busier
  (:func:`pick_target`: power of two choices among the live ready siblings, two drawn at random
  and the one with fewer items kept, as Ray Serve's request router does; Mitzenmacher, "The
  Power of Two Choices in Randomized Load Balancing"). An idle worker never forwards (no hop at
  c = 1) and a 2:1 imbalance is the most left in place.
- **Coordination**: a new worker listens only once its models are warm while another worker
  accepts requests (:func:`others_serving`); a draining worker keeps serving while no other
  worker is ready and a replacement still boots (:func:`replacement_booting`); a worker past
  ``max_requests`` drains only while another is ready, or there is none (:func:`may_recycle`).

Tuned numbers (docs/architecture.md, *Tuned numbers*): ``SHED_INTERVAL_S`` 100 ms,
``SHED_CHECK_S`` 10 ms, ``MIN_WAIT_S`` 5 ms (and the table's ``STALE_S``, 1 s, and
``RECENT_TAU_S``, 100 ms). See docs/architecture.md (*Balancing among sibling workers*) for why this and
not request forwarding or SO_REUSEPORT.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from app.server.loadtable import BOOTING, DRAINING, LOADING, READY, Load, WorkerSlot

if TYPE_CHECKING:
    from app.observability.metrics import ServerMetrics
    from app.serving.context import RequestContext
    from app.serving.siblings import Arrays, LocalRun
    from app.serving.unit import ServingUnit

#: The balancing decisions (``balance: ...`` at debug level).
log = logging.getLogger(__name__)
#: Runs a request (in part) on siblings (``app.server.router.Router.route``): its outputs, or None
#: to run it here whole.
Route = Callable[["ServingUnit", "Arrays", "RequestContext", "LocalRun"], Awaitable["Arrays | None"]]

# --- coordination: pure functions of the other workers' states ------------------------------


def others_serving(others: Iterator[int] | list[int]) -> bool:
    """Another worker accepts requests (ready, or draining but still listening): a new worker
    then listens only once its models are warm."""
    return any(s in (READY, DRAINING) for s in others)


def replacement_booting(others: Iterator[int] | list[int]) -> bool:
    """No other worker is ready and one is bound and still booting or loading: a draining
    worker keeps serving meanwhile (a HUP reload with slow boots)."""
    states = set(others)
    return READY not in states and bool(states & {BOOTING, LOADING})


def may_recycle(others: Iterator[int] | list[int]) -> bool:
    """Another worker is ready, or there is no other worker at all: a worker past
    ``max_requests`` may drain now."""
    states = list(others)
    return not states or READY in states


# --- balancing: pure functions of the loads -------------------------------------------------

#: Minimum time between two shed connections of one worker, seconds.
SHED_INTERVAL_S = 0.1
#: Minimum time between two looks at the load table for shedding, seconds (a response costs a
#: clock read, not a read of every slot).
SHED_CHECK_S = 0.01


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


#: A pinned request is forwarded only when it would wait at least this long here, seconds
#: (docs/architecture.md, *Tuned numbers*).
MIN_WAIT_S = 0.005


def splits(scatter: bool, max_batch_size: int, items: int) -> bool:
    """Whether a request of ``items`` items is cut into shards: ``scatter`` on and more items
    than one batch holds."""
    return scatter and items > max_batch_size


def pick_siblings(siblings: list[Load], items: int, max_batch_size: int, now: float) -> list[Load]:
    """The least-loaded live siblings that take a shard: at most one shard per
    ``max_batch_size`` items, this worker keeping one. A sibling with a full batch (or more)
    already queued or running is saturated: a shard would only wait there."""
    wanted = math.ceil(items / max(1, max_batch_size)) - 1
    free = (s for s in siblings if s.live(now) and s.items < max_batch_size)
    live = sorted(free, key=lambda s: (s.recent, s.items, s.connections))
    return live[: max(0, wanted)]


def pick_target(
    mine: int,
    siblings: Sequence[Load],
    now: float,
    pending: dict[int, int] | None = None,
    rng: random.Random | None = None,
) -> Load | None:
    """The sibling a pinned request should go to, or None to run it here (module docstring).

    Args:
        mine: this worker's items queued + in flight (before this request).
        siblings: the other slots of the load table (dead, stale and unready ones are skipped).
        now: ``time.monotonic()``, seconds.
        pending: items this worker forwarded per sibling pid, not yet answered.
        rng: the random source of the two choices (tests pass a seeded one).
    """
    if mine < 1:
        return None
    pending = pending or {}
    live = [s for s in siblings if s.live(now)]
    if len(live) > 2:
        live = (rng or random).sample(live, 2)

    def load(s: Load) -> tuple[int, float]:
        return (max(s.items, pending.get(s.pid, 0)), s.recent)

    best = min(live, key=load, default=None)
    if best is None or not clearly_busier(mine, load(best)[0]):
        return None
    return best


# --- this worker's decisions ----------------------------------------------------------------


class WorkerConnections:
    """Whether this worker accepts new connections and sheds kept-alive ones (module
    docstring); never while it is not ready (draining, loading) or does not balance.

    Args:
        slot: this worker's slot.
        balancing: ``SCORING_BALANCE``; False: accept always, never shed.
        metrics: counts shed connections (``scoring_connections_shed_total``); None when off.
    """

    def __init__(
        self, slot: WorkerSlot, balancing: bool = True, metrics: ServerMetrics | None = None
    ) -> None:
        self.slot = slot
        self.balancing = balancing
        self._shed = None if metrics is None else metrics.connections_shed.labels(str(slot.pid))
        self._last_shed = 0.0
        self._next_check = 0.0

    def may_accept(self) -> bool:
        """Whether the listener should accept now (:func:`may_accept`)."""
        slot = self.slot
        if not slot.ready or not self.balancing:
            return True
        return may_accept(slot.me(), slot.others(), time.monotonic())

    def accepted(self) -> None:
        """The listener accepted a connection (published at once)."""
        self.slot.accepted()

    def should_shed(self) -> bool:
        """Whether the response being prepared should close its connection
        (:func:`should_shed`, at most once per ``SHED_INTERVAL_S``; the table
        is looked at at most once per ``SHED_CHECK_S``)."""
        slot = self.slot
        now = time.monotonic()
        if not slot.ready or now < self._next_check or now - self._last_shed < SHED_INTERVAL_S:
            return False
        self._next_check = now + SHED_CHECK_S
        if not self.balancing:
            return False
        target = should_shed(slot.me(), slot.others(), now)
        if target is None:
            return False
        self._last_shed = now
        slot.shed()
        log.debug(
            "balance: shedding a connection (%d open, recent load %.1f items) towards pid %d (%d open, %.1f)",
            slot.connections + 1, slot.recent, target.pid, target.connections, target.recent,
        )  # fmt: skip
        if self._shed is not None:
            self._shed.inc()
        return True


class WorkerBalancer:
    """The data plane's ``app.serving.siblings.Balancer`` on this worker's slot: the load
    published, and requests that may leave handed to ``route`` (the router's; None: balancing
    off, or no internal endpoints: nothing leaves); ``forward``: pinned requests may leave
    whole (the router forwards them)."""

    def __init__(self, slot: WorkerSlot, route: Route | None = None, *, forward: bool = True) -> None:
        self.slot = slot
        self.route_out = route
        self.forward = forward
        #: Admission (+items) or completion (-items) of an inference request, published in the
        #: load table: the slot's own method (a request's path goes there directly).
        self.add_load: Callable[[int], None] = slot.add_load

    def considers(self, unit: ServingUnit, items: int, pinned: bool) -> bool:
        """Whether a request may leave: this worker ready and routing, and the request split
        (:func:`splits`) or pinned and waiting at least ``MIN_WAIT_S`` here
        (for a model whose batches take a fraction of a millisecond the hop costs more than the
        wait it saves)."""
        if self.route_out is None or not self.slot.ready:
            return False
        if splits(unit.scatter, unit.max_batch_size, items):
            return True
        return (
            pinned and self.forward and unit.expected_wait_s(asyncio.get_running_loop().time()) >= MIN_WAIT_S
        )

    async def route(
        self, unit: ServingUnit, inputs: Arrays, context: RequestContext, local: LocalRun
    ) -> Arrays | None:
        """The router's answer (``app.server.router.Router.route``); None without a router."""
        if self.route_out is None:
            return None
        return await self.route_out(unit, inputs, context, local)
