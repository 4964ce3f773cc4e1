"""Open Inference Protocol (KServe V2) JSON REST: request decoding, response encoding.

Source: the Open Inference Protocol REST spec ("Inference Request JSON Object",
"Inference Response JSON Object", "Tensor Data"). Request ``parameters`` may
carry ``timeout`` in microseconds (Triton's convention). The msgspec structs here are the
wire shapes (and the OpenAPI schemas, ``python -m app.http.openapi``); decoding yields the
protocol-neutral :class:`app.protocols.infer.InferRequest`.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import orjson

from app.datatypes import DATATYPES
from app.errors import InvalidInput
from app.models.repository import ModelConfig
from app.protocols.binary import response_document
from app.protocols.infer import (
    InferInput,
    InferRequest,
    InferResponse,
    RequestedOutput,
    parameters_timeout_s,
)
from app.protocols.limits import RequestLimits, decode_json

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
    :func:`app.protocols.binary.attach_binary` to fill.

    Raises:
        InvalidInput: malformed JSON, nesting deeper than ``limits.max_json_depth``, a field
            of the wrong type (the message names the JSON path, e.g. ``$.inputs[0].shape``),
            or a ``parameters.timeout`` that is not a positive number of microseconds.
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
        timeout_s=parameters_timeout_s(parameters),
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

    return {
        "name": config.name,
        "versions": [config.version],
        "platform": config.platform,
        "inputs": [spec(s) for s in config.inputs],
        "outputs": [spec(s) for s in config.outputs],
        "parameters": {
            "max_batch_size": config.max_batch_size,
            "max_queue_delay_ms": config.max_queue_delay_ms,
        },
    }
