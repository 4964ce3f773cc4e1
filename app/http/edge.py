"""The HTTP edge: the one middleware every request passes (one coroutine per request on the hot
path): its id, its checks, the API key hook, the one place exceptions become HTTP responses, and
its metrics. The inference routes and the path they take are ``app.http.inference``'s, the limits
before any handler ``app.http.limits``'s, the keep-alive policy ``app.http.connections``'s, the
other routes (health, metadata, metrics, the OpenAPI document) ``app.http.routes``'s.

In order, for each request (:func:`edge_middleware`):

1. the **request id**: ``X-Request-Id`` when sane (1-128 of ``[A-Za-z0-9._:-]``), else a new
   one (:func:`app.serving.dataplane.request_id`); every response carries it, and
   ``Server-Timing: app;dur=<ms>``;
2. **header limits** (:func:`app.http.limits.check_headers`: ``SCORING_MAX_HEADER_BYTES``,
   ``SCORING_MAX_HEADERS``; 431);
3. the **API key** (``app.http.auth``), when keys are configured: no body is read for a client
   without one (401);
4. the **body**, in a content coding the server decodes (415 otherwise), read within its
   timeout and at its minimum rate (408; :func:`app.http.limits.read_body_within`);
5. the handler; then the **error map**: domain errors (:mod:`app.errors`) get their status and
   headers (``Retry-After`` for a 503), aiohttp's own HTTP errors (404, 405, 413) are re-rendered,
   a body that is not UTF-8 is 400, anything else is logged with the request id and answered
   500 naming the id, never a traceback. Every error body has the shape of the route's API
   (``app.protocols.codec.Api.errors``): the Open Inference Protocol's ``{"error": "<message>"}``
   (KServe V1 uses the same shape), OpenAI's on the OpenAI-style APIs;
6. the **request metrics** of an inference request (count by status, latency, in flight; the
   status the client gets, 499 when it left: :class:`app.observability.metrics.Recording`, one
   per request, as the gRPC servicer's), labelled by its route's API's protocol and model:
   counted in flight on arrival when its path names the model (so that what is refused here
   counts under it), else once the data plane has found the model its body names
   (``DataPlane.admit``); a model the repository knows but this worker cannot serve counts
   under its name (``ModelRegistry.labels``), an unknown one under "". The inference route
   puts it in the request's context (:data:`RECORDING`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from app.errors import ScoringError
from app.http.limits import check_content_encoding, check_headers, read_body_within
from app.http.state import CORE
from app.observability.metrics import Recording, ServerMetrics
from app.observability.tracing import Tracing
from app.protocols.codec import PLAIN_ERRORS, Api, ErrorShape
from app.serving.dataplane import request_id
from app.settings import Settings

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
SERVER_TIMING_HEADER = "Server-Timing"
REQUEST_ID = web.RequestKey("request_id", str)


def request_id_of(request: web.Request) -> str:
    """This request's id (accepted from ``X-Request-Id`` or generated)."""
    return str(request.get(REQUEST_ID, "-"))


#: The request metrics of an inference request (metrics on), for its context.
RECORDING = web.RequestKey("recording", Recording)


def json_error(
    status: int, message: str, headers: dict[str, str] | None = None, shape: ErrorShape = PLAIN_ERRORS
) -> web.Response:
    """An error response in ``shape`` (an API's, ``app.protocols.codec.ErrorShape``; by default
    ``{"error": message}``)."""
    return web.Response(
        status=status, body=shape.body(status, message), content_type="application/json", headers=headers
    )


