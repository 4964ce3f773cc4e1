"""The sibling-to-sibling wire format of inference shards: msgpack (msgspec), no pickle.

A numeric tensor travels as its dtype string (``"<f4"``), shape and raw bytes; a BYTES tensor
(a numpy object array of ``bytes``/``str``) as its shape and the list of its elements. Decoding
accepts numeric dtypes only for raw buffers (never ``object``), checks the buffer size against
the shape, and copies into a writable array.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np

from app import errors

#: numpy dtype kinds a raw buffer may carry: bool, signed, unsigned, float, complex.
_RAW_KINDS = frozenset("biufc")


class Tensor(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One array: ``dtype`` (numpy ``dtype.str``, or ``"object"``), ``shape``, and either
    ``data`` (raw little/big-endian bytes) or ``items`` (object arrays, row-major)."""

    dtype: str
    shape: list[int]
    data: bytes | None = None
    items: list[Any] | None = None  # bytes or str (checked when decoded)


class ShardRequest(msgspec.Struct, forbid_unknown_fields=True):
    """A shard of an inference request sent to a sibling's internal endpoint.

    ``timeout_s``: what is left of the original deadline, seconds.
    """

    model: str
    version: str
    request_id: str
    timeout_s: float
    inputs: dict[str, Tensor]


class ShardResponse(msgspec.Struct, forbid_unknown_fields=True):
    """The outputs of a shard, or the name and message of the :mod:`app.errors` class it raised."""

    outputs: dict[str, Tensor] | None = None
    error: str | None = None
    message: str = ""
    retry_after_s: float | None = None


#: The errors a shard may report back, by class name (anything else is InferenceFailed).
ERRORS: dict[str, type[errors.ScoringError]] = {
    cls.__name__: cls
    for cls in (
        errors.InvalidInput, errors.ModelNotFound, errors.PayloadTooLarge, errors.ClientDisconnected,
        errors.InferenceFailed, errors.ServiceUnavailable, errors.ModelNotReady, errors.QueueFull,
        errors.DeadlineExceeded, errors.InsufficientStorage,
    )
}  # fmt: skip

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(ShardRequest)
_response_decoder = msgspec.msgpack.Decoder(ShardResponse)


def to_tensor(array: np.ndarray) -> Tensor:
    """Encode ``array`` (any shape; numeric, or object of bytes/str)."""
    shape = list(array.shape)
    if array.dtype == object:
        return Tensor("object", shape, items=list(array.ravel()))
    return Tensor(array.dtype.str, shape, data=np.ascontiguousarray(array).tobytes())


def from_tensor(tensor: Tensor) -> np.ndarray:
    """Decode a :class:`Tensor`.

    Raises:
        InvalidInput: an unknown or object dtype for raw data, or a size that does not match.
    """
    if any(d < 0 for d in tensor.shape):
        raise errors.InvalidInput(f"negative dimension in shape {tensor.shape}")
    count = math.prod(tensor.shape)
    if tensor.dtype == "object":
        items = tensor.items
        if items is None or len(items) != count or not all(isinstance(i, (bytes, str)) for i in items):
            raise errors.InvalidInput("object tensor: items are not bytes/str matching its shape")
        out = np.empty(count, dtype=object)
        out[:] = items
        return out.reshape(tensor.shape)
    try:
        dtype = np.dtype(tensor.dtype)
    except TypeError as exc:
        raise errors.InvalidInput(f"unknown dtype {tensor.dtype!r}") from exc
    if dtype.kind not in _RAW_KINDS or tensor.data is None or len(tensor.data) != count * dtype.itemsize:
        raise errors.InvalidInput(f"tensor of dtype {tensor.dtype!r} does not match its shape or data")
    return np.frombuffer(tensor.data, dtype=dtype).reshape(tensor.shape).copy()


def encode(message: ShardRequest | ShardResponse) -> bytes:
    """msgpack bytes of a request or response."""
    return _encoder.encode(message)


def decode_request(body: bytes) -> ShardRequest:
    """Raises InvalidInput on anything but a well-formed :class:`ShardRequest`."""
    try:
        return _request_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise errors.InvalidInput(f"bad shard request: {exc}") from exc


def decode_response(body: bytes) -> ShardResponse:
    """Raises InferenceFailed on anything but a well-formed :class:`ShardResponse`."""
    try:
        return _response_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise errors.InferenceFailed(f"bad shard response from a sibling worker: {exc}") from exc


def raise_error(response: ShardResponse) -> None:
    """Re-raise the error a sibling reported, as the same :mod:`app.errors` class."""
    if response.error is not None:
        cls = ERRORS.get(response.error, errors.InferenceFailed)
        raise cls(response.message, retry_after_s=response.retry_after_s)
