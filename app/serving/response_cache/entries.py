"""What the response cache stores per item: every output of the item encoded without pickle
(datatype, shape, raw bytes; msgpack around them), behind a header with the entry's stamp (its
place in the eviction order), the time it was written and a checksum.

The checksum is a keyed BLAKE2b of the payload with the entry's key as the key: an entry that a
torn copy of the store, a bit flip or a bug put under another key fails it, as does a damaged
payload, and either is a miss. The stamp is outside the checksum, so a hit can be stamped again
without hashing the payload anew.
"""

from __future__ import annotations

import hashlib
import struct
import time
from typing import NamedTuple

import msgspec
import numpy as np

#: One item's outputs: output name -> its array without the batch dimension.
Item = dict[str, np.ndarray]

MAGIC = b"RC2\0"
#: magic, stamp (insertion order), written (unix seconds), checksum of the key and payload.
HEADER = struct.Struct("<4sQd16s")
#: Numeric dtype kinds an output may have to be cached (BYTES outputs are lists of bytes).
KINDS = frozenset("biuf")


class _Field(msgspec.Struct, array_like=True):
    name: str
    dtype: str
    shape: list[int]
    data: bytes | list[bytes]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[_Field])


def encode_item(item: Item) -> bytes | None:
    """One item's outputs as bytes (msgpack of name, dtype, shape, raw little/native-endian
    bytes per output; BYTES as a list of bytes); None when an output cannot be cached (an
    object array holding anything but bytes, a dtype that is not bool, int, uint or float)."""
    fields = []
    for name, arr in item.items():
        if arr.dtype == object:
            flat = arr.ravel().tolist()
            if not all(isinstance(e, bytes) for e in flat):
                return None
            fields.append(_Field(name, "O", list(arr.shape), flat))
        elif arr.dtype.kind in KINDS:
            fields.append(_Field(name, arr.dtype.str, list(arr.shape), np.ascontiguousarray(arr).tobytes()))
        else:
            return None
    return _encoder.encode(fields)


def decode_item(payload: bytes | memoryview) -> Item | None:
    """The outputs :func:`encode_item` wrote; None when ``payload`` does not decode to them."""
    try:
        fields = _decoder.decode(payload)
        item: Item = {}
        for f in fields:
            if f.dtype == "O":
                if not isinstance(f.data, list):
                    return None
                arr = np.empty(len(f.data), dtype=object)
                arr[:] = f.data
                item[f.name] = arr.reshape(f.shape)
            else:
                dtype = np.dtype(f.dtype)
                if dtype.kind not in KINDS or not isinstance(f.data, bytes):
                    return None
                item[f.name] = np.frombuffer(f.data, dtype=dtype).reshape(f.shape)
        return item
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError):
        return None


def _checksum(key: bytes, payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=16, key=key[:64]).digest()


def make_value(key: bytes, stamp: int, written: float, payload: bytes) -> bytes:
    """The stored value of ``key``: the header (magic, ``stamp``, ``written`` in unix seconds,
    the checksum of ``key`` and ``payload``), then ``payload``."""
    return HEADER.pack(MAGIC, stamp, written, _checksum(key, payload)) + payload


def restamp(value: bytes, stamp: int) -> bytes:
    """``value`` with ``stamp`` in its header (its checksum stays valid)."""
    magic, _, written, checksum = HEADER.unpack_from(value)
    return HEADER.pack(magic, stamp, written, checksum) + value[HEADER.size :]


class Parsed(NamedTuple):
    """A stored value read back: its stamp, the time it was written (unix seconds), its payload."""

    stamp: int
    written: float
    payload: memoryview


def parse(key: bytes, value: bytes | memoryview) -> Parsed | None:
    """The header and payload of the value stored under ``key``; None when its magic or
    checksum is wrong (damaged, or not ``key``'s)."""
    view = memoryview(value)
    if len(view) < HEADER.size:
        return None
    magic, stamp, written, checksum = HEADER.unpack_from(view)
    payload = view[HEADER.size :]
    if magic != MAGIC or _checksum(key, payload) != checksum:
        return None
    return Parsed(stamp, written, payload)


def pack_entry(key: bytes, item: Item) -> bytes | None:
    """One item's outputs as the value of ``key`` for a tier outside LMDB (header with the time
    written and a checksum, then :func:`encode_item`'s payload); None when it cannot be cached."""
    payload = encode_item(item)
    return None if payload is None else make_value(key, 0, time.time(), payload)


def unpack_entry(key: bytes, value: bytes, ttl_s: float = 0.0) -> Item | None:
    """The outputs of a value :func:`pack_entry` made for ``key``; None when it is damaged, not
    ``key``'s, does not decode, or is older than ``ttl_s`` (0 = no limit)."""
    parsed = parse(key, value)
    if parsed is None or (ttl_s and time.time() - parsed.written > ttl_s):
        return None
    return decode_item(bytes(parsed.payload))
