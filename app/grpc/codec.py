"""Protobuf <-> the shared inference request/response types (:mod:`app.protocols.infer`).

A ``ModelInferRequest`` carries each input's data either as ``raw_input_contents`` (one
``bytes`` per input, in input order: little-endian row-major elements, BYTES elements as a
4-byte little-endian length then the bytes; what tritonclient.grpc and kserve send by
default) or as typed ``contents`` (the repeated field of the datatype). Raw data become
arrays with ``numpy.frombuffer`` (no per-element Python objects) in validation, after the
tensor's name, datatype, shape and element count are checked against the model, so a hostile
message costs at most a scan of its own bytes.

The response mirrors the request: raw inputs get ``raw_output_contents`` (Triton always
answers raw), typed inputs get typed ``contents``.

Source: the Open Inference Protocol gRPC spec ("Tensor data", "raw_input_contents") and
Triton's ``grpc_service.proto``; KServe's ``InferRequest.from_grpc`` / ``to_grpc``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from app.datatypes import NUMPY_DTYPES
from app.errors import InvalidInput
from app.grpc.generated import grpc_service_pb2 as pb
from app.models.repository import ModelConfig
from app.protocols.infer import (
    InferInput,
    InferRequest,
    InferResponse,
    RawData,
    RequestedOutput,
)
from app.protocols.tensors import RequestLimits, check_elements, check_shape, tensor_bytes, wire_tensors

#: Datatype -> the ``InferTensorContents`` field that carries it (FP16 travels raw only).
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
_ALL_FIELDS = frozenset(CONTENTS_FIELD.values())


def parameters(params: Any) -> dict[str, Any]:
    """A protobuf ``map<string, InferParameter>`` as plain Python values."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        which = value.WhichOneof("parameter_choice")
        out[key] = getattr(value, which) if which is not None else None
    return out


def _set_parameter(target: Any, key: str, value: Any) -> None:
    param = target[key]
    if isinstance(value, bool):
        param.bool_param = value
    elif isinstance(value, int):
        param.int64_param = value
    elif isinstance(value, float):
        param.double_param = value
    else:
        param.string_param = str(value)


def contents_to_array(contents: Any, datatype: str, where: str) -> np.ndarray:
    """One input's typed ``contents`` -> a flat array of ``datatype``.

    Raises:
        InvalidInput: FP16 (raw only), a field of another datatype is filled, or an integer
            outside the datatype's range.
    """
    name = CONTENTS_FIELD.get(datatype)
    if name is None:
        raise InvalidInput(f"{where}: {datatype} data must be sent as raw_input_contents")
    others = [f.name for f, _ in contents.ListFields() if f.name != name and f.name in _ALL_FIELDS]
    if others:
        raise InvalidInput(f"{where}: contents.{others[0]} given for datatype {datatype} (use {name})")
    values = getattr(contents, name)
    if datatype == "BYTES":
        arr = np.empty(len(values), dtype=object)
        arr[:] = list(values)
        return arr
    dtype = NUMPY_DTYPES[datatype]
    if name in ("int_contents", "uint_contents") and dtype.itemsize < 4:
        wide = np.asarray(values, dtype=np.int64)
        info = np.iinfo(dtype)  # type: ignore[type-var]
        if wide.size and (int(wide.min()) < info.min or int(wide.max()) > info.max):
            raise InvalidInput(f"{where}: value out of {datatype} range [{info.min}, {info.max}]")
        return wide.astype(dtype)
    return np.asarray(values, dtype=dtype)


def decode_request(message: Any, config: ModelConfig, limits: RequestLimits) -> InferRequest:
    """A ``ModelInferRequest`` for model ``config`` -> :class:`InferRequest`: raw contents as
    :class:`~app.protocols.infer.RawData` (decoded by validation, once the tensor fits the
    model: :func:`app.serving.dataplane.validate_inputs`), typed contents as arrays (converted
    only for a known input, after its element count is checked).

    Raises:
        InvalidInput: raw contents whose count differs from the inputs', raw and typed data
            mixed, an unknown datatype, a malformed shape (negative, over ``MAX_DIMS``
            dimensions), more elements than ``max_items`` items of the input hold, or typed
            contents of another datatype's field.
        PayloadTooLarge: more than ``limits.max_items`` items.
    """
    raw = message.raw_input_contents
    if raw and len(raw) != len(message.inputs):
        raise InvalidInput(
            f"raw_input_contents has {len(raw)} entries for {len(message.inputs)} inputs (one per input)"
        )
    inputs = []
    for i, tensor in enumerate(message.inputs):
        where = f"inputs[{i}] ({tensor.name!r})"
        if tensor.datatype not in NUMPY_DTYPES:
            raise InvalidInput(f"{where}: unknown datatype {tensor.datatype!r}")
        shape = check_shape(list(tensor.shape), where)
        data: np.ndarray | RawData
        if raw:
            if tensor.HasField("contents"):
                raise InvalidInput(f"{where}: both contents and raw_input_contents given; send one")
            data = RawData(raw[i])
        else:
            spec = config.input(tensor.name)
            if spec is None or spec.datatype != tensor.datatype:
                data = _UNREAD  # validation refuses the name or the datatype before any data
            else:
                check_elements(shape, spec, limits.max_items, where)
                data = contents_to_array(tensor.contents, tensor.datatype, where)
        inputs.append(InferInput(tensor.name, tensor.datatype, shape, data, parameters(tensor.parameters)))
    outputs = [RequestedOutput(o.name, parameters=parameters(o.parameters)) for o in message.outputs]
    request_parameters = parameters(message.parameters)
    return InferRequest(
        model_name=message.model_name,
        model_version=message.model_version or None,
        inputs=inputs,
        id=message.id or None,
        parameters=request_parameters,
        outputs=outputs or None,
    )


#: The data of a tensor that validation refuses before reading (unknown input, other datatype).
_UNREAD = np.empty(0)


def _fill_contents(contents: Any, datatype: str, array: np.ndarray) -> None:
    flat = array.ravel()
    if datatype == "BYTES":
        contents.bytes_contents.extend(v if isinstance(v, bytes) else str(v).encode("utf-8") for v in flat)
    else:
        getattr(contents, CONTENTS_FIELD[datatype]).extend(flat.tolist())


def encode_response(response: InferResponse, raw: bool) -> pb.ModelInferResponse:
    """:class:`InferResponse` -> ``ModelInferResponse``; outputs as ``raw_output_contents``
    when ``raw`` (FP16 outputs always are), else as typed ``contents``."""
    message = pb.ModelInferResponse(
        model_name=response.model_name, model_version=response.model_version, id=response.id or ""
    )
    for key, value in response.parameters.items():
        _set_parameter(message.parameters, key, value)
    # raw_output_contents, once used, holds every output (the protocol's rule)
    outputs = wire_tensors(response.outputs)
    raw = raw or any(o.datatype not in CONTENTS_FIELD for o in outputs)
    for output in outputs:
        tensor = message.outputs.add(name=output.name, datatype=output.datatype, shape=output.array.shape)
        if raw:
            message.raw_output_contents.append(tensor_bytes(output.array, output.datatype))
        else:
            _fill_contents(tensor.contents, output.datatype, output.array)
    return message
