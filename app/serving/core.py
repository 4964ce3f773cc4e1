"""The serving core of one worker: one plain object holding what its serving needs, handed to
the front ends (HTTP, gRPC, the internal endpoint), to the watchdog and to the run of its models
(``app.serving.boot``), and run as its own async context (:meth:`ServingCore.running`: its
models, its response cache, its tracing). Nothing here knows aiohttp or gRPC: the front ends
are the core's peers, started beside it by whoever runs it (the gunicorn worker,
``app.server.worker``; in process, ``app.main.create_app``).

``app.main.build_core`` builds it once per worker, complete: its lifecycle
(:class:`~app.serving.lifecycle.Lifecycle`) and model control
(:class:`~app.serving.control.ModelControl`) are made first, from the registry, the settings and
the siblings, and handed to it; neither knows the core.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.binding import WorkerBinding
from app.protocols.tensors import RequestLimits
from app.serving.auth import ApiKeys
from app.serving.dataplane import DataPlane
from app.serving.registry import ModelRegistry
from app.serving.siblings import Siblings, Supervisor
from app.settings import Settings

if TYPE_CHECKING:  # the lifecycle imports torch; the request path needs none of it
    from app.observability.metrics import ServerMetrics
    from app.observability.tracing import Tracing
    from app.serving.control import ModelControl
    from app.serving.item_cache import ItemCache
    from app.serving.lifecycle import Lifecycle


@dataclass(eq=False)
class WorkerHealth:
    """This worker's liveness and its count of responses (``max_requests`` recycling)."""

    responses: int = 0
    #: Why an inference thread is considered stuck (liveness turns 503), or None.
    hung: str | None = None
    #: Passes the hung-inference watchdog has made over the units.
    watchdog_passes: int = 0


@dataclass(eq=False)
class ServingCore:
    """What one worker serves with (module docstring).

    Attributes:
        settings: the worker's settings (``SCORING_*``).
        registry: the model versions it serves and their states (``app.serving.registry``).
        health: its liveness and its count of responses.
        limits: the caps a request body is decoded under (items, string bytes, JSON depth).
        siblings: the server's other workers, as model control, startup and the statistics
            see them (:class:`~app.serving.siblings.Alone` outside gunicorn).
        supervisor: what restarts this process (the gunicorn worker, or nothing).
        dataplane: the request path every front end calls (``app.serving.dataplane``).
        binding: where this worker is bound (GPU, slot) and the torch device its models use.
        lifecycle: what loads, swaps and frees its model versions (``app.serving.lifecycle``).
        control: model control (load, reload, unload while serving; ``app.serving.control``).
        metrics: the Prometheus metrics, or None when ``SCORING_METRICS_ENABLED`` is off.
        tracing: the OpenTelemetry tracing, or None when the ``OTEL_*`` variables set none.
        keys: the API keys every front end checks (``app.serving.auth``); None: no check.
        cache: the response cache's item stage (``app.serving.item_cache``), None without one.
        owns_process: the process is this worker's (the gunicorn worker): its collector is set
            for serving (``app.serving.boot.collect_less``) and the stop frees the models with
            one collection; False in another program's process (tests, ``python -m
            aiohttp.web``), whose collector is left as it is.
    """

    settings: Settings
    registry: ModelRegistry
    health: WorkerHealth
    limits: RequestLimits
    siblings: Siblings
    supervisor: Supervisor
    dataplane: DataPlane
    binding: WorkerBinding
    lifecycle: Lifecycle
    control: ModelControl
    metrics: ServerMetrics | None = None
    tracing: Tracing | None = None
    keys: ApiKeys | None = None
    cache: ItemCache | None = None
    owns_process: bool = False

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[ServingCore]:
        """The core from start to stop: its models load (in the background) and it enters once
        this worker may listen (:func:`app.serving.boot.serve_models`); on exit the units stop
        and the models are freed, then what the response cache has queued is written (at most
        2 s) and its threads stop, then tracing flushes and stops.

        Raises:
            ModelLoadError: the repository cannot be scanned.
        """
        from app.serving.boot import serve_models  # imports torch: not in the gunicorn master

        try:
            async with serve_models(self):
                yield self
        finally:
            if self.cache is not None:
                await asyncio.to_thread(self.cache.close, 2.0)
            if self.tracing is not None:
                self.tracing.close()
