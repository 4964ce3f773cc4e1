"""This worker's part among its siblings: load publishing, balancing hooks, shard endpoint.

Created by the worker (:mod:`app.server.worker`) once the app is set up, before it listens;
imported lazily there (it imports the serving layer, hence torch). It wires:

- the load table slot and :class:`app.server.balance.Balancer` into the app's registry
  (``on_load``: items queued + in flight) and the worker's listener (accept / shed);
- the internal endpoint (:mod:`app.server.peers`) on ``<run dir>/peers/<pid>.sock`` and
  scatter/gather of large requests (:mod:`app.server.scatter`, ``registry.spread``) and
  forwarding of requests on pinned gRPC connections (:mod:`app.server.forward`);
- the balancing metrics (``scoring_worker_*``, ``scoring_connections_shed_total``,
  ``scoring_scattered_requests_total``, ``scoring_forwarded_shards_total``,
  ``scoring_forwarded_requests_total``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from aiohttp import web

from app.observability.metrics import METRICS
from app.server import loadtable
from app.server.balance import Balancer
from app.server.forward import Forwarder
from app.server.peers import PEERS_DIR, PeerClient, internal_app, socket_path
from app.server.scatter import Scatter
from app.serving.state import REGISTRY, SETTINGS

log = logging.getLogger(__name__)

#: Longest path a Unix socket may have (sun_path, with its NUL).
_MAX_SOCKET_PATH = 107


class Cluster:
    """The balancing side of one worker.

    Args:
        app: the worker's app (set up: its registry exists).
        server: the app's ``web.Server`` (its open connections are counted).
        table: the run directory's load table; slot: this worker's slot in it.
        run_dir: the run directory.
    """

    def __init__(
        self, app: web.Application, server: web.Server, table: loadtable.LoadTable, slot: int, run_dir: str
    ) -> None:
        self.app = app
        self.run_dir = Path(run_dir)
        self.pid = os.getpid()
        metrics = app.get(METRICS)
        label = str(self.pid)
        self._metrics = metrics
        shed = metrics.connections_shed.labels(label) if metrics is not None else None
        self.balancer = Balancer(
            table,
            slot,
            lambda: len(server.connections),
            (lambda _pid: shed.inc()) if shed is not None else None,
        )
        registry = app[REGISTRY]
        registry.on_load = self.balancer.add_items
        self.peers = PeerClient(self.run_dir)
        self._internal: web.AppRunner | None = None
        self._load_gauge = metrics.worker_load_items.labels(label) if metrics is not None else None
        self._connections_gauge = metrics.worker_connections.labels(label) if metrics is not None else None

    async def start(self) -> None:
        """Serve the internal endpoint and turn scatter/gather on (when the socket path fits)."""
        path = socket_path(self.run_dir, self.pid)
        if len(str(path)) > _MAX_SOCKET_PATH:
            log.warning("run dir path too long for a Unix socket (%s): no scatter/gather", path)
            return
        path.parent.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.run_dir / PEERS_DIR, 0o700)  # the endpoint trusts whoever can connect
        path.unlink(missing_ok=True)
        runner = web.AppRunner(internal_app(self.app), access_log=None)
        await runner.setup()
        await web.UnixSite(runner, str(path)).start()
        self._internal = runner
        metrics = self._metrics

        def on_scatter(model: str, version: str, shards: int) -> None:
            if metrics is not None:
                metrics.scattered.labels(model, version).inc()
                metrics.forwarded_shards.labels(model, version).inc(shards)

        def on_forward(model: str, version: str) -> None:
            if metrics is not None:
                metrics.forwarded_requests.labels(model, version).inc()

        forwarder = Forwarder(self.balancer, self.peers, on_forward)
        self.app[REGISTRY].spread = Scatter(self.balancer, self.peers, on_scatter, forwarder)

    def tick(self, state: int) -> None:
        """Publish state, heartbeat and load (the worker's tick)."""
        self.balancer.tick(state)
        if self._load_gauge is not None and self._connections_gauge is not None:
            self._load_gauge.set(self.balancer.items)
            self._connections_gauge.set(self.balancer.connections)

    def shed_now(self, draining: bool) -> bool:
        """Whether the response being prepared should close its connection."""
        return not draining and self.balancer.shed_now()

    async def close(self) -> None:
        """Stop scattering, close the internal endpoint and the sessions to siblings."""
        self.app[REGISTRY].spread = None
        if self._internal is not None:
            await self._internal.cleanup()
            self._internal = None
        socket_path(self.run_dir, self.pid).unlink(missing_ok=True)
        await self.peers.close()


def enabled(app: web.Application) -> bool:
    """Whether balancing is on (``SCORING_BALANCE``)."""
    return bool(app[SETTINGS].balance)
