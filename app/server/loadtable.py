"""The load table: ``<run dir>/load``, where every worker of a server publishes its state and
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
rules: :mod:`app.server.balance`).

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
numbers are :mod:`app.server.balance`'s.

Values are advisory: a reader may see a slot mid-write (each field is one aligned store, so
a field is never torn, but two fields may come from two writes). Balancing tolerates that.
The file is opened without following links, in the run directory (``app.server.rundir``).
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import mmap
import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import psutil

from app.server import rundir

if TYPE_CHECKING:
    from app.observability.metrics import ServerMetrics

__all__ = [
    "BINDING", "BOOTING", "DRAINING", "EMPTY", "FILE_NAME", "LOADING", "MAGIC", "MAX_SLOTS", "READY",
    "RECENT_TAU_S", "SIZE", "STALE_S", "STOPPING", "Load", "LoadTable", "WorkerSlot",
]  # fmt: skip

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
