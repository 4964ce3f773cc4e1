"""Balancing among sibling workers: the load table in shared memory and the decisions read from
it, as pure functions of the loads. A worker's side of it (its slot, the hot-path writes, the
decisions applied to itself) is ``app.server.siblings.WorkerSiblings``.

**The load table**, ``<run dir>/load``: one fixed-size slot per worker in an mmap'd file; a
worker writes its own slot (a ``struct.pack_into`` on the mmap: no system call, no lock) and
reads its siblings' (``struct.unpack_from``: a few hundred ns per look, ``python -m
benchmarks.loadtable``). No master, no lock and no system call on the hot path. Layout (little
endian)::

    header   16 bytes: magic b"SCLOAD02", slots in use (u32), reserved (u32)
    slot k   32 bytes at 16 + 32 k: pid (i32), generation (u32), state (i32),
             items (i32: items queued + in flight), connections (i32: open HTTP connections),
             recent (i32: items queued + in flight averaged over ~0.1 s, in 1/1000 items),
             heartbeat (f64: time.monotonic(), seconds)

**States**, in a worker's order of life: ``BINDING`` (forked, waiting for a GPU slot;
``gunicorn.conf.py``'s ``post_fork`` claims the slot), ``BOOTING`` (bound, importing),
``LOADING`` (the app exists, models load), ``READY`` (warm and listening), ``DRAINING``
(unready, still accepting), ``STOPPING`` (listener closed, finishing requests). The workers
coordinate boot, drain and recycling through them (:func:`others_serving`,
:func:`replacement_booting`, :func:`may_recycle`), and balance through the load fields
(below).

Slots are claimed, not assigned by rank: a CPU worker's rank (``gpu_stat.binding``) is its
index among the live siblings, which a HUP reload gives to a new worker while the old one
with the same rank still serves. A worker claims, under ``flock`` of the file (once, at
fork), the first slot that is empty or whose pid is dead; the master frees it when the
worker exits (``child_exit``), the worker itself too. A SIGKILLed worker's slot is freed by the
master; readers ignore a slot whose heartbeat is older than ``STALE_S`` (a stopped worker).

Values are advisory: a reader may see a slot mid-write (each field is one aligned store, so
a field is never torn, but two fields may come from two writes). Balancing tolerates that.
The file is opened without following links, in the run directory (``app.server.rundir``).

**The decisions.** Placement is by open connections first (nginx's ``least_conn``), then by recent load (items
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

import contextlib
import fcntl
import logging
import mmap
import os
import struct
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import psutil

from app.server import rundir

#: The balancing decisions' log (``balance: ...`` at debug level; ``app.server.siblings`` writes
#: a worker's shed decisions to it).
log = logging.getLogger(__name__)

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
        recent: items queued + in flight, averaged over the last ~0.1 s (app.server.balance).
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


# --- coordination among siblings: pure functions of the other workers' states -------------


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


def _offset(slot: int) -> int:
    return _HEADER.size + slot * _SLOT.size


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a running (not zombie) process."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


# --- balancing decisions: pure functions of the table -------------------------------------

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
