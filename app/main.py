"""The async app factory that gunicorn's aiohttp worker calls.

Launch: ``gunicorn -c gunicorn.conf.py app.main:create_app`` (the factory is
given without parentheses; aiohttp's worker awaits it in each worker process).
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Middleware

from app.binding import BINDING, WorkerBinding
from app.grpc.server import grpc_ctx
from app.http.auth import API_KEYS, ApiKeys, authorizer
from app.http.connections import setup_connections
from app.http.extensions import routes as extension_routes
from app.http.limits import limits_middleware, parser_limits, quiet_parser_errors
from app.http.metrics import gpu_metrics_ctx, metrics_handler, metrics_middleware
from app.http.middleware import error_middleware
from app.http.routes import inference_routes, routes
from app.observability.metrics import METRICS, create_metrics
from app.protocols.limits import RequestLimits
from app.serving.dataplane import DATAPLANE, DataPlane
from app.serving.lifecycle import models_ctx, on_shutdown, resolve_device
from app.serving.state import (
    LIFECYCLE,
    LIMITS,
    REGISTRY,
    SETTINGS,
    ModelRegistry,
    WorkerLifecycle,
)
from app.settings import Settings


async def create_app(settings: Settings | None = None) -> web.Application:
    """Build the aiohttp application: routes, metrics, error middleware, limits, API keys,
    keep-alive policy, model lifecycle.

    Args:
        settings: defaults to ``Settings()`` read from ``SCORING_*`` env vars.

    Raises:
        pydantic.ValidationError: a setting has an invalid value.
        RuntimeError: ``PROMETHEUS_MULTIPROC_DIR`` was set after prometheus_client was imported.
    """
    settings = settings or Settings()
    quiet_parser_errors()
    # Outermost first: metrics see the status the error middleware chose; the error
    # middleware renders what the edge's checks raise (headers, API key, body, early refusal).
    middlewares: list[Middleware] = [error_middleware]
    if settings.metrics_enabled:
        middlewares.insert(0, metrics_middleware)
    keys = ApiKeys.from_settings(settings)
    authorize = authorizer(keys, metrics_open=not settings.metrics_auth) if keys.enabled else None
    middlewares.append(limits_middleware(settings, authorize))
    app = web.Application(
        middlewares=middlewares,
        client_max_size=settings.max_request_bytes,
        handler_args=parser_limits(settings),
    )
    app[SETTINGS] = settings
    app[LIFECYCLE] = WorkerLifecycle()
    app[REGISTRY] = ModelRegistry()  # filled from the repository by models_ctx at startup
    app[API_KEYS] = keys
    app[LIMITS] = RequestLimits(
        max_items=settings.max_items_per_request,
        max_string_bytes=settings.max_string_bytes,
        max_json_depth=settings.max_json_depth,
    )
    app[DATAPLANE] = DataPlane(app[REGISTRY], settings, app[LIMITS])
    app[BINDING] = WorkerBinding.current(str(resolve_device(settings.device)))
    app.add_routes(inference_routes)  # the hot path first (aiohttp tries routes in order)
    app.add_routes(extension_routes)  # before routes: /v2/models/stats is not a model's metadata
    app.add_routes(routes)
    if settings.metrics_enabled:
        app[METRICS] = create_metrics()
        app.router.add_get("/metrics", metrics_handler)
        app.cleanup_ctx.append(gpu_metrics_ctx)
    app.cleanup_ctx.append(models_ctx)
    app.cleanup_ctx.append(grpc_ctx)  # after models_ctx: starts once it listens, stops first
    app.on_shutdown.append(on_shutdown)
    setup_connections(app)
    return app
