"""One inference request type for every protocol front end (HTTP V2 JSON, V2 JSON + binary,
KServe V1, gRPC), validated against a model the same way, and one response type.

A front end decodes its wire format into an :class:`InferRequest` and hands it to the data
plane (:meth:`app.serving.dataplane.DataPlane.infer`), which validates it
(:func:`validate_inputs`: ``dict[str, np.ndarray]``, ``[B, *item_shape]`` per input), runs it
and builds the :class:`InferResponse` (:func:`build_response`: the outputs asked for, each
marked binary or not); the front end then encodes that response in its own wire format.

Deadlines: every protocol's ways of naming one (HTTP ``X-Request-Timeout-Ms``, V2
``parameters.timeout`` in microseconds, a gRPC deadline) are parsed here, by
:func:`header_timeout_s`, :func:`parameters_timeout_s` and :func:`earliest`, into
:attr:`InferRequest.timeout_s`; the data plane clips it to the model's maximum.

Source: KServe's ``InferRequest``/``InferInput``/``InferResponse``
(kserve/kserve ``python/kserve/kserve/protocol/infer_type.py``), reduced to what the
server needs; no aiohttp and no grpc here. The classes are plain ``msgspec.Struct``s (cheaper to
build than dataclasses; nothing is validated on construction).
"""

from __future__ import annotations

import math
import random
import re
from typing import Any

import msgspec
import numpy as np

from app.datatypes import NUMPY_DTYPES
from app.errors import InvalidInput, PayloadTooLarge
from app.models.repository import ModelConfig
from app.protocols.limits import RequestLimits
from app.protocols.tensors import (
    check_against_spec,
    check_elements,
    check_shape,
    complete_inputs,
    decode_raw,
    to_array,
)

#: A request id a client may choose (HTTP ``X-Request-Id``, gRPC ``ModelInferRequest.id`` or
#: ``x-request-id`` metadata): a sane token, echoed in responses and logs.
_VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def request_id(*candidates: str) -> str:
    """The first candidate that is a sane request id (1-128 of ``[A-Za-z0-9._:-]``), else a
    new one: 128 random bits as 32 hex digits. An id names a request in logs and errors; it is
    no secret, so it comes from ``random`` (reseeded in each forked worker), not a syscall."""
    for candidate in candidates:
        if candidate and _VALID_REQUEST_ID.match(candidate):
            return candidate
    return f"{random.getrandbits(128):032x}"

_DEFAULT_LIMITS = RequestLimits()


class RawData(msgspec.Struct):
    """A tensor's data as raw bytes, not yet decoded (binary tensor data, gRPC
    ``raw_input_contents``): little-endian row-major elements, BYTES length-prefixed.
    :func:`validate_inputs` decodes it once its name, datatype and size fit the model."""

    data: memoryview | bytes


class InferInput(msgspec.Struct):
    """One input tensor of a request.

    Attributes:
        name: the model input it feeds.
        datatype: Open Inference Protocol datatype name (``"FP32"``, ``"BYTES"``...).
        shape: the tensor's shape, batch dimension first; None = infer it from nested ``data``
            (KServe V1 bodies carry no shape).
        data: JSON values (flat or nested row-major lists; BYTES as ``str``), raw bytes
            (:class:`RawData`: binary tensor data, gRPC raw contents), or a numpy array already
            of ``datatype``'s dtype (gRPC typed contents; BYTES as an ``object`` array of
            ``bytes``), any shape with ``prod(shape)`` elements; None until a binary part
            fills it (:func:`app.protocols.binary.attach_binary`).
        parameters: the tensor's ``parameters`` as sent.
    """

    name: str
    datatype: str
    shape: list[int] | None
    data: list[Any] | np.ndarray | RawData | None
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)


