"""The inference APIs as declarations: each API says, once, in its protocol module, everything the
front end and the OpenAPI document derive from it: its URLs, method, codec, OpenAPI operation,
error shape and protocol label (:class:`Api`). ``app.protocols.apis.APIS`` lists them; the HTTP
front end makes one route per URL (``app.http.inference``), labels the requests' metrics and
shapes their errors by the route's API (``app.http.edge``), and ``python -m app.http.openapi``
writes their operations. A new API is its protocol module and one line in that table.

A codec says where its request names the model, how its wire format becomes an inference request,
and how an inference response becomes its answer: ``named_in_path`` (the model is in the URL: the
request is admitted before its body is read, so an overloaded model refuses it without decoding
it) and ``call(body, headers, limits)``, which decodes the body into a :class:`Call`. The one path
that admits, decodes, runs and encodes is the front end's (``app.http.inference.serve``). No
aiohttp here: an answer is bytes, a content type and headers. Source: KServe's model server, whose
REST and gRPC front ends decode into one ``InferRequest`` for its ``DataPlane``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import msgspec
import numpy as np

from app.protocols.infer import InferRequest, InferResponse
from app.protocols.schemas import Error
from app.protocols.tensors import RequestLimits

if TYPE_CHECKING:
    from app.models.repository import ModelConfig

__all__ = ["JSON", "PLAIN_ERRORS", "Answer", "Api", "BodyNamedCodec", "Call", "Codec", "ErrorShape", "Route"]

JSON = "application/json"
#: An HTTP API's answer: the body, its content type, more headers.
Answer = tuple[bytes, str, dict[str, str]]
#: What a call encodes a response into (an HTTP :data:`Answer`, a gRPC message).
Encoded = TypeVar("Encoded")


@dataclass(frozen=True)
class Call(Generic[Encoded]):
    """One decoded inference call (``app.serving.dataplane.DataPlane.serve`` serves it).

    Attributes:
        build: the inference request for the model's config (decoding what depends on it, e.g.
            V2's tensors against the declared inputs). Raises InvalidInput (400).
        encode: the answer from the model's config and the data plane's response.
        name, version: the model the body names (None where the path names it).
    """

    build: Callable[[ModelConfig], InferRequest]
    encode: Callable[[ModelConfig, InferResponse], Encoded]
    name: str | None = None
    version: str | None = None


class Codec(Protocol):
    """One inference API's wire format (module docstring)."""

    @property
    def named_in_path(self) -> bool: ...

    def call(self, body: bytes, headers: Mapping[str, str], limits: RequestLimits) -> Call[Answer]:
        """Decode ``body`` (its headers beside it).

        Raises:
            InvalidInput, UnsupportedMediaType: a body this API does not accept (4xx).
        """
        ...


@dataclass(frozen=True)
class ErrorShape:
    """How an API answers an error.

    Attributes:
        schema: the msgspec type of the error body (its OpenAPI schema).
        body: (HTTP status, message) -> the JSON body.
    """

    schema: type
    body: Callable[[int, str], bytes]


def plain_error(status: int, message: str) -> bytes:
    """The Open Inference Protocol's error body, ``{"error": "<message>"}`` (KServe V1's too)."""
    return msgspec.json.encode(Error(message))


#: ``{"error": "<message>"}``: the server's errors, but those of an API with a shape of its own.
PLAIN_ERRORS = ErrorShape(Error, plain_error)


@dataclass(frozen=True)
class Route:
    """One URL of an API.

    Attributes:
        path: aiohttp's pattern (``{name}``, ``{name:[^/:]+}``); the OpenAPI path drops the regex.
        operation: its OpenAPI ``operationId``.
    """

    path: str
    operation: str


@dataclass(frozen=True)
class Api:
    """One inference API, declared once (module docstring).

    Attributes:
        protocol: the label of its requests' metrics (``protocol``) and its OpenAPI tag.
        title: the tag's description: whose API it is.
        routes: its URLs, the first one tried first (aiohttp tries resources in order).
        codec: its wire format.
        summary: the OpenAPI operation's summary.
        request, response: the msgspec types of its JSON body and of its 200 answer (their
            schemas become OpenAPI components).
        answer: what its 200 answer holds (OpenAPI).
        errors: the shape of its error answers.
        binary: it takes and gives Triton's binary tensor data (``application/octet-stream``
            bodies, ``Inference-Header-Content-Length``).
        method: the HTTP method of its routes.
    """

    protocol: str
    title: str
    routes: tuple[Route, ...]
    codec: Codec
    summary: str
    request: type
    response: type
    answer: str
    errors: ErrorShape = PLAIN_ERRORS
    binary: bool = False
    method: str = "POST"


@dataclass(frozen=True)
class BodyNamedCodec:
    """An API whose JSON body names the model (``"model"``): OpenAI's embeddings, rerank, classify.
    A ``priority`` in the body (vLLM's field on these APIs) becomes the inference request's
    ``parameters.priority`` (Triton's: 1 = the highest level, 0 = the model's default), checked
    by the data plane as V2's.

    Attributes:
        decode: body bytes and limits -> the API's request object (with a ``model`` attribute).
        build: the model's config and that object -> the inference request.
        answer: that object, the model's config and the outputs by name -> the JSON body.
    """

    decode: Callable[[bytes, RequestLimits], Any]
    build: Callable[[ModelConfig, Any], InferRequest]
    answer: Callable[[Any, ModelConfig, dict[str, np.ndarray]], bytes]
    named_in_path: bool = False

    def call(self, body: bytes, headers: Mapping[str, str], limits: RequestLimits) -> Call[Answer]:
        """Decode the body; its ``model`` names the model."""
        request = self.decode(body, limits)

        def encode(config: ModelConfig, response: InferResponse) -> Answer:
            outputs = {o.name: o.array for o in response.outputs}
            return self.answer(request, config, outputs), JSON, {}

        def build(config: ModelConfig) -> InferRequest:
            parsed = self.build(config, request)
            priority = getattr(request, "priority", None)
            if priority is not None:
                parsed.parameters["priority"] = priority
            return parsed

        return Call(build, encode, request.model)
