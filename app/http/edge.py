"""The HTTP edge: what every request and response passes. The one middleware (one coroutine per
request on the hot path): its id, its header limits, the API key hook, its body, the one place
exceptions become HTTP responses, and its metrics; and the keep-alive policy every response
passes (:func:`setup_connections`). The inference routes and the path they take are
``app.http.inference``'s, the connection's parser (its bounds, its JSON answers to what it
refuses) ``app.http.edge``'s, the other routes (health, metadata, metrics, the OpenAPI
document) ``app.http.routes``'s.

In order, for each request (:func:`edge_middleware`):

1. the **request id**: ``X-Request-Id`` when sane (1-128 of ``[A-Za-z0-9._:-]``), else a new
   one (:func:`app.serving.context.request_id`); every response carries it, and
   ``Server-Timing: app;dur=<ms>``;
2. **header limits** (:func:`check_headers`: ``SCORING_MAX_HEADER_BYTES``,
   ``SCORING_MAX_HEADERS``; 431);
3. the **API key** (``app.http.auth``), when keys are configured: no body is read for a client
   without one (401);
4. the **body**, in a content coding the server decodes (:func:`check_content_encoding`, 415
   otherwise), read within ``body_timeout_s`` and, after ``body_grace_s``, at no less than
   ``min_body_rate_bytes_s`` bytes/s (:func:`read_body_within`: 408 and the connection closed;
   aiohttp's server has no read timeout of its own; sources: nginx's ``client_body_timeout``,
   Apache's ``mod_reqtimeout``); a client that leaves mid-upload is 499, a corrupt chunked or
   encoded body 400;
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

**The keep-alive policy** (:func:`setup_connections`): the one place that decides which responses
close their connection, and which hold an impatient client's refusal. A response carries
``Connection: close`` (and the server closes the connection after it) when

- the error it answers says so (a 408: the body came too slowly, the rest of it may still
  arrive and cannot be told from a next request);
- the worker is draining: clients move to another worker *after* a complete response,
  instead of finding their idle keep-alive connection closed under them when the
  worker stops (the race in which a client sends on a connection the server is
  closing, and sees a reset);
- the connection has served ``max_requests_per_connection`` requests (nginx's
  ``keepalive_requests``): long-lived clients spread over workers again, and no
  connection lives forever;
- it is a 503 to a client that ignored the ``Retry-After`` of the previous 503 on the same
  connection, and ``impatient_hold_ms`` is 0 (then an impatient client pays a reconnect for
  each further try);
- it is a 503 whose ``Retry-After`` is at least the keep-alive idle timeout: the client that
  waits as asked would reuse the connection as the idle timer closes it, and be reset;
- the balance among sibling workers says a less-loaded sibling should take this connection
  (``app.http.state.SHEDDING``: ``app.server.balance.WorkerConnections``).

The idle timeout of a keep-alive connection is gunicorn's ``keepalive``
(``SCORING_KEEPALIVE_S``). The policy runs as an ``on_response_prepare`` signal, so it sees every
response the app produces, error responses included; it also counts them for the
worker's ``max_requests`` recycling (``app.server.worker``).

**Holding impatient clients.** Under overload a client that resends at once after a 503
costs the server a whole request (its body read, its refusal written) every round trip,
thousands a second, and that takes the CPU the models need. By default such a 503 (the
client came back on the same connection before the previous 503's ``Retry-After`` had
passed) is *held* for ``impatient_hold_ms`` (35 ms) before it is sent, and the connection
stays open: a held refusal costs an idle timer, not CPU, and it bounds each such connection
to one refusal per hold, which a reconnect did not (a fresh connection's first 503 is never
held, so closing halved the effect). A client that keeps doing it has each further 503 in a
row held twice as long, up to ``impatient_hold_max_ms`` (280 ms: 35, 70, 140, 280, 280 ...),
the exponential backoff it was asked for and did not do; the streak ends when the connection
gets any other answer or the client waits as asked. The first 503 on a connection, and every
503 to a client that waits as asked, is sent at once. Source: the tarpit idea (delay, not
refuse harder), as in nginx's ``limit_req ... delay``, with gRPC's retry backoff (doubling
up to a cap). Measured in docs/reliability.md (overload).

The connection's HTTP parser: its bounds and the JSON answer to what it refuses, before any
handler runs (the limits the app enforces itself, on each request's headers and body, are the
edge's: ``app.http.edge``).

aiohttp's HTTP parser refuses a request line or header field longer than
``max_line_size``/``max_field_size`` and more than ``max_headers`` fields while it reads them,
before any application code runs; it is set to *twice* the configured limits
(:func:`parser_limits`), and the edge middleware enforces the limits themselves with a JSON 431
(``app.http.edge.check_headers``: ``SCORING_MAX_HEADER_BYTES``, ``SCORING_MAX_HEADERS``), so the
usual oversized request gets the server's JSON 431 and only a grossly oversized one its 400.
What the parser refuses (a grossly oversized line, malformed framing, an unsupported or
truncated content encoding seen early) is answered in JSON by :class:`JsonParserErrors` (431 or
400, never quoting what was sent), and aiohttp's traceback for it becomes one DEBUG line
(:func:`quiet_parser_errors`): a client's malformed request is not a server error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.typedefs import Handler, Middleware
from aiohttp.web import RequestHandler

from app.errors import (
    ClientDisconnected,
    HeaderFieldsTooLarge,
    InvalidInput,
    RequestTimeout,
    ScoringError,
    UnsupportedMediaType,
)
from app.http.state import CORE, SHEDDING
from app.observability.metrics import Recording, ServerMetrics
from app.observability.tracing import Tracing
from app.protocols.codec import PLAIN_ERRORS, Api, ErrorShape
from app.serving.context import request_id
from app.settings import Settings

log = logging.getLogger(__name__)

#: Bytes of a request line besides the path: method, spaces, "HTTP/1.1".
_REQUEST_LINE_OVERHEAD = 16
#: The content codings aiohttp's parser decodes (a ``br`` or ``zstd`` body needs its library).
CONTENT_CODINGS = frozenset({"identity", "gzip", "deflate", "br", "zstd"})
#: How often the body timer looks at the bytes received, seconds.
_BODY_TICK_S = 0.5

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
        config = request.app[CORE].dataplane.get_model(name, version).config
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


# --- the request's header limits and body (module docstring, 2 and 4) ---------------------


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


async def read_body_within(request: web.Request, timeout_s: float, min_rate: float, grace_s: float) -> None:
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


# --- the keep-alive policy (module docstring) -------------------------------------------------


#: Requests answered per connection, keyed by its transport (gone with the connection).
_PER_CONNECTION = web.AppKey("requests_per_connection", weakref.WeakKeyDictionary)
#: Per connection, the loop time until which its last 503 asked the client to wait.
_RETRY_AFTER = web.AppKey("retry_after_per_connection", weakref.WeakKeyDictionary)
#: Per connection, how many 503s in a row answered a client that came back too early.
_STREAK = web.AppKey("impatient_streak_per_connection", weakref.WeakKeyDictionary)


def setup_connections(app: web.Application) -> None:
    """Install the keep-alive policy on ``app``."""
    app[_PER_CONNECTION] = weakref.WeakKeyDictionary[asyncio.BaseTransport, int]()
    app[_RETRY_AFTER] = weakref.WeakKeyDictionary[asyncio.BaseTransport, float]()
    app[_STREAK] = weakref.WeakKeyDictionary[asyncio.BaseTransport, int]()
    app.on_response_prepare.append(_on_response_prepare)


async def _on_response_prepare(request: web.Request, response: web.StreamResponse) -> None:
    app = request.app
    app[CORE].health.responses += 1
    if response.headers.get("Connection") == "close" or app[CORE].registry.draining:
        _close_after(response)
        return
    transport = request.transport
    retry_after_s = _retry_after_s(response)
    keepalive_s = app[CORE].settings.keepalive_s
    if retry_after_s is not None and retry_after_s >= keepalive_s > 1 and transport is not None:
        # A client that waits as asked must come back before the idle timer closes the
        # connection (its request would be reset), and closing it instead lets a client that
        # resends at once reconnect and be refused as often as it likes, never held: the wait
        # asked is cut to under the idle timeout, on a connection kept open.
        retry_after_s = float(keepalive_s - 1)
        response.headers["Retry-After"] = str(int(retry_after_s))
    if transport is not None:
        hold_s = _impatient_hold_s(app, transport, retry_after_s)
        if hold_s is not None:
            if hold_s:
                await asyncio.sleep(hold_s)
            else:
                _close_after(response)
            return
    if retry_after_s is not None and retry_after_s >= app[CORE].settings.keepalive_s:
        # A client that waits as asked would come back as the idle timer closes the
        # connection, and a request sent on it then is reset (module docstring).
        _close_after(response)
        return
    cap = app[CORE].settings.max_requests_per_connection
    if cap and transport is not None:
        counts = app[_PER_CONNECTION]
        served = counts.get(transport, 0) + 1
        counts[transport] = served
        if served >= cap:
            _close_after(response)
            return
    if app[SHEDDING].should_shed():
        _close_after(response)


def _retry_after_s(response: web.StreamResponse) -> float | None:
    """A 503's ``Retry-After``, seconds (the edge writes whole seconds); None for any other
    answer, or one without a number there."""
    retry_after = response.headers.get("Retry-After") if response.status == 503 else None
    with contextlib.suppress(ValueError):
        return float(retry_after) if retry_after is not None else None
    return None


def _impatient_hold_s(
    app: web.Application, transport: asyncio.BaseTransport, retry_after_s: float | None
) -> float | None:
    """How long to hold this response, seconds: None unless it is a 503 (its ``Retry-After``
    ``retry_after_s``) to a client that came back before the ``Retry-After`` of the previous
    503 on its connection; else ``impatient_hold_ms`` doubled for each such 503 before it in a
    row, at most ``impatient_hold_max_ms`` (0 = no hold: close instead). Records this 503's
    ``Retry-After`` and the streak; any other answer ends the streak."""
    streaks = app[_STREAK]
    if retry_after_s is None:
        if streaks:
            streaks.pop(transport, None)
        return None
    now = asyncio.get_running_loop().time()
    waits = app[_RETRY_AFTER]
    impatient = now < waits.get(transport, 0.0)
    waits[transport] = now + retry_after_s
    if not impatient:
        streaks.pop(transport, None)
        return None
    streak = streaks.get(transport, 0)
    streaks[transport] = streak + 1
    settings = app[CORE].settings
    base_ms = settings.impatient_hold_ms
    hold_ms = min(base_ms * 2 ** min(streak, 16), max(base_ms, settings.impatient_hold_max_ms))
    return float(hold_ms) / 1000


def _close_after(response: web.StreamResponse) -> None:
    # The headers were computed before this signal: say it, and make aiohttp do it.
    response.headers["Connection"] = "close"
    response.force_close()


def parser_limits(settings: Settings) -> dict[str, Any]:
    """``handler_args`` for ``web.Application``: the parser's hard bounds (twice the limits),
    and no lingering over unread bodies."""
    return {
        "max_line_size": 2 * settings.max_header_bytes,
        "max_field_size": 2 * settings.max_header_bytes,
        "max_headers": 2 * settings.max_headers,
        # After an answer given before the whole body arrived (408, 413, 401, a corrupt
        # encoding), aiohttp by default reads and discards the rest for up to 10 s (and logs
        # a traceback if that read fails): close at once instead, so a slow or lying client
        # cannot hold the connection past the body timeout.
        "lingering_time": 0,
    }


class JsonParserErrors(RequestHandler):
    """aiohttp's connection protocol, answering what its HTTP parser refuses before the app
    runs as the server's other errors: ``{"error": ...}`` JSON, 431 for a request line or
    header field over the parser's hard bound (twice ``SCORING_MAX_HEADER_BYTES``), 400 for
    other malformed requests, and never an excerpt of what was sent (aiohttp's own answer is a
    plain-text 400 that quotes the line). The connection still closes. The app's own errors
    (500, 504) keep aiohttp's handling. The class adds no state: :func:`with_json_parser_errors`
    turns a handler ``web.Server`` made into one."""

    __slots__ = ()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if not 400 <= status < 500 or not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        log.debug("malformed request refused: %s %s", status, type(exc).__name__)
        if isinstance(exc, LineTooLong):
            status, text = 431, "request line or a header field is too large (SCORING_MAX_HEADER_BYTES)"
        else:
            text = f"malformed HTTP request ({type(exc).__name__})"
        body = orjson.dumps({"error": text})
        response = web.Response(status=status, body=body, content_type="application/json")
        response.force_close()
        return response


def json_errors_protocol(server: web.Server) -> RequestHandler:
    """A new connection's protocol made by ``server`` (``web.Server``), answering parser errors
    in JSON (:class:`JsonParserErrors`): the listener's protocol factory."""
    return with_json_parser_errors(server())


def with_json_parser_errors(handler: RequestHandler) -> RequestHandler:
    """``handler`` (a connection's protocol, as ``web.Server()`` makes it) as a
    :class:`JsonParserErrors`: the same object and state, the JSON answers to parser errors."""
    handler.__class__ = JsonParserErrors
    return handler


class _ParserErrorFilter(logging.Filter):
    """Demotes aiohttp's "Error handling request" records caused by a malformed request
    (an ``HttpProcessingError`` with a 4xx code) to one DEBUG line without a traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError) or not 400 <= exc.code < 500:
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        record.msg = f"{record.getMessage()}: {exc.code} {exc.message}"
        record.args, record.exc_info, record.exc_text = None, None, None
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


_PARSER_ERRORS = _ParserErrorFilter()


#: aiohttp's server logger, and gunicorn's error log, which aiohttp's gunicorn worker gives it.
_SERVER_LOGGERS = ("aiohttp.server", "gunicorn.error")


def quiet_parser_errors() -> None:
    """Install the filter on the loggers aiohttp's server logs to (idempotent)."""
    for name in _SERVER_LOGGERS:
        logger = logging.getLogger(name)
        if _PARSER_ERRORS not in logger.filters:
            logger.addFilter(_PARSER_ERRORS)
