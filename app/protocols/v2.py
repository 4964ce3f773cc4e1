"""Open Inference Protocol (KServe V2) REST: request decoding, response encoding, and Triton's
binary tensor data extension.

Source: the Open Inference Protocol REST spec ("Inference Request JSON Object",
"Inference Response JSON Object", "Tensor Data"). Request ``parameters`` may
carry ``timeout`` in microseconds (Triton's convention). The msgspec structs here are the
wire shapes (and the OpenAPI schemas, ``python -m app.http.openapi``); decoding yields the
protocol-neutral :class:`app.protocols.infer.InferRequest`.

**Binary tensor data.** A request body is a JSON inference request of
``Inference-Header-Content-Length`` bytes, then the raw data of every input whose
``parameters.binary_data_size`` is set, in input order. A fixed-size datatype is its elements
little-endian, row-major; a BYTES tensor is each element as a 4-byte little-endian length then
that many bytes. Responses work the same way for the outputs asked for as binary
(``parameters.binary_data`` per output, or ``parameters.binary_data_output`` for all), whose
JSON then carries ``parameters.binary_data_size`` instead of ``data``.

Source: triton-inference-server/server ``docs/protocol/extension_binary_data.md`` and the
client's ``tritonclient/http/_utils.py`` (``_get_inference_request``). No aiohttp here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import numpy as np
import orjson

from app.datatypes import DATATYPES
from app.errors import InvalidInput
from app.models.repository import ModelConfig, TensorSpec
from app.protocols.codec import JSON, Answer, Api, Call, Route
from app.protocols.infer import (
    InferInput,
    InferRequest,
    InferResponse,
    RawData,
    RequestedOutput,
    lengths_name,
)
from app.protocols.tensors import RequestLimits, decode_json, tensor_bytes, wire_tensors

_DATATYPES = sorted(DATATYPES)
#: Schema-only annotations (decoding stays lenient, so the checks below name the field).
DatatypeField = Annotated[str, msgspec.Meta(extra_json_schema={"enum": _DATATYPES})]
ResponseDatatype = Annotated[str, msgspec.Meta(extra_json_schema={"enum": _DATATYPES})]
Parameters = Annotated[dict[str, Any], msgspec.Meta(description="Free-form parameters.")]


class RequestInput(msgspec.Struct):
    """``$request_input``: one input tensor; ``data`` is absent when the tensor travels as
    binary tensor data (``parameters.binary_data_size``)."""

    name: str
    shape: Annotated[list[int], msgspec.Meta(description="[batch, *item shape].")]
    datatype: DatatypeField
    data: (
        Annotated[list[Any], msgspec.Meta(description="Row-major, flat or nested; strings for BYTES.")] | None
    ) = None
    parameters: (
        Annotated[
            dict[str, Any],
            msgspec.Meta(description="binary_data_size: bytes of this tensor after the JSON."),
        ]
        | None
    ) = None


class RequestOutput(msgspec.Struct):
    """``$request_output``: an output the client wants back."""

    name: str
    parameters: (
        Annotated[dict[str, Any], msgspec.Meta(description="binary_data: true = as binary tensor data.")]
        | None
    ) = None


class InferenceRequest(msgspec.Struct):
    """``$inference_request``."""

    inputs: list[RequestInput]
    id: str | None = None
    parameters: (
        Annotated[
            dict[str, Any],
            msgspec.Meta(
                description="timeout: deadline in microseconds (Triton's convention); "
                "binary_data_output: every output as binary tensor data."
            ),
        ]
        | None
    ) = None
    outputs: list[RequestOutput] | None = None


class ResponseOutput(msgspec.Struct, omit_defaults=True):
    """``$response_output``: ``data`` flattened row-major, or ``parameters.binary_data_size``
    when the tensor follows the JSON as binary tensor data."""

    name: str
    shape: list[int]
    datatype: ResponseDatatype
    data: list[Any] | None = None
    parameters: Parameters | None = None


class InferenceResponse(msgspec.Struct, omit_defaults=True):
    """``$inference_response``."""

    model_name: str
    outputs: list[ResponseOutput]
    model_version: str | None = None
    id: str | None = None
    parameters: Parameters | None = None


_decoder = msgspec.json.Decoder(InferenceRequest)
_DEFAULT_LIMITS = RequestLimits()


def _flag(parameters: dict[str, Any], key: str, where: str) -> bool | None:
    value = parameters.get(key)
    if value is not None and not isinstance(value, bool):
        raise InvalidInput(f"{where}.{key} must be true or false")
    return value


def decode_request(
    body: bytes,
    model_name: str,
    model_version: str | None = None,
    limits: RequestLimits = _DEFAULT_LIMITS,
) -> InferRequest:
    """Parse an ``$inference_request`` JSON body (or the JSON part of a binary one) into an
    :class:`InferRequest`; inputs sent as binary keep ``data`` None for
    :func:`attach_binary` to fill.

    Raises:
        InvalidInput: malformed JSON, nesting deeper than ``limits.max_json_depth``, a field
            of the wrong type (the message names the JSON path, e.g. ``$.inputs[0].shape``).
    """
    wire = decode_json(_decoder, body, limits.max_json_depth, "inference request")
    parameters = wire.parameters or {}
    outputs = None
    if wire.outputs is not None:
        outputs = [
            RequestedOutput(o.name, _flag(o.parameters or {}, "binary_data", f"outputs[{i}].parameters"),
                            o.parameters or {})
            for i, o in enumerate(wire.outputs)
        ]  # fmt: skip
    return InferRequest(
        model_name=model_name,
        model_version=model_version,
        inputs=[InferInput(t.name, t.datatype, t.shape, t.data, t.parameters or {}) for t in wire.inputs],
        id=wire.id,
        parameters=parameters,
        outputs=outputs,
        binary_data_output=bool(_flag(parameters, "binary_data_output", "parameters")),
    )


def encode_response(response: InferResponse) -> tuple[bytes, int | None]:
    """``$inference_response`` bytes; with outputs marked binary, the JSON then their binary
    tensor data, and the JSON's length for the ``Inference-Header-Content-Length`` header
    (None when the body is all JSON)."""
    document, chunks = response_document(response)
    head = orjson.dumps(document, option=orjson.OPT_SERIALIZE_NUMPY)
    if not chunks:
        return head, None
    return b"".join([head, *chunks]), len(head)


def model_metadata(config: ModelConfig) -> dict[str, Any]:
    """``$metadata_model_response``: shapes with -1 for the batch dimension."""

    def spec(s: Any) -> dict[str, Any]:
        return {"name": s.name, "datatype": s.datatype, "shape": [-1, *s.shape]}

    def outputs(s: TensorSpec) -> list[dict[str, Any]]:
        if not s.ragged:  # a ragged one: its items' rows end to end, and their lengths
            return [spec(s)]
        return [{"name": s.name, "datatype": s.datatype, "shape": s.shape},
                {"name": lengths_name(s.name), "datatype": "INT64", "shape": [-1]}]  # fmt: skip

    return {
        "name": config.name,
        "versions": [config.version],
        "platform": config.platform,
        "inputs": [spec(s) for s in config.inputs],
        "outputs": [t for s in config.outputs for t in outputs(s)],
        "parameters": {
            "max_batch_size": config.max_batch_size,
            "max_queue_delay_ms": config.max_queue_delay_ms,
        },
    }


#: Request and response header: length in bytes of the JSON part at the start of the body.
HEADER_LENGTH = "Inference-Header-Content-Length"


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    """Split a request body at ``Inference-Header-Content-Length``.

    Args:
        body: the whole (decompressed) request body.
        header_length: the header's value, or None when absent (all of ``body`` is JSON).

    Returns:
        The JSON part and a zero-copy view of the binary part after it (empty when none).

    Raises:
        InvalidInput: the header is not a decimal integer within ``[0, len(body)]``.
    """
    if header_length is None:
        return body, memoryview(b"")
    text = header_length.strip()
    if not text.isdecimal() or not text.isascii() or len(text) > 20:
        raise InvalidInput(f"{HEADER_LENGTH} must be a non-negative integer, got {header_length[:40]!r}")
    size = int(text)
    if size > len(body):
        raise InvalidInput(f"{HEADER_LENGTH} is {size} but the body has only {len(body)} bytes")
    view = memoryview(body)
    return body[:size] if size < len(body) else body, view[size:]


def _declared_size(parameters: dict[str, Any], where: str) -> int | None:
    size = parameters.get("binary_data_size")
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise InvalidInput(f"{where}: parameters.binary_data_size must be a non-negative integer")
    return size


def attach_binary(request: InferRequest, binary: memoryview) -> None:
    """Give every input that declares ``parameters.binary_data_size`` its part of ``binary``, in
    input order, as :class:`~app.protocols.infer.RawData` (a view: nothing is copied or
    decoded here; validation decodes it once the tensor's name, datatype and size are known to
    fit the model: :func:`app.serving.dataplane.validate_inputs`).

    Raises:
        InvalidInput: a declared size is not a non-negative integer; sizes do not add up to
            the binary part's length; an input has both ``data`` and binary data, or neither;
            shared-memory parameters (not supported).
    """
    offset = 0
    for i, tensor in enumerate(request.inputs):
        where = f"inputs[{i}] ({tensor.name!r})"
        if "shared_memory_region" in tensor.parameters:
            raise InvalidInput(f"{where}: shared-memory tensors are not supported by this server")
        size = _declared_size(tensor.parameters, where)
        if size is None:
            if tensor.data is None:
                raise InvalidInput(f"{where}: no data: give data or parameters.binary_data_size")
            continue
        if tensor.data is not None:
            raise InvalidInput(f"{where}: both data and parameters.binary_data_size given")
        if size > len(binary) - offset:
            raise InvalidInput(
                f"{where}: binary_data_size {size} runs past the body ({len(binary) - offset} bytes left)"
            )
        tensor.data = RawData(binary[offset : offset + size])
        offset += size
    if offset != len(binary):
        raise InvalidInput(
            f"the body has {len(binary) - offset} bytes after the JSON header and the inputs' "
            f"binary_data_size; {HEADER_LENGTH} or a binary_data_size is wrong"
        )


def response_document(response: InferResponse) -> tuple[dict[str, Any], list[bytes]]:
    """The JSON object of ``response`` (``$inference_response``) and the binary chunks of the
    outputs marked binary, in order; JSON outputs keep numpy ``data`` for orjson to write."""
    body: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id is not None:
        body["id"] = response.id
    if response.parameters:
        body["parameters"] = response.parameters
    tensors: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for out in wire_tensors(response.outputs):
        tensor: dict[str, Any] = {"name": out.name, "datatype": out.datatype, "shape": list(out.array.shape)}
        if out.binary:
            raw = tensor_bytes(out.array, out.datatype)
            tensor["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        elif out.datatype == "BYTES":
            tensor["data"] = [
                v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in out.array.ravel()
            ]
        else:
            tensor["data"] = np.ascontiguousarray(out.array).ravel()
        tensors.append(tensor)
    body["outputs"] = tensors
    return body, chunks


@dataclass(frozen=True)
class V2Codec:
    """Open Inference Protocol REST as a codec (``app.protocols.codec``): ``$inference_request``
    in, ``$inference_response`` out, either with Triton's binary tensor data extension
    (``Inference-Header-Content-Length``); the model named in the path."""

    named_in_path: bool = True

    def call(self, body: bytes, headers: Mapping[str, str], limits: RequestLimits) -> Call[Answer]:
        """Split the JSON head from the binary tensors; decode the head once the model is known.

        Raises:
            InvalidInput: a bad ``Inference-Header-Content-Length``.
        """
        head, binary = split_body(body, headers.get(HEADER_LENGTH))

        def build(config: ModelConfig) -> InferRequest:
            parsed = decode_request(head, config.name, config.version, limits)
            attach_binary(parsed, binary)
            return parsed

        return Call(build, self.encode)

    @staticmethod
    def encode(config: ModelConfig, response: InferResponse) -> Answer:
        """JSON, or the JSON head and the binary outputs the request asked for."""
        payload, header_length = encode_response(response)
        if header_length is None:
            return payload, JSON, {}
        return payload, "application/octet-stream", {HEADER_LENGTH: str(header_length)}


#: The Open Inference Protocol's inference over HTTP (``app.protocols.codec.Api``).
API = Api(
    protocol="v2",
    title="Open Inference Protocol (KServe V2) REST",
    routes=(
        Route("/v2/models/{name}/infer", "modelInfer"),
        Route("/v2/models/{name}/versions/{version}/infer", "modelVersionInfer"),
    ),
    codec=V2Codec(),
    summary="Run inference (Open Inference Protocol)",
    request=InferenceRequest,
    response=InferenceResponse,
    answer="Outputs, flattened row-major (or as binary tensor data after the JSON).",
    binary=True,
)