def edge_middleware(
    settings: Settings,
    apis: Mapping[Handler, Api],
    authorize: Callable[[web.Request], None] | None = None,
    metrics: ServerMetrics | None = None,
    tracing: Tracing | None = None,
) -> Middleware:
    """The middleware (module docstring). ``apis``: the API of each inference route's handler
    (``app.http.inference.API_OF``): its requests' metrics label and error shape; ``authorize``
    raises ``Unauthorized`` for a request without a valid key (``app.http.auth.authorizer``;
    None: no keys); ``metrics``: None when metrics are off; ``tracing``: tags the request's
    server span with its id (None: off)."""
    max_bytes, max_headers = settings.max_header_bytes, settings.max_headers
    timeout_s, grace_s = settings.body_timeout_s, settings.body_grace_s
    min_rate = settings.min_body_rate_bytes_s

    @web.middleware
    async def edge(request: web.Request, handler: Handler) -> web.StreamResponse:
        start = time.perf_counter()
        rid = request_id(request.headers.get(REQUEST_ID_HEADER, ""))
        request[REQUEST_ID] = rid
        if tracing is not None:
            tracing.tag(rid)
        api = apis.get(request.match_info.handler)  # None: not an inference route
        shape = PLAIN_ERRORS if api is None else api.errors
        recording = None
        if metrics is not None and api is not None:
            recording = request[RECORDING] = Recording(metrics, api.protocol)
            labels = _model_labels(request) if api.codec.named_in_path else None
            if labels is not None:  # labelled from arrival: refusals here (401, 408, 413) too
                recording.model(*labels)
        code = 500
        try:
            try:
                check_headers(request, max_bytes, max_headers)
                if authorize is not None:
                    authorize(request)
                if request.body_exists:
                    check_content_encoding(request.headers.get("Content-Encoding"))
                    await read_body_within(request, timeout_s, min_rate, grace_s)
                response = await handler(request)
            except ScoringError as exc:
                response = _domain_error(exc, rid, shape)
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                response = _http_error(exc, rid, shape)
            except UnicodeDecodeError as exc:
                message = f"request body is not valid UTF-8 (byte {exc.start}: {exc.reason})"
                response = json_error(400, message, {REQUEST_ID_HEADER: rid}, shape)
            except Exception:
                log.exception("request %s %s %s failed", rid, request.method, request.path)
                message = f"internal server error (request id {rid})"
                response = json_error(500, message, {REQUEST_ID_HEADER: rid}, shape)
            else:
                response.headers[REQUEST_ID_HEADER] = rid
            if not response.prepared:
                # The access log reads it: aiohttp's own request time has the loop clock's
                # resolution, which is 1 ms under uvloop.
                response.headers[SERVER_TIMING_HEADER] = f"app;dur={(time.perf_counter() - start) * 1000:.3f}"
            code = response.status
            return response
        except web.HTTPException as exc:
            code = exc.status
            raise
        except asyncio.CancelledError:
            code = 499  # the client went away (nginx's code; nothing was sent)
            raise
        finally:
            if recording is not None:
                recording.answered(code)

    return edge


def _model_labels(request: web.Request) -> tuple[str, str] | None:
    """(model, version) of the request its path names, an unavailable one's included; None (counted
    under "") for one this worker does not know (``ModelRegistry.labels``)."""
    info = request.match_info
    name, version = info["name"], info.get("version")
    try:
        config = request.app[CORE].dataplane.version(name, version).config
    except ScoringError:  # not served: unavailable (its name), or unknown ("")
        return request.app[CORE].registry.labels(name, version)
    return config.name, config.version


def _domain_error(exc: ScoringError, rid: str, shape: ErrorShape) -> web.Response:
    headers = {**exc.headers, REQUEST_ID_HEADER: rid}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    if exc.status >= 500:
        # Overload answers (503) are counted in metrics; a line each would flood the log.
        level = logging.DEBUG if exc.status == 503 else logging.WARNING
        log.log(level, "request %s: %d %s", rid, exc.status, exc.message)
    return json_error(exc.status, exc.message, headers, shape)


def _http_error(exc: web.HTTPException, rid: str, shape: ErrorShape) -> web.Response:
    message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
    if exc.status == 413:
        message = f"request body too large: {message}"
    headers = {REQUEST_ID_HEADER: rid}
    if "Allow" in exc.headers:
        headers["Allow"] = exc.headers["Allow"]
    return json_error(exc.status, message, headers, shape)
