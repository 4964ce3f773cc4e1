"""The async app factory that the gunicorn worker calls.

Launch: ``gunicorn -c gunicorn.conf.py app.main:create_app`` (the factory is given without
parentheses; our worker, ``app.server.worker.ScoringWebWorker``, awaits it in each worker process
with its siblings, balancer, shedding and metrics, and itself as supervisor).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from app.binding import WorkerBinding
from app.http.auth import authorizer
from app.http.edge import edge_middleware, setup_connections
from app.http.extensions import routes as extension_routes
from app.http.inference import API_OF, inference_routes
from app.http.limits import parser_limits, quiet_parser_errors
from app.http.routes import metrics_handler, routes
from app.http.state import (
    CORE,
    SHEDDING,
    NoShedding,
    Shedding,
    grpc_ctx,
    models_ctx,
    on_shutdown,
    tracing_ctx,
)
from app.observability.gpu import gpu_metrics_ctx
from app.observability.looplag import loop_lag_ctx
from app.observability.metrics import ServerMetrics, create_metrics
from app.observability.tracing import Tracing
from app.observability.tracing import setup as setup_tracing
from app.protocols.tensors import RequestLimits
from app.serving.auth import ApiKeys
from app.serving.control import ModelControl
from app.serving.core import ServingCore, WorkerHealth
from app.serving.dataplane import DataPlane
from app.serving.item_cache import ItemCache
from app.serving.items import ItemStage, Stages
from app.serving.lifecycle import Lifecycle, resolve_device
from app.serving.redis_tier import RedisTier
from app.serving.registry import ModelRegistry
from app.serving.response_cache import ResponseCache
from app.serving.siblings import Alone, Balancer, Siblings, Supervisor
from app.serving.windows import WindowStage
from app.settings import Settings


async def create_app(
    settings: Settings | None = None,
    *,
    siblings: Siblings | None = None,
    balancer: Balancer | None = None,
    supervisor: Supervisor | None = None,
    shedding: Shedding | None = None,
    metrics: ServerMetrics | None = None,
) -> web.Application:
    """Build the aiohttp application: routes, the edge middleware, API keys, keep-alive policy,
    metrics, the serving core (its models load when the app starts), gRPC.

    Args:
        settings: defaults to ``Settings()`` read from ``SCORING_*`` env vars.
        siblings: the server's other workers (``app.server.siblings.WorkerSiblings`` under
            gunicorn with a load table); default :class:`~app.serving.siblings.Alone`.
        balancer: this worker's load and the requests that leave it
            (``app.server.balance.WorkerBalancer``); default: ``Alone`` (all run here).
        supervisor: what restarts this process (the gunicorn worker); default: nothing.
        shedding: which keep-alive connections move to a less-loaded sibling
            (``app.server.balance.WorkerConnections``); default: none move.
        metrics: this process's metrics, when its maker made them already (the gunicorn worker,
            whose balancing counts into them); default: made here when
            ``SCORING_METRICS_ENABLED``.

    Raises:
        pydantic.ValidationError: a setting has an invalid value.
        RuntimeError: ``PROMETHEUS_MULTIPROC_DIR`` was set after prometheus_client was imported.
    """
    settings = settings or Settings()
    alone = Alone()
    tracing = setup_tracing()  # before the Application: its instrumentation adds a middleware
    quiet_parser_errors()
    keys = ApiKeys.from_settings(settings)
    authorize = authorizer(keys, metrics_open=not settings.metrics_auth) if keys.enabled else None
    if metrics is None and settings.metrics_enabled:
        metrics = create_metrics()
    app = web.Application(
        middlewares=[edge_middleware(settings, API_OF, authorize, metrics, tracing)],
        client_max_size=settings.max_request_bytes,
        handler_args=parser_limits(settings),
    )
    registry = ModelRegistry(strict=settings.strict_readiness)  # filled when the models start
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
    core = ServingCore(
        settings=settings, registry=registry, health=WorkerHealth(), limits=limits, siblings=siblings,
        supervisor=supervisor or alone, dataplane=plane, binding=binding, lifecycle=lifecycle,
        control=ModelControl(lifecycle, siblings), metrics=metrics, tracing=tracing, keys=keys,
    )  # fmt: skip
    app[CORE] = core
    app[SHEDDING] = shedding or NoShedding()
    if tracing is not None:
        app.cleanup_ctx.append(tracing_ctx)  # first: its cleanup runs last, after the requests
    app.add_routes(inference_routes)  # the hot path first (aiohttp tries routes in order)
    app.add_routes(extension_routes)  # before routes: /v2/models/stats is not a model's metadata
    app.add_routes(routes)
    if metrics is not None:
        app.router.add_get("/metrics", metrics_handler)
        app.cleanup_ctx.append(gpu_metrics_ctx(metrics, binding.labels(), settings.gpu_metrics_interval_s))
        if settings.loop_lag_interval_ms > 0:
            app.cleanup_ctx.append(loop_lag_ctx(metrics.registry, settings.loop_lag_interval_ms / 1000))
    if cache is not None:
        app.cleanup_ctx.append(cache_ctx(cache))  # before models_ctx: cleaned up after the models stop
    app.cleanup_ctx.append(models_ctx)
    app.cleanup_ctx.append(grpc_ctx)  # after models_ctx: starts once it listens, stops first
    app.on_shutdown.append(on_shutdown)
    setup_connections(app)
    return app


def response_cache(
    settings: Settings, device: str, metrics: ServerMetrics | None, tracing: Tracing | None
) -> ItemCache | None:
    """The host's response cache as this worker sees it: at ``response_cache_path``, else in the
    run directory, with the Redis tier where ``response_cache_redis_url`` names one; None where
    no path is set (in-process, without a path)."""
    folder = settings.response_cache_path
    if folder is None and settings.run_dir is not None:
        folder = settings.run_dir / "response-cache"
    if folder is None:
        return None
    store = ResponseCache(folder, settings.response_cache_bytes, settings.response_cache_ttl_s)
    shared = None
    if settings.response_cache_redis_url:
        shared = RedisTier(
            settings.response_cache_redis_url,
            settings.response_cache_redis_timeout_ms / 1000.0,
            settings.response_cache_ttl_s,
        )
    lookup_timeout_s = settings.response_cache_lookup_timeout_ms / 1000.0
    return ItemCache(store, device, metrics, tracing, shared, lookup_timeout_s=lookup_timeout_s)


def cache_ctx(cache: ItemCache) -> Callable[[web.Application], AsyncIterator[None]]:
    """``cleanup_ctx`` of the response cache: on cleanup (after the requests), what is queued is
    written (at most 2 s) and its threads stop."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(cache.close, 2.0)

    return ctx
