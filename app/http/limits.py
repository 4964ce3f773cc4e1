"""Header limits, in two tiers.

aiohttp's HTTP parser refuses a request line or header field longer than
``max_line_size``/``max_field_size`` and more than ``max_headers`` fields while it reads
them, before any application code runs, with a plain-text 400 and a closed connection;
nothing above those bounds is ever buffered. The parser is set to *twice* the configured
limits (``SCORING_MAX_HEADER_BYTES``, ``SCORING_MAX_HEADERS``), and a middleware enforces
the limits themselves with a JSON 431, so the usual oversized request (a cookie too many,
a long token) gets the server's JSON error; only a grossly oversized one (over twice the
limit) gets the parser's plain-text 400.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from app.errors import HeaderFieldsTooLarge
from app.settings import Settings

#: Bytes of a request line besides the path: method, spaces, "HTTP/1.1".
_REQUEST_LINE_OVERHEAD = 16


def parser_limits(settings: Settings) -> dict[str, Any]:
    """``handler_args`` for ``web.Application``: the parser's hard bounds (twice the limits)."""
    return {
        "max_line_size": 2 * settings.max_header_bytes,
        "max_field_size": 2 * settings.max_header_bytes,
        "max_headers": 2 * settings.max_headers,
    }


def header_limits_middleware(max_bytes: int, max_headers: int) -> Middleware:
    """A middleware that answers 431 (``HeaderFieldsTooLarge``) when the request line or a
    header field (name + value) is longer than ``max_bytes``, or there are more than
    ``max_headers`` fields."""

    @web.middleware
    async def check_headers(request: web.Request, handler: Handler) -> web.StreamResponse:
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
        return await handler(request)

    return check_headers
