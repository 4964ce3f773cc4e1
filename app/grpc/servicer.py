"""``inference.GRPCInferenceService``: KServe V2 gRPC, plus Triton's config/statistics/index.

Every RPC goes through :meth:`InferenceServicer._call`, which assigns the request id, checks
the API key (``authorization: Bearer <key>`` or ``x-api-key: <key>`` metadata, as the HTTP
headers; ServerLive and ServerReady are open like the HTTP health probes), counts the
response for ``max_requests``, and maps every exception to a status through
:mod:`app.grpc.errors`. ModelInfer decodes the message into the shared
:class:`app.protocols.infer.InferRequest`, validates it against the model with the same
limits as HTTP, and awaits :func:`app.serving.dataplane.infer`, the one inference entry
point (dynamic batching, balancing among sibling workers).

Deadline of a ModelInfer: the earlier of the gRPC deadline (``context.time_remaining()``)
and the request's ``timeout`` parameter (microseconds, Triton's); with neither, the model's
``timeout_ms`` else ``request_timeout_ms``.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from aiohttp import web

from app import SERVER_NAME, __version__
from app.grpc import codec
from app.errors import ScoringError, Unauthorized
from app.grpc.errors import REQUEST_ID_KEY, outcome, status_of
from app.grpc.generated import grpc_service_pb2 as pb
from app.grpc.generated import grpc_service_pb2_grpc as pb_grpc
from app.http.auth import API_KEY_HEADER, API_KEYS
from app.observability.metrics import METRICS
from app.protocols import infer, v2
from app.serving import dataplane
from app.serving.state import LIFECYCLE, LIMITS, REGISTRY, SETTINGS, ModelEntry

Reply = TypeVar("Reply")
Context = Any  # grpc.aio.ServicerContext (grpcio ships no type information)

_VALID_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_OPEN = frozenset({"ServerLive", "ServerReady"})
_API_KEY = API_KEY_HEADER.lower()
#: Protocol extensions answered over gRPC (``ServerMetadataResponse.extensions``).
EXTENSIONS = ["model_configuration", "statistics", "model_repository"]


def _metadata(context: Context, key: str) -> str | None:
    for name, value in context.invocation_metadata() or ():
        if name == key and isinstance(value, str):
            return value
    return None


def presented_key(context: Context) -> str | None:
    """The key a call presents: ``authorization: Bearer <key>`` metadata, else ``x-api-key``."""
    scheme, _, credentials = (_metadata(context, "authorization") or "").partition(" ")
    if scheme.lower() == "bearer" and credentials.strip():
        return credentials.strip()
    return _metadata(context, _API_KEY) or None


def _request_id(context: Context, sent: str = "") -> str:
    """The id a request gave (``ModelInferRequest.id``, else ``x-request-id`` metadata) when
    it is a sane token, else a new one."""
    for candidate in (sent, _metadata(context, REQUEST_ID_KEY) or ""):
        if _VALID_ID.match(candidate):
            return candidate
    return uuid.uuid4().hex


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """The RPCs of ``proto/grpc_service.proto`` over one worker's app state.

    Args:
        app: the worker's aiohttp application (its registry, settings, limits, keys, metrics).
    """

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.registry = app[REGISTRY]
        self.settings = app[SETTINGS]
        self.limits = app[LIMITS]
        self.lifecycle = app[LIFECYCLE]
        self.keys = app.get(API_KEYS)
        self.metrics = app.get(METRICS)

    async def _call(
        self, method: str, context: Context, handler: Callable[[str], Awaitable[Reply]], sent_id: str = ""
    ) -> Reply:
        """Run one RPC: request id, API key, response count, the one error mapping."""
        rid = _request_id(context, sent_id)
        try:
            if (
                method not in _OPEN
                and self.keys is not None
                and self.keys.enabled
                and not self.keys.check(presented_key(context))
            ):
                raise Unauthorized("unauthorized")
            reply = await handler(rid)
        except Exception as exc:
            code, details, trailer = outcome(exc, rid, method)
            context.set_trailing_metadata(trailer)
            await context.abort(code, details)
            raise AssertionError("unreachable: abort raises") from None
        finally:
            self.lifecycle.responses += 1
        context.set_trailing_metadata(((REQUEST_ID_KEY, rid),))
        return reply

    # --- health and metadata -------------------------------------------------------------

    async def ServerLive(self, request: pb.ServerLiveRequest, context: Context) -> pb.ServerLiveResponse:
        """Liveness: false once the worker's inference thread is stuck (it restarts itself)."""

        async def run(rid: str) -> pb.ServerLiveResponse:
            return pb.ServerLiveResponse(live=self.lifecycle.hung is None)

        return await self._call("ServerLive", context, run)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: Context) -> pb.ServerReadyResponse:
        """Readiness: every model warm and the worker not draining."""

        async def run(rid: str) -> pb.ServerReadyResponse:
            return pb.ServerReadyResponse(ready=self.registry.ready)

        return await self._call("ServerReady", context, run)

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Context) -> pb.ModelReadyResponse:
        """Model readiness; NOT_FOUND for an unknown model or version."""

        async def run(rid: str) -> pb.ModelReadyResponse:
            entry = self.registry.get(request.name, request.version or None)
            return pb.ModelReadyResponse(ready=entry.ready and not self.registry.draining)

        return await self._call("ModelReady", context, run)

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: Context
    ) -> pb.ServerMetadataResponse:
        """Server name, version and the protocol extensions served."""

        async def run(rid: str) -> pb.ServerMetadataResponse:
            return pb.ServerMetadataResponse(name=SERVER_NAME, version=__version__, extensions=EXTENSIONS)

        return await self._call("ServerMetadata", context, run)

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: Context
    ) -> pb.ModelMetadataResponse:
        """Model metadata: the same fields as ``GET /v2/models/{name}`` (-1 = batch dimension)."""

        async def run(rid: str) -> pb.ModelMetadataResponse:
            meta = v2.model_metadata(self.registry.get(request.name, request.version or None).config)

            def tensors(specs: list[dict[str, Any]]) -> list[pb.ModelMetadataResponse.TensorMetadata]:
                return [pb.ModelMetadataResponse.TensorMetadata(**s) for s in specs]

            return pb.ModelMetadataResponse(
                name=meta["name"],
                versions=meta["versions"],
                platform=meta["platform"],
                inputs=tensors(meta["inputs"]),
                outputs=tensors(meta["outputs"]),
            )

        return await self._call("ModelMetadata", context, run)

    # --- inference -----------------------------------------------------------------------

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Context) -> pb.ModelInferResponse:
        """Inference; raw inputs get raw outputs, typed inputs typed outputs."""

        async def run(rid: str) -> pb.ModelInferResponse:
            entry = self.registry.get(request.model_name, request.model_version or None)
            return await self._observed(entry, context, self._infer(entry, request, context, rid))

        return await self._call("ModelInfer", context, run, request.id)

    async def _infer(
        self, entry: ModelEntry, message: pb.ModelInferRequest, context: Context, rid: str
    ) -> pb.ModelInferResponse:
        config = entry.config
        request = codec.decode_request(message)
        inputs = infer.validate_inputs(config, request, self.limits)
        infer.requested_outputs(config, request)  # an unknown output fails before inference
        outputs = await dataplane.infer(
            self.registry,
            entry,
            inputs,
            timeout_s=self._timeout_s(entry, request, context),
            request_id=rid,
            is_disconnected=context.cancelled,
        )
        response = infer.build_response(config, request, outputs)
        return codec.encode_response(response, raw=bool(message.raw_input_contents))

    def _timeout_s(self, entry: ModelEntry, request: infer.InferRequest, context: Context) -> float:
        """The earlier of the gRPC deadline and the request's ``timeout``, else the default."""
        limits = [t for t in (context.time_remaining(), request.timeout_s()) if t is not None]
        return min(limits) if limits else dataplane.default_timeout_s(self.settings, entry)

    async def _observed(self, entry: ModelEntry, context: Context, work: Awaitable[Reply]) -> Reply:
        """Count and time one ModelInfer in the Prometheus metrics (``protocol="grpc"``, ``code``
        = the gRPC status name)."""
        if self.metrics is None:
            return await work
        labels = (entry.config.name, entry.config.version)
        in_flight = self.metrics.in_flight.labels(*labels)
        in_flight.inc()
        start = time.perf_counter()
        code = grpc.StatusCode.INTERNAL.name
        try:
            reply = await work
            code = grpc.StatusCode.OK.name
            return reply
        except ScoringError as exc:
            code = status_of(exc).name
            raise
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED.name  # the client went away or its deadline passed
            raise
        finally:
            in_flight.dec()
            self.metrics.request_seconds.labels(*labels, "grpc").observe(time.perf_counter() - start)
            self.metrics.requests.labels(*labels, "grpc", code).inc()
