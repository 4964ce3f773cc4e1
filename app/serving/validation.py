"""A request against its model: its tensors validated and converted into arrays, the outputs it
asks for, its ``parameters`` (``timeout``, ``priority``), and the response built from the model's
outputs. What :meth:`app.serving.dataplane.DataPlane.infer` runs before and after the model, the
same checks and limits for every protocol; no aiohttp here.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from app.errors import InvalidInput, PayloadTooLarge
from app.models.repository import ModelConfig
from app.protocols import triton
from app.protocols.infer import InferRequest, InferResponse, OutputTensor, RawData
from app.protocols.tensors import (
    RequestLimits,
    check_against_spec,
    check_elements,
    check_shape,
    complete_inputs,
    decode_raw,
    to_array,
    typed_array,
)

Arrays = dict[str, np.ndarray]
_LIMITS = RequestLimits()


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


def parameters_priority(parameters: dict[str, Any]) -> int | None:
    """``parameters.priority`` (Triton's: 1 = the highest level, 0 = the model's default);
    None when absent.

    Raises:
        InvalidInput: not a whole number >= 0.
    """
    value = parameters.get("priority")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInput("parameters.priority must be a whole number >= 0 (1 = the highest level)")
    return value


def validate_inputs(config: ModelConfig, request: InferRequest, limits: RequestLimits = _LIMITS) -> Arrays:
    """The request's tensors checked against ``config``, each in this order: its shape (at most
    ``MAX_DIMS`` non-negative dimensions, ``limits.max_items`` items), its name (a model input,
    once), its datatype, its element count (all before any per-element work: a hostile tensor
    costs a few comparisons), then its data, decoded or converted and checked against the spec.

    Returns:
        One array ``[B, *item_shape]`` per model input (omitted optional inputs filled), one B >= 1.

    Raises:
        InvalidInput: a malformed shape, unknown/missing/duplicate input, wrong datatype or shape,
            element count mismatch, malformed raw data, non-finite floats the model forbids.
        PayloadTooLarge: over ``limits.max_items`` items or ``limits.max_string_bytes`` per string.
    """
    specs = {s.name: s for s in config.inputs}
    arrays: Arrays = {}
    for i, tensor in enumerate(request.inputs):
        where = f"inputs[{i}] ({tensor.name!r})"
        shape = check_shape(tensor.shape, where) if tensor.shape is not None else None
        if shape:
            limits.check_items(shape[0], where)
        if tensor.name in arrays:
            raise InvalidInput(f"{where}: input given twice")
        spec = specs.get(tensor.name)
        if spec is None:
            raise InvalidInput(f"{where}: unknown input; model {config.name} takes {list(specs)}")
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
            arr = typed_array(tensor, shape if shape is not None else list(data.shape), where, limits)
        else:
            if shape is not None and shape and len(data) > math.prod(shape):
                raise InvalidInput(f"{where}: shape {shape} needs {math.prod(shape)} elements, data has more")
            arr = to_array(data, tensor.datatype, shape, where, limits.max_string_bytes)
        arrays[tensor.name] = check_against_spec(arr, spec, config.allow_non_finite, where)
    if not arrays and all(s.optional for s in config.inputs):
        raise InvalidInput(f"inputs: empty; model {config.name} takes {list(specs)}")
    return complete_inputs(config, arrays, "inputs")


def check_capacity(config: ModelConfig, items: int) -> None:
    """The one cap on a request's size at its model: ``items`` (what it will queue, its texts'
    windows included) at most the model's ``queue_capacity``. Checked before the request is
    balanced, so that it does not depend on how many workers would share it (a scattered
    request's shards each fit a queue that the whole does not).

    Raises:
        PayloadTooLarge: more items than ``queue_capacity`` (413, naming the setting).
    """
    if items > config.queue_capacity:
        raise PayloadTooLarge(
            f"request has {items} items to run (its texts' windows included); model {config.name} "
            f"queues at most {config.queue_capacity} (queue_capacity in its model.toml)"
        )


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
    for o in request.outputs:
        if o.parameters and triton.CLASSIFICATION in o.parameters:
            datatype = next(s.datatype for s in config.outputs if s.name == o.name)
            triton.classification_count(o.parameters[triton.CLASSIFICATION], o.name, datatype)
    return wanted


def build_response(
    config: ModelConfig, request: InferRequest, outputs: Arrays, wanted: list[str]
) -> InferResponse:
    """The response to ``request``: the outputs ``wanted``, in that order, each marked binary when
    the request wants it so (per output ``binary_data``, else ``binary_data_output``); an output
    asked for with ``"classification": k`` becomes its top k classes (Triton's classification
    extension, :func:`app.protocols.triton.classification`)."""
    datatypes = {s.name: s.datatype for s in config.outputs}
    labels = {s.name: s.labels for s in config.outputs}
    binary = {o.name: o.binary_data for o in request.outputs or ()}
    classify = {
        o.name: o.parameters[triton.CLASSIFICATION]
        for o in request.outputs or ()
        if o.parameters and triton.CLASSIFICATION in o.parameters
    }
    tensors = []
    for name in wanted:
        wants = binary.get(name)
        datatype, array = datatypes[name], outputs[name]
        if name in classify:  # Triton's classification extension: top k as "score:index:label"
            datatype, array = "BYTES", triton.classification(array, classify[name], labels[name])
        tensors.append(
            OutputTensor(name, datatype, array, request.binary_data_output if wants is None else wants)
        )
    return InferResponse(config.name, config.version, tensors, request.id)
