"""The worker's serving core on the aiohttp application: one typed key, :data:`CORE`, and the
hooks that run the core's models and tracing with the app.

Handlers read ``request.app[CORE]`` (its registry, data plane, health, ...); the internal
endpoint and the gunicorn worker read the same key, and :func:`grpc_ctx` hands the core to the
gRPC front end. ``app.main.create_app`` puts the core there and appends :func:`models_ctx`,
:func:`grpc_ctx` and :func:`tracing_ctx` to the app's ``cleanup_ctx`` and :func:`on_shutdown` to
its ``on_shutdown``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from app.serving.core import ServingCore

__all__ = ["CORE", "models_ctx", "on_shutdown", "tracing_ctx"]

#: The worker's serving core (``app.serving.core``).
CORE = web.AppKey("core", ServingCore)


async def models_ctx(app: web.Application) -> AsyncIterator[None]:
    """``cleanup_ctx``: the core's models from start to stop
    (:func:`app.serving.control.serve_models`): startup returns once this worker may listen,
    with its models loading in the background; cleanup stops the units and frees the models."""
    from app.serving.control import serve_models  # imports torch: not in the gunicorn master

    async with serve_models(app[CORE]):
        yield


async def grpc_ctx(app: web.Application) -> AsyncIterator[None]:
    """``cleanup_ctx``: the core's gRPC front end (:func:`app.grpc.server.serving_grpc`), started
    after the models' context (so a worker that waits for its models before listening does so
    for gRPC too) and stopped before it."""
    from app.grpc.server import serving_grpc  # imports grpc: not in the gunicorn master

    async with serving_grpc(app[CORE]):
        yield


async def tracing_ctx(app: web.Application) -> AsyncIterator[None]:
    """``cleanup_ctx`` of an app whose core has tracing: on cleanup, flush and stop it."""
    yield
    tracing = app[CORE].tracing
    if tracing is not None:
        tracing.close()


async def on_shutdown(app: web.Application) -> None:
    """Turn readiness 503 when the app shuts down (under gunicorn the worker did it earlier,
    at SIGTERM, before its listener closed)."""
    app[CORE].registry.begin_drain("shutdown")
