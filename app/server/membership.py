"""This worker's membership in the balancing among its siblings: its load table slot and its
cluster, from fork to exit.

The worker (:mod:`app.server.worker`) claims a slot in ``<run dir>/load``
(:mod:`app.server.loadtable`) at fork, joins the cluster (:mod:`app.server.cluster`: balancer,
internal endpoint, scatter/gather) once its app is set up, publishes its state and load every
tick and frees the slot at exit. Without a run directory, when the table cannot be opened, or
with balancing off (``SCORING_BALANCE``) the worker does not balance; it still counts the items
it answers. Imported by the master with the worker class: no torch (``app.server.cluster``,
which imports the serving layer, is imported lazily in :meth:`Membership.join`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from aiohttp import web

from app.server import loadtable

if TYPE_CHECKING:
    from app.server.balance import Balancer
    from app.server.cluster import Cluster

__all__ = ["Membership"]

log = logging.getLogger(__name__)


class Membership:
    """One worker's slot in the load table and, once joined, its :class:`~app.server.cluster.Cluster`.

    Args:
        run_dir: the server's run directory (``SCORING_RUN_DIR``); None or "": no balancing.
        pid: this worker's pid (the slot's owner).

    A table that cannot be opened or claimed (OSError, RuntimeError when full) is logged as a
    warning and leaves the worker out of balancing; nothing raises.
    """

    def __init__(self, run_dir: str | None, pid: int) -> None:
        self.run_dir = run_dir
        self.pid = pid
        self.table: loadtable.LoadTable | None = None
        self.slot: int | None = None
        self.cluster: Cluster | None = None
        if run_dir:
            try:
                table = loadtable.LoadTable(run_dir)
                self.slot = table.claim(pid)
                self.table = table
            except (OSError, RuntimeError) as exc:
                log.warning("no load table in %s (%s): this worker does not balance", run_dir, exc)

    @property
    def balancer(self) -> Balancer | None:
        """The cluster's balancer once joined (accept / shed decisions); None without balancing."""
        return self.cluster.balancer if self.cluster is not None else None

    async def join(self, app: web.Application, server: web.Server) -> Balancer | None:
        """Join the cluster (after the app's startup: its registry exists) when the worker
        balances. Returns the balancer, or None."""
        from app.server.cluster import Cluster, enabled

        if self.table is None or self.slot is None or not self.run_dir or not enabled(app):
            return None
        cluster = Cluster(app, server, self.table, self.slot, self.run_dir)
        await cluster.start()
        self.cluster = cluster
        return cluster.balancer

    def tick(self, state: int) -> None:
        """Publish ``state`` (``loadtable.BOOTING``/``READY``/``DRAINING``), the heartbeat and,
        when joined, the load."""
        if self.cluster is not None:
            self.cluster.tick(state)
        elif self.table is not None and self.slot is not None:
            self.table.set_state(self.slot, state)
            self.table.beat(self.slot)

    def draining(self) -> None:
        """Publish ``DRAINING`` at once (the drain began; siblings stop sending work here)."""
        if self.table is not None and self.slot is not None:
            self.table.set_state(self.slot, loadtable.DRAINING)

    def shed_now(self, draining: bool) -> bool:
        """Whether the response being prepared should close its connection so that a less-loaded
        sibling takes it (never while draining, never without balancing)."""
        return self.cluster is not None and self.cluster.shed_now(draining)

    async def close(self) -> None:
        """Leave the cluster (internal endpoint, sessions to siblings); the slot stays claimed."""
        if self.cluster is not None:
            await self.cluster.close()

    def release(self) -> None:
        """Free the load table slot (at exit; idempotent)."""
        if self.table is not None and self.slot is not None:
            self.table.release(self.slot, self.pid)
            self.slot = None
