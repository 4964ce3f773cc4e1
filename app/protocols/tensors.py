"""Convert one tensor's data, JSON values or raw bytes, and check it against a model's input spec.

Shapes: a request tensor is ``[B, *item_shape]`` where ``item_shape`` matches
the spec's per-item shape (``-1`` = any). A spec of per-item shape ``[1]``
also accepts ``[B]`` (a plain list of B values), the common way to send texts.

Raw bytes are Triton's layout (binary tensor data, gRPC ``raw_input_contents``): little-endian
row-major elements; a BYTES element is a 4-byte little-endian length, then that many bytes.
Source: triton-inference-server ``docs/protocol/extension_binary_data.md``; the Open Inference
Protocol's gRPC "raw_input_contents".

**Request limits** (:class:`RequestLimits`): items per request, bytes per string, JSON depth
(checked before a JSON body is decoded: :func:`decode_json`). The body size is capped before any
of this runs (aiohttp's ``client_max_size``, 413).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import numpy as np

from app.datatypes import FLOAT_DATATYPES, INT_DATATYPES, NUMPY_DTYPES
from app.errors import InvalidInput, PayloadTooLarge
from app.models.repository import ModelConfig, TensorSpec
from app.protocols.infer import OutputTensor, lengths_name
from app.protocols.jsonbody import check_json_depth, invalid_json

#: Most dimensions of a request tensor, whatever the protocol (numpy 1.x allows 32 and 2.x 64;
#: no model needs more).
MAX_DIMS = 32
_LENGTH = struct.Struct("<I")
T = TypeVar("T")


def _opens_at_most(body: bytes, limit: int) -> bool:
    """Whether ``body`` opens at most ``limit`` arrays and objects in all (inside strings too):
    at most ``limit + 1`` memchr-speed ``find`` calls."""
    left = limit
    for opener in b"[{":
        start = body.find(opener)
        while start >= 0:
            left -= 1
            if left < 0:
                return False
            start = body.find(opener, start + 1)
    return True


def decode_json(decoder: msgspec.json.Decoder[T], body: bytes, max_depth: int, what: str) -> T:
    """``body`` decoded by ``decoder`` (a msgspec typed decoder), its nesting bounded first: a
    body that opens at most ``max_depth`` arrays and objects cannot nest deeper, and most do not
    (a feed-ranker request of 8 items opens 7; counted at memchr speed, 1 µs for 5 KB, 22 µs for
    1 MB); one that opens more is scanned (:func:`app.protocols.jsonbody.check_json_depth`).

    Raises:
        InvalidInput: nested deeper than ``max_depth``, malformed JSON, invalid UTF-8, or a
            field of the wrong type (the message starts "invalid {what}:" and names the JSON
            path, e.g. ``$.inputs[0].shape``).
    """
    if not _opens_at_most(body, max_depth):
        check_json_depth(body, max_depth)
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise invalid_json(body, what, exc) from None
    except RecursionError:  # only with max_depth near Python's recursion limit
        raise InvalidInput(f"invalid {what}: nested too deeply") from None


def check_shape(shape: Any, where: str) -> list[int]:
    """``shape`` as a list of non-negative ints of at most ``MAX_DIMS`` dimensions.

    Raises:
        InvalidInput: anything else (numpy itself refuses more than 64 dimensions with an
            error no client should see).
    """
    if not isinstance(shape, (list, tuple)) or any(
        isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape
    ):
        raise InvalidInput(
            f"{where}: shape {list(shape) if isinstance(shape, (list, tuple)) else shape} "
            "must be non-negative integers"
        )
    if len(shape) > MAX_DIMS:
        raise InvalidInput(f"{where}: shape has {len(shape)} dimensions; at most {MAX_DIMS}")
    return list(shape)


def check_elements(shape: Sequence[int], spec: TensorSpec, max_items: int, where: str) -> None:
    """Bound the work of converting a tensor before doing any: at most ``max_items`` items and,
    for an input of fixed item shape, at most ``max_items`` x its elements per item (any valid
    request passes; a BYTES tensor declared ``[1, 4000000]`` is refused before its first
    element is read).

    Raises:
        PayloadTooLarge: more than ``max_items`` items.
        InvalidInput: more elements than ``max_items`` items of the spec's shape hold.
    """
    if shape and shape[0] > max_items:
        raise PayloadTooLarge(
            f"{where}: {shape[0]} items in one request; the server accepts at most "
            f"{max_items} (SCORING_MAX_ITEMS_PER_REQUEST)"
        )
    if spec.shape and all(d >= 0 for d in spec.shape):
        most = max_items * math.prod(spec.shape)
        if math.prod(shape) > most:
            raise InvalidInput(
                f"{where}: shape {list(shape)} holds more than the {most} elements of "
                f"{max_items} items of shape {list(spec.shape)}"
            )


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
    if shape is not None:
        shape = check_shape(shape, where)
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
    """Check that every required input is there with one common batch size B; fill optional
    ones; repeat a shared input sent once (``TensorSpec.shared``, batch dimension 1) for the B
    items (a copy per request: a few microseconds for a user's features, where decoding them
    B times, as a client that repeats them makes the server do, costs B times as long).

    Omitted optional inputs become ``b""`` (BYTES) or zeros of ``[B, *shape]``.

    Raises:
        InvalidInput: unknown or missing input, or inputs with different batch sizes (a shared
            one: 1 or B).
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
    shared = {s.name for s in config.inputs if s.shared is not None and s.name in arrays}
    if len(set(sizes.values())) > 1 and shared:
        per_item = {sizes[name] for name in sizes if name not in shared} or {1}
        if len(per_item) == 1 and all(sizes[name] in (1, *per_item) for name in shared):
            batch = per_item.pop()
            for name in shared:
                if sizes[name] == 1 and batch > 1:
                    arrays[name] = np.repeat(arrays[name], batch, axis=0)
            sizes = {name: batch for name in sizes}
    if len(set(sizes.values())) > 1:
        raise InvalidInput(f"{where}: inputs disagree on the batch size: {sizes}")
    batch = next(iter(sizes.values()))
    return {s.name: arrays[s.name] if s.name in arrays else s.filled(batch) for s in config.inputs}


