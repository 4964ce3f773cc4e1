"""The inference APIs as codecs: each says where its request names the model, how its wire format
becomes an inference request, and how an inference response becomes its answer; the one path that
admits, decodes, runs and encodes is the front end's (``app.http.edge.serve``).

A codec has ``protocol`` (the label its requests' metrics carry), ``named_in_path`` (the model
is in the URL: the request is admitted before its body is read, so an overloaded model refuses it
without decoding it) and ``call(body, headers, limits)``, which decodes the body into a
:class:`Call`. Each API's module defines its codec beside its wire format (``v2.CODEC``,
``v1.CODEC``, ``openai.CODEC``, ``rerank.CODEC``, ``classify.CODEC``): adding an API is that
module and one route entry. No aiohttp here: an answer is bytes, a content type and headers.
Source: KServe's model server, whose REST and gRPC front ends decode into one ``InferRequest``
for its ``DataPlane``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import numpy as np

from app.protocols.infer import InferRequest, InferResponse
from app.protocols.tensors import RequestLimits

if TYPE_CHECKING:
    from app.models.repository import ModelConfig

__all__ = ["JSON", "Answer", "BodyNamedCodec", "Call", "Codec"]

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
    def protocol(self) -> str: ...

    @property
    def named_in_path(self) -> bool: ...

    def call(self, body: bytes, headers: Mapping[str, str], limits: RequestLimits) -> Call[Answer]:
        """Decode ``body`` (its headers beside it).

        Raises:
            InvalidInput, UnsupportedMediaType: a body this API does not accept (4xx).
        """
        ...


@dataclass(frozen=True)
class BodyNamedCodec:
    """An API whose JSON body names the model (``"model"``): OpenAI's embeddings, rerank, classify.
    A ``priority`` in the body (vLLM's field on these APIs) becomes the inference request's
    ``parameters.priority`` (Triton's: 1 = the highest level, 0 = the model's default), checked
    by the data plane as V2's.

    Attributes:
        protocol: the metrics label.
        decode: body bytes and limits -> the API's request object (with a ``model`` attribute).
        build: the model's config and that object -> the inference request.
        answer: that object, the model's config and the outputs by name -> the JSON body.
    """

    protocol: str
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