class RequestedOutput(msgspec.Struct):
    """An output the client asked for.

    Attributes:
        name: the model output.
        binary_data: True/False = send it as binary tensor data / as JSON; None = the
            request's default (:attr:`InferRequest.binary_data_output`).
        parameters: the output's ``parameters`` as sent.
    """

    name: str
    binary_data: bool | None = None
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)


class InferRequest(msgspec.Struct):
    """One inference request, whatever protocol it came in.

    Attributes:
        model_name, model_version: the model addressed (version None = the highest).
        inputs: the input tensors, in the order sent.
        id: the client's request id, echoed in the response.
        parameters: the request's ``parameters`` (``timeout`` in microseconds, Triton's).
        outputs: the outputs asked for; None = every output in model order.
        binary_data_output: send outputs not named in ``outputs`` (or all) as binary tensor
            data (Triton's ``parameters.binary_data_output``).
    """

    model_name: str
    inputs: list[InferInput]
    model_version: str | None = None
    id: str | None = None
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)
    outputs: list[RequestedOutput] | None = None
    binary_data_output: bool = False

    #: The earliest deadline the client named, seconds from when the request arrived
    #: (:func:`earliest` of the transport's and ``parameters.timeout``); None = none named.
    timeout_s: float | None = None


def header_timeout_s(value: str | None, header: str = "X-Request-Timeout-Ms") -> float | None:
    """A deadline header in milliseconds (``X-Request-Timeout-Ms``) as seconds; None when absent.

    Raises:
        InvalidInput: not a positive finite number.
    """
    if value is None:
        return None
    try:
        ms = float(value)
    except ValueError:
        raise InvalidInput(f"{header} must be a number of milliseconds") from None
    if not 0 < ms < math.inf:
        raise InvalidInput(f"{header} must be a positive number of milliseconds")
    return ms / 1000.0


def parameters_timeout_s(parameters: dict[str, Any]) -> float | None:
    """``parameters.timeout`` (microseconds, Triton's convention) as seconds; None when absent.

    Raises:
        InvalidInput: not a positive finite number.
    """
    value = parameters.get("timeout")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise InvalidInput("parameters.timeout must be a positive number of microseconds")
    return float(value) / 1e6


def earliest(*timeouts_s: float | None) -> float | None:
    """The shortest of the deadlines given (seconds), None when none is: a client that names a
    deadline twice (a header and a body parameter, a gRPC deadline and a parameter) gets the
    earlier one."""
    given = [t for t in timeouts_s if t is not None]
    return min(given) if given else None


class OutputTensor(msgspec.Struct):
    """One output of a response: ``array`` is ``[B, ...]`` of the output's datatype (BYTES:
    ``object`` array of ``bytes``); ``binary`` = the client wants it as binary tensor data."""

    name: str
    datatype: str
    array: np.ndarray
    binary: bool = False


class InferResponse(msgspec.Struct):
    """An inference response before encoding: model, echoed request id, outputs in order."""

    model_name: str
    model_version: str
    outputs: list[OutputTensor]
    id: str | None = None
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)


def _typed_array(tensor: InferInput, shape: list[int], where: str, limits: RequestLimits) -> np.ndarray:
    """An array already of the tensor's dtype (gRPC typed contents), reshaped to ``shape``."""
    arr = tensor.data
    assert isinstance(arr, np.ndarray)
    expected = math.prod(shape)
    if arr.size != expected:
        raise InvalidInput(f"{where}: shape {shape} needs {expected} elements, data has {arr.size}")
    if tensor.datatype == "BYTES":
        longest = max((len(v) for v in arr.ravel()), default=0)
        if longest > limits.max_string_bytes:
            raise PayloadTooLarge(
                f"{where}: an element is {longest} bytes; the server accepts at most "
                f"{limits.max_string_bytes} per string (SCORING_MAX_STRING_BYTES)"
            )
    elif arr.dtype != NUMPY_DTYPES[tensor.datatype]:
        raise InvalidInput(f"{where}: data of dtype {arr.dtype} for datatype {tensor.datatype}")
    return arr.reshape(shape)


