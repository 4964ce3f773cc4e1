"""The HTTP front end's limits before any handler runs: aiohttp's parser bounds, the header
limits, the content coding and the body's read (its timeout and minimum rate), and the JSON answer
to what the parser refuses.

**The parser's limits and errors.** aiohttp's HTTP parser refuses a request line or header
field longer than ``max_line_size``/``max_field_size`` and more than ``max_headers`` fields
while it reads them, before any application code runs; it is set to *twice* the configured
limits (:func:`parser_limits`), and the edge middleware enforces the limits themselves with a
JSON 431 (:func:`check_headers`: ``SCORING_MAX_HEADER_BYTES``, ``SCORING_MAX_HEADERS``), so the
usual oversized request gets the server's JSON 431 and only a grossly oversized one its 400.
What the parser refuses (a grossly oversized line, malformed framing, an unsupported or
truncated content encoding seen early) is answered in JSON by :class:`JsonParserErrors` (431 or
400, never quoting what was sent), and aiohttp's traceback for it becomes one DEBUG line
(:func:`quiet_parser_errors`): a client's malformed request is not a server error.

**The body** (:func:`read_body_within`), in a content coding the server decodes
(:func:`check_content_encoding`, 415 otherwise), is read within ``body_timeout_s`` and, after
``body_grace_s``, at no less than ``min_body_rate_bytes_s`` bytes/s (408 and the connection
closed; aiohttp's server has no read timeout of its own); a client that leaves mid-upload is 499,
a corrupt chunked or encoded body 400. Sources: nginx's ``client_body_timeout``, Apache's
``mod_reqtimeout``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web import RequestHandler

from app.errors import (
    ClientDisconnected,
    HeaderFieldsTooLarge,
    InvalidInput,
    RequestTimeout,
    UnsupportedMediaType,
)
from app.settings import Settings

log = logging.getLogger(__name__)

#: Bytes of a request line besides the path: method, spaces, "HTTP/1.1".
_REQUEST_LINE_OVERHEAD = 16
#: The content codings aiohttp's parser decodes (a ``br`` or ``zstd`` body needs its library).
CONTENT_CODINGS = frozenset({"identity", "gzip", "deflate", "br", "zstd"})
#: How often the body timer looks at the bytes received, seconds.
_BODY_TICK_S = 0.5


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


# The parser's limits and errors (module docstring).


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
