"""HTTP handlers: Open Inference Protocol (V2) REST, KServe V1, OpenAI embeddings, rerank, classify,
health.

Every inference handler is one line: :func:`serve`, the one path, with its API's codec
(:mod:`app.protocols.codec`): admission, decoding into an inference request, the data plane
(:class:`app.serving.dataplane.DataPlane`), encoding; model code never runs here (it runs on
the inference thread).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from importlib import resources
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CONTENT_TYPE_LATEST

from app import SERVER_NAME, __version__
from app.errors import InvalidInput, UnsupportedMediaType
from app.http.edge import model_known, request_id_of
from app.http.state import CORE
from app.protocols import classify, openai, rerank, triton, v1, v2
from app.protocols.codec import Codec
from app.serving.registry import ModelRegistry, ModelVersion

TIMEOUT_HEADER = "X-Request-Timeout-Ms"
_BODY_TYPES = frozenset({"application/json", "text/json", "application/octet-stream"})
#: The OpenAPI 3 description of this API (``GET /openapi.json``), shipped in the package.
OPENAPI = resources.files("app").joinpath("openapi.json").read_bytes()

routes = web.RouteTableDef()
#: The inference POSTs, added to the router before every other table (``app.main``): aiohttp
#: tries the resources that share a static prefix (``/v2/models``) in the order they were
#: added, one coroutine each, so the hot path goes first (2 tries per request instead of 10).
inference_routes = web.RouteTableDef()


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


async def _read_body(request: web.Request) -> bytes:
    """The (decompressed) body of an inference POST.

    Stock clients send JSON as ``application/json``, as ``application/octet-stream``
    (``tritonclient.http.aio``, kserve's ``InferRequest``) or with no type
    (``tritonclient.http``); ``Inference-Header-Content-Length``, not the type, tells whether
    binary tensor data follows the JSON (docs/protocols.md). Other types (forms, text) are
    refused.

    Raises:
        UnsupportedMediaType: a Content-Type other than JSON or octet-stream.
        aiohttp.web.HTTPRequestEntityTooLarge: body over ``max_request_bytes``.
    """
    if "Content-Type" in request.headers and request.content_type not in _BODY_TYPES:
        raise UnsupportedMediaType(
            f"Content-Type {request.content_type!r} is not supported; send application/json "
            "or application/octet-stream"
        )
    return await request.read()


def header_deadline(request: web.Request, arrival: float) -> float | None:
    """The deadline ``X-Request-Timeout-Ms`` names (milliseconds from ``arrival``), as loop time;
    None when absent.

    Raises:
        InvalidInput: not a positive finite number.
    """
    value = request.headers.get(TIMEOUT_HEADER)
    if value is None:
        return None
    try:
        ms = float(value)
    except ValueError:
        raise InvalidInput(f"{TIMEOUT_HEADER} must be a number of milliseconds") from None
    if not 0 < ms < math.inf:
        raise InvalidInput(f"{TIMEOUT_HEADER} must be a positive number of milliseconds")
    return arrival + ms / 1000.0


def _disconnected(request: web.Request) -> Callable[[], bool]:
    """True once the client of ``request`` has gone (its queued items are then dropped)."""
    transport = request.transport

    def disconnected() -> bool:
        return transport is None or transport.is_closing()

    return disconnected


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


async def serve(request: web.Request, codec: Codec) -> web.Response:
    """The one path of every HTTP inference API: the deadline from the headers, admission (before
    the body is read where the path names the model), the codec's decoding, the data plane, the
    codec's encoding (a span of its own where tracing is on). Errors are raised as
    :mod:`app.errors` and answered by the edge middleware, in the API's shape.

    Raises:
        ScoringError: what admission, decoding or the data plane raised (4xx, 503, 504).
    """
    plane = request.app[CORE].dataplane
    arrival = asyncio.get_running_loop().time()
    deadline = header_deadline(request, arrival)
    model = None
    if codec.named_in_path:
        model = plane.admit(request.match_info["name"], request.match_info.get("version"), arrival, deadline)
    call = codec.call(await _read_body(request), request.headers, plane.limits)
    if model is None:
        assert call.name is not None, f"the {codec.protocol} codec named no model"
        model = plane.admit(call.name, call.version, arrival, deadline)
        model_known(request, model.config.name, model.config.version)
    body, content_type, headers = await plane.serve(
        model, call, arrival=arrival, deadline=deadline, request_id=request_id_of(request),
        is_disconnected=_disconnected(request),
    )  # fmt: skip
    return web.Response(body=body, content_type=content_type, headers=headers)


@inference_routes.post("/v2/models/{name}/versions/{version}/infer")
@inference_routes.post("/v2/models/{name}/infer")  # innermost: added first
async def infer(request: web.Request) -> web.Response:
    """``POST .../infer``: an ``$inference_request`` in, an ``$inference_response`` out; either
    may use Triton's binary tensor data extension (``Inference-Header-Content-Length``)."""
    return await serve(request, v2.CODEC)


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


@inference_routes.post("/v1/models/{name:[^/:]+}:predict")
async def v1_predict(request: web.Request) -> web.Response:
    """``POST /v1/models/{name}:predict``: ``{"instances": [...]}`` -> ``{"predictions": [...]}``."""
    return await serve(request, v1.CODEC)


@inference_routes.post("/v1/embeddings")
async def embeddings(request: web.Request) -> web.Response:
    """``POST /v1/embeddings``: OpenAI's embeddings API over any model that makes embeddings
    (``app.protocols.openai``): the same batching, admission, API keys and deadlines as V2."""
    return await serve(request, openai.CODEC)


@inference_routes.post("/v1/rerank")
@inference_routes.post("/v2/rerank")
async def rerank_documents(request: web.Request) -> web.Response:
    """``POST /v1/rerank`` (and ``/v2/rerank``, where Cohere's v2 client posts): Cohere's rerank
    API over a cross-encoder or an embedding model (``app.protocols.rerank``)."""
    return await serve(request, rerank.CODEC)


@inference_routes.post("/v1/classify")
async def classify_texts(request: web.Request) -> web.Response:
    """``POST /v1/classify``: vLLM's classify API over a sequence classifier
    (``app.protocols.classify``)."""
    return await serve(request, classify.CODEC)


#: The protocol of each inference handler: the label of its requests' metrics (the edge
#: middleware, ``app.http.edge``).
PROTOCOLS: dict[Handler, str] = {
    infer: v2.CODEC.protocol,
    v1_predict: v1.CODEC.protocol,
    embeddings: openai.CODEC.protocol,
    rerank_documents: rerank.CODEC.protocol,
    classify_texts: classify.CODEC.protocol,
}


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
