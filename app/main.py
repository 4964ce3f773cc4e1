"""The composition root: one worker's serving core and its front ends.

Launch: ``gunicorn -c gunicorn.conf.py app.main:create_app`` (the factory is given without
parentheses). Under gunicorn our worker, ``app.server.worker.ScoringWebWorker``, builds the core
(:func:`build_core`, with its siblings, balancer and metrics, and itself as supervisor), asks
:func:`create_app` for the HTTP front end over it, and runs the core (``ServingCore.running``),
gRPC (``app.grpc.server.serving_grpc``), the HTTP app and its internal endpoint side by side.
In process (tests, ``python -m aiohttp.web``) :func:`create_app` alone builds the core and runs
it and gRPC as the HTTP app's cleanup contexts (:func:`standalone`). The front ends only read the
core; the core imports neither of them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from app.binding import WorkerBinding
from app.http.auth import authorizer
from app.http.edge import (
    edge_middleware,
    json_errors_protocol,
    parser_limits,
    quiet_parser_errors,
    setup_connections,
)
from app.http.extensions import routes as extension_routes
from app.http.inference import API_OF, inference_routes
from app.http.routes import metrics_handler, routes
from app.http.state import CORE, SHEDDING, NoShedding, Shedding, on_shutdown
from app.observability.gpu import gpu_metrics_ctx
from app.observability.looplag import loop_lag_ctx
from app.observability.metrics import ServerMetrics, create_metrics
from app.observability.tracing import setup as setup_tracing
from app.protocols.tensors import RequestLimits
from app.serving.auth import ApiKeys
from app.serving.control import ModelControl
from app.serving.core import ServingCore, WorkerHealth
from app.serving.dataplane import DataPlane
from app.serving.item_cache import response_cache
from app.serving.items import ItemStage, Stages
from app.serving.lifecycle import Lifecycle, resolve_device
from app.serving.registry import ModelRegistry
from app.serving.siblings import Alone, Balancer, Siblings, Supervisor
from app.serving.windows import WindowStage
from app.settings import Settings

__all__ = ["build_core", "create_app", "http_protocol", "standalone"]

#: The HTTP server's protocol for a connection the worker's listener accepted (aiohttp's, with
#: the parser's refusals answered in JSON: ``app.http.edge.json_errors_protocol``).
http_protocol = json_errors_protocol


def build_core(
    settings: Settings,
    *,
    siblings: Siblings | None = None,
    balancer: Balancer | None = None,
    supervisor: Supervisor | None = None,
    metrics: ServerMetrics | None = None,
    owns_process: bool = False,
) -> ServingCore:
    """One worker's serving core, complete (``app.serving.core``): its registry (filled when
    it runs), request limits, device and binding, response cache, item stages (windows, then the
    cache), data plane, lifecycle, model control, API keys and tracing (from the ``OTEL_*``
    variables; None when they set none).

    Args:
        settings: the worker's settings.
        siblings: the server's other workers (``app.server.siblings.WorkerSiblings`` under
            gunicorn with a load table); default :class:`~app.serving.siblings.Alone`.
        balancer: this worker's load and the requests that leave it
            (``app.server.balance.WorkerBalancer``); default: all run here.
        supervisor: what restarts this process (the gunicorn worker); default: nothing.
        metrics: this process's metrics; None when off.
        owns_process: the process is the worker's (``ServingCore.owns_process``).

    Raises:
        ModelLoadError: a CUDA device asked for where torch has none.
    """
    alone = Alone()
    tracing = setup_tracing()
    registry = ModelRegistry(strict=settings.strict_readiness)
    limits = RequestLimits(
        max_items=settings.max_items_per_request,
        max_string_bytes=settings.max_string_bytes,
        max_json_depth=settings.max_json_depth,
    )
    device = resolve_device(settings.device)
    binding = WorkerBinding.current(str(device))
    cache = response_cache(settings, binding.device, metrics, tracing)
    # windows first (nearest the client), then the cache: each window is one cached item
    items: ItemStage[Any] = WindowStage() if cache is None else Stages([WindowStage(), cache])
    siblings = siblings or alone
    plane = DataPlane(registry, settings, limits, siblings, tracing, items=items, balancer=balancer)
    lifecycle = Lifecycle(settings, registry, device, metrics, tracing)
    return ServingCore(
        settings=settings, registry=registry, health=WorkerHealth(), limits=limits, siblings=siblings,
        supervisor=supervisor or alone, dataplane=plane, binding=binding, lifecycle=lifecycle,
        control=ModelControl(lifecycle, siblings), metrics=metrics, tracing=tracing,
        keys=ApiKeys.from_settings(settings), cache=cache, owns_process=owns_process,
    )  # fmt: skip


async def create_app(
    settings: Settings | None = None,
    *,
    core: ServingCore | None = None,
    siblings: Siblings | None = None,
    balancer: Balancer | None = None,
    supervisor: Supervisor | None = None,
    shedding: Shedding | None = None,
    metrics: ServerMetrics | None = None,
) -> web.Application:
    """The HTTP front end (routes, the edge middleware, API keys, the keep-alive policy,
    ``/metrics`` with its GPU and loop-lag samplers) over ``core``; without one, over a core
    built here (:func:`build_core` with ``siblings``, ``balancer``, ``supervisor`` and
    ``metrics``) that the app itself runs, with gRPC (:func:`standalone`).

    Args:
        settings: defaults to ``core.settings``, else ``Settings()`` read from ``SCORING_*``.
        core: the worker's serving core, run by the caller (the gunicorn worker).
        shedding: which keep-alive connections move to a less-loaded sibling
            (``app.server.balance.WorkerConnections``); default: none move.
        metrics: this process's metrics, when its maker made them already (the gunicorn worker,
            whose balancing counts into them); default: made here when
            ``SCORING_METRICS_ENABLED``.

    Raises:
        pydantic.ValidationError: a setting has an invalid value.
        RuntimeError: ``PROMETHEUS_MULTIPROC_DIR`` was set after prometheus_client was imported.
    """
    settings = settings or (core.settings if core is not None else Settings())
    quiet_parser_errors()
    if core is not None:
        metrics = core.metrics
    elif metrics is None and settings.metrics_enabled:
        metrics = create_metrics()
    runs_core = core is None
    if core is None:
        core = build_core(
            settings, siblings=siblings, balancer=balancer, supervisor=supervisor, metrics=metrics
        )
    keys, tracing = core.keys, core.tracing
    authorize = None
    if keys is not None and keys.enabled:
        authorize = authorizer(keys, metrics_open=not settings.metrics_auth)
    app = web.Application(
        middlewares=[edge_middleware(settings, API_OF, authorize, metrics, tracing)],
        client_max_size=settings.max_request_bytes,
        handler_args=parser_limits(settings),
    )
    app[CORE] = core
    app[SHEDDING] = shedding or NoShedding()
    app.add_routes(inference_routes)  # the hot path first (aiohttp tries routes in order)
    app.add_routes(extension_routes)  # before routes: /v2/models/stats is not a model's metadata
    app.add_routes(routes)
    if metrics is not None:
        app.router.add_get("/metrics", metrics_handler)
        gpus = gpu_metrics_ctx(metrics, core.binding.labels(), settings.gpu_metrics_interval_s)
        app.cleanup_ctx.append(gpus)
        if settings.loop_lag_interval_ms > 0:
            app.cleanup_ctx.append(loop_lag_ctx(metrics.registry, settings.loop_lag_interval_ms / 1000))
    if runs_core:
        app.cleanup_ctx.append(standalone)
    app.on_shutdown.append(on_shutdown)
    setup_connections(app)
    return app


async def standalone(app: web.Application) -> AsyncIterator[None]:
    """``cleanup_ctx`` of an app that runs its own core (in process): the core
    (``ServingCore.running``: its startup returns once this worker may listen, its models
    loading), then gRPC beside it (``app.grpc.server.serving_grpc``); stopped in the reverse
    order, after the HTTP requests."""
    from app.grpc.server import serving_grpc  # imports grpc: not in the gunicorn master

    core = app[CORE]
    async with core.running(), serving_grpc(core):
        yield
