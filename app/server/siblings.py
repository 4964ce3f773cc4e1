"""The siblings of a gunicorn worker, from fork to exit: :class:`WorkerSiblings`, what the data
plane may ask of the other workers (``app.serving.siblings.Siblings``), and :class:`SiblingSlot`,
the worker's place among them, which makes its ``WorkerSiblings``.

- **Its slot** in ``<run dir>/load`` (:mod:`app.server.balance`), claimed by
  ``gunicorn.conf.py``'s ``post_fork`` (state ``BINDING``) and kept by the worker: its state,
  load and heartbeat, published every tick; freed at exit.
- **Its siblings** (:class:`WorkerSiblings`), made with the slot, so that the worker hands them
  to the app factory as the data plane's ``Siblings``, balancing on or off: the load published
  at every admission and completion, the accept and shed decisions (the policy's pure functions
  are :mod:`app.server.balance`'s), model control sent to every sibling, and requests that
  leave the worker.
- **Coordination** of boot, drain and recycling through the siblings' states (a new worker
  listens once warm while another serves; a draining worker holds while a replacement boots;
  a worker recycles only while another is ready).
- **The internal endpoint** (:mod:`app.server.peers`, ``<run dir>/peers/<pid>.sock``), once the
  worker's app is set up (:meth:`SiblingSlot.join`): model control changes from siblings, and
  unless ``SCORING_BALANCE=0`` the :class:`~app.server.router.Router` (scatter/gather of large
  requests, forwarding of requests on pinned gRPC connections); and the balancing metrics
  (``scoring_worker_*``, ``scoring_connections_shed_total``, ``scoring_scattered_requests_total``,
  ``scoring_forwarded_shards_total``, ``scoring_forwarded_requests_total``).

Without a run directory, or when the table cannot be opened, the worker neither coordinates
nor balances (a warning says so), there is no ``WorkerSiblings`` and its app gets
``app.serving.siblings.Alone``; nothing raises. Imported by the master with the worker class:
no torch (the serving layer is imported lazily in :meth:`SiblingSlot.join`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from app.server import balance, rundir

if TYPE_CHECKING:
    from app.server.peers import PeerClient
    from app.server.router import Router
    from app.serving.context import RequestContext
    from app.serving.siblings import Arrays, LocalRun
    from app.serving.unit import ServingUnit

__all__ = ["SiblingSlot", "WorkerSiblings"]

log = logging.getLogger(__name__)

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

    def __init__(self, table: balance.LoadTable, slot: int, pid: int, *, balancing: bool = True) -> None:
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
        (:func:`app.server.balance.should_shed`, at most once per ``balance.SHED_INTERVAL_S``; the
        table is looked at most once per ``balance.SHED_CHECK_S``; never while not ready, e.g.
        draining)."""
        now = time.monotonic()
        if not self.ready or now < self._next_check or now - self._last_shed < balance.SHED_INTERVAL_S:
            return False
        self._next_check = now + balance.SHED_CHECK_S
        if not self.balancing:
            return False
        target = balance.should_shed(self.me(), self.others(), now)
        if target is None:
            return False
        self._last_shed = now
        self.connections -= 1
        self.table.set_connections(self.slot, self.connections)
        balance.log.debug(
            "balance: shedding a connection (%d open, recent load %.1f items) towards pid %d (%d open, %.1f)",
            self.connections + 1, self.recent, target.pid, target.connections, target.recent,
        )  # fmt: skip
        if self.on_shed is not None:
            self.on_shed(target.pid)
        return True

    def considers(self, unit: ServingUnit, items: int, pinned: bool) -> bool:
        """Whether a request may leave: this worker ready and routing, and the request split
        (:func:`app.server.balance.splits`) or pinned and waiting at least ``balance.MIN_WAIT_S``
        here (for a model whose batches take a fraction of a millisecond the hop costs more than
        the wait it saves)."""
        if self.router is None or not self.ready:
            return False
        if balance.splits(unit.scatter, unit.max_batch_size, items):
            return True
        return (
            pinned
            and self.router.forward
            and unit.expected_wait_s(asyncio.get_running_loop().time()) >= balance.MIN_WAIT_S
        )

    async def route(
        self, unit: ServingUnit, inputs: Arrays, context: RequestContext, local: LocalRun
    ) -> Arrays | None:
        """The router's answer (``app.server.router.Router.route``); None without a router."""
        if self.router is None:
            return None
        return await self.router.route(unit, inputs, context, local)

    def others_serving(self) -> bool:
        """Another worker accepts requests (:func:`app.server.balance.others_serving`). Reads
        /proc: off the loop."""
        return balance.others_serving(state for pid, state in self.table.states().items() if pid != self.pid)

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
        self.ready = state == balance.READY
        now = time.monotonic()
        self._area += self.items * (now - self._changed)
        self._changed = now
        elapsed = now - self._tick
        if elapsed > 0:
            alpha = 1.0 - math.exp(-elapsed / balance.RECENT_TAU_S)
            self.recent += alpha * (self._area / elapsed - self.recent)
        self._area, self._tick = 0.0, now
        self.table.set_recent(self.slot, self.recent)
        self.connections = self._count_connections()
        self.table.set_connections(self.slot, self.connections)
        self.table.set_state(self.slot, state)
        self.table.beat(self.slot)
        if self.on_tick is not None:
            self.on_tick()

    def me(self) -> balance.Load:
        """This worker's load as siblings see it."""
        return self.table.read(self.slot)

    def others(self) -> list[balance.Load]:
        """The loads of the other claimed slots (check ``Load.live``)."""
        return [load for load in self.table.snapshot() if load.slot != self.slot]

    def may_accept(self) -> bool:
        """Whether the listener should accept now (:func:`app.server.balance.may_accept`); always
        True while this worker is not ready (it is then not listening, or draining) or does not
        balance."""
        if not self.ready or not self.balancing:
            return True
        return balance.may_accept(self.me(), self.others(), time.monotonic())


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
        self.table: balance.LoadTable | None = None
        self.slot: int | None = None
        self.siblings: WorkerSiblings | None = None
        self._peers: PeerClient | None = None
        self._internal: web.AppRunner | None = None
        if self.run_dir is not None:
            try:
                table = balance.LoadTable(self.run_dir)
                self.slot = table.claim(pid)  # kept when post_fork claimed it already
                self.table = table
                self.siblings = WorkerSiblings(table, self.slot, pid, balancing=balancing)
            except (OSError, RuntimeError) as exc:
                log.warning("no load table in %s (%s): this worker does not balance", run_dir, exc)

    # --- state and coordination ---------------------------------------------------------

    def publish(self, state: int) -> None:
        """Publish this worker's state (``balance.BOOTING`` ... ``STOPPING``) at once."""
        if self.table is not None and self.slot is not None:
            self.table.set_state(self.slot, state)

    def _others(self) -> list[int]:
        if self.table is None:
            return []
        return [state for pid, state in self.table.states().items() if pid != self.pid]

    def replacement_booting(self) -> bool:
        """No other worker is ready and one still boots (``balance.replacement_booting``)."""
        return balance.replacement_booting(self._others())

    def may_recycle(self) -> bool:
        """Another worker is ready, or there is none (``balance.may_recycle``)."""
        return balance.may_recycle(self._others())

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
