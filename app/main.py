"""The async app factory that gunicorn's aiohttp worker calls.

Launch: ``gunicorn -c gunicorn.conf.py app.main:create_app`` (the factory is
given without parentheses; aiohttp's worker awaits it in each worker process).
"""

from __future__ import annotations

from aiohttp import web

from app.lifecycle import models_ctx, on_shutdown, resolve_device
from app.metrics import METRICS, create_metrics, gpu_metrics_ctx, metrics_handler, metrics_middleware
from app.middleware import error_middleware
from app.routes import routes, worker_info
from app.settings import Settings
from app.state import SETTINGS, WORKER_INFO


async def create_app(settings: Settings | None = None) -> web.Application:
    """Build the aiohttp application: routes, metrics, error middleware, model lifecycle.

    Args:
        settings: defaults to ``Settings()`` read from ``SCORING_*`` env vars.

    Raises:
        pydantic.ValidationError: a setting has an invalid value.
        RuntimeError: ``PROMETHEUS_MULTIPROC_DIR`` was set after prometheus_client was imported.
    """
    settings = settings or Settings()
    # The metrics middleware is outermost: it sees the status the error middleware chose.
    middlewares = [metrics_middleware, error_middleware] if settings.metrics_enabled else [error_middleware]
    app = web.Application(middlewares=middlewares, client_max_size=settings.max_request_bytes)
    app[SETTINGS] = settings
    app[WORKER_INFO] = worker_info(str(resolve_device(settings.device)))
    app.add_routes(routes)
    if settings.metrics_enabled:
        app[METRICS] = create_metrics()
        app.router.add_get("/metrics", metrics_handler)
        app.cleanup_ctx.append(gpu_metrics_ctx)
    app.cleanup_ctx.append(models_ctx)
    app.on_shutdown.append(on_shutdown)
    return app
