"""The response cache's write transactions on the host's LMDB store, and its accounting.

Three named databases: ``items`` (key -> value, ``app.serving.response_cache.entries``),
``order`` (big-endian stamp + key -> model name: LMDB orders keys bytewise, so a cursor walks the
entries oldest stamp first) and ``meta`` (the last stamp given, the entries, their bytes, their
bytes per model). Each function here runs inside one write transaction that its caller opened
and commits; LMDB serialises writers across processes.

Eviction walks the order from its oldest stamp. Items are keyed by a hash, so the entries of one
eviction lie on random leaf pages of ``items``: deleting *n* of them copies up to *n* leaf pages
(LMDB's copy-on-write) before the transaction frees any. The store's callers therefore evict in
transactions of a bounded number of entries (``app.serving.response_cache.store``), each of
which needs few free pages, as Knot Resolver's cache garbage collector deletes at most
``rw_txn_items`` (100) records per transaction (CZ-NIC/knot-resolver, ``utils/cache_gc``).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

import lmdb

from app.serving.response_cache.entries import Parsed, make_value, parse, restamp

if TYPE_CHECKING:  # generic in lmdb's stubs only
    Txn: TypeAlias = lmdb.Transaction[Any]

STAMP = struct.Struct(">Q")  # big-endian: LMDB orders keys bytewise, so stamps sort in order
_U64 = struct.Struct("<Q")
_SEQ, _BYTES, _ENTRIES = b"seq", b"bytes", b"entries"
_MODEL_BYTES = b"bytes:"
#: Bytes of LMDB bookkeeping counted per entry (its order record and node headers).
ENTRY_OVERHEAD = 96


@dataclass(frozen=True, slots=True)
class Tables:
    """The store's named databases (handles of one open environment)."""

    items: Any
    order: Any
    meta: Any


@dataclass
class CacheCounts:
    """What one call did to the store, per model: entries evicted, the store's data bytes after
    it (of the models it changed), and entries that were not written, per (model, reason):
    ``store_full``, ``store_error``, ``unencodable``, ``queue_full``, ``redis_error``."""

    evicted: dict[str, int] = field(default_factory=dict)
    model_bytes: dict[str, int] = field(default_factory=dict)
    dropped: dict[tuple[str, str], int] = field(default_factory=dict)

    def drop(self, model: str, reason: str, count: int = 1) -> None:
        """Count ``count`` entries of ``model`` not written for ``reason``."""
        self.dropped[model, reason] = self.dropped.get((model, reason), 0) + count

    def __bool__(self) -> bool:
        return bool(self.evicted or self.model_bytes or self.dropped)


class _Meta:
    """The meta counters of one write transaction, read at its start, written by :meth:`save`."""

    def __init__(self, txn: Txn, tables: Tables) -> None:
        self.txn, self.tables = txn, tables
        self.seq = u64(txn.get(_SEQ, db=tables.meta))
        self.total = u64(txn.get(_BYTES, db=tables.meta))
        self.count = u64(txn.get(_ENTRIES, db=tables.meta))
        self.per_model: dict[str, int] = {}

    def changed(self, model: str | None, size: int) -> None:
        """An entry of ``size`` bytes stored (> 0) or deleted (< 0); ``model`` None: unknown."""
        if model is not None:
            self.per_model[model] = self.per_model.get(model, 0) + size
        self.total += size
        self.count += 1 if size > 0 else -1

    def save(self) -> dict[str, int]:
        """Write the counters back; the new byte counts of the models that changed."""
        put, meta = self.txn.put, self.tables.meta
        put(_SEQ, _U64.pack(self.seq), db=meta)
        put(_BYTES, _U64.pack(max(self.total, 0)), db=meta)
        put(_ENTRIES, _U64.pack(max(self.count, 0)), db=meta)
        out = {}
        for model, change in self.per_model.items():
            key = _MODEL_BYTES + model.encode()
            value = max(u64(self.txn.get(key, db=meta)) + change, 0)
            put(key, _U64.pack(value), db=meta)
            out[model] = value
        return out


def u64(value: bytes | memoryview | None) -> int:
    """A little-endian counter of ``meta``; 0 when absent."""
    return _U64.unpack(bytes(value))[0] if value is not None and len(value) == 8 else 0


def entry_count(txn: Txn, tables: Tables) -> int:
    """The entries the store holds."""
    return u64(txn.get(_ENTRIES, db=tables.meta))


def clock(txn: Txn, tables: Tables) -> tuple[int, int]:
    """The last stamp given and the entries the store holds."""
    return u64(txn.get(_SEQ, db=tables.meta)), u64(txn.get(_ENTRIES, db=tables.meta))


def figures(txn: Txn, tables: Tables) -> dict[str, int]:
    """entries, their bytes (keys and values), stamps given, bytes of the trees' pages."""
    get, meta = txn.get, tables.meta
    return {
        "entries": u64(get(_ENTRIES, db=meta)),
        "bytes": u64(get(_BYTES, db=meta)),
        "seq": u64(get(_SEQ, db=meta)),
        "pages_bytes": pages_bytes(txn, tables),
    }


