"""The siblings of a gunicorn worker (the other workers of its server), from fork to exit, in
three parts, in this order below:

- **The table** they share (:class:`LoadTable`, one :class:`Load` per worker, the states
  ``BINDING`` ... ``STOPPING``): ``<run dir>/load``, where every worker publishes its state and
  load and reads its siblings'.
- **The rules** read from it, pure functions of the loads and states: balancing
  (:func:`least_loaded`, :func:`busier`, :func:`clearly_busier`, :func:`may_accept`,
  :func:`should_shed`, :func:`splits`) and coordination of boot, drain and recycling
  (:func:`others_serving`, :func:`replacement_booting`, :func:`may_recycle`).
- **This worker's seat** among them: :class:`SiblingSlot`, its place in the table, which makes its
  :class:`WorkerSiblings`, what the data plane may ask of the other workers
  (``app.serving.siblings.Siblings``): its side of the table (its slot, the hot-path writes, the
  rules applied to itself).

No master, no lock and no system call on the hot path. Imported by the master with the worker
class (``gunicorn.conf.py``'s hooks claim and free slots): no torch and nothing from
``app.serving`` at import (the serving layer is imported lazily in :meth:`SiblingSlot.join`).

**The table**, ``<run dir>/load``: one fixed-size slot per worker in an mmap'd file; a worker
writes its own slot (a ``struct.pack_into`` on the mmap: no system call, no lock) and reads its
siblings' (``struct.unpack_from``: a few hundred ns per look, ``python -m
benchmarks.loadtable``). Layout (little endian)::

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
rules, below).

Slots are claimed, not assigned by rank: a CPU worker's rank (``gpu_stat.binding``) is its
index among the live siblings, which a HUP reload gives to a new worker while the old one
with the same rank still serves. A worker claims, under ``flock`` of the file (once, at
fork), the first slot that is empty or whose pid is dead; the master frees it when the
worker exits (``child_exit``), the worker itself too. A SIGKILLed worker's slot is freed by the
master; readers ignore a slot whose heartbeat is older than ``STALE_S`` (a stopped worker).

Values are advisory: a reader may see a slot mid-write (each field is one aligned store, so
a field is never torn, but two fields may come from two writes). Balancing tolerates that.
The file is opened without following links, in the run directory (``app.server.rundir``).

**The rules.** Placement is by open connections first (nginx's ``least_conn``), then by recent
load (items queued + in flight, averaged over about ``RECENT_TAU_S``): with keep-alive clients a
connection is the unit the kernel places, and each connection of a closed-loop client carries
about the same load.

- **Accept** (new connections): a worker accepts only while no live sibling is less loaded
  than itself (nginx's ``accept_mutex`` idea, without a mutex: the least-loaded workers accept;
  several equal ones race as before). The least-loaded live worker never pauses, so some
  worker always accepts; a stopped or dead sibling stops counting after ``STALE_S``.
- **Shed** (existing connections): a worker answers one response with ``Connection: close``
  when moving that connection to its least-loaded live sibling narrows the gap: it has two or
  more connections more, or one more and is clearly busier (:func:`clearly_busier`: a recent
  load of at least one item and more than twice the sibling's, + 0.5; a busy connection moves
  to an idle worker, so that with fewer connections than workers the load rotates over all of
  them). The client reconnects and the accept rule places the connection on a less-loaded
  worker (gRPC's ``max_connection_age`` idea, applied only while unbalanced). At most one per
  ``SHED_INTERVAL_S`` per worker; the table is looked at at most once per ``SHED_CHECK_S``.
- **Leave** (``app.server.router``): a request may leave the worker when it is split
  (:func:`splits`: scatter on and more items than one batch holds), or pinned (a gRPC
  connection) and it would wait at least ``MIN_WAIT_S`` here (for a model whose batches take a
  fraction of a millisecond the hop costs more than the wait it saves).
- **Coordination**: a new worker listens only once its models are warm while another worker
  accepts requests (:func:`others_serving`); a draining worker keeps serving while no other
  worker is ready and a replacement still boots (:func:`replacement_booting`); a worker past
  ``max_requests`` drains only while another is ready, or there is none (:func:`may_recycle`).

Tuned numbers (docs/architecture.md, *Tuned numbers*): ``STALE_S`` 1 s, ``RECENT_TAU_S`` 100 ms,
``SHED_INTERVAL_S`` 100 ms, ``SHED_CHECK_S`` 10 ms, ``MIN_WAIT_S`` 5 ms. The decisions are logged
at debug level (``balance: ...``). See docs/architecture.md (*Balancing among sibling workers*)
for why this and not request forwarding or SO_REUSEPORT.

**This worker's seat.**

- **Its slot**, claimed by ``gunicorn.conf.py``'s ``post_fork`` (state ``BINDING``) and kept by
  the worker (:class:`SiblingSlot`): its state, load and heartbeat, published every tick; freed
  at exit.
- **Its siblings** (:class:`WorkerSiblings`), made with the slot, so that the worker hands them
  to the app factory as the data plane's ``Siblings``, balancing on or off: the load published
  at every admission and completion, the accept and shed decisions, model control sent to every
  sibling, and requests that leave the worker.
- **The internal endpoint** (:mod:`app.server.peers`, ``<run dir>/peers/<pid>.sock``), once the
  worker's app is set up (:meth:`SiblingSlot.join`): model control changes from siblings, and
  unless ``SCORING_BALANCE=0`` the :class:`~app.server.router.Router` (scatter/gather of large
  requests, forwarding of requests on pinned gRPC connections); and the balancing metrics
  (``scoring_worker_*``, ``scoring_connections_shed_total``, ``scoring_scattered_requests_total``,
  ``scoring_forwarded_shards_total``, ``scoring_forwarded_requests_total``).

Without a run directory, or when the table cannot be opened, the worker neither coordinates
nor balances (a warning says so), there is no ``WorkerSiblings`` and its app gets
``app.serving.siblings.Alone``; nothing raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import math
import mmap
import os
import struct
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import psutil
from aiohttp import web

from app.server import rundir

if TYPE_CHECKING:
    from app.server.peers import PeerClient
    from app.server.router import Router
    from app.serving.context import RequestContext
    from app.serving.siblings import Arrays, LocalRun
    from app.serving.unit import ServingUnit

__all__ = [
    "BINDING", "BOOTING", "DRAINING", "EMPTY", "FILE_NAME", "LOADING", "MAGIC", "MAX_SLOTS",
    "MIN_WAIT_S", "READY", "RECENT_TAU_S", "SHED_CHECK_S", "SHED_INTERVAL_S", "SIZE", "STALE_S",
    "STOPPING", "Load", "LoadTable", "SiblingSlot", "WorkerSiblings", "busier", "clearly_busier",
    "least_loaded", "may_accept", "may_recycle", "others_serving", "replacement_booting",
    "should_shed", "splits",
]

#: The siblings' log: a worker's balancing decisions (``balance: ...`` at debug level) and a table
#: it cannot open (a warning).
log = logging.getLogger(__name__)


# --- the table ------------------------------------------------------------------------------

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


# --- the rules: coordination, pure functions of the other workers' states -----------------


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


# --- the rules: balancing, pure functions of the loads -------------------------------------

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


#: A pinned request is forwarded only when it would wait at least this long here, seconds
#: (docs/architecture.md, *Tuned numbers*).
MIN_WAIT_S = 0.005


def splits(scatter: bool, max_batch_size: int, items: int) -> bool:
    """Whether a request of ``items`` items is cut into shards: ``scatter`` on and more items
    than one batch holds."""
    return scatter and items > max_batch_size


# --- this worker's seat ----------------------------------------------------------------------

#: Longest path a Unix socket may have (sun_path, with its NUL).
_MAX_SOCKET_PATH = 107


class WorkerSiblings:
    """The siblings of this gunicorn worker: the data plane's ``app.serving.siblings.Siblings``,
    on this worker's side of the load table. Publishes its load, decides for its listener and its
    keep-alive policy, sends model control changes to the siblings and routes requests that leave
    the worker (``app.server.router``), once :meth:`SiblingSlot.join` gave it a control client
    (``control``) and a router (:meth:`attach`).

    Args:
        table: the run directory's load table.
        slot: this worker's claimed slot.
        pid: this worker's pid.
        balancing: decide at all (``SCORING_BALANCE``); False: accept always, never shed or
            route, but publish the load and the state.
    """

    def __init__(self, table: LoadTable, slot: int, pid: int, *, balancing: bool = True) -> None:
        self.table = table
        self.slot = slot
        self.pid = pid
        self.balancing = balancing
        self.items = 0
        self.recent = 0.0
        self.connections = 0
        self.ready = False
        self.router: Router | None = None
        #: Sends a model control change to one sibling (pid, action, name) -> why it failed or
        #: None (``app.server.peers.PeerClient.control``); None: no internal endpoints.
        self.control: Callable[[int, str, str], Awaitable[str | None]] | None = None
        #: A sibling's statistics (pid) -> its ``$model_stat`` objects, or None when it did not
        #: answer (``app.server.peers.PeerClient.statistics``); None: no internal endpoints.
        self.statistics_of: Callable[[int], Awaitable[list[dict[str, Any]] | None]] | None = None
        self._count_connections: Callable[[], int] = lambda: 0
        #: Called once per shed connection (metrics), with the sibling's pid.
        self.on_shed: Callable[[int], None] | None = None
        #: Called at the end of every tick (the balancing gauges).
        self.on_tick: Callable[[], object] | None = None
        self._last_shed = 0.0
        self._next_check = 0.0
        self._changed = time.monotonic()  # last change of ``items``
        self._area = 0.0  # item-seconds since the last tick
        self._tick = self._changed

    def attach(self, connections: Callable[[], int], router: Router | None) -> None:
        """Start counting the worker's open connections and routing through ``router``."""
        self._count_connections = connections
        self.router = router

    # --- app.serving.siblings.Siblings --------------------------------------------------------

    def add_load(self, items: int) -> None:
        """Admission (+items) or completion (-items) of an inference request: published."""
        now = time.monotonic()
        self._area += self.items * (now - self._changed)
        self._changed = now
        self.items += items
        self.table.set_items(self.slot, self.items)

    def should_shed(self) -> bool:
        """Whether the response being prepared should close its connection
        (:func:`app.server.siblings.should_shed`, at most once per ``SHED_INTERVAL_S``; the
        table is looked at most once per ``SHED_CHECK_S``; never while not ready, e.g.
        draining)."""
        now = time.monotonic()
        if not self.ready or now < self._next_check or now - self._last_shed < SHED_INTERVAL_S:
            return False
        self._next_check = now + SHED_CHECK_S
        if not self.balancing:
            return False
        target = should_shed(self.me(), self.others(), now)
        if target is None:
            return False
        self._last_shed = now
        self.connections -= 1
        self.table.set_connections(self.slot, self.connections)
        log.debug(
            "balance: shedding a connection (%d open, recent load %.1f items) towards pid %d (%d open, %.1f)",
            self.connections + 1, self.recent, target.pid, target.connections, target.recent,
        )  # fmt: skip
        if self.on_shed is not None:
            self.on_shed(target.pid)
        return True

    def considers(self, unit: ServingUnit, items: int, pinned: bool) -> bool:
        """Whether a request may leave: this worker ready and routing, and the request split
        (:func:`app.server.siblings.splits`) or pinned and waiting at least ``MIN_WAIT_S``
        here (for a model whose batches take a fraction of a millisecond the hop costs more than
        the wait it saves)."""
        if self.router is None or not self.ready:
            return False
        if splits(unit.scatter, unit.max_batch_size, items):
            return True
        return (
            pinned
            and self.router.forward
            and unit.expected_wait_s(asyncio.get_running_loop().time()) >= MIN_WAIT_S
        )

    async def route(
        self, unit: ServingUnit, inputs: Arrays, context: RequestContext, local: LocalRun
    ) -> Arrays | None:
        """The router's answer (``app.server.router.Router.route``); None without a router."""
        if self.router is None:
            return None
        return await self.router.route(unit, inputs, context, local)

    def others_serving(self) -> bool:
        """Another worker accepts requests (:func:`app.server.siblings.others_serving`). Reads
        /proc: off the loop."""
        return others_serving(state for pid, state in self.table.states().items() if pid != self.pid)

    async def apply(self, action: str, name: str) -> dict[int, str]:
        """Send a model control change to every sibling that ticks and is not leaving, ready or
        not (one with no model ready must hear it too, or it keeps its old state), at once;
        pid -> why, for each that failed (``app.serving.control``)."""
        control = self.control
        if control is None:
            return {}
        now = time.monotonic()
        pids = [load.pid for load in self.others() if load.reachable(now)]
        answers = await asyncio.gather(*(control(pid, action, name) for pid in pids))
        return {pid: why for pid, why in zip(pids, answers, strict=True) if why is not None}

    async def statistics(self) -> list[list[dict[str, Any]]]:
        """Every reachable sibling's statistics, asked at once; those that did not answer in
        time (``app.server.peers.STATS_TIMEOUT_S``) left out."""
        ask = self.statistics_of
        if ask is None:
            return []
        now = time.monotonic()
        answers = await asyncio.gather(*(ask(load.pid) for load in self.others() if load.reachable(now)))
        return [stats for stats in answers if stats is not None]

    # --- the listener and the tick --------------------------------------------------------------

    def accepted(self) -> None:
        """A connection was accepted (counted before aiohttp sees it)."""
        self.connections += 1
        self.table.set_connections(self.slot, self.connections)

    def tick(self, state: int) -> None:
        """Publish state, heartbeat, recent load and the true connection count (every tick)."""
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

    def others(self) -> list[Load]:
        """The loads of the other claimed slots (check ``Load.live``)."""
        return [load for load in self.table.snapshot() if load.slot != self.slot]

    def may_accept(self) -> bool:
        """Whether the listener should accept now (:func:`app.server.siblings.may_accept`); always
        True while this worker is not ready (it is then not listening, or draining) or does not
        balance."""
        if not self.ready or not self.balancing:
            return True
        return may_accept(self.me(), self.others(), time.monotonic())


