"""``inference.GRPCInferenceService``: KServe V2 gRPC, plus Triton's config/statistics/index.

Every RPC goes through :meth:`InferenceServicer.handler`, which parses the request message
itself (so malformed protobuf is INVALID_ARGUMENT, not grpcio's INTERNAL), assigns the request id, checks
the API key (``authorization: Bearer <key>`` or ``x-api-key: <key>`` metadata, as the HTTP
headers; ServerLive and ServerReady are open like the HTTP health probes), counts the
response for ``max_requests``, maps every exception to a status through :mod:`app.grpc.errors`,
and records an inference call's metrics as the HTTP edge does (one
:class:`app.observability.metrics.Recording` per call, ``protocol="grpc"``, ``code`` = the gRPC
status name). ModelInfer builds the call's :class:`app.serving.context.RequestContext` (pinned:
a channel's one HTTP/2 connection cannot be shed), decodes the message into the shared
:class:`app.protocols.infer.InferRequest`, hands both to the data plane
(:class:`app.serving.dataplane.DataPlane`: validation with the same limits as HTTP, admission,
balancing among sibling workers, dynamic batching) and encodes the response it returns.

Deadline of a ModelInfer: the earlier of the gRPC deadline (``context.time_remaining()``)
and the request's ``timeout`` parameter (microseconds, Triton's); with neither, the model's
``timeout_ms`` else ``request_timeout_ms``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message

from app import SERVER_NAME, __version__
from app.errors import InvalidInput, ModelNotReady, Unauthorized
from app.grpc import codec
from app.grpc.errors import REQUEST_ID_KEY, outcome
from app.grpc.generated import grpc_service_pb2 as pb
from app.observability.metrics import Recording
from app.protocols import triton, v2
from app.protocols.codec import Call
from app.serving.auth import API_KEY_HEADER, presented_key
from app.serving.context import NO_DEADLINE, RequestContext, request_id
from app.serving.control import LOAD, UNLOAD
from app.serving.core import ServingCore

MessageT = TypeVar("MessageT", bound=Message)
#: The service served, as the proto declares it (``inference.GRPCInferenceService``).
SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
Context = Any  # grpc.aio.ServicerContext (grpcio ships no type information)

_OPEN = frozenset({"ServerLive", "ServerReady"})
#: The inference RPCs: their calls are recorded in the request metrics.
_RECORDED = frozenset({"ModelInfer"})
#: The metrics label of gRPC's inference calls.
PROTOCOL = "grpc"
_API_KEY = API_KEY_HEADER.lower()
#: Protocol extensions answered over gRPC (``ServerMetadataResponse.extensions``): Triton's,
#: as ``GET /v2`` lists them, but the binary tensor data of HTTP (gRPC is binary anyway).
EXTENSIONS = [e for e in triton.EXTENSIONS if e != "binary_tensor_data"]


def _metadata(context: Context, key: str) -> str | None:
    for name, value in context.invocation_metadata() or ():
        if name == key and isinstance(value, str):
            return value
    return None


def _answered(recording: Recording | None, status: grpc.StatusCode) -> None:
    """An inference call's metrics: it ends with ``status`` (no-op for other calls)."""
    if recording is not None:
        recording.answered(status.name)


def call_key(context: Context) -> str | None:
    """The key a call presents: ``authorization: Bearer <key>`` metadata, else ``x-api-key``."""
    return presented_key(_metadata(context, "authorization"), _metadata(context, _API_KEY))


def _request_id(context: Context, sent: str = "") -> str:
    """The id a request gave (``ModelInferRequest.id``, else ``x-request-id`` metadata) when
    it is a sane token, else a new one."""
    return request_id(sent, _metadata(context, REQUEST_ID_KEY) or "")


