"""What the HTTP edge does around every request, in one middleware (one coroutine per request on
the hot path): its id, its checks, the one place exceptions become HTTP responses, and its
metrics.

In order, for each request (:func:`edge_middleware`):

1. the **request id**: ``X-Request-Id`` when sane (1-128 of ``[A-Za-z0-9._:-]``), else a new
   one (:func:`app.serving.context.request_id`); every response carries it, and
   ``Server-Timing: app;dur=<ms>``;
2. **header limits** (:func:`check_headers`: ``SCORING_MAX_HEADER_BYTES``, ``SCORING_MAX_HEADERS``;
   431). aiohttp's parser runs at twice these bounds (``app.http.connections``), so the usual
   oversized request gets the server's JSON 431 and only a grossly oversized one its 400;
3. the **API key** (``app.http.auth``), when keys are configured: no body is read for a client
   without one (401);
4. the **body**, in a content coding the server decodes (415 otherwise), read within
   ``body_timeout_s`` and, after ``body_grace_s``, at no less than ``min_body_rate_bytes_s``
   bytes/s (408 and the connection closed; aiohttp's server has no read timeout of its own);
   a client that leaves mid-upload is 499, a corrupt chunked or encoded body 400. Sources:
   nginx's ``client_body_timeout``, Apache's ``mod_reqtimeout``;
5. the handler; then the **error map**: domain errors (:mod:`app.errors`) get their status and
   headers (``Retry-After`` for a 503), aiohttp's own HTTP errors (404, 405, 413) are re-rendered,
   a body that is not UTF-8 is 400, anything else is logged with the request id and answered
   500 naming the id, never a traceback. Every error body is the Open Inference Protocol's
   ``{"error": "<message>"}`` (KServe V1 uses the same shape);
6. the **request metrics** of an inference request (count by status, latency, in flight; the
   status the client gets, 499 when it left), labelled by its route's protocol (the
   ``protocols`` map of the inference handlers) and model: counted in flight on arrival when its
   path names the model, or once its handler knows it (:func:`model_known`: OpenAI's, from
   the body).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler, Middleware

from app.errors import (
    ClientDisconnected,
    HeaderFieldsTooLarge,
    InvalidInput,
    RequestTimeout,
    ScoringError,
    UnsupportedMediaType,
)
from app.http.state import CORE
from app.observability.metrics import Recording, ServerMetrics
from app.observability.tracing import Tracing
from app.protocols.openai import error_body
from app.serving.context import request_id
from app.settings import Settings

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
SERVER_TIMING_HEADER = "Server-Timing"
REQUEST_ID = web.RequestKey("request_id", str)
#: The paths whose errors take OpenAI's shape (``app.protocols.openai.error_body``): OpenAI's
#: embeddings, and the rerank and classify APIs (OpenAI's error shape, as vLLM answers them).
OPENAI_PATHS = frozenset({"/v1/embeddings", "/v1/rerank", "/v2/rerank", "/v1/classify"})
#: Bytes of a request line besides the path: method, spaces, "HTTP/1.1".
_REQUEST_LINE_OVERHEAD = 16
#: The content codings aiohttp's parser decodes (a ``br`` or ``zstd`` body needs its library).
CONTENT_CODINGS = frozenset({"identity", "gzip", "deflate", "br", "zstd"})
#: How often the body timer looks at the bytes received, seconds.
_BODY_TICK_S = 0.5


def request_id_of(request: web.Request) -> str:
    """This request's id (accepted from ``X-Request-Id`` or generated)."""
    return str(request.get(REQUEST_ID, "-"))


RECORDING = web.RequestKey("recording", Recording)


def model_known(request: web.Request, name: str, version: str) -> None:
    """An inference handler found the model its request's body names: the request counts in
    flight from now, under that model (no-op with metrics off)."""
    recording = request.get(RECORDING)
    if recording is not None:
        recording.model(name, version)


def json_error(
    status: int, message: str, headers: dict[str, str] | None = None, *, openai: bool = False
) -> web.Response:
    """A ``{"error": message}`` JSON response; ``openai``: OpenAI's error shape instead."""
    body = error_body(status, message) if openai else orjson.dumps({"error": message})
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


def edge_middleware(
    settings: Settings,
    authorize: Callable[[web.Request], None] | None = None,
    metrics: ServerMetrics | None = None,
    tracing: Tracing | None = None,
    protocols: Mapping[Handler, str] | None = None,
) -> Middleware:
    """The middleware (module docstring). ``authorize`` raises ``Unauthorized`` for a request
    without a valid key (``app.http.auth.authorizer``; None: no keys); ``metrics``: None when
    metrics are off; ``tracing``: tags the request's server span with its id (None: off);
    ``protocols``: the protocol of each inference handler (``app.http.routes.PROTOCOLS``), the
    label of its requests' metrics."""
    by_handler = protocols or {}
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
        recording, openai = None, request.path in OPENAI_PATHS
        protocol = by_handler.get(request.match_info.handler) if metrics is not None else None
        if metrics is not None and protocol is not None:
            recording = request[RECORDING] = Recording(metrics, protocol)
            if "name" in request.match_info:
                recording.model(*_model_labels(request))
        code = 500
        try:
            try:
                check_headers(request, max_bytes, max_headers)
                if authorize is not None:
                    authorize(request)
                if request.body_exists:
                    check_content_encoding(request.headers.get("Content-Encoding"))
                    await _read_within(request, timeout_s, min_rate, grace_s)
                response = await handler(request)
            except ScoringError as exc:
                response = _domain_error(exc, rid, openai)
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                response = _http_error(exc, rid, openai)
            except UnicodeDecodeError as exc:
                message = f"request body is not valid UTF-8 (byte {exc.start}: {exc.reason})"
                response = json_error(400, message, {REQUEST_ID_HEADER: rid}, openai=openai)
            except Exception:
                log.exception("request %s %s %s failed", rid, request.method, request.path)
                message = f"internal server error (request id {rid})"
                response = json_error(500, message, {REQUEST_ID_HEADER: rid}, openai=openai)
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
                recording.answered(code, time.perf_counter() - start)

    return edge