def deserialize_bytes(buffer: memoryview, count: int, where: str, max_string_bytes: int) -> np.ndarray:
    """BYTES binary data (4-byte little-endian length, then the bytes, per element) -> an
    ``object`` array of ``count`` ``bytes``.

    Raises:
        InvalidInput: a length runs past the buffer, or the buffer holds more or fewer than
            ``count`` elements.
        PayloadTooLarge: an element longer than ``max_string_bytes``.
    """
    offset, end = 0, len(buffer)
    if count * 4 > end:  # before allocating: a declared shape may be huge
        raise InvalidInput(
            f"{where}: shape declares {count} BYTES elements; {end} bytes cannot hold that many "
            "4-byte length prefixes"
        )
    out = np.empty(count, dtype=object)
    for i in range(count):
        if end - offset < 4:
            raise InvalidInput(f"{where}: binary BYTES data ends inside element {i} of {count}")
        (length,) = _LENGTH.unpack_from(buffer, offset)
        offset += 4
        if length > end - offset:
            raise InvalidInput(
                f"{where}: binary BYTES element {i} declares {length} bytes, only {end - offset} remain"
            )
        if length > max_string_bytes:
            raise PayloadTooLarge(
                f"{where}: element {i} is {length} bytes; the server accepts at most "
                f"{max_string_bytes} per string (SCORING_MAX_STRING_BYTES)"
            )
        out[i] = bytes(buffer[offset : offset + length])
        offset += length
    if offset != end:
        raise InvalidInput(f"{where}: {end - offset} bytes left after {count} BYTES elements")
    return out


def serialize_bytes(array: np.ndarray) -> bytes:
    """An ``object``/bytes/str array -> BYTES binary data (length-prefixed, row-major)."""
    parts: list[bytes] = []
    for value in array.ravel():
        data = value if isinstance(value, bytes) else str(value).encode("utf-8")
        parts.append(_LENGTH.pack(len(data)))
        parts.append(data)
    return b"".join(parts)


