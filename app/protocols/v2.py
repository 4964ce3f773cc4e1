"""Open Inference Protocol (KServe V2) JSON REST: request decoding, response encoding.

Source: the Open Inference Protocol REST spec ("Inference Request JSON Object",
"Inference Response JSON Object", "Tensor Data"). Request ``parameters`` may
carry ``timeout`` in microseconds (Triton's convention).
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import orjson

from app.errors import InvalidInput
from app.models.repository import ModelConfig
from app.protocols.limits import RequestLimits, check_json_depth
from app.protocols.tensors import check_against_spec, complete_inputs, to_array


class RequestInput(msgspec.Struct):
    """``$request_input``: one input tensor."""

    name: str
    shape: list[int]
    datatype: str
    data: list[Any]
    parameters: dict[str, Any] | None = None


class RequestOutput(msgspec.Struct):
    """``$request_output``: an output the client wants back."""

    name: str
    parameters: dict[str, Any] | None = None


class InferenceRequest(msgspec.Struct):
    """``$inference_request``."""

    inputs: list[RequestInput]
    id: str | None = None
    parameters: dict[str, Any] | None = None
    outputs: list[RequestOutput] | None = None


_decoder = msgspec.json.Decoder(InferenceRequest)
_DEFAULT_LIMITS = RequestLimits()


def decode_request(body: bytes, limits: RequestLimits = _DEFAULT_LIMITS) -> InferenceRequest:
    """Parse an inference request body.

    Raises:
        InvalidInput: malformed JSON, nesting deeper than ``limits.max_json_depth``, or a
            field of the wrong type (the message names the JSON path, e.g. ``$.inputs[0].shape``).
    """
    check_json_depth(body, limits.max_json_depth)
    try:
        return _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise InvalidInput(f"invalid inference request: {exc}") from None
    except RecursionError:  # only with max_json_depth near Python's recursion limit
        raise InvalidInput("invalid inference request: nested too deeply") from None


def timeout_s(request: InferenceRequest) -> float | None:
    """The request's ``parameters.timeout`` (microseconds) in seconds, or None.

    Raises:
        InvalidInput: the timeout is not a positive number.
    """
    value = (request.parameters or {}).get("timeout")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise InvalidInput("parameters.timeout must be a positive number of microseconds")
    return float(value) / 1e6


def prepare_inputs(
    config: ModelConfig, request: InferenceRequest, limits: RequestLimits = _DEFAULT_LIMITS
) -> dict[str, np.ndarray]:
    """Validate the request's tensors against ``config``: arrays [B, *item_shape] by input name.

    Raises:
        InvalidInput: unknown/missing/duplicate input, wrong datatype or shape,
            element count mismatch, non-finite floats where forbidden.
        PayloadTooLarge: more than ``limits.max_items`` items, or a string longer than
            ``limits.max_string_bytes``.
    """
    arrays: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(request.inputs):
        where = f"inputs[{i}] ({tensor.name!r})"
        if tensor.shape:  # checked before any data is converted
            limits.check_items(tensor.shape[0], where)
        if tensor.name in arrays:
            raise InvalidInput(f"{where}: input given twice")
        spec = config.input(tensor.name)
        if spec is None:
            raise InvalidInput(
                f"{where}: unknown input; model {config.name} takes {[s.name for s in config.inputs]}"
            )
        if tensor.datatype != spec.datatype:
            raise InvalidInput(
                f"{where}: datatype {tensor.datatype} but model {config.name} expects {spec.datatype}"
            )
        arr = to_array(tensor.data, tensor.datatype, tensor.shape, where, limits.max_string_bytes)
        arrays[tensor.name] = check_against_spec(arr, spec, config.allow_non_finite, where)
    return complete_inputs(config, arrays, "inputs")


def requested_outputs(config: ModelConfig, request: InferenceRequest) -> list[str]:
    """Names of the outputs to return: the request's ``outputs`` or all, in model order.

    Raises:
        InvalidInput: an unknown output name.
    """
    names = [s.name for s in config.outputs]
    if not request.outputs:
        return names
    wanted = [o.name for o in request.outputs]
    unknown = [n for n in wanted if n not in names]
    if unknown:
        raise InvalidInput(f"outputs: unknown output(s) {unknown}; model {config.name} has {names}")
    return wanted


def _tensor(name: str, datatype: str, arr: np.ndarray) -> dict[str, Any]:
    if datatype == "BYTES":
        data: Any = [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in arr.ravel()]
    else:
        data = np.ascontiguousarray(arr).ravel()
    return {"name": name, "datatype": datatype, "shape": list(arr.shape), "data": data}


def encode_response(
    config: ModelConfig, outputs: dict[str, np.ndarray], names: list[str], request_id: str | None
) -> bytes:
    """``$inference_response`` as JSON bytes, data flattened row-major."""
    datatypes = {s.name: s.datatype for s in config.outputs}
    body: dict[str, Any] = {"model_name": config.name, "model_version": config.version}
    if request_id is not None:
        body["id"] = request_id
    body["outputs"] = [_tensor(n, datatypes[n], outputs[n]) for n in names]
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


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
