"""The worker's state on the aiohttp application: two typed keys, :data:`CORE` (the serving
core) and :data:`SHEDDING` (the keep-alive side of balancing), and the hooks that run the core's
models and tracing with the app.

Handlers read ``request.app[CORE]`` (its registry, data plane, health, ...); the internal
endpoint and the gunicorn worker read the same key, and :func:`grpc_ctx` hands the core to the
gRPC front end. ``app.main.create_app`` puts the core and the shedding there and appends
:func:`models_ctx`, :func:`grpc_ctx` and :func:`tracing_ctx` to the app's ``cleanup_ctx`` and
:func:`on_shutdown` to its ``on_shutdown``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from aiohttp import web

from app.serving.core import ServingCore

__all__ = ["CORE", "SHEDDING", "NoShedding", "Shedding", "models_ctx", "on_shutdown", "tracing_ctx"]


class Shedding(Protocol):
    """Which keep-alive connection should move to a less-loaded sibling worker: a question of the
    transport (HTTP/1.1 connections are placed by the kernel and stay where they were accepted),
    asked by the keep-alive policy (``app.http.edge``) of every response. The gunicorn
    worker's is ``app.server.balance.WorkerConnections``."""

    def should_shed(self) -> bool:
        """Whether the response being prepared should close its connection (``Connection:
        close``) so that a less-loaded sibling takes the client's next one."""
        ...


class NoShedding:
    """No siblings: every connection stays."""

    def should_shed(self) -> bool:
        """Never."""
        return False


#: The worker's serving core (``app.serving.core``).
CORE = web.AppKey("core", ServingCore)
#: The worker's keep-alive shedding (:class:`Shedding`; :class:`NoShedding` without siblings).
SHEDDING: web.AppKey[Shedding] = web.AppKey("shedding")


async def models_ctx(app: web.Application) -> AsyncIterator[None]:
    """``cleanup_ctx``: the core's models from start to stop
    (:func:`app.serving.boot.serve_models`): startup returns once this worker may listen,
    with its models loading in the background; cleanup stops the units and frees the models."""
    from app.serving.boot import serve_models  # imports torch: not in the gunicorn master

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