def decode_raw(
    datatype: str, shape: Sequence[int], raw: memoryview | bytes, where: str, max_string_bytes: int
) -> np.ndarray:
    """One tensor's raw bytes (binary tensor data, or gRPC ``raw_input_contents``) -> a flat
    array of ``datatype`` with ``prod(shape)`` elements: fixed-size datatypes through
    ``numpy.frombuffer`` (one copy into a writable array; torch warns on read-only ones), BYTES
    as length-prefixed strings into an ``object`` array of ``bytes``. ``shape`` has been
    checked (:func:`check_shape`, :func:`check_elements`).

    Raises:
        InvalidInput: an unknown datatype, a size that is not ``prod(shape)`` elements, or
            malformed BYTES lengths.
        PayloadTooLarge: a string longer than ``max_string_bytes``.
    """
    count = math.prod(shape)
    view = memoryview(raw)
    if datatype == "BYTES":
        return deserialize_bytes(view, count, where, max_string_bytes)
    dtype = NUMPY_DTYPES.get(datatype)
    if dtype is None:
        raise InvalidInput(f"{where}: datatype {datatype!r} is not supported")
    if len(view) != count * dtype.itemsize:
        raise InvalidInput(
            f"{where}: {len(view)} bytes of data != {count} elements of {datatype} "
            f"({count * dtype.itemsize} bytes) for shape {list(shape)}"
        )
    if datatype == "BOOL":
        flags: np.ndarray = np.frombuffer(view, dtype=np.uint8) != 0
        return flags
    return np.frombuffer(view, dtype=dtype.newbyteorder("<")).astype(dtype)


def tensor_bytes(array: np.ndarray, datatype: str) -> bytes:
    """An output array -> its raw bytes (binary tensor data, or gRPC ``raw_output_contents``):
    little-endian row-major elements, BYTES length-prefixed."""
    if datatype == "BYTES":
        return serialize_bytes(array)
    return np.ascontiguousarray(array, dtype=NUMPY_DTYPES[datatype].newbyteorder("<")).tobytes()


@dataclass(frozen=True)
class RequestLimits:
    """Per-request limits; the defaults are the settings' defaults.

    Attributes:
        max_items: most items (rows along the batch dimension) in one request.
        max_string_bytes: longest BYTES element, UTF-8 bytes.
        max_json_depth: deepest nesting of arrays/objects in the body.
    """

    max_items: int = 4096
    max_string_bytes: int = 65536
    max_json_depth: int = 32

    def check_items(self, items: int, where: str) -> None:
        """Raises ``PayloadTooLarge`` (413) when ``items`` exceeds ``max_items``."""
        if items > self.max_items:
            raise PayloadTooLarge(
                f"{where}: {items} items in one request; the server accepts at most "
                f"{self.max_items} (SCORING_MAX_ITEMS_PER_REQUEST)"
            )


def typed_array(tensor: Any, shape: list[int], where: str, limits: RequestLimits) -> np.ndarray:
    """A tensor's ``data`` already an array of its dtype (gRPC typed contents; a
    ``app.protocols.infer.InferInput``), reshaped to ``shape``.

    Raises:
        InvalidInput: the element count or dtype does not match; PayloadTooLarge: a string over
            ``limits.max_string_bytes``.
    """
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


def wire_tensors(outputs: list[OutputTensor]) -> list[OutputTensor]:
    """A response's outputs as the Open Inference Protocol sends them (V2 JSON, binary, gRPC):
    each as it is, but a ragged output as two tensors, its items' rows end to end (``[sum n_i,
    ...]``: the batch and the first item dimension become one) and, after it, their lengths
    (:func:`app.protocols.infer.lengths_name`, INT64 ``[B]``), so that a client splits the rows
    per item: ``np.split(rows, np.cumsum(lengths)[:-1])``. Triton has no ragged outputs; this is
    the layout of its ragged batch inputs (one dimension for all items' rows, and their counts)."""
    if not any(o.ragged for o in outputs):
        return outputs
    out: list[OutputTensor] = []
    for o in outputs:
        if not o.ragged:
            out.append(o)
            continue
        rows = list(o.array)
        lengths = np.array([len(r) for r in rows], dtype=np.int64)
        flat = np.concatenate(rows) if rows else np.zeros((0,), NUMPY_DTYPES[o.datatype])
        out.append(OutputTensor(o.name, o.datatype, flat, o.binary))
        out.append(OutputTensor(lengths_name(o.name), "INT64", lengths, o.binary))
    return out
