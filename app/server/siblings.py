"""This worker among its siblings, from fork to exit: one object (:class:`Membership`).

- **Its slot** in ``<run dir>/load`` (:mod:`app.server.balance`), claimed by
  ``gunicorn.conf.py``'s ``post_fork`` (state ``BINDING``) and kept by the worker: its state,
  load and heartbeat, published every tick; freed at exit.
- **Its balancer** (:class:`app.server.balance.Balancer`), made at once, so that the worker
  hands it to the app factory as the data plane's ``Siblings``: the load published at every
  admission and completion, the accept and shed decisions.
- **Coordination** of boot, drain and recycling through the siblings' states (a new worker
  listens once warm while another serves; a draining worker holds while a replacement boots;
  a worker recycles only while another is ready).
- **The internal endpoint** (:mod:`app.server.peers`, ``<run dir>/peers/<pid>.sock``), once the
  worker's app is set up (:meth:`Membership.join`): model control changes from siblings, and
  unless ``SCORING_BALANCE=0`` the :class:`~app.server.router.Router` (scatter/gather of large
  requests, forwarding of requests on pinned gRPC connections) and the balancing metrics
  (``scoring_worker_*``, ``scoring_connections_shed_total``, ``scoring_scattered_requests_total``,
  ``scoring_forwarded_shards_total``, ``scoring_forwarded_requests_total``).

Without a run directory, or when the table cannot be opened, the worker neither coordinates
nor balances (a warning says so) and its app gets no siblings; nothing raises. Imported by the
master with the worker class: no torch (the serving layer is imported lazily in :meth:`join`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from app.server import balance, rundir

if TYPE_CHECKING:
    from app.server.peers import PeerClient

__all__ = ["Membership"]

log = logging.getLogger(__name__)

#: Longest path a Unix socket may have (sun_path, with its NUL).
_MAX_SOCKET_PATH = 107


class Membership:
    """One worker's slot in the load table, its balancer and, once joined, its routing.

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
        self.balancer: balance.Balancer | None = None
        self._peers: PeerClient | None = None
        self._internal: web.AppRunner | None = None
        if self.run_dir is not None:
            try:
                table = balance.LoadTable(self.run_dir)
                self.slot = table.claim(pid)  # kept when post_fork claimed it already
                self.table = table
                self.balancer = balance.Balancer(table, self.slot, pid, balancing=balancing)
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
        if self.balancer is not None:
            self.balancer.tick(state)

    # --- routing --------------------------------------------------------------------------

    async def join(self, app: web.Application, server: web.Server) -> None:
        """Once the app has started: count the server's connections, serve the internal endpoint
        (model control, shards), and unless balancing is off route through a router.

        Raises:
            RunDirError: ``<run dir>/peers`` exists and is not a private folder of this user.
        """
        from app.http.state import CORE
        from app.server.peers import PeerClient, internal_app, socket_path
        from app.server.router import Router

        balancer = self.balancer
        if balancer is None or self.run_dir is None:
            return
        core = app[CORE]
        metrics = core.metrics
        label = str(self.pid)
        if metrics is not None:
            shed = metrics.connections_shed.labels(label)
            balancer.on_shed = lambda _pid: shed.inc()
            load_gauge = metrics.worker_load_items.labels(label)
            connections_gauge = metrics.worker_connections.labels(label)

            def gauges() -> None:
                load_gauge.set(balancer.items)
                connections_gauge.set(balancer.connections)

            balancer.on_tick = gauges
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
            balancer.control = peers.control

            def on_scatter(model: str, version: str, shards: int) -> None:
                if metrics is not None:
                    metrics.scattered.labels(model, version).inc()
                    metrics.forwarded_shards.labels(model, version).inc(shards)

            def on_forward(model: str, version: str) -> None:
                if metrics is not None:
                    metrics.forwarded_requests.labels(model, version).inc()

            if balancer.balancing:
                router = Router(balancer, peers, on_scatter=on_scatter, on_forward=on_forward)
        balancer.attach(lambda: len(server.connections), router)

    async def close(self) -> None:
        """Stop routing, close the internal endpoint and the sessions to siblings; the slot
        stays claimed until :meth:`release`."""
        if self.balancer is not None:
            self.balancer.router = self.balancer.control = None
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
