"""The serving core of one worker: one plain object holding what its serving needs, handed to
the front ends (HTTP, gRPC, the internal endpoint) and to the lifecycle, model control and the
watchdog. Nothing here knows aiohttp: the HTTP layer puts the core on its ``web.Application``
under one typed key (``app.http.state.CORE``) and starts and stops its models there.

``app.main.create_app`` builds it once per worker (:class:`ServingCore` then its
:class:`~app.serving.control.ModelControl`); the models load when the app starts
(:func:`app.serving.control.serve_models`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from app.binding import WorkerBinding
from app.protocols.tensors import RequestLimits
from app.serving.auth import ApiKeys
from app.serving.dataplane import DataPlane
from app.serving.registry import ModelRegistry, WorkerHealth
from app.serving.siblings import Siblings, Supervisor
from app.settings import Settings

if TYPE_CHECKING:  # model control imports torch; the request path needs none of it
    from app.observability.metrics import ServerMetrics
    from app.observability.tracing import Tracing
    from app.serving.control import ModelControl


@dataclass(eq=False)
class ServingCore:
    """What one worker serves with (module docstring).

    Attributes:
        settings: the worker's settings (``SCORING_*``).
        registry: the model versions it serves and their states (``app.serving.registry``).
        health: its liveness and its count of responses.
        limits: the caps a request body is decoded under (items, string bytes, JSON depth).
        siblings: the server's other workers (:class:`~app.serving.siblings.Alone` outside
            gunicorn).
        supervisor: what restarts this process (the gunicorn worker, or nothing).
        dataplane: the request path every front end calls (``app.serving.dataplane``).
        binding: where this worker is bound (GPU, slot) and the torch device its models use.
        metrics: the Prometheus metrics, or None when ``SCORING_METRICS_ENABLED`` is off.
        tracing: the OpenTelemetry tracing, or None when the ``OTEL_*`` variables set none.
        keys: the API keys every front end checks (``app.serving.auth``); None: no check.
        control: model control (load, reload, unload while serving); set by ``create_app``
            right after the core is made (it holds the core in turn).
        tasks: the lifecycle's background tasks (load retries, old units draining); cancelled
            when the models stop.
        load_task: the task loading the boot models (then reconciling, polling), from the start
            of the models until they stop; None before.
    """

    settings: Settings
    registry: ModelRegistry
    health: WorkerHealth
    limits: RequestLimits
    siblings: Siblings
    supervisor: Supervisor
    dataplane: DataPlane
    binding: WorkerBinding
    metrics: ServerMetrics | None = None
    tracing: Tracing | None = None
    keys: ApiKeys | None = None
    control: ModelControl = field(init=False)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    load_task: asyncio.Task[None] | None = None