class InferenceServicer:
    """The RPCs of ``proto/grpc_service.proto`` over one worker's serving core.

    Each RPC method takes (request message, context, request id) and returns the response
    message; :meth:`handler` wraps it for grpcio.

    Args:
        core: the worker's serving core (its data plane, registry, health, API keys, metrics).
    """

    def __init__(self, core: ServingCore) -> None:
        self.core = core
        self.registry = core.registry
        self.plane = core.dataplane
        self.health = core.health
        #: None when no API keys are configured (no check per call).
        self.keys = core.keys if core.keys is not None and core.keys.enabled else None
        self.metrics = core.metrics

    def handler(self, name: str) -> Callable[[bytes, Context], Awaitable[Message]]:
        """The grpcio behaviour of RPC ``name``: serialized request in, response message out.

        Checks the API key (before the message is parsed), parses the request, assigns the
        request id (``ModelInferRequest.id`` when sane, else ``x-request-id`` metadata, else a
        new one; returned as ``x-request-id`` trailing metadata), counts the response, maps any
        exception through :func:`app.grpc.errors.outcome` (the one mapping), and records an
        inference call (its metrics made on arrival, answered with the status it ends with;
        CANCELLED when the client went away or its deadline passed).
        """
        method = getattr(self, name)
        request_type = getattr(pb, SERVICE.methods_by_name[name].input_type.name)
        metrics = self.metrics if name in _RECORDED else None

        async def rpc(raw: bytes, context: Context) -> Message:
            rid = ""
            recording = Recording(metrics, PROTOCOL) if metrics is not None else None
            try:
                # The key first: a caller without one costs no parsing of its message.
                if name not in _OPEN and not self.authorized(context):
                    raise Unauthorized("unauthorized")
                try:
                    request = request_type.FromString(raw)
                except DecodeError as exc:
                    raise InvalidInput(f"malformed {request_type.__name__} message: {exc}") from None
                rid = _request_id(context, getattr(request, "id", ""))
                if self.plane.tracing is not None:
                    self.plane.tracing.tag(rid)
                extra = () if recording is None else (recording,)  # an inference call's
                reply: Message = await method(request, context, rid, *extra)
            except asyncio.CancelledError:  # the client went away, or its deadline passed
                _answered(recording, grpc.StatusCode.CANCELLED)
                raise
            except Exception as exc:
                rid = rid or _request_id(context)
                status, details, trailer = outcome(exc, rid, name)
                _answered(recording, status)  # before the client can see the answer
                context.set_trailing_metadata(trailer)
                await context.abort(status, details)
                raise AssertionError("unreachable: abort raises") from None
            finally:
                self.health.responses += 1
            _answered(recording, grpc.StatusCode.OK)
            context.set_trailing_metadata(((REQUEST_ID_KEY, rid),))
            return reply

        return rpc

    def authorized(self, context: Context) -> bool:
        """True when no API keys are configured or the call presents one of them."""
        return self.keys is None or self.keys.check(call_key(context))

    # --- health and metadata -------------------------------------------------------------

    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: Context, rid: str
    ) -> pb.ServerLiveResponse:
        """Liveness: false once the worker's inference thread is stuck (it restarts itself)."""
        return pb.ServerLiveResponse(live=self.health.hung is None)

    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: Context, rid: str
    ) -> pb.ServerReadyResponse:
        """Readiness: every model warm and the worker not draining."""
        return pb.ServerReadyResponse(ready=self.registry.ready)

    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: Context, rid: str
    ) -> pb.ModelReadyResponse:
        """Model readiness (false for a model that cannot be served); NOT_FOUND for an unknown
        model or version."""
        try:
            entry = self.registry.get(request.name, request.version or None)
        except ModelNotReady:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=entry.ready and not self.registry.draining)

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: Context, rid: str
    ) -> pb.ServerMetadataResponse:
        """Server name, version and the protocol extensions served."""
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=__version__, extensions=EXTENSIONS)

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: Context, rid: str
    ) -> pb.ModelMetadataResponse:
        """Model metadata: the same fields as ``GET /v2/models/{name}`` (-1 = batch dimension)."""
        meta = v2.model_metadata(self.registry.get(request.name, request.version or None).config)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=meta["name"],
            versions=meta["versions"],
            platform=meta["platform"],
            inputs=[tensor(name=s["name"], datatype=s["datatype"], shape=s["shape"]) for s in meta["inputs"]],
            outputs=[
                tensor(name=s["name"], datatype=s["datatype"], shape=s["shape"]) for s in meta["outputs"]
            ],
        )

    # --- Triton extensions: the same documents as HTTP (app.protocols.triton) -------------

    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: Context, rid: str
    ) -> pb.ModelConfigResponse:
        """Triton's model configuration, as ``GET /v2/models/{name}/config`` answers it."""
        entry = self.registry.get(request.name, request.version or None)
        document = triton.model_config(entry.config, self.core.binding.device)
        return pb.ModelConfigResponse(config=_message(document, pb.ModelConfig()))

    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: Context, rid: str
    ) -> pb.ModelStatisticsResponse:
        """The server's statistics of every model (empty name), of every version of one model
        (empty version), or of one version, as ``GET /v2/models[/{name}]/stats`` answers them."""
        document = await self.plane.statistics(request.name or None, request.version or None)
        return _message(document, pb.ModelStatisticsResponse())

    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: Context, rid: str
    ) -> pb.RepositoryIndexResponse:
        """Every model version with its state (READY, LOADING, UNAVAILABLE + reason); only the
        ready ones when ``ready`` is set. ``repository_name`` is ignored (one repository)."""
        reply = pb.RepositoryIndexResponse()
        for row in self.registry.index(request.ready):
            reply.models.add(**triton.repository_entry(*row))
        return reply

    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: Context, rid: str
    ) -> pb.RepositoryModelLoadResponse:
        """Load (or reload) a model on every worker, as ``POST /v2/repository/models/{name}/load``."""
        if "config" in request.parameters or any(k.startswith("file:") for k in request.parameters):
            raise InvalidInput("parameters config and file: overrides are not supported")
        await self.core.control.request(LOAD, request.model_name)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: Context, rid: str
    ) -> pb.RepositoryModelUnloadResponse:
        """Unload a model on every worker, as ``POST /v2/repository/models/{name}/unload``."""
        await self.core.control.request(UNLOAD, request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # --- inference -----------------------------------------------------------------------

    async def ModelInfer(
        self, message: pb.ModelInferRequest, context: Context, rid: str, recording: Recording | None = None
    ) -> pb.ModelInferResponse:
        """Inference; raw inputs get raw outputs, typed inputs typed outputs. Its deadline: the
        earlier of the gRPC deadline and its ``timeout`` parameter (the data plane's); pinned to
        this worker's connection, so forwarded whole to a less-loaded sibling rather than shed."""
        plane = self.plane
        arrival = asyncio.get_running_loop().time()
        remaining = context.time_remaining()  # None without a gRPC deadline
        tracing = plane.tracing
        request_context = RequestContext(
            rid,
            NO_DEADLINE if remaining is None else arrival + remaining,
            trace=tracing.carrier() if tracing is not None else (),
            pinned=True,  # one HTTP/2 connection per channel: forwarded, not shed (dataplane)
            is_disconnected=context.cancelled,
            arrival=arrival,
            recording=recording,
        )
        name, version = message.model_name, message.model_version or None
        model, request_context = plane.admit(name, version, request_context)
        raw = bool(message.raw_input_contents)
        call = Call(
            lambda config: codec.decode_request(message, config, plane.limits),
            lambda config, response: codec.encode_response(response, raw=raw),
        )
        return await plane.serve(model, call, request_context)


def _message(document: dict[str, Any], message: MessageT) -> MessageT:
    """A Triton JSON document into its protobuf message; members the served proto leaves out
    (empty lists, our own ``worker_pid``) are skipped."""
    json_format.ParseDict(document, message, ignore_unknown_fields=True)
    return message


def generic_handler(servicer: InferenceServicer) -> Any:
    """A ``grpc.GenericRpcHandler`` serving every RPC of :data:`SERVICE` from ``servicer``
    (requests arrive as bytes: :meth:`InferenceServicer.handler` parses them)."""
    handlers = {
        m.name: grpc.unary_unary_rpc_method_handler(
            servicer.handler(m.name), response_serializer=lambda reply: reply.SerializeToString()
        )
        for m in SERVICE.methods
        if hasattr(servicer, m.name)  # the others answer UNIMPLEMENTED
    }
    return grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)
