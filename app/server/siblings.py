"""This worker among its siblings, from fork to exit: one object (:class:`Siblings`).

- **Its slot** in ``<run dir>/load`` (:mod:`app.server.loadtable`), claimed by
  ``gunicorn.conf.py``'s ``post_fork`` (state ``BINDING``) and kept by the worker: its state,
  load and heartbeat, published every tick; freed at exit.
- **Coordination** of boot, drain and recycling through the siblings' states (a new worker
  listens once warm while another serves; a draining worker holds while a replacement boots;
  a worker recycles only while another is ready).
- **Balancing**, once the worker's app is set up (:meth:`Siblings.join`, unless
  ``SCORING_BALANCE=0``): the :class:`~app.server.balance.Balancer` (accept and shed decisions,
  the load published at every admission and completion through ``registry.on_load``), the
  internal endpoint (:mod:`app.server.peers`, ``<run dir>/peers/<pid>.sock``) and the
  :class:`~app.server.router.Router` (scatter/gather of large requests, forwarding of requests
  on pinned gRPC connections; ``registry.spread``), and the balancing metrics
  (``scoring_worker_*``, ``scoring_connections_shed_total``, ``scoring_scattered_requests_total``,
  ``scoring_forwarded_shards_total``, ``scoring_forwarded_requests_total``).

Without a run directory, or when the table cannot be opened, the worker neither coordinates
nor balances (a warning says so); nothing raises. Imported by the master with the worker
class: no torch (the serving layer is imported lazily in :meth:`Siblings.join`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from app.server import loadtable, rundir

if TYPE_CHECKING:
    from app.server.balance import Balancer
    from app.server.peers import PeerClient

__all__ = ["Siblings"]

log = logging.getLogger(__name__)

#: Longest path a Unix socket may have (sun_path, with its NUL).
_MAX_SOCKET_PATH = 107


class Siblings:
    """One worker's slot in the load table and, once joined, its balancing.

    Args:
        run_dir: the server's run directory (``SCORING_RUN_DIR``); None or "": alone.
        pid: this worker's pid (the slot's owner).
    """

    def __init__(self, run_dir: str | None, pid: int) -> None:
        self.run_dir = Path(run_dir) if run_dir else None
        self.pid = pid
        self.table: loadtable.LoadTable | None = None
        self.slot: int | None = None
        self.balancer: Balancer | None = None
        self._app: web.Application | None = None
        self._peers: PeerClient | None = None
        self._internal: web.AppRunner | None = None
        if self.run_dir is not None:
            try:
                table = loadtable.LoadTable(self.run_dir)
                self.slot = table.claim(pid)  # kept when post_fork claimed it already
                self.table = table
            except (OSError, RuntimeError) as exc:
                log.warning("no load table in %s (%s): this worker does not balance", run_dir, exc)

    # --- state and coordination ---------------------------------------------------------

    def publish(self, state: int) -> None:
        """Publish this worker's state (``loadtable.BOOTING`` ... ``STOPPING``) at once."""
        if self.table is not None and self.slot is not None:
            self.table.set_state(self.slot, state)

    def _others(self) -> list[int]:
        if self.table is None:
            return []
        return [state for pid, state in self.table.states().items() if pid != self.pid]

    def others_serving(self) -> bool:
        """Another worker accepts requests (``loadtable.others_serving``). Reads /proc: call
        it off the event loop."""
        return loadtable.others_serving(self._others())

    def replacement_booting(self) -> bool:
        """No other worker is ready and one still boots (``loadtable.replacement_booting``)."""
        return loadtable.replacement_booting(self._others())

    def may_recycle(self) -> bool:
        """Another worker is ready, or there is none (``loadtable.may_recycle``)."""
        return loadtable.may_recycle(self._others())

    def tick(self, state: int) -> None:
        """Publish ``state``, the heartbeat and, when joined, the load (every worker tick)."""
        if self.balancer is not None:
            self.balancer.tick(state)
        elif self.table is not None and self.slot is not None:
            self.table.set_state(self.slot, state)
            self.table.beat(self.slot)

    # --- balancing ----------------------------------------------------------------------

    async def join(self, app: web.Application, server: web.Server) -> Balancer | None:
        """Start balancing (after the app's startup: its registry exists) unless it is off or
        there is no table: the balancer, the internal endpoint and the router. Returns the
        balancer, or None.

        Raises:
            RunDirError: ``<run dir>/peers`` exists and is not a private folder of this user.
        """
        from app.observability.metrics import METRICS
        from app.server.balance import Balancer
        from app.server.peers import PeerClient, internal_app, socket_path
        from app.server.router import Router
        from app.serving.state import REGISTRY, SETTINGS

        if self.table is None or self.slot is None or self.run_dir is None or not app[SETTINGS].balance:
            return None
        metrics = app.get(METRICS)
        label = str(self.pid)
        shed = metrics.connections_shed.labels(label) if metrics is not None else None
        on_shed = (lambda _pid: shed.inc()) if shed is not None else None
        balancer = Balancer(self.table, self.slot, lambda: len(server.connections), on_shed)
        registry = app[REGISTRY]
        registry.on_load = balancer.add_items
        self.balancer, self._app = balancer, app
        if metrics is not None:
            load_gauge = metrics.worker_load_items.labels(label)
            connections_gauge = metrics.worker_connections.labels(label)

            def gauges() -> None:
                load_gauge.set(balancer.items)
                connections_gauge.set(balancer.connections)

            balancer.on_tick = gauges
        path = socket_path(self.run_dir, self.pid)
        if len(str(path)) > _MAX_SOCKET_PATH:
            log.warning("run dir path too long for a Unix socket (%s): no scatter/gather", path)
            return balancer
        rundir.private_subdir(self.run_dir, path.parent.name)  # whoever can connect gives it work
        path.unlink(missing_ok=True)
        runner = web.AppRunner(internal_app(app), access_log=None)
        await runner.setup()
        await web.UnixSite(runner, str(path)).start()
        self._internal = runner
        self._peers = PeerClient(self.run_dir)

        def on_scatter(model: str, version: str, shards: int) -> None:
            if metrics is not None:
                metrics.scattered.labels(model, version).inc()
                metrics.forwarded_shards.labels(model, version).inc(shards)

        def on_forward(model: str, version: str) -> None:
            if metrics is not None:
                metrics.forwarded_requests.labels(model, version).inc()

        registry.spread = Router(balancer, self._peers, on_scatter=on_scatter, on_forward=on_forward)
        return balancer

    def shed_now(self, draining: bool) -> bool:
        """Whether the response being prepared should close its connection so that a less-loaded
        sibling takes it (never while draining, never without balancing)."""
        return not draining and self.balancer is not None and self.balancer.shed_now()

    async def close(self) -> None:
        """Stop routing, close the internal endpoint and the sessions to siblings; the slot
        stays claimed until :meth:`release`."""
        if self._app is not None:
            from app.serving.state import REGISTRY

            self._app[REGISTRY].spread = None
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