def pages_bytes(txn: Txn, tables: Tables) -> int:
    """Bytes of the pages the store's trees take (branch, leaf and overflow pages)."""
    used = 0
    for db in (tables.items, tables.order, tables.meta):
        stat = txn.stat(db)
        used += (stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]) * stat["psize"]
    return used


def insert(
    txn: Txn, tables: Tables, blobs: Sequence[tuple[bytes, str, bytes]], ttl_s: float
) -> dict[str, int]:
    """Store each ``(key, model, payload)`` not already stored (a valid, unexpired entry is kept:
    another worker stored it first; a damaged or expired one is replaced), stamped in order.

    Returns:
        The store's data bytes of each model changed.
    """
    get, put = txn.get, txn.put
    meta = _Meta(txn, tables)
    now = time.time()
    for key, model, payload in blobs:
        old = get(key, db=tables.items)
        if old is not None:
            parsed = parse(key, old)
            if parsed is not None and not (ttl_s and now - parsed.written > ttl_s):
                continue
            _drop(txn, tables, key, old, parsed, meta)
        meta.seq += 1
        value = make_value(key, meta.seq, now, payload)
        put(key, value, db=tables.items)
        put(STAMP.pack(meta.seq) + key, model.encode(), db=tables.order)
        meta.changed(model, len(value) + len(key) + ENTRY_OVERHEAD)
    return meta.save()


def refresh(txn: Txn, tables: Tables, renew: Sequence[bytes], bad: Sequence[bytes]) -> dict[str, int]:
    """Stamp the entries ``renew`` again (hits in the older half of the order: CLOCK's second
    chance) and delete those of ``bad`` that are still damaged.

    Returns:
        The store's data bytes of each model changed.
    """
    get, put = txn.get, txn.put
    meta = _Meta(txn, tables)
    for key in bad:
        old = get(key, db=tables.items)
        if old is not None and parse(key, old) is None:
            _drop(txn, tables, key, old, None, meta)
    for key in renew:
        old = get(key, db=tables.items)
        parsed = parse(key, old) if old is not None else None
        if old is None or parsed is None:
            continue
        order_key = STAMP.pack(parsed.stamp) + key
        model = get(order_key, db=tables.order)
        if model is None:
            continue
        model_name = bytes(model)
        txn.delete(order_key, db=tables.order)
        meta.seq += 1
        put(key, restamp(bytes(old), meta.seq), db=tables.items)
        put(STAMP.pack(meta.seq) + key, model_name, db=tables.order)
    return meta.save()


def evict(txn: Txn, tables: Tables, drop: int, evicted: dict[str, int]) -> dict[str, int]:
    """Delete the ``drop`` entries of the oldest stamps (counted per model into ``evicted``).

    Returns:
        The store's data bytes of each model changed.
    """
    get = txn.get
    meta = _Meta(txn, tables)
    gone = 0
    stale: list[bytes] = []
    for order_key, model in txn.cursor(db=tables.order):
        if gone >= drop:
            break
        order_key, name = bytes(order_key), bytes(model).decode()
        stamp, key = STAMP.unpack(order_key[:8])[0], order_key[8:]
        value = get(key, db=tables.items)
        parsed = parse(key, value) if value is not None else None
        stale.append(order_key)
        if value is None or parsed is None or parsed.stamp != stamp:
            continue  # its entry was stamped again or replaced: only the record goes
        txn.delete(key, db=tables.items)
        meta.changed(name, -(len(value) + len(key) + ENTRY_OVERHEAD))
        gone += 1
        evicted[name] = evicted.get(name, 0) + 1
    for order_key in stale:
        txn.delete(order_key, db=tables.order)
    return meta.save()


def clear(txn: Txn, tables: Tables, evicted: dict[str, int]) -> dict[str, int]:
    """Empty the store: every entry (counted per model into ``evicted``) and counter, by LMDB's
    ``mdb_drop`` of each database, which frees their pages without copying them.

    Returns:
        The store's data bytes of each model it held: 0.
    """
    for _, model in txn.cursor(db=tables.order):
        name = bytes(model).decode()
        evicted[name] = evicted.get(name, 0) + 1
    for db in (tables.items, tables.order, tables.meta):
        txn.drop(db, delete=False)
    return dict.fromkeys(evicted, 0)


def _drop(
    txn: Txn, tables: Tables, key: bytes, old: bytes | memoryview, parsed: Parsed | None, meta: _Meta
) -> None:
    """Delete the entry ``key`` (its order record where its header can be read)."""
    name = None
    if parsed is not None:
        order_key = STAMP.pack(parsed.stamp) + key
        model = txn.get(order_key, db=tables.order)
        if model is not None:
            name = bytes(model).decode()
            txn.delete(order_key, db=tables.order)
    meta.changed(name, -(len(old) + len(key) + ENTRY_OVERHEAD))
    txn.delete(key, db=tables.items)