class SiblingSlot:
    """One worker's slot in the load table, its :class:`WorkerSiblings` and, once joined, its
    internal endpoint and routing.

    Args:
        run_dir: the server's run directory (``SCORING_RUN_DIR``); None or "": alone.
        pid: this worker's pid (the slot's owner).
        balancing: ``SCORING_BALANCE``.
    """

    def __init__(self, run_dir: str | Path | None, pid: int, balancing: bool = True) -> None:
        self.run_dir = Path(run_dir) if run_dir else None
        self.pid = pid
        self.table: LoadTable | None = None
        self.slot: int | None = None
        self.siblings: WorkerSiblings | None = None
        self._peers: PeerClient | None = None
        self._internal: web.AppRunner | None = None
        if self.run_dir is not None:
            try:
                table = LoadTable(self.run_dir)
                self.slot = table.claim(pid)  # kept when post_fork claimed it already
                self.table = table
                self.siblings = WorkerSiblings(table, self.slot, pid, balancing=balancing)
            except (OSError, RuntimeError) as exc:
                log.warning("no load table in %s (%s): this worker does not balance", run_dir, exc)

    # --- state and coordination ---------------------------------------------------------

    def publish(self, state: int) -> None:
        """Publish this worker's state (``BOOTING`` ... ``STOPPING``) at once."""
        if self.table is not None and self.slot is not None:
            self.table.set_state(self.slot, state)

    def _others(self) -> list[int]:
        if self.table is None:
            return []
        return [state for pid, state in self.table.states().items() if pid != self.pid]

    def replacement_booting(self) -> bool:
        """No other worker is ready and one still boots
        (:func:`app.server.siblings.replacement_booting`)."""
        return replacement_booting(self._others())

    def may_recycle(self) -> bool:
        """Another worker is ready, or there is none
        (:func:`app.server.siblings.may_recycle`)."""
        return may_recycle(self._others())

    def tick(self, state: int) -> None:
        """Publish ``state``, the heartbeat and the load (every worker tick)."""
        if self.siblings is not None:
            self.siblings.tick(state)

    # --- routing --------------------------------------------------------------------------

    async def join(self, app: web.Application, server: web.Server) -> None:
        """Once the app has started, serve the internal endpoint (model control, shards) and
        complete this worker's :class:`WorkerSiblings` (:meth:`WorkerSiblings.attach`): the
        server's connection count, the balancing metrics, the model control client (none when
        the socket path is too long) and, unless balancing is off, a router. Until then they
        route nothing and reach no sibling; without siblings (no load table) nothing happens.

        Raises:
            RunDirError: ``<run dir>/peers`` exists and is not a private folder of this user.
        """
        from app.http.state import CORE
        from app.server.peers import PeerClient, internal_app, socket_path
        from app.server.router import Router

        siblings = self.siblings
        if siblings is None or self.run_dir is None:
            return
        core = app[CORE]
        metrics = core.metrics
        label = str(self.pid)
        if metrics is not None:
            shed = metrics.connections_shed.labels(label)
            siblings.on_shed = lambda _pid: shed.inc()
            load_gauge = metrics.worker_load_items.labels(label)
            connections_gauge = metrics.worker_connections.labels(label)

            def gauges() -> None:
                load_gauge.set(siblings.items)
                connections_gauge.set(siblings.connections)

            siblings.on_tick = gauges
        router = None
        path = socket_path(self.run_dir, self.pid)
        if len(str(path)) > _MAX_SOCKET_PATH:
            log.warning(
                "run dir path too long for a Unix socket (%s): no scatter/gather, no model control", path
            )
        else:
            rundir.private_subdir(self.run_dir, path.parent.name)  # whoever can connect gives it work
            path.unlink(missing_ok=True)
            runner = web.AppRunner(internal_app(core), access_log=None)
            await runner.setup()
            await web.UnixSite(runner, str(path)).start()
            self._internal = runner
            self._peers = peers = PeerClient(self.run_dir)
            siblings.control = peers.control
            siblings.statistics_of = peers.statistics

            def on_scatter(model: str, version: str, shards: int) -> None:
                if metrics is not None:
                    metrics.scattered.labels(model, version).inc()
                    metrics.forwarded_shards.labels(model, version).inc(shards)

            def on_forward(model: str, version: str) -> None:
                if metrics is not None:
                    metrics.forwarded_requests.labels(model, version).inc()

            if siblings.balancing:
                router = Router(siblings, peers, on_scatter=on_scatter, on_forward=on_forward)
        siblings.attach(lambda: len(server.connections), router)

    async def close(self) -> None:
        """Stop routing, close the internal endpoint and the sessions to siblings; the slot
        stays claimed until :meth:`release`."""
        if self.siblings is not None:
            self.siblings.router = self.siblings.control = None
        if self._internal is not None:
            await self._internal.cleanup()
            self._internal = None
        if self.run_dir is not None and self._peers is not None:
            from app.server.peers import socket_path

            socket_path(self.run_dir, self.pid).unlink(missing_ok=True)
            await self._peers.close()
            self._peers = None

    def release(self) -> None:
        """Free the load table slot (at exit; idempotent)."""
        if self.table is not None and self.slot is not None:
            self.table.release(self.slot, self.pid)
            self.slot = None
