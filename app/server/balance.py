"""The balancing and coordination rules among a server's workers, pure functions of the loads
and states the load table holds (below), and this worker's decisions by
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

The load table: ``<run dir>/load``, where every worker of a server publishes its state and
load and reads its siblings' (:class:`LoadTable`, one :class:`Load` per worker), and this
worker's slot in it from its claim to its release (:class:`WorkerSlot`). No master, no lock and
no system call on the hot path. Imported by the master (``gunicorn.conf.py``'s hooks claim and
free slots): no torch, nothing from ``app.serving``.

One fixed-size slot per worker in an mmap'd file; a worker writes its own slot (a
``struct.pack_into`` on the mmap: no system call, no lock) and reads its siblings'
(``struct.unpack_from``: a few hundred ns per look, ``python -m benchmarks.loadtable``). Layout
(little endian)::

    header   16 bytes: magic b"SCLOAD02", slots in use (u32), reserved (u32)
    slot k   32 bytes at 16 + 32 k: pid (i32), generation (u32), state (i32),
             items (i32: items queued + in flight), connections (i32: open HTTP connections),
             recent (i32: items queued + in flight averaged over ~0.1 s, in 1/1000 items),
             heartbeat (f64: time.monotonic(), seconds)

States, in a worker's order of life: ``BINDING`` (forked, waiting for a GPU slot;
``gunicorn.conf.py``'s ``post_fork`` claims the slot), ``BOOTING`` (bound, importing),
``LOADING`` (the app exists, models load), ``READY`` (warm and listening), ``DRAINING``
(unready, still accepting), ``STOPPING`` (listener closed, finishing requests). The workers
coordinate boot, drain and recycling through them, and balance through the load fields (the
rules above).

Slots are claimed, not assigned by rank: a CPU worker's rank (``gpu_stat.binding``) is its
index among the live siblings, which a HUP reload gives to a new worker while the old one
with the same rank still serves. A worker claims, under ``flock`` of the file (once, at
fork), the first slot that is empty or whose pid is dead; the master frees it when the
worker exits (``child_exit``), the worker itself too. A SIGKILLed worker's slot is freed by the
master; readers ignore a slot whose heartbeat is older than ``STALE_S`` (a stopped worker).

**This worker's slot** (:class:`WorkerSlot`): ``post_fork`` claims it (state ``BINDING``), the
worker keeps it: its load at every admission and completion (one store), its connections at
every accept, and every tick (50 ms) its state, heartbeat, recent load (items averaged over
``RECENT_TAU_S``) and true connection count; freed at exit. The decisions taken on these
numbers are the rules above.

Values are advisory: a reader may see a slot mid-write (each field is one aligned store, so
a field is never torn, but two fields may come from two writes). Balancing tolerates that.
The file is opened without following links, in the run directory (``app.server.rundir``).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import math
import mmap
import os
import random
import struct
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import psutil

from app.server import rundir

if TYPE_CHECKING:
    from app.observability.metrics import ServerMetrics


FILE_NAME = "load"
MAGIC = b"SCLOAD02"
MAX_SLOTS = 256
_HEADER = struct.Struct("<8sII")
_SLOT = struct.Struct("<iIiiiid")
_FIELD = struct.Struct("<i")
_TIME = struct.Struct("<d")
_STATE_AT, _ITEMS_AT, _CONNECTIONS_AT, _RECENT_AT, _HEARTBEAT_AT = 8, 12, 16, 20, 24
SIZE = _HEADER.size + MAX_SLOTS * _SLOT.size
#: A slot whose heartbeat is older than this (seconds) is not live: its worker is stopped.
STALE_S = 1.0
#: Time constant of the recent load (an exponentially weighted average of items), seconds.
RECENT_TAU_S = 0.1

# Slot states, in a worker's order of life.
EMPTY, BINDING, BOOTING, LOADING, READY, DRAINING, STOPPING = range(7)


class Load(NamedTuple):
    """One worker's published state and load.

    Attributes:
        slot: its index in the table.
        pid: its process id.
        generation: bumped at every claim of the slot (a restarted worker is a new generation).
        state: EMPTY, BINDING, BOOTING, LOADING, READY, DRAINING or STOPPING.
        items: inference items queued + in flight (admitted, not yet answered).
        connections: open HTTP connections (idle keep-alive ones included).
        recent: items queued + in flight, averaged over the last ~0.1 s (``RECENT_TAU_S``).
        heartbeat: ``time.monotonic()`` of its last tick, seconds.
    """

    slot: int
    pid: int
    generation: int
    state: int
    items: int
    connections: int
    recent: float
    heartbeat: float

    def live(self, now: float, stale_s: float = STALE_S) -> bool:
        """Ready and ticking (heartbeat within ``stale_s`` seconds of ``now``)."""
        return self.state == READY and self.pid > 0 and now - self.heartbeat <= stale_s

    def reachable(self, now: float, stale_s: float = STALE_S) -> bool:
        """Ticking (its internal endpoint is up) and not leaving: ready, or "loading" (no model
        ready, e.g. its only model unloaded); what model control must reach."""
        return self.state in (LOADING, READY) and self.pid > 0 and now - self.heartbeat <= stale_s


class LoadTable:
    """The mmap'd table of a run directory (created on first open).

    Args:
        run_dir: the server's run directory (``SCORING_RUN_DIR``; private: ``app.server.rundir``).
        readonly: only look (monitoring, tests): the file must exist; nothing is written.

    Raises:
        OSError: the file cannot be created, opened or mapped, or it is a link.
    """

    def __init__(self, run_dir: str | os.PathLike[str], *, readonly: bool = False) -> None:
        self.path = Path(run_dir) / FILE_NAME
        if readonly:
            self._fd = rundir.open_private(self.path, os.O_RDONLY)
            if os.fstat(self._fd).st_size < SIZE:
                os.close(self._fd)
                raise OSError(f"{self.path}: not a load table (too short)")
            self._map = mmap.mmap(self._fd, SIZE, access=mmap.ACCESS_READ)
            return
        self._fd = rundir.open_private(self.path, os.O_RDWR | os.O_CREAT)
        with self._locked():
            if os.fstat(self._fd).st_size < SIZE:
                os.ftruncate(self._fd, SIZE)
                os.pwrite(self._fd, _HEADER.pack(MAGIC, 0, 0), 0)
        self._map = mmap.mmap(self._fd, SIZE)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    @property
    def slots_in_use(self) -> int:
        """How many slots have ever been claimed (readers look at these only)."""
        return int(_HEADER.unpack_from(self._map, 0)[1])

    def claim(self, pid: int, state: int = BOOTING) -> int:
        """Take the first empty slot, or one whose pid is dead (a SIGKILLed worker's), for
        ``pid``, in ``state``; a slot ``pid`` already holds is kept. Returns the slot index.

        Raises:
            RuntimeError: all ``MAX_SLOTS`` slots belong to live processes.
        """
        with self._locked():
            in_use = self.slots_in_use
            held = next((s for s in range(in_use) if self.read(s).pid == pid), None)
            if held is not None:
                _FIELD.pack_into(self._map, _offset(held) + _STATE_AT, state)
                return held
            for slot in range(MAX_SLOTS):
                if slot < in_use:
                    old = self.read(slot)
                    if old.pid != 0 and _alive(old.pid):
                        continue
                    generation = old.generation + 1
                else:
                    generation = 1
                _SLOT.pack_into(self._map, _offset(slot), pid, generation, state, 0, 0, 0, time.monotonic())
                if slot >= in_use:
                    _HEADER.pack_into(self._map, 0, MAGIC, slot + 1, 0)
                return slot
        raise RuntimeError(f"{self.path}: all {MAX_SLOTS} slots belong to live workers")

    def slot_of(self, pid: int) -> int | None:
        """The slot ``pid`` holds, or None."""
        return next((s.slot for s in self.snapshot() if s.pid == pid), None)

    def release(self, slot: int, pid: int) -> None:
        """Free ``slot`` if ``pid`` still holds it (at a worker's exit; idempotent)."""
        with self._locked():
            old = self.read(slot)
            if old.pid == pid:
                _SLOT.pack_into(self._map, _offset(slot), 0, old.generation, EMPTY, 0, 0, 0, 0.0)

    def release_pid(self, pid: int) -> None:
        """Free the slot of ``pid``, wherever it is (the master, after the worker exited)."""
        slot = self.slot_of(pid)
        if slot is not None:
            self.release(slot, pid)

    # --- hot path: one store or one load each ----------------------------------------

    def set_items(self, slot: int, items: int) -> None:
        """Publish items queued + in flight."""
        _FIELD.pack_into(self._map, _offset(slot) + _ITEMS_AT, items)

    def set_connections(self, slot: int, connections: int) -> None:
        """Publish the number of open connections."""
        _FIELD.pack_into(self._map, _offset(slot) + _CONNECTIONS_AT, connections)

    def set_recent(self, slot: int, recent: float) -> None:
        """Publish the recent load (items, averaged)."""
        _FIELD.pack_into(self._map, _offset(slot) + _RECENT_AT, min(int(recent * 1000), 2**31 - 1))

    def set_state(self, slot: int, state: int) -> None:
        """Publish one of the states (module docstring)."""
        _FIELD.pack_into(self._map, _offset(slot) + _STATE_AT, state)

    def beat(self, slot: int, now: float | None = None) -> None:
        """Publish a heartbeat (``time.monotonic()``)."""
        _TIME.pack_into(self._map, _offset(slot) + _HEARTBEAT_AT, time.monotonic() if now is None else now)

    def read(self, slot: int) -> Load:
        """One slot as it is now."""
        pid, generation, state, items, connections, milli, beat = _SLOT.unpack_from(self._map, _offset(slot))
        return Load(slot, pid, generation, state, items, connections, milli / 1000.0, beat)

    def snapshot(self) -> list[Load]:
        """Every claimed slot (empty and stale ones included; see :meth:`Load.live`)."""
        return [self.read(slot) for slot in range(min(self.slots_in_use, MAX_SLOTS))]

    def states(self) -> dict[int, int]:
        """pid -> state of every slot held by a live process."""
        return {s.pid: s.state for s in self.snapshot() if s.pid > 0 and _alive(s.pid)}

    def close(self) -> None:
        """Unmap and close the file."""
        self._map.close()
        os.close(self._fd)


def _offset(slot: int) -> int:
    return _HEADER.size + slot * _SLOT.size


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a running (not zombie) process."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


class WorkerSlot:
    """This worker's slot in the table (module docstring).

    Args:
        table: the run directory's load table.
        pid: this worker's pid; its slot is claimed now (kept when ``post_fork`` claimed it).
        metrics: the worker's metrics (``scoring_worker_load_items``,
            ``scoring_worker_connections``, set every tick); None when off.

    Raises:
        RuntimeError: every slot of the table belongs to a live process.

    Attributes:
        items: inference items queued + in flight here (admitted, not yet answered).
        recent: ``items`` averaged over about ``RECENT_TAU_S`` (as of the last tick).
        connections: open HTTP connections (accepts counted at once, the true count per tick).
        ready: the state of the last tick was ``READY``.
    """

    def __init__(self, table: LoadTable, pid: int, metrics: ServerMetrics | None = None) -> None:
        self.table = table
        self.pid = pid
        self.slot = table.claim(pid)
        self.items = 0
        self.recent = 0.0
        self.connections = 0
        self.ready = False
        self._changed = time.monotonic()  # last change of ``items``
        self._area = 0.0  # item-seconds since the last tick
        self._tick = self._changed
        self._released = False
        label = str(pid)
        self._gauges = (
            None
            if metrics is None
            else (metrics.worker_load_items.labels(label), metrics.worker_connections.labels(label))
        )

    # --- what this worker publishes ---------------------------------------------------------

    def add_load(self, items: int) -> None:
        """Admission (+items) or completion (-items) of an inference request: published."""
        now = time.monotonic()
        self._area += self.items * (now - self._changed)
        self._changed = now
        self.items += items
        self.table.set_items(self.slot, self.items)

    def accepted(self) -> None:
        """A connection was accepted (counted before aiohttp sees it)."""
        self.connections += 1
        self.table.set_connections(self.slot, self.connections)

    def shed(self) -> None:
        """A connection is being closed for a sibling to take: counted out at once."""
        self.connections -= 1
        self.table.set_connections(self.slot, self.connections)

    def publish(self, state: int) -> None:
        """Publish this worker's state (``BOOTING`` ... ``STOPPING``) at once."""
        if not self._released:
            self.table.set_state(self.slot, state)

    def tick(self, state: int, connections: int) -> None:
        """Publish ``state``, the heartbeat, the recent load and the true number of open
        ``connections`` (every worker tick)."""
        if self._released:
            return
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
        self.connections = connections
        self.table.set_connections(self.slot, connections)
        self.table.set_state(self.slot, state)
        self.table.beat(self.slot)
        if self._gauges is not None:
            self._gauges[0].set(self.items)
            self._gauges[1].set(connections)

    def release(self) -> None:
        """Free the slot (at exit; idempotent)."""
        if not self._released:
            self._released = True
            self.table.release(self.slot, self.pid)

    # --- what it reads of its siblings ----------------------------------------------------------

    def me(self) -> Load:
        """This worker's load as siblings see it."""
        return self.table.read(self.slot)

    def others(self) -> list[Load]:
        """The loads of the other claimed slots (check ``Load.live``)."""
        return [load for load in self.table.snapshot() if load.slot != self.slot]

    def other_states(self) -> list[int]:
        """The states of the other live processes' slots (reads /proc: off the loop)."""
        return [state for pid, state in self.table.states().items() if pid != self.pid]


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

    def may_leave(self, unit: ServingUnit, items: int, pinned: bool) -> bool:
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
