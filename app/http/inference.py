"""The inference routes of the HTTP front end: one route per URL of each inference API
(``app.protocols.apis.APIS``, in that order, the hot path first: aiohttp tries the resources that
share a static prefix, ``/v2/models``, in the order they were added, one coroutine each), and the
one path they all take, :func:`serve`, with their API's codec (:mod:`app.protocols.codec`): the
deadline from the headers (``X-Request-Timeout-Ms``), admission, decoding into an inference
request, the data plane (:class:`app.serving.dataplane.DataPlane`), encoding; model code never
runs here (it runs on the inference thread). The inference routes are added to the router before
every other table (``app.main``): 2 tries per request instead of 10.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

from aiohttp import web
from aiohttp.typedefs import Handler

from app.errors import InvalidInput, UnsupportedMediaType
from app.http.edge import RECORDING, request_id_of
from app.http.state import CORE
from app.protocols.apis import APIS
from app.protocols.codec import Api
from app.serving.context import NO_DEADLINE, RequestContext

#: The header that gives a request its own timeout, in milliseconds.
TIMEOUT_HEADER = "X-Request-Timeout-Ms"
#: The Content-Types an inference POST may have (or none).
_BODY_TYPES = frozenset({"application/json", "text/json", "application/octet-stream"})


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


def header_deadline(request: web.Request, arrival: float) -> float:
    """The deadline ``X-Request-Timeout-Ms`` names (milliseconds from ``arrival``), as loop time;
    ``app.serving.context.NO_DEADLINE`` when absent.

    Raises:
        InvalidInput: not a positive finite number.
    """
    value = request.headers.get(TIMEOUT_HEADER)
    if value is None:
        return NO_DEADLINE
    try:
        ms = float(value)
    except ValueError:
        raise InvalidInput(f"{TIMEOUT_HEADER} must be a number of milliseconds") from None
    if not 0 < ms < math.inf:
        raise InvalidInput(f"{TIMEOUT_HEADER} must be a positive number of milliseconds")
    return arrival + ms / 1000.0


def _disconnected(request: web.Request) -> Callable[[], bool]:
    """True once the client of ``request`` has gone (its queued items are then dropped): its
    transport's own ``is_closing`` (asyncio's), called by the queue as it forms batches."""
    transport = request.transport
    return transport.is_closing if transport is not None else _gone


def _gone() -> bool:
    """A request whose connection closed before it was served."""
    return True


async def serve(request: web.Request, api: Api) -> web.Response:
    """The one path of every HTTP inference API: the request's context (its id and metrics from
    the edge middleware, its arrival, the deadline of its headers, its trace, its client),
    admission (before the body is read where the path names the model), the codec's decoding,
    the data plane, the codec's encoding (a span of its own where tracing is on). Errors are
    raised as :mod:`app.errors` and answered by the edge middleware, in the API's shape.

    Raises:
        ScoringError: what admission, decoding or the data plane raised (4xx, 503, 504).
    """
    core = request.app[CORE]
    plane, codec, tracing = core.dataplane, api.codec, core.tracing
    arrival = asyncio.get_running_loop().time()
    context = RequestContext(
        request_id_of(request),
        header_deadline(request, arrival),
        trace=tracing.carrier() if tracing is not None else (),
        is_disconnected=_disconnected(request),
        arrival=arrival,
        recording=request.get(RECORDING),
    )
    model = None
    if codec.named_in_path:
        model, context = plane.admit(request.match_info["name"], request.match_info.get("version"), context)
    call = codec.call(await _read_body(request), request.headers, plane.limits)
    if model is None:
        assert call.name is not None, f"the {api.protocol} codec named no model"
        model, context = plane.admit(call.name, call.version, context)
    body, content_type, headers = await plane.serve(model, call, context)
    return web.Response(body=body, content_type=content_type, headers=headers)


def _handler(api: Api) -> Handler:
    """The route handler of ``api``: :func:`serve` with it."""

    async def handle(request: web.Request) -> web.StreamResponse:
        return await serve(request, api)

    handle.__name__ = handle.__qualname__ = f"serve_{api.protocol}"
    return handle


#: The handler of each inference API (the edge middleware labels its requests and shapes their
#: errors by it).
API_OF: dict[Handler, Api] = {_handler(api): api for api in APIS}
#: One route per URL of each API, in the order of ``app.protocols.apis.APIS``.
inference_routes = [
    web.route(api.method, route.path, handler) for handler, api in API_OF.items() for route in api.routes
]
