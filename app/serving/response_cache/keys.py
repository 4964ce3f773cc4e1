"""The response cache's keys: what decides an item's outputs, hashed.

An item's key is a 32-byte BLAKE2b of its model's *identity* (name, version, the fingerprint of
the files its serving unit was loaded from, :func:`environment`, the device kind: built by
``app.serving.item_cache.ItemCache.identity``) and of the item's inputs in a canonical encoding.
Inputs whose name starts with ``#`` are reserved for what the server itself derives from the
others and are not keyed as inputs, with one exception: an item's preparation
(``app.models.base.PREPARED``, its token rows) is part of its key where it has one. A window of a
long text (``app.serving.windows``) carries the span of text its tokens cover as its ``text``
input, and that span does not decide its tokens: cut inside a word, or with a pair's query, the
same characters alone tokenize otherwise, so a key of the span alone could answer one context's
window with another's result. The preparation is hashed, never stored.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import struct
from typing import Any

import numpy as np

from app.models.base import PREPARED
from app.serving.response_cache.entries import KINDS

#: Libraries whose version changes what a model computes.
LIBRARIES = ("numpy", "torch", "onnxruntime", "onnxruntime-gpu", "transformers", "tokenizers",
             "sentence-transformers")  # fmt: skip
#: The first character of the names of inputs the server derives (not keyed).
RESERVED = "#"
_U64 = struct.Struct("<Q")


def environment(model_package: str | None = None) -> str:
    """What besides a model's files decides its outputs: this server's version (its handlers and
    formats), the versions of the numeric libraries installed (:data:`LIBRARIES`) and of
    ``model_package`` (a handler's weights package), as one string."""
    from app import __version__

    names = [*LIBRARIES, *([model_package.replace("_", "-")] if model_package else [])]
    found = [f"scoring-server={__version__}"]
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found.append(f"{name}={importlib.metadata.version(name)}")
    return ";".join(found)


def item_keys(identity: bytes, inputs: dict[str, np.ndarray]) -> list[bytes] | None:
    """The key of each item of ``inputs`` (one array ``[B, ...]`` per input, one B): a 32-byte
    BLAKE2b of ``identity`` (the model version and its environment) and the item's inputs in
    a canonical encoding (inputs by name; per input its name, dtype, item shape, bytes; BYTES
    elements each length-prefixed), and of its preparation where ``inputs`` hold
    ``PREPARED`` (:func:`_key_prepared`). Other inputs named ``#...`` are left out (module
    docstring). None when an input holds anything but numbers or bytes, a preparation anything
    but integer arrays, or no input is keyed."""
    names = sorted(name for name in inputs if not name.startswith(RESERVED))
    if not names:
        return None
    items = len(inputs[names[0]])
    base = hashlib.blake2b(identity, digest_size=32)
    hashes = [base.copy() for _ in range(items)]
    for name in names:
        arr = inputs[name]
        head = f"\0{name}\0{arr.dtype.str}\0{arr.shape[1:]}\0".encode()
        if arr.dtype == object:
            for i, h in enumerate(hashes):
                h.update(head)
                for element in arr[i].ravel().tolist():
                    if not isinstance(element, bytes):
                        return None
                    h.update(_U64.pack(len(element)))
                    h.update(element)
        elif arr.dtype.kind in KINDS:
            arr = np.ascontiguousarray(arr)
            for i, h in enumerate(hashes):
                h.update(head)
                h.update(arr[i].tobytes())
        else:
            return None
    prepared = inputs.get(PREPARED)
    if prepared is not None and not _key_prepared(hashes, prepared):
        return None
    return [h.digest() for h in hashes]


def _key_prepared(hashes: list[Any], prepared: np.ndarray) -> bool:
    """Add each item's preparation (object ``[B]``: a tuple of 1-D integer arrays, or one such
    array) to its hash: the number of rows, then each row length-prefixed, its ids as
    little-endian int64 (the same ids hash alike whatever integer dtype carried them, e.g.
    from a sibling worker). False (not keyed: the items are not cached) for anything else."""
    elements = prepared.reshape(-1)
    if len(elements) != len(hashes):
        return False
    for element, h in zip(elements.tolist(), hashes, strict=True):
        rows = element if isinstance(element, tuple) else (element,)
        if not all(isinstance(row, np.ndarray) and row.ndim == 1 and row.dtype.kind in "iu" for row in rows):
            return False
        h.update(f"\0{PREPARED}\0{len(rows)}\0".encode())
        for row in rows:
            h.update(_U64.pack(len(row)))
            h.update(row.astype("<i8", copy=False).tobytes())
    return True
