"""The connection's HTTP parser: its bounds and the JSON answer to what it refuses, before any
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

import logging
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web import RequestHandler

from app.settings import Settings

log = logging.getLogger(__name__)


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
