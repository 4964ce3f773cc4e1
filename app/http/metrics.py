"""The HTTP side of the metrics: a middleware that counts and times inference requests,
``GET /metrics``, and the ``cleanup_ctx`` that publishes this worker's binding and polls its
GPU. The metric definitions are in ``app.observability.metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CONTENT_TYPE_LATEST

from app.binding import BINDING
from app.errors import ScoringError
from app.observability.gpu import poll_gpus
from app.observability.metrics import METRICS
from app.serving.state import REGISTRY as MODELS
from app.serving.state import SETTINGS


def _inference_protocol(request: web.Request) -> str | None:
    """ "v1" or "v2" for a routed inference request, else None (health, metadata, /metrics)."""
    if request.method != "POST" or request.match_info.http_exception is not None:
        return None
    path = request.path
    if path.startswith("/v2/models/") and path.endswith("/infer"):
        return "v2"
    if path.startswith("/v1/models/") and path.endswith(":predict"):
        return "v1"
    return None


def _model_labels(request: web.Request) -> tuple[str, str]:
    """(model, version) of the request; ("", "") for a model this worker does not serve."""
    info = request.match_info
    try:
        config = request.app[MODELS].get(info["name"], info.get("version")).config
    except (ScoringError, KeyError):  # unknown, or unavailable: answered 404 / 503
        return "", ""
    return config.name, config.version


@web.middleware
async def metrics_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Count and time inference requests; sits outside the error middleware, so it sees
    the status the client gets."""
    protocol = _inference_protocol(request)
    if protocol is None:
        return await handler(request)
    model, version = _model_labels(request)
    recorded = request.app[METRICS].for_requests(model, version, protocol)
    recorded.in_flight.inc()
    start = time.perf_counter()
    code = 500
    try:
        response = await handler(request)
        code = response.status
        return response
    except web.HTTPException as exc:
        code = exc.status
        raise
    except asyncio.CancelledError:
        code = 499  # the client went away (nginx's code; nothing was sent)
        raise
    finally:
        recorded.answered(code, time.perf_counter() - start)


async def metrics_handler(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text format, the whole server's figures."""
    body = await asyncio.get_running_loop().run_in_executor(None, request.app[METRICS].render)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def gpu_metrics_ctx(app: web.Application) -> AsyncIterator[None]:
    """``cleanup_ctx``: publish the binding; poll the bound GPU through NVML (GPU mode only)."""
    metrics = app[METRICS]
    labels = app[BINDING].labels()
    metrics.set_binding(labels)
    task: asyncio.Task[None] | None = None
    if labels["gpu_uuid"]:
        task = asyncio.get_running_loop().create_task(
            poll_gpus(metrics, labels["gpu_uuid"], labels["gpu"], app[SETTINGS].gpu_metrics_interval_s),
            name="gpu-metrics",
        )
    try:
        yield
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
