"""This worker's slot in the load table (:mod:`app.server.loadtable`), from its claim to its
release: what the worker publishes there (state, heartbeat, load, connections) and what it reads
of its siblings' slots.

``gunicorn.conf.py``'s ``post_fork`` claims the slot (state ``BINDING``); the worker keeps it
(:class:`WorkerSlot`): its load at every admission and completion (one store), its connections at
every accept, and every tick (``_TICK_S``, 50 ms) its state, heartbeat, recent load (items
averaged over ``RECENT_TAU_S``) and true connection count; freed at exit. The decisions taken on
these numbers are :mod:`app.server.balance`'s rules, applied by :mod:`app.server.siblings` and
:mod:`app.server.router`. Imported by the master with the worker class: no torch, nothing from
``app.serving``.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from app.server.balance import RECENT_TAU_S, may_recycle, others_serving, replacement_booting
from app.server.loadtable import READY, Load, LoadTable

if TYPE_CHECKING:
    from app.observability.metrics import ServerMetrics

__all__ = ["WorkerSlot"]


class WorkerSlot:
    """This worker's slot (module docstring).

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

    def others_serving(self) -> bool:
        """Another worker accepts requests (:func:`app.server.balance.others_serving`); off the
        loop."""
        return others_serving(self.other_states())

    def replacement_booting(self) -> bool:
        """No other worker is ready and one still boots
        (:func:`app.server.balance.replacement_booting`); off the loop."""
        return replacement_booting(self.other_states())

    def may_recycle(self) -> bool:
        """Another worker is ready, or there is none (:func:`app.server.balance.may_recycle`);
        off the loop."""
        return may_recycle(self.other_states())