def validate_inputs(
    config: ModelConfig, request: InferRequest, limits: RequestLimits = _DEFAULT_LIMITS
) -> dict[str, np.ndarray]:
    """Validate the request's tensors against ``config``, each in this order: its shape (at
    most ``MAX_DIMS`` non-negative dimensions, at most ``limits.max_items`` items), its name
    (a model input, once), its datatype, its element count against the input's spec (all
    before any per-element work, so a hostile tensor costs a few comparisons), and only then
    its data, decoded or converted and checked against the spec.

    Returns:
        One array ``[B, *item_shape]`` per model input (omitted optional inputs filled),
        all with the same B >= 1.

    Raises:
        InvalidInput: a malformed shape, unknown/missing/duplicate input, wrong datatype or
            shape, element count mismatch, malformed raw data, non-finite floats where the
            model forbids them.
        PayloadTooLarge: more than ``limits.max_items`` items, or a string longer than
            ``limits.max_string_bytes``.
    """
    arrays: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(request.inputs):
        where = f"inputs[{i}] ({tensor.name!r})"
        shape = check_shape(tensor.shape, where) if tensor.shape is not None else None
        if shape:
            limits.check_items(shape[0], where)
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
        data = tensor.data
        if data is None:
            raise InvalidInput(f"{where}: no data: give data or parameters.binary_data_size")
        if shape is not None:
            check_elements(shape, spec, limits.max_items, where)
        if isinstance(data, RawData):
            if shape is None:
                raise InvalidInput(f"{where}: raw data needs a shape")
            arr = decode_raw(tensor.datatype, shape, data.data, where, limits.max_string_bytes).reshape(shape)
        elif isinstance(data, np.ndarray):
            arr = _typed_array(tensor, shape if shape is not None else list(data.shape), where, limits)
        else:
            if shape is not None and shape and len(data) > math.prod(shape):
                raise InvalidInput(f"{where}: shape {shape} needs {math.prod(shape)} elements, data has more")
            arr = to_array(data, tensor.datatype, shape, where, limits.max_string_bytes)
        arrays[tensor.name] = check_against_spec(arr, spec, config.allow_non_finite, where)
    if not arrays and all(s.optional for s in config.inputs):
        raise InvalidInput(f"inputs: empty; model {config.name} takes {[s.name for s in config.inputs]}")
    return complete_inputs(config, arrays, "inputs")


def requested_outputs(config: ModelConfig, request: InferRequest) -> list[str]:
    """Names of the outputs to return: the request's ``outputs`` in its order, or all in model
    order.

    Raises:
        InvalidInput: an unknown output name, or one asked for twice.
    """
    names = [s.name for s in config.outputs]
    if not request.outputs:
        return names
    wanted = [o.name for o in request.outputs]
    unknown = [n for n in wanted if n not in names]
    if unknown:
        raise InvalidInput(f"outputs: unknown output(s) {unknown}; model {config.name} has {names}")
    if len(set(wanted)) != len(wanted):
        twice = sorted({n for n in wanted if wanted.count(n) > 1})
        raise InvalidInput(f"outputs: {twice} asked for more than once")
    return wanted


def build_response(
    config: ModelConfig, request: InferRequest, outputs: dict[str, np.ndarray], wanted: list[str]
) -> InferResponse:
    """The response to ``request``: the outputs ``wanted`` (:func:`requested_outputs`), in that
    order, each marked binary when the request wants it so (per output ``binary_data``, else
    the request's ``binary_data_output``)."""
    datatypes = {s.name: s.datatype for s in config.outputs}
    binary = {o.name: o.binary_data for o in request.outputs or ()}
    tensors = []
    for name in wanted:
        wants = binary.get(name)
        tensors.append(
            OutputTensor(
                name,
                datatypes[name],
                outputs[name],
                request.binary_data_output if wants is None else wants,
            )
        )
    return InferResponse(config.name, config.version, tensors, request.id)
