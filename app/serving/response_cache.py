"""The response cache: per-item results of a model, in one store that every worker of a host
shares (Triton's *response cache*, keyed per item instead of per request).

A feed request rarely repeats whole, but its items do: a popular post is a candidate in many
users' requests within minutes. An item's key is a hash of what decides its outputs: the model's
name, version and the identity of its files (``app.models.repository.fingerprint``), the
libraries and device kind that compute it (:func:`environment`), and the item's input bytes in a
canonical encoding (every input by name, its datatype, item shape and bytes; BYTES elements
length-prefixed). The value is every output of the item (the model computes all of them; a
request's ``outputs`` only choose among them), encoded without pickle (datatype, shape, raw
bytes; :func:`encode_item`), with a checksum: an entry that fails it is a miss.

The store is an LMDB environment (the ``lmdb`` package: a memory-mapped B-tree with one writer
and lock-free readers across processes) under the server's run directory or a configured path;
its map size is the byte bound, which the file never exceeds. Eviction approximates LRU the way
CLOCK does: entries are stamped in insertion order and evicted oldest stamp first once the pages
of the store's trees pass half the map (the rest is room for copy-on-write and pages that open
readers still hold); a
hit on an entry in the older half of the order stamps it again (at most one write per hit on a
cold entry, none on a hot one). With a TTL, an entry older than it is a miss. LMDB has neither
eviction nor TTL of its own; both live here.

Failure is never an error: a store that cannot be opened, is full, corrupt, unwritable or
removed while the server runs makes lookups miss and inserts drop (logged at most once a
minute), and the store is opened again (a new file where it was removed) once a second has
passed. The caller then computes.

Source: Triton's response cache (``docs/user_guide/response_cache.md``: opt-in per model,
``response_cache { enable: true }``, a local tier and a Redis tier); LMDB's documentation
(``mdb_env_set_mapsize``, ``mdb_reader_check``); CLOCK / second-chance replacement (Corbató,
1968) for the approximation of LRU.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import logging
import math
import os
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import lmdb
import msgspec
import numpy as np

log = logging.getLogger(__name__)

#: One item's outputs: output name -> its array without the batch dimension.
Item = dict[str, np.ndarray]
if TYPE_CHECKING:  # generic in lmdb's stubs only
    Txn: TypeAlias = lmdb.Transaction[Any]

_MAGIC = b"RC1\0"
#: magic, stamp (insertion order), written (unix seconds), checksum of what follows it.
_HEADER = struct.Struct("<4sQd16s")
_STAMP = struct.Struct(">Q")  # big-endian: LMDB orders keys bytewise, so stamps sort in order
_U64 = struct.Struct("<Q")
_SEQ, _BYTES, _ENTRIES = b"seq", b"bytes", b"entries"
_MODEL_BYTES = b"bytes:"
#: Share of the map that the store's pages (its trees: entries, their order, branch pages,
#: half-filled leaves) may take before the oldest entries are evicted, down to _LOW_WATER of it;
#: the rest is room for copy-on-write and for pages that open readers still hold.
DATA_SHARE = 0.5
_LOW_WATER = 0.9
#: Bytes of LMDB bookkeeping counted per entry (its order record and node headers).
_ENTRY_OVERHEAD = 96
#: Most entries one insert evicts (a writer holds the store's one write lock while it does).
_EVICT_BATCH = 4096
#: Numeric dtype kinds an output may have to be cached (BYTES outputs are lists of bytes).
_KINDS = frozenset("biuf")
#: Libraries whose version changes what a model computes.
_LIBRARIES = ("numpy", "torch", "onnxruntime", "onnxruntime-gpu", "transformers", "tokenizers",
              "sentence-transformers")  # fmt: skip


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
        elif arr.dtype.kind in _KINDS:
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
                if dtype.kind not in _KINDS or not isinstance(f.data, bytes):
                    return None
                item[f.name] = np.frombuffer(f.data, dtype=dtype).reshape(f.shape)
        return item
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError):
        return None


def _checksum(body: bytes | memoryview) -> bytes:
    return hashlib.blake2b(body, digest_size=16).digest()


def environment(model_package: str | None = None) -> str:
    """What besides a model's files decides its outputs: this server's version (its handlers and
    formats), the versions of the numeric libraries installed (:data:`_LIBRARIES`) and of
    ``model_package`` (a handler's weights package), as one string."""
    from app import __version__

    names = [*_LIBRARIES, *([model_package.replace("_", "-")] if model_package else [])]
    found = [f"scoring-server={__version__}"]
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found.append(f"{name}={importlib.metadata.version(name)}")
    return ";".join(found)


def item_keys(identity: bytes, inputs: dict[str, np.ndarray]) -> list[bytes] | None:
    """The key of each item of ``inputs`` (one array ``[B, ...]`` per input, one B): a 32-byte
    BLAKE2b of ``identity`` (the model version and its environment) and the item's inputs in
    a canonical encoding (inputs by name; per input its name, dtype, item shape, bytes; BYTES
    elements each length-prefixed). None when an input holds anything but numbers or bytes."""
    names = sorted(inputs)
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
        elif arr.dtype.kind in _KINDS:
            arr = np.ascontiguousarray(arr)
            for i, h in enumerate(hashes):
                h.update(head)
                h.update(arr[i].tobytes())
        else:
            return None
    return [h.digest() for h in hashes]


@dataclass
class CacheCounts:
    """What one call did to the store, per model: evicted entries; the store's data bytes per
    model after it (None: not known)."""

    evicted: dict[str, int]
    model_bytes: dict[str, int]


class ResponseCache:
    """One worker's handle on the host's store (module docstring).

    Args:
        path: the store's folder (made if missing; LMDB's ``data.mdb`` and ``lock.mdb``).
        max_bytes: the map size: the most bytes the store's file takes, >= 1 MiB.
        ttl_s: an entry older than this many seconds is a miss; 0 = none (LRU only).
        on_change: called after each write with what it evicted and the bytes per model (the
            metrics); may be None.

    Opened lazily, in the process that uses it: an LMDB environment must not cross a fork, and
    one process must open a given store once (``lmdb`` documentation), so each worker makes one.
    """

    #: Seconds between two checks that the store's file is still where it was.
    CHECK_S = 1.0
    #: Seconds between two log lines about a failing store.
    LOG_S = 60.0

    def __init__(
        self,
        path: Path,
        max_bytes: int,
        ttl_s: float = 0.0,
        on_change: Callable[[CacheCounts], None] | None = None,
    ) -> None:
        if max_bytes < 1 << 20:
            raise ValueError(f"response cache max_bytes must be >= 1 MiB, got {max_bytes}")
        self.path = path
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.on_change = on_change
        self.budget = int(max_bytes * DATA_SHARE)
        self._env: lmdb.Environment | None = None
        self._dbs: tuple[Any, Any, Any] | None = None  # items, order, meta
        self._inode: tuple[int, int] | None = None
        self._checked = 0.0
        self._logged = -self.LOG_S
        self._retry_at = 0.0

    # --- opening, checking, failing ------------------------------------------------------------

    def _failed(self, what: str, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._logged >= self.LOG_S:
            self._logged = now
            log.warning("response cache %s: %s: %s; computing instead", what, type(exc).__name__, exc,
                        extra={"event": "response_cache_error"})  # fmt: skip
        self.close()
        self._retry_at = now + self.CHECK_S

    def _open(self) -> bool:
        now = time.monotonic()
        if self._env is not None:
            if now - self._checked < self.CHECK_S:
                return True
            self._checked = now
            try:
                st = os.stat(self.path / "data.mdb")
                if (st.st_dev, st.st_ino) == self._inode:
                    return True
            except OSError:
                pass
            self.close()  # removed or replaced while open: open what is there now
        if now < self._retry_at:
            return False
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            env = lmdb.open(
                str(self.path), map_size=self.max_bytes, max_dbs=3, sync=False, metasync=False,
                readahead=False, max_readers=1024,
            )  # fmt: skip
            env.reader_check()  # readers of processes that died free their slots
            self._dbs = (env.open_db(b"items"), env.open_db(b"order"), env.open_db(b"meta"))
            st = os.stat(self.path / "data.mdb")
            self._inode = (st.st_dev, st.st_ino)
        except (lmdb.Error, OSError) as exc:
            self._failed("cannot be opened", exc)
            return False
        self._env, self._checked = env, now
        return True

    def close(self) -> None:
        """Close this worker's handle (the store stays for the others)."""
        env, self._env, self._dbs = self._env, None, None
        if env is not None:
            with contextlib.suppress(Exception):  # a handle on a broken store closes as it can
                env.close()

    # --- lookup and insert -----------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> list[Item | None]:
        """The cached outputs of each key, None where it is missing, expired or corrupt (a
        store that fails: all None). A hit on an entry in the older half of the order is
        stamped again (module docstring)."""
        found: list[Item | None] = [None] * len(keys)
        if not keys or not self._open():
            return found
        env = self._env
        assert env is not None and self._dbs is not None
        items_db, _, meta_db = self._dbs
        renew: list[bytes] = []
        bad: list[bytes] = []
        now = time.time()
        try:
            with env.begin(buffers=True) as txn:
                seq = _u64(txn.get(_SEQ, db=meta_db))
                entries = _u64(txn.get(_ENTRIES, db=meta_db))
                for i, key in enumerate(keys):
                    value = txn.get(key, db=items_db)
                    if value is None:
                        continue
                    parsed = _parse(value)
                    if parsed is None:
                        bad.append(key)
                        continue
                    stamp, written, payload = parsed
                    if self.ttl_s and now - written > self.ttl_s:
                        continue
                    item = decode_item(bytes(payload))
                    if item is None:
                        bad.append(key)
                        continue
                    found[i] = item
                    if seq - stamp > entries // 2:
                        renew.append(key)
        except lmdb.Error as exc:
            self._failed("lookup failed", exc)
            return [None] * len(keys)
        if renew or bad:
            self._write(lambda txn: self._renew(txn, renew, bad))
        return found

    def insert(self, entries: Sequence[tuple[bytes, str, Item]]) -> None:
        """Store each ``(key, model name, outputs)`` not already stored (a valid, unexpired entry
        is kept), evicting the oldest entries once the store's pages pass :attr:`budget`. Drops
        what it cannot store."""
        blobs = []
        for key, model, item in entries:
            payload = encode_item(item)
            if payload is not None:
                blobs.append((key, model, payload))
        if blobs and self._open():
            self._write(lambda txn: self._insert(txn, blobs))

    def stats(self) -> dict[str, int]:
        """The store's figures: entries, their bytes (keys and values), stamps given, bytes of
        the pages its trees take; {} when it cannot be read."""
        if not self._open():
            return {}
        env = self._env
        assert env is not None and self._dbs is not None
        try:
            with env.begin() as txn:
                meta = self._dbs[2]
                return {
                    "entries": _u64(txn.get(_ENTRIES, db=meta)),
                    "bytes": _u64(txn.get(_BYTES, db=meta)),
                    "seq": _u64(txn.get(_SEQ, db=meta)),
                    "pages_bytes": self._pages_bytes(txn),
                }
        except lmdb.Error as exc:
            self._failed("cannot be read", exc)
            return {}

    # --- writes (one write transaction each; LMDB serialises writers across processes) ----------

    def _write(self, body: Callable[[Txn], CacheCounts]) -> None:
        env = self._env
        assert env is not None
        for attempt in range(2):
            try:
                with env.begin(write=True) as txn:
                    counts = body(txn)
                break
            except lmdb.MapFullError as exc:
                if attempt:
                    self._failed("is full", exc)
                    return
                try:  # pages held for readers or freed late filled it: evict half, try once more
                    env.reader_check()
                    with env.begin(write=True) as txn:
                        assert self._dbs is not None
                        evicted: dict[str, int] = {}
                        per_model: dict[str, int] = {}
                        self._evict(txn, _u64(txn.get(_ENTRIES, db=self._dbs[2])) // 2, evicted, per_model)
                        held = self._model_bytes(txn, per_model)
                    if self.on_change is not None:
                        self.on_change(CacheCounts(evicted, held))
                except lmdb.Error as again:
                    self._failed("is full", again)
                    return
            except lmdb.Error as exc:
                self._failed("write failed", exc)
                return
        if self.on_change is not None:
            self.on_change(counts)

    def _insert(self, txn: Txn, blobs: list[tuple[bytes, str, bytes]]) -> CacheCounts:
        assert self._dbs is not None
        items_db, order_db, meta_db = self._dbs
        get, put = txn.get, txn.put
        seq = _u64(get(_SEQ, db=meta_db))
        total = _u64(get(_BYTES, db=meta_db))
        count = _u64(get(_ENTRIES, db=meta_db))
        per_model: dict[str, int] = {}
        now = time.time()
        for key, model, payload in blobs:
            old = get(key, db=items_db)
            if old is not None:
                parsed = _parse(old)
                if parsed is not None and not (self.ttl_s and now - parsed[1] > self.ttl_s):
                    continue  # another worker stored it first
                total -= self._drop(txn, key, old, parsed, per_model)
                count -= 1
            seq += 1
            value = _value(seq, now, payload)
            put(key, value, db=items_db)
            put(_STAMP.pack(seq) + key, model.encode(), db=order_db)
            size = len(value) + len(key) + _ENTRY_OVERHEAD
            total += size
            count += 1
            per_model[model] = per_model.get(model, 0) + size
        put(_SEQ, _U64.pack(seq), db=meta_db)
        put(_BYTES, _U64.pack(max(total, 0)), db=meta_db)
        put(_ENTRIES, _U64.pack(max(count, 0)), db=meta_db)
        evicted: dict[str, int] = {}
        used = self._pages_bytes(txn)
        if used > self.budget and count:
            share = (used - self.budget * _LOW_WATER) / used
            self._evict(txn, min(_EVICT_BATCH, math.ceil(count * share)), evicted, per_model)
        return CacheCounts(evicted, self._model_bytes(txn, per_model))

    def _renew(self, txn: Txn, renew: list[bytes], bad: list[bytes]) -> CacheCounts:
        assert self._dbs is not None
        items_db, order_db, meta_db = self._dbs
        get, put, delete = txn.get, txn.put, txn.delete
        seq = _u64(get(_SEQ, db=meta_db))
        total = _u64(get(_BYTES, db=meta_db))
        count = _u64(get(_ENTRIES, db=meta_db))
        per_model: dict[str, int] = {}
        for key in bad:
            old = get(key, db=items_db)
            if old is not None and _parse(old) is None:
                total -= self._drop(txn, key, old, None, per_model)
                count -= 1
        for key in renew:
            old = get(key, db=items_db)
            parsed = _parse(old) if old is not None else None
            if old is None or parsed is None:
                continue
            stamp = parsed[0]
            model = get(_STAMP.pack(stamp) + key, db=order_db)
            if model is None:
                continue
            model_name = bytes(model).decode()
            delete(_STAMP.pack(stamp) + key, db=order_db)
            seq += 1
            put(key, _restamp(bytes(old), seq), db=items_db)
            put(_STAMP.pack(seq) + key, model_name.encode(), db=order_db)
        put(_SEQ, _U64.pack(seq), db=meta_db)
        put(_BYTES, _U64.pack(max(total, 0)), db=meta_db)
        put(_ENTRIES, _U64.pack(max(count, 0)), db=meta_db)
        return CacheCounts({}, self._model_bytes(txn, per_model))

    def _drop(
        self,
        txn: Txn,
        key: bytes,
        old: bytes | memoryview,
        parsed: tuple[int, float, memoryview] | None,
        per_model: dict[str, int],
    ) -> int:
        """Delete the entry ``key`` (its order record where its header can be read); its size."""
        assert self._dbs is not None
        items_db, order_db, _ = self._dbs
        size = len(old) + len(key) + _ENTRY_OVERHEAD
        if parsed is not None:
            order_key = _STAMP.pack(parsed[0]) + key
            model = txn.get(order_key, db=order_db)
            if model is not None:
                name = bytes(model).decode()
                per_model[name] = per_model.get(name, 0) - size
                txn.delete(order_key, db=order_db)
        txn.delete(key, db=items_db)
        return size

    def _evict(self, txn: Txn, drop: int, evicted: dict[str, int], per_model: dict[str, int]) -> None:
        """Delete the ``drop`` entries of the oldest stamps; counts go to ``evicted`` and the
        byte changes to ``per_model``, per model."""
        assert self._dbs is not None
        items_db, order_db, meta_db = self._dbs
        get = txn.get
        total = _u64(get(_BYTES, db=meta_db))
        count = _u64(get(_ENTRIES, db=meta_db))
        gone = 0
        stale: list[bytes] = []
        for order_key, model in txn.cursor(db=order_db):
            if gone >= drop:
                break
            order_key, name = bytes(order_key), bytes(model).decode()
            stamp, key = _STAMP.unpack(order_key[:8])[0], order_key[8:]
            value = get(key, db=items_db)
            parsed = _parse(value) if value is not None else None
            stale.append(order_key)
            if value is None or parsed is None or parsed[0] != stamp:
                continue  # its entry was stamped again or replaced: only the record goes
            size = len(value) + len(key) + _ENTRY_OVERHEAD
            txn.delete(key, db=items_db)
            total -= size
            count -= 1
            gone += 1
            evicted[name] = evicted.get(name, 0) + 1
            per_model[name] = per_model.get(name, 0) - size
        for order_key in stale:
            txn.delete(order_key, db=order_db)
        txn.put(_BYTES, _U64.pack(max(total, 0)), db=meta_db)
        txn.put(_ENTRIES, _U64.pack(max(count, 0)), db=meta_db)

    def _pages_bytes(self, txn: Txn) -> int:
        """Bytes of the pages the store's trees take (branch, leaf and overflow pages)."""
        assert self._dbs is not None
        used = 0
        for db in self._dbs:
            stat = txn.stat(db)
            used += (stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]) * stat["psize"]
        return used

    def _model_bytes(self, txn: Txn, delta: dict[str, int]) -> dict[str, int]:
        """Apply ``delta`` to the per-model byte counts; the new counts of those models."""
        assert self._dbs is not None
        meta_db = self._dbs[2]
        out = {}
        for model, change in delta.items():
            key = _MODEL_BYTES + model.encode()
            value = max(_u64(txn.get(key, db=meta_db)) + change, 0)
            txn.put(key, _U64.pack(value), db=meta_db)
            out[model] = value
        return out


def _u64(value: bytes | memoryview | None) -> int:
    return _U64.unpack(bytes(value))[0] if value is not None and len(value) == 8 else 0


def _value(stamp: int, written: float, payload: bytes) -> bytes:
    """A stored value: the header (the checksum covers the payload only, so that a hit can be
    stamped again without hashing it anew) and the payload."""
    return _HEADER.pack(_MAGIC, stamp, written, _checksum(payload)) + payload


def _restamp(value: bytes, stamp: int) -> bytes:
    magic, _, written, checksum = _HEADER.unpack_from(value)
    return _HEADER.pack(magic, stamp, written, checksum) + value[_HEADER.size :]


def _parse(value: bytes | memoryview) -> tuple[int, float, memoryview] | None:
    """(stamp, written, payload) of a stored value; None when its header or checksum is wrong."""
    view = memoryview(value)
    if len(view) < _HEADER.size:
        return None
    magic, stamp, written, checksum = _HEADER.unpack_from(view)
    payload = view[_HEADER.size :]
    if magic != _MAGIC or _checksum(payload) != checksum:
        return None
    return stamp, written, payload


def pack_entry(item: Item) -> bytes | None:
    """One item's outputs as a stored value (header with the time written and a checksum, then
    :func:`encode_item`'s payload), for a tier outside LMDB; None when it cannot be cached."""
    payload = encode_item(item)
    return None if payload is None else _value(0, time.time(), payload)


def unpack_entry(value: bytes, ttl_s: float = 0.0) -> Item | None:
    """The outputs of a value :func:`pack_entry` made; None when it is corrupt, does not decode
    or is older than ``ttl_s`` (0 = no limit)."""
    parsed = _parse(value)
    if parsed is None or (ttl_s and time.time() - parsed[1] > ttl_s):
        return None
    return decode_item(bytes(parsed[2]))
