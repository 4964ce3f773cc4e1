"""The one place exceptions become HTTP responses, plus request ids and server timing.

Every error body is the Open Inference Protocol's ``{"error": "<message>"}``
(KServe V1 uses the same shape). Domain errors (:mod:`app.errors`) map to their
status; aiohttp's own HTTP errors (404 no route, 405, 413 body too large) are
re-rendered as JSON; a body that is not valid UTF-8 (``UnicodeDecodeError`` from the JSON
decoder) is the client's 400; anything else is logged with the request id and answered
with a 500 that names the request id and no traceback. An error's own headers go on its
response (a 408 says ``Connection: close``: ``app.http.connections`` then closes it).
"""

from __future__ import annotations

import logging
import math
import time

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler

from app.errors import ScoringError
from app.protocols.infer import request_id as new_or_given_id

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
SERVER_TIMING_HEADER = "Server-Timing"
REQUEST_ID = web.RequestKey("request_id", str)


def request_id(request: web.Request) -> str:
    """This request's id (accepted from ``X-Request-Id`` or generated)."""
    return str(request.get(REQUEST_ID, "-"))


def json_error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    """A ``{"error": message}`` JSON response."""
    return web.Response(
        status=status,
        body=orjson.dumps({"error": message}),
        content_type="application/json",
        headers=headers,
    )


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Assign the request id, run the handler, map any exception to a JSON error; every
    response carries ``X-Request-Id`` and ``Server-Timing: app;dur=<ms>``."""
    start = time.perf_counter()
    rid = new_or_given_id(request.headers.get(REQUEST_ID_HEADER, ""))
    request[REQUEST_ID] = rid
    try:
        response = await handler(request)
    except ScoringError as exc:
        response = _domain_error(exc, rid)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = _http_error(exc, rid)
    except UnicodeDecodeError as exc:
        message = f"request body is not valid UTF-8 (byte {exc.start}: {exc.reason})"
        response = json_error(400, message, {REQUEST_ID_HEADER: rid})
    except Exception:
        log.exception("request %s %s %s failed", rid, request.method, request.path)
        response = json_error(500, f"internal server error (request id {rid})", {REQUEST_ID_HEADER: rid})
    else:
        response.headers[REQUEST_ID_HEADER] = rid
    if not response.prepared:
        # The access log reads it: aiohttp's own request time has the loop clock's
        # resolution, which is 1 ms under uvloop.
        response.headers[SERVER_TIMING_HEADER] = f"app;dur={(time.perf_counter() - start) * 1000:.3f}"
    return response


def _domain_error(exc: ScoringError, rid: str) -> web.Response:
    headers = {**exc.headers, REQUEST_ID_HEADER: rid}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    if exc.status >= 500:
        # Overload answers (503) are counted in metrics; a line each would flood the log.
        level = logging.DEBUG if exc.status == 503 else logging.WARNING
        log.log(level, "request %s: %d %s", rid, exc.status, exc.message)
    return json_error(exc.status, exc.message, headers)


def _http_error(exc: web.HTTPException, rid: str) -> web.Response:
    message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
    if exc.status == 413:
        message = f"request body too large: {message}"
    headers = {REQUEST_ID_HEADER: rid}
    if "Allow" in exc.headers:
        headers["Allow"] = exc.headers["Allow"]
    return json_error(exc.status, message, headers)
