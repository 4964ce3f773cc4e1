"""Convert and validate one tensor of JSON data against a model's input spec.

Shapes: a request tensor is ``[B, *item_shape]`` where ``item_shape`` matches
the spec's per-item shape (``-1`` = any). A spec of per-item shape ``[1]``
also accepts ``[B]`` (a plain list of B values), the common way to send texts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from app.datatypes import FLOAT_DATATYPES, INT_DATATYPES, NUMPY_DTYPES
from app.errors import InvalidInput, PayloadTooLarge
from app.models.repository import ModelConfig, TensorSpec

#: Most dimensions of a request tensor (numpy 1.x allows 32 and 2.x 64; no model needs more).
MAX_DIMS = 32


def _flatten_strings(data: Any, where: str, max_bytes: int | None) -> list[bytes]:
    out: list[bytes] = []
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            encoded = item.encode()  # JSON decoders reject lone surrogates: always valid UTF-8
            if max_bytes is not None and len(encoded) > max_bytes:
                raise PayloadTooLarge(
                    f"{where}: element {len(out)} is {len(encoded)} bytes; the server accepts at "
                    f"most {max_bytes} per string (SCORING_MAX_STRING_BYTES)"
                )
            out.append(encoded)
        elif isinstance(item, list):
            stack.extend(reversed(item))
        else:
            raise InvalidInput(f"{where}: BYTES data must be strings, got {type(item).__name__}")
    return out


def _nested_shape(data: Any) -> list[int]:
    shape = []
    while isinstance(data, list):
        shape.append(len(data))
        if not data:
            break
        data = data[0]
    return shape


def to_array(
    data: Any,
    datatype: str,
    shape: Sequence[int] | None,
    where: str,
    max_string_bytes: int | None = None,
) -> np.ndarray:
    """JSON ``data`` (flat or nested row-major) -> numpy array of ``datatype`` and ``shape``.

    ``shape`` None infers it from the nesting. BYTES become an ``object`` array
    of UTF-8 ``bytes``, each at most ``max_string_bytes`` long.

    Raises:
        InvalidInput: wrong element types, ragged nesting, element count that
            does not match ``shape``, or integers out of the datatype's range.
        PayloadTooLarge: a BYTES element longer than ``max_string_bytes``.
    """
    if shape is not None and any((not isinstance(d, int)) or d < 0 for d in shape):
        raise InvalidInput(f"{where}: shape {list(shape)} must be non-negative integers")
    if shape is not None and len(shape) > MAX_DIMS:
        raise InvalidInput(f"{where}: shape has {len(shape)} dimensions; at most {MAX_DIMS}")
    if datatype == "BYTES":
        flat = _flatten_strings(data, where, max_string_bytes)
        if shape is None:
            shape = _nested_shape(data)
        arr = np.empty(len(flat), dtype=object)
        arr[:] = flat
    else:
        try:
            arr = np.asarray(data)
        except ValueError as exc:
            raise InvalidInput(f"{where}: data is ragged or not numeric ({exc})") from None
        kind = arr.dtype.kind
        if arr.size == 0:
            arr = arr.astype(NUMPY_DTYPES[datatype])
        elif datatype == "BOOL":
            if kind != "b":
                raise InvalidInput(f"{where}: BOOL data must be true/false, got {arr.dtype}")
        elif datatype in INT_DATATYPES:
            if kind not in "iu":
                raise InvalidInput(f"{where}: {datatype} data must be integers, got {_kind(kind)}")
            info = np.iinfo(NUMPY_DTYPES[datatype])  # type: ignore[type-var]
            if int(arr.min()) < info.min or int(arr.max()) > info.max:
                raise InvalidInput(f"{where}: value out of {datatype} range [{info.min}, {info.max}]")
        elif kind not in "iuf":
            raise InvalidInput(f"{where}: {datatype} data must be numbers, got {_kind(kind)}")
        with np.errstate(over="ignore"):  # overflow to inf is reported below, as non-finite
            arr = arr.astype(NUMPY_DTYPES[datatype], copy=False)
        if shape is None:
            shape = list(arr.shape)
    expected = math.prod(shape)
    if arr.size != expected:
        raise InvalidInput(f"{where}: shape {list(shape)} needs {expected} elements, data has {arr.size}")
    if arr.ndim > 1 and list(arr.shape) != list(shape):
        raise InvalidInput(f"{where}: nested data of shape {list(arr.shape)} != shape {list(shape)}")
    return arr.reshape(shape)


def _kind(kind: str) -> str:
    return {"b": "booleans", "U": "strings", "O": "mixed or huge values", "f": "floats"}.get(kind, kind)


def check_against_spec(arr: np.ndarray, spec: TensorSpec, allow_non_finite: bool, where: str) -> np.ndarray:
    """Check ``arr`` ([B, *item]) against ``spec``; returns it reshaped to ``[B, *spec.shape]``.

    Raises:
        InvalidInput: rank or a fixed dimension differs, B is 0, or a float is
            NaN/inf where the model forbids non-finite values.
    """
    item = list(spec.shape)
    if arr.ndim == 1 and item == [1]:
        arr = arr.reshape(-1, 1)
    if arr.ndim != len(item) + 1 or any(
        want not in (-1, got) for want, got in zip(item, arr.shape[1:], strict=True)
    ):
        shown = ["B", *("*" if d == -1 else d for d in item)]
        raise InvalidInput(f"{where}: shape {list(arr.shape)} does not match [{', '.join(map(str, shown))}]")
    if arr.shape[0] == 0:
        raise InvalidInput(f"{where}: batch dimension is 0; send at least one item")
    if spec.datatype in FLOAT_DATATYPES and not allow_non_finite and not bool(np.isfinite(arr).all()):
        raise InvalidInput(f"{where}: contains NaN or infinity, which this model does not accept")
    return arr


def complete_inputs(config: ModelConfig, arrays: dict[str, np.ndarray], where: str) -> dict[str, np.ndarray]:
    """Check that every required input is there with one common batch size; fill optional ones.

    Omitted optional inputs become ``b""`` (BYTES) or zeros of ``[B, *shape]``.

    Raises:
        InvalidInput: unknown or missing input, or inputs with different batch sizes.
    """
    unknown = set(arrays) - {s.name for s in config.inputs}
    if unknown:
        raise InvalidInput(
            f"{where}: unknown input(s) {sorted(unknown)}; model {config.name} takes "
            f"{[s.name for s in config.inputs]}"
        )
    missing = [s.name for s in config.inputs if not s.optional and s.name not in arrays]
    if missing:
        raise InvalidInput(f"{where}: missing required input(s) {missing} of model {config.name}")
    sizes = {name: len(a) for name, a in arrays.items()}
    if len(set(sizes.values())) > 1:
        raise InvalidInput(f"{where}: inputs disagree on the batch size: {sizes}")
    batch = next(iter(sizes.values()))
    return {s.name: arrays[s.name] if s.name in arrays else s.filled(batch) for s in config.inputs}
