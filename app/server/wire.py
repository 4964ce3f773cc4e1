"""The internal endpoint's wire format: the messages sibling workers exchange
(:mod:`app.server.peers`) and the arrays they carry.

**Wire format**: msgpack (msgspec), no pickle. A numeric tensor travels as its dtype string
(``"<f4"``), shape and raw bytes; a BYTES tensor (a numpy object array of ``bytes``/``str``) as
its shape and the list of its elements; a ragged tensor (an object array ``[B]`` whose items are
numeric arrays ``[n_i, *rest]``, or tuples of P such arrays: a ragged output, or the items'
preparations a handler made, ``app.models.base.PREPARED``, whatever they mean to it) as its
rows end to end and their lengths. Decoding accepts numeric dtypes only for raw buffers (never
``object``), checks the buffer size against the shape, and copies into a writable array.
The messages only ever gain fields, each with a default, and ignore fields they do not know: a
HUP that upgrades the code leaves old and new workers side by side for a while, and each must
understand what the other sends (protobuf's rule for unknown fields).
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
    items: list[Any] | None = None  # bytes or str, or a ragged tensor's lengths (checked when decoded)


class ShardRequest(msgspec.Struct):
    """A shard of an inference request sent to a sibling's internal endpoint, with the request's
    context (``app.serving.context.RequestContext``).

    ``timeout_s``: what is left of the original deadline when sent, seconds (the one place a
    deadline travels relative: two processes' loop clocks need not agree). ``priority``:
    Triton's request priority (0 = the model's default level). The request's trace context
    travels in the call's ``traceparent`` header (``app.observability.tracing``).
    """

    model: str
    version: str
    request_id: str
    timeout_s: float
    inputs: dict[str, Tensor]
    priority: int = 0


class ControlRequest(msgspec.Struct):
    """A model control change for a sibling to apply here: ``action`` (``load``, ``unload``)."""

    action: str
    model: str


class ControlResponse(msgspec.Struct):
    """Why the change failed on the sibling, or None when it applied."""

    error: str | None = None


class ShardResponse(msgspec.Struct):
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
    """Encode ``array`` (any shape; numeric, or object of bytes/str; or a ragged object array:
    see :func:`_ragged`)."""
    shape = list(array.shape)
    if array.dtype == object:
        items = list(array.ravel())
        if items and isinstance(items[0], np.ndarray | tuple):
            return _ragged(array)
        return Tensor("object", shape, items=items)
    return Tensor(array.dtype.str, shape, data=np.ascontiguousarray(array).tobytes())


def _ragged(array: np.ndarray) -> Tensor:
    """An object array ``[B]`` of numeric arrays ``[n_i, *rest]`` (one dtype and ``rest`` for
    all), or of tuples of P of them, as ``dtype`` ``"ragged/<dtype>/P[/<rest, comma-separated>]"``
    (P = 0: bare arrays), ``shape`` ``[B]``, ``data`` the rows end to end and ``items`` their
    first dimensions (``B * max(P, 1)`` integers, row-major), so that no pickle is needed (and a
    sibling need not prepare the items again)."""
    elements = list(array.ravel())
    arity = 0 if isinstance(elements[0], np.ndarray) else len(elements[0])
    rows = [np.asarray(e) for e in elements] if arity == 0 else [np.asarray(r) for e in elements for r in e]
    dtype = np.result_type(*rows) if rows else np.dtype(np.int32)
    rest = rows[0].shape[1:] if rows else ()
    if any(r.ndim == 0 or r.shape[1:] != rest for r in rows):
        raise ValueError("a ragged tensor's items differ in their trailing dimensions")
    flat = np.concatenate(rows).astype(dtype, copy=False) if rows else np.zeros((0, *rest), dtype)
    name = f"ragged/{dtype.str}/{arity}" + (f"/{','.join(map(str, rest))}" if rest else "")
    return Tensor(name, list(array.shape), data=np.ascontiguousarray(flat).tobytes(),
                  items=[len(r) for r in rows])  # fmt: skip


def _from_ragged(tensor: Tensor) -> np.ndarray:
    """Decode :func:`_ragged`'s form, checking every length and size against the data.

    Raises:
        InvalidInput: a malformed dtype, lengths that are not non-negative integers matching the
            shape and arity, or ids that do not fill the data.
    """
    try:
        _, name, arity_text, *trailing = tensor.dtype.split("/")
        dtype, arity = np.dtype(name), int(arity_text)
        rest = tuple(int(d) for d in trailing[0].split(",")) if trailing else ()
    except (TypeError, ValueError) as exc:
        raise errors.InvalidInput(f"bad ragged tensor dtype {tensor.dtype!r}") from exc
    count = math.prod(tensor.shape)
    lengths = tensor.items
    row_size = math.prod(rest)
    if (
        dtype.kind not in _RAW_KINDS
        or not 0 <= arity <= 16
        or len(trailing) > 1
        or any(d < 0 for d in rest)
        or lengths is None
        or len(lengths) != count * max(arity, 1)
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in lengths)
        or tensor.data is None
        or len(tensor.data) != sum(lengths) * row_size * dtype.itemsize
    ):
        raise errors.InvalidInput("ragged tensor: lengths do not match its shape or data")
    flat = np.frombuffer(tensor.data, dtype=dtype)
    if rest:
        flat = flat.reshape(-1, *rest)
    rows = np.split(flat.copy(), np.cumsum(lengths)[:-1]) if lengths else []
    out = np.empty(count, dtype=object)
    for i in range(count):
        out[i] = rows[i] if arity == 0 else tuple(rows[i * arity : (i + 1) * arity])
    return out.reshape(tensor.shape)


def from_tensor(tensor: Tensor) -> np.ndarray:
    """Decode a :class:`Tensor`.

    Raises:
        InvalidInput: an unknown or object dtype for raw data, or a size that does not match.
    """
    if any(d < 0 for d in tensor.shape):
        raise errors.InvalidInput(f"negative dimension in shape {tensor.shape}")
    count = math.prod(tensor.shape)
    if tensor.dtype.startswith("ragged/"):
        return _from_ragged(tensor)
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
