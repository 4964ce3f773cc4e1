"""The response cache's keys: what decides an item's outputs, hashed.

An item's key is a 32-byte BLAKE2b of its model's *identity* (name, version, the fingerprint of
the files its serving unit was loaded from, :func:`environment`, the device kind: built by
``app.serving.item_cache.ItemCache.identity``) and of the item's inputs in a canonical encoding.
Inputs whose name starts with ``#`` are reserved for what the server itself derives from the
others (``app.models.base.PREPARED``: a window's token ids) and are not part of the key: the
inputs they were derived from and the model's identity already decide them.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import struct

import numpy as np

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
    elements each length-prefixed). Inputs named ``#...`` are left out (module docstring).
    None when an input holds anything but numbers or bytes, or none is keyed."""
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
    return [h.digest() for h in hashes]
