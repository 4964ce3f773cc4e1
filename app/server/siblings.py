"""A gunicorn worker among its siblings (the other workers of its server): what it hands the app
factory, one object per job, all made at once when the worker starts (:class:`Membership`).

- ``app.server.balance.WorkerConnections``, the transport's side: the listener asks it whether
  to accept now, the HTTP keep-alive policy whether a response should close its connection so
  that a less-loaded sibling takes the next one (``app.http.state.Shedding``).
- ``app.server.balance.WorkerBalancer``, the data plane's (``app.serving.siblings.Balancer``):
  this worker's load, published at every admission and completion, and the requests that leave
  it, handed to the :class:`~app.server.router.Router` (scatter/gather, forwarding of pinned
  requests).
- :class:`WorkerSiblings`, model control's, startup's and the statistics'
  (``app.serving.siblings.Siblings``): does another worker serve, a change applied on every
  sibling, their statistics, over their internal endpoints (:mod:`app.server.peers`).

Under them, this worker's slot in the load table (``app.server.balance.WorkerSlot``), from its
claim to its release. The internal endpoint, which serves this worker's core to its siblings,
exists once the app does (:meth:`Membership.serve_endpoint`).

With ``SCORING_BALANCE=0`` the slot still publishes state and load (siblings coordinate boot and
drain through them) and model control still reaches every sibling, but the worker accepts
whatever comes, sheds nothing and routes nothing. Without a run directory, or when the table
cannot be opened (a warning says so), the worker neither coordinates nor balances: its app gets
``app.serving.siblings.Alone`` and ``app.http.state.NoShedding``; nothing raises. Without room for
a Unix socket path (a run directory path too long), there is no internal endpoint: no
scatter/gather, no forwarding, no model control across workers (a warning says so).

Imported by the master with the worker class: no torch, nothing from ``app.serving`` at import
(the router and the peers' client, which need it, are imported when a :class:`Membership` is
made, in the worker).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.server import rundir
from app.server.balance import (
    LoadTable,
    WorkerBalancer,
    WorkerConnections,
    WorkerSlot,
    may_recycle,
    others_serving,
    replacement_booting,
)
from app.settings import PEER_KEEPALIVE_S

if TYPE_CHECKING:
    from app.observability.metrics import ServerMetrics
    from app.server.peers import InternalEndpoint, PeerClient
    from app.serving.core import ServingCore
    from app.serving.siblings import Balancer, Siblings

__all__ = ["Membership", "WorkerSiblings"]

log = logging.getLogger(__name__)

#: Longest path a Unix socket may have (sun_path, with its NUL).
_MAX_SOCKET_PATH = 107


class WorkerSiblings:
    """Model control's, startup's and the statistics' ``app.serving.siblings.Siblings``: the
    other workers as the load table lists them, reached through ``peers`` (None: no internal
    endpoints; nothing is sent)."""

    def __init__(self, slot: WorkerSlot, peers: PeerClient | None) -> None:
        self.slot = slot
        self.peers = peers

    def others_serving(self) -> bool:
        """Another worker accepts requests (:func:`app.server.balance.others_serving`). Reads
        /proc: off the loop."""
        return others_serving(self.slot.other_states())

    def _reachable(self) -> list[int]:
        """The pids of the siblings that tick and are not leaving, ready or not (one with no
        model ready must hear a model control change too, or it keeps its old state)."""
        now = time.monotonic()
        return [load.pid for load in self.slot.others() if load.reachable(now)]

    async def apply(self, action: str, name: str) -> dict[int, str]:
        """Send a model control change to every reachable sibling at once; pid -> why, for each
        that failed (``app.serving.control``)."""
        if self.peers is None:
            return {}
        pids = self._reachable()
        answers = await asyncio.gather(*(self.peers.control(pid, action, name) for pid in pids))
        return {pid: why for pid, why in zip(pids, answers, strict=True) if why is not None}

    async def statistics(self) -> list[list[dict[str, Any]]]:
        """Every reachable sibling's statistics, asked at once; those that did not answer in
        time (``app.server.peers.STATS_TIMEOUT_S``) left out."""
        if self.peers is None:
            return []
        answers = await asyncio.gather(*(self.peers.statistics(pid) for pid in self._reachable()))
        return [stats for stats in answers if stats is not None]


class Membership:
    """This worker among its siblings, made complete when the worker starts (module docstring).

    Args:
        run_dir: the server's run directory (``SCORING_RUN_DIR``); None: alone.
        pid: this worker's pid (its slot's owner).
        balancing: ``SCORING_BALANCE``.
        metrics: the worker's metrics (balancing gauges and counters); None when off.
        peer_keepalive_s: how long an idle connection to a sibling stays open
            (``SCORING_PEER_KEEPALIVE_S``).

    Attributes:
        slot: its slot in the load table; None when alone.
        connections: what its listener and keep-alive policy ask; None when alone.
        balancer, siblings: what its app factory gets (``app.serving.siblings``); None when
            alone (the app then stands alone).
    """

    def __init__(
        self,
        run_dir: str | Path | None,
        pid: int,
        balancing: bool = True,
        metrics: ServerMetrics | None = None,
        peer_keepalive_s: float = PEER_KEEPALIVE_S,
    ) -> None:
        self.run_dir = Path(run_dir) if run_dir else None
        self.pid = pid
        self.slot: WorkerSlot | None = None
        self.connections: WorkerConnections | None = None
        self.balancer: Balancer | None = None
        self.siblings: Siblings | None = None
        self._peers: PeerClient | None = None
        self._endpoint: InternalEndpoint | None = None
        if self.run_dir is None:
            return
        try:
            self.slot = slot = WorkerSlot(LoadTable(self.run_dir), pid, metrics)
        except (OSError, RuntimeError) as exc:
            log.warning("no load table in %s (%s): this worker does not balance", run_dir, exc)
            return
        # The serving layer (torch) only now, in the worker: the master imports this module.
        from app.server.peers import PeerClient, socket_path
        from app.server.router import Router

        path = socket_path(self.run_dir, pid)
        if len(str(path)) > _MAX_SOCKET_PATH:
            log.warning(
                "run dir path too long for a Unix socket (%s): no scatter/gather, no model control", path
            )
        else:
            self._peers = PeerClient(self.run_dir, peer_keepalive_s)
        route = None
        if balancing and self._peers is not None:
            route = Router(slot, self._peers, **_router_metrics(metrics)).route
        self.connections = WorkerConnections(slot, balancing, metrics)
        self.balancer = WorkerBalancer(slot, route)
        self.siblings = WorkerSiblings(slot, self._peers)

    def publish(self, state: int) -> None:
        """Publish this worker's state (``BOOTING`` ... ``STOPPING``) at once."""
        if self.slot is not None:
            self.slot.publish(state)

    def tick(self, state: int, connections: int) -> None:
        """Publish ``state``, the heartbeat, the load and the open ``connections`` (every tick)."""
        if self.slot is not None:
            self.slot.tick(state, connections)

    def replacement_booting(self) -> bool:
        """No other worker is ready and one still boots
        (:func:`app.server.balance.replacement_booting`); reads /proc: off the loop."""
        return self.slot is not None and replacement_booting(self.slot.other_states())

    def may_recycle(self) -> bool:
        """Another worker is ready, or there is none (:func:`app.server.balance.may_recycle`);
        reads /proc: off the loop."""
        return self.slot is None or may_recycle(self.slot.other_states())

    async def serve_endpoint(self, core: ServingCore) -> None:
        """Serve ``core`` to the siblings on this worker's internal endpoint (shards, model
        control, statistics), once the app has started; nothing without peers.

        Raises:
            RunDirError: ``<run dir>/peers`` exists and is not a private folder of this user.
        """
        if self._peers is None or self.run_dir is None:
            return
        from app.server.peers import InternalEndpoint

        rundir.private_subdir(self.run_dir, "peers")  # whoever can connect gives it work
        self._endpoint = await InternalEndpoint.start(core, self.run_dir, self.pid)
        log.info(
            "worker %d: internal endpoint listening on %s", self.pid, self._endpoint.path,
            extra={"event": "internal_endpoint_listening"},
        )  # fmt: skip

    async def close(self) -> None:
        """Close the internal endpoint and the sessions to siblings; the slot stays claimed until
        :meth:`release`."""
        if self._endpoint is not None:
            await self._endpoint.close()
            self._endpoint = None
        if self._peers is not None:
            await self._peers.close()

    def release(self) -> None:
        """Free the load table slot (at exit; idempotent)."""
        if self.slot is not None:
            self.slot.release()


def _router_metrics(metrics: ServerMetrics | None) -> dict[str, Any]:
    """The router's counters (``scoring_scattered_requests_total``,
    ``scoring_forwarded_shards_total``, ``scoring_forwarded_requests_total``); none when off."""
    if metrics is None:
        return {}

    def on_scatter(model: str, version: str, shards: int) -> None:
        metrics.scattered.labels(model, version).inc()
        metrics.forwarded_shards.labels(model, version).inc(shards)

    def on_forward(model: str, version: str) -> None:
        metrics.forwarded_requests.labels(model, version).inc()

    return {"on_scatter": on_scatter, "on_forward": on_forward}