def _model_labels(request: web.Request) -> tuple[str, str]:
    """(model, version) of the request its path names; ("", "") for one this worker does not
    serve."""
    info = request.match_info
    name = info["name"]
    try:
        config = request.app[CORE].dataplane.version(name, info.get("version")).config
    except ScoringError:  # unknown, or unavailable: answered 404 / 503
        return "", ""
    return config.name, config.version


def check_headers(request: web.Request, max_bytes: int, max_headers: int) -> None:
    """Refuse a request line or a header field (name + value) longer than ``max_bytes``, or
    more than ``max_headers`` fields.

    Raises:
        HeaderFieldsTooLarge: 431.
    """
    raw = request.raw_headers
    if len(raw) > max_headers:
        raise HeaderFieldsTooLarge(
            f"request has {len(raw)} header fields; the server accepts at most {max_headers} "
            "(SCORING_MAX_HEADERS)"
        )
    if len(request.raw_path) + _REQUEST_LINE_OVERHEAD > max_bytes:
        raise HeaderFieldsTooLarge(
            f"request line is longer than {max_bytes} bytes (SCORING_MAX_HEADER_BYTES)"
        )
    for name, value in raw:
        if len(name) + len(value) > max_bytes:
            shown = name.decode("latin-1")[:64]
            raise HeaderFieldsTooLarge(
                f"header field {shown!r} is {len(name) + len(value)} bytes; the server accepts "
                f"at most {max_bytes} per field (SCORING_MAX_HEADER_BYTES)"
            )


def check_content_encoding(value: str | None) -> None:
    """Refuse a body in a content coding the server does not decode (aiohttp's parser passes
    any other value through as if it were ``identity``: the model would get compressed bytes).

    Raises:
        UnsupportedMediaType: 415, naming the codings accepted.
    """
    if value is None:
        return
    coding = value.strip().lower()
    if coding and coding not in CONTENT_CODINGS:
        raise UnsupportedMediaType(
            f"Content-Encoding {value[:40]!r} is not supported; send the body as is, or as "
            f"{', '.join(sorted(CONTENT_CODINGS - {'identity'}))}"
        )


async def _read_within(request: web.Request, timeout_s: float, min_rate: float, grace_s: float) -> None:
    """Read the body (``request.read()`` keeps it for the handler) under a deadline that a timer
    moves with the bytes received: ``start + grace + received / min_rate``, never past
    ``start + timeout_s``."""
    content = request.content
    if content.is_eof():  # the whole body came with the headers (small requests): no timers
        try:
            await request.read()
        except HttpProcessingError as exc:
            raise InvalidInput(f"request body cannot be decoded: {exc.message}") from None
        except web.RequestPayloadError as exc:
            raise InvalidInput(f"request body cannot be decoded: {str(exc).strip()}") from None
        return
    loop = asyncio.get_running_loop()
    start = loop.time()
    hard = start + timeout_s
    handle: asyncio.TimerHandle | None = None
    try:
        async with asyncio.timeout(min(hard, start + grace_s) if min_rate else hard) as window:

            def tick() -> None:
                nonlocal handle
                if window.expired():  # fired: the read is being cancelled
                    return
                if min_rate:
                    window.reschedule(min(hard, start + grace_s + content.total_raw_bytes / min_rate))
                handle = loop.call_later(_BODY_TICK_S, tick)

            tick()
            await request.read()
    except TimeoutError:
        received = content.total_raw_bytes
        raise RequestTimeout(
            f"request body too slow: {received} bytes in {loop.time() - start:.1f} s (the server "
            f"needs the body within {timeout_s:g} s, at {min_rate:g} bytes/s or more after "
            f"{grace_s:g} s)"
        ) from None
    except HttpProcessingError as exc:
        raise InvalidInput(f"request body cannot be decoded: {exc.message}") from None
    except web.RequestPayloadError as exc:  # wraps a corrupt Content-Encoding
        raise InvalidInput(f"request body cannot be decoded: {str(exc).strip()}") from None
    except (ConnectionError, asyncio.IncompleteReadError, EOFError) as exc:
        log.debug("client left during the request body: %r", exc)
        raise ClientDisconnected("client disconnected during the request body") from None
    finally:
        if handle is not None:
            handle.cancel()


def _domain_error(exc: ScoringError, rid: str, openai: bool) -> web.Response:
    headers = {**exc.headers, REQUEST_ID_HEADER: rid}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    if exc.status >= 500:
        # Overload answers (503) are counted in metrics; a line each would flood the log.
        level = logging.DEBUG if exc.status == 503 else logging.WARNING
        log.log(level, "request %s: %d %s", rid, exc.status, exc.message)
    return json_error(exc.status, exc.message, headers, openai=openai)


def _http_error(exc: web.HTTPException, rid: str, openai: bool) -> web.Response:
    message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
    if exc.status == 413:
        message = f"request body too large: {message}"
    headers = {REQUEST_ID_HEADER: rid}
    if "Allow" in exc.headers:
        headers["Allow"] = exc.headers["Allow"]
    return json_error(exc.status, message, headers, openai=openai)
