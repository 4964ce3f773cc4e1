"""The HTTP routes besides inference: the Open Inference Protocol's (V2) server and model
metadata, liveness and readiness, KServe V1's liveness and model list, the OpenAPI document and
``/metrics``. The inference routes, and the one path they take, are ``app.http.inference``'s.
"""

from __future__ import annotations

import asyncio
from importlib import resources
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from app import SERVER_NAME, __version__
from app.http.state import CORE
from app.protocols import triton, v2
from app.serving.registry import ModelRegistry, ModelVersion

#: The OpenAPI 3 description of this API (``GET /openapi.json``), shipped in the package.
OPENAPI = resources.files("app").joinpath("openapi.json").read_bytes()

routes = web.RouteTableDef()


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


# --- Open Inference Protocol (KServe V2) ---------------------------------------------


@routes.get("/v2")
async def server_metadata(request: web.Request) -> web.Response:
    """``GET /v2``: server name, version, extensions, and this worker's binding."""
    return _json(
        {
            "name": SERVER_NAME,
            "version": __version__,
            "extensions": triton.EXTENSIONS,
            "worker": request.app[CORE].binding.describe(),
        }
    )


@routes.get("/v2/health/live")
async def live(request: web.Request) -> web.Response:
    """Liveness: 200 while the worker's event loop answers; 503 once its inference thread is
    stuck (the worker is then restarting itself)."""
    hung = request.app[CORE].health.hung
    if hung is not None:
        return _json({"live": False, "error": f"inference thread stuck: {hung}"}, 503)
    return _json({"live": True})


@routes.get("/v2/health/ready")
async def ready(request: web.Request) -> web.Response:
    """Readiness: 200 once every model that can load is warm (every model with
    ``SCORING_STRICT_READINESS``); 503 while loading or draining. Models that cannot be served
    are listed under ``unavailable`` with their reason."""
    registry = request.app[CORE].registry
    body: dict[str, Any] = {"ready": registry.ready}
    failures = registry.failures()
    if failures:
        body["unavailable"] = failures
    return _json(body, 200 if registry.ready else 503)


@routes.get("/v2/models/{name}")
@routes.get("/v2/models/{name}/versions/{version}")
async def model_metadata(request: web.Request) -> web.Response:
    """Model metadata: name, versions, platform, inputs/outputs with -1 batch dims."""
    entry = request.app[CORE].registry.get(request.match_info["name"], request.match_info.get("version"))
    return _json(v2.model_metadata(entry.config))


def _model_readiness(registry: ModelRegistry, entry: ModelVersion) -> web.Response:
    """``{"name", "ready"}``: 200 when the model is warm and the worker not draining, else 503."""
    is_ready = entry.ready and not registry.draining
    return _json({"name": entry.config.name, "ready": is_ready}, 200 if is_ready else 503)


@routes.get("/v2/models/{name}/ready")
@routes.get("/v2/models/{name}/versions/{version}/ready")
async def model_ready(request: web.Request) -> web.Response:
    """Model readiness: 200 when ready, 503 while loading; 404 for an unknown model."""
    registry = request.app[CORE].registry
    entry = registry.get(request.match_info["name"], request.match_info.get("version"))
    return _model_readiness(registry, entry)


# --- KServe V1 -------------------------------------------------------------------------


@routes.get("/")
async def v1_live(request: web.Request) -> web.Response:
    """``GET /``: KServe V1 liveness, ``{"status": "alive"}`` (what kserve's V1
    ``is_server_live`` reads); 503 once the inference thread is stuck, like ``/v2/health/live``."""
    hung = request.app[CORE].health.hung
    if hung is not None:
        return _json({"status": "stuck", "error": f"inference thread stuck: {hung}"}, 503)
    return _json({"status": "alive"})


@routes.get("/v1/models")
async def v1_models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the names of the models served."""
    return _json({"models": sorted(request.app[CORE].registry.versions)})


@routes.get("/v1/models/{name:[^/:]+}")
async def v1_model(request: web.Request) -> web.Response:
    """``GET /v1/models/{name}``: 200 ``{"name", "ready": true}`` when ready, else 503."""
    registry = request.app[CORE].registry
    entry = registry.get(request.match_info["name"])
    return _model_readiness(registry, entry)


@routes.get("/openapi.json")
async def openapi(request: web.Request) -> web.Response:
    """``GET /openapi.json``: the OpenAPI 3 description of this HTTP API."""
    return web.Response(body=OPENAPI, content_type="application/json")


async def metrics_handler(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text format, the whole server's figures."""
    metrics = request.app[CORE].metrics
    assert metrics is not None  # the route exists only with metrics on (create_app)
    body = await asyncio.get_running_loop().run_in_executor(None, metrics.render)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
