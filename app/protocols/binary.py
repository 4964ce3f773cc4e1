"""Triton's binary tensor data extension for the V2 HTTP/REST protocol.

A request body is a JSON inference request of ``Inference-Header-Content-Length`` bytes, then
the raw data of every input whose ``parameters.binary_data_size`` is set, in input order. A
fixed-size datatype is its elements little-endian, row-major; a BYTES tensor is each element
as a 4-byte little-endian length then that many bytes. Responses work the same way for the
outputs asked for as binary (``parameters.binary_data`` per output, or
``parameters.binary_data_output`` for all), whose JSON then carries
``parameters.binary_data_size`` instead of ``data``.

Source: triton-inference-server/server ``docs/protocol/extension_binary_data.md`` and the
client's ``tritonclient/http/_utils.py`` (``_get_inference_request``). No aiohttp here.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from app.datatypes import NUMPY_DTYPES
from app.errors import InvalidInput, PayloadTooLarge
from app.protocols.infer import InferRequest, InferResponse
from app.protocols.limits import RequestLimits

#: Request and response header: length in bytes of the JSON part at the start of the body.
HEADER_LENGTH = "Inference-Header-Content-Length"
_LENGTH = struct.Struct("<I")
_DEFAULT_LIMITS = RequestLimits()


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
    datatype: str, shape: list[int] | None, raw: memoryview | bytes, where: str, limits: RequestLimits
) -> np.ndarray:
    """One tensor's raw bytes (binary tensor data, or gRPC ``raw_input_contents``) -> a flat
    array of ``datatype`` with ``prod(shape)`` elements: fixed-size datatypes through
    ``numpy.frombuffer`` (one copy into a writable array; torch warns on read-only ones), BYTES
    as length-prefixed strings into an ``object`` array of ``bytes``.

    Raises:
        InvalidInput: a bad shape, an unknown datatype, a size that is not ``prod(shape)``
            elements, or malformed BYTES lengths.
        PayloadTooLarge: more than ``limits.max_items`` items, or a string longer than
            ``limits.max_string_bytes``.
    """
    if shape is None or any((not isinstance(d, int)) or d < 0 for d in shape):
        raise InvalidInput(f"{where}: shape {shape} must be non-negative integers")
    if shape:
        limits.check_items(shape[0], where)
    count = 1
    for d in shape:
        count *= d
    view = memoryview(raw)
    if datatype == "BYTES":
        return deserialize_bytes(view, count, where, limits.max_string_bytes)
    dtype = NUMPY_DTYPES.get(datatype)
    if dtype is None:
        raise InvalidInput(f"{where}: datatype {datatype!r} is not supported")
    if len(view) != count * dtype.itemsize:
        raise InvalidInput(
            f"{where}: {len(view)} bytes of data != {count} elements of {datatype} "
            f"({count * dtype.itemsize} bytes) for shape {shape}"
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


def attach_binary(request: InferRequest, binary: memoryview, limits: RequestLimits = _DEFAULT_LIMITS) -> None:
    """Fill the ``data`` of every input that declares ``parameters.binary_data_size`` from
    ``binary``, in input order: fixed-size datatypes are read with ``numpy.frombuffer`` (one
    copy, no per-element Python objects), BYTES become an ``object`` array of ``bytes``.

    Raises:
        InvalidInput: a declared size is not a non-negative integer; sizes do not add up to
            the binary part's length; a size is not a whole number of elements or does not
            match the tensor's shape; an input has both ``data`` and binary data, or neither;
            shared-memory parameters (not supported).
        PayloadTooLarge: more than ``limits.max_items`` items, or a string longer than
            ``limits.max_string_bytes``.
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
        chunk = binary[offset : offset + size]
        offset += size
        tensor.data = decode_raw(tensor.datatype, tensor.shape, chunk, where, limits)
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
    for out in response.outputs:
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
