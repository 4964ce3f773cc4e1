"""The host's store of the response cache: one LMDB environment that every worker of the host
maps (the ``lmdb`` package: a memory-mapped B-tree with one writer and lock-free readers across
processes), under the server's run directory or a configured path. Its map size is the byte
bound, which the file never exceeds.

**Bounds.** Entries are stamped in insertion order and evicted oldest stamp first once the pages
of the store's trees pass :data:`DATA_SHARE` of the map, down to :data:`LOW_WATER` of that, in
write transactions of at most :attr:`ResponseCache.per_txn` entries each; inserts are made in
transactions of that size too. The other half of the map is room for LMDB's copy-on-write and
for the pages that open readers still hold, so a bounded transaction always finds the free
pages it needs; one that does not (pages pinned by a reader that stalls, overflow pages that
need a contiguous run) makes the store evict a quarter of its entries, again in bounded
transactions, and try once more; when even that fails the store is emptied (``mdb_drop``, which
copies no page). A hit on an entry in the older half of the order stamps it again (CLOCK's
second chance: at most one write per hit on a cold entry, none on a hot one). With a TTL, an
entry older than it is a miss. LMDB has neither eviction nor TTL of its own; both live here.

**Failure is never an error.** A store that cannot be opened, is full, corrupt, unwritable or
removed while the server runs makes lookups miss and inserts drop (each dropped entry counted
per model and reason in :class:`~app.serving.response_cache.writes.CacheCounts`; logged at
most once a minute), and the store is opened again (a new file where it was removed) once a
second has passed. The caller then computes.

**Threads.** Every method blocks (disk, LMDB's write lock) and is meant for a thread off the
event loop (``app.serving.item_cache``); any number of threads may call them at once. An
environment replaced while threads use it is closed by the last of them.

Source: LMDB's documentation (``mdb_env_set_mapsize``, ``mdb_reader_check``, ``mdb_drop``);
Knot Resolver's LMDB cache (bounded delete transactions above a usage threshold; ``cdb_clear``);
CLOCK / second-chance replacement (Corbató, 1968) for the approximation of LRU.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import lmdb

from app.serving.response_cache import writes
from app.serving.response_cache.entries import Item, decode_item, encode_item, parse
from app.serving.response_cache.opening import Handle, Opener
from app.serving.response_cache.writes import CacheCounts

if TYPE_CHECKING:
    from app.serving.response_cache.writes import Txn

log = logging.getLogger(__name__)

#: Share of the map that the store's pages (its trees: entries, their order, branch pages,
#: half-filled leaves) may take before the oldest entries are evicted, down to LOW_WATER of it.
DATA_SHARE = 0.5
LOW_WATER = 0.9
#: Share of the map's pages that one write transaction may copy (its entries' leaf pages):
#: the bound of :attr:`ResponseCache.per_txn`, at least 8 entries and at most 100.
TXN_PAGES_SHARE = 1 / 32


@dataclass(frozen=True, slots=True)
class Found:
    """What :meth:`ResponseCache.read` found: each key's outputs (None: missing, expired or
    damaged), the keys to stamp again (hits in the older half of the order) and the damaged."""

    items: list[Item | None]
    renew: list[bytes]
    bad: list[bytes]


class ResponseCache:
    """One worker's handle on the host's store (module docstring).

    Args:
        path: the store's folder (made if missing; LMDB's ``data.mdb`` and ``lock.mdb``).
        max_bytes: the map size: the most bytes the store's file takes, >= 1 MiB.
        ttl_s: an entry older than this many seconds is a miss; 0 = none (LRU only).
        on_change: called after each write with what it evicted, the bytes per model and the
            entries it dropped (the metrics); may be None. Called on the writing thread.

    Opened lazily, in the process that uses it: an LMDB environment must not cross a fork, and
    one process must open a given store once (``lmdb`` documentation), so each worker makes one.

    Raises:
        ValueError: ``max_bytes`` under 1 MiB.
    """

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
        #: Most entries one write transaction inserts or evicts.
        self.per_txn = max(8, min(100, int(max_bytes // 4096 * TXN_PAGES_SHARE)))
        #: The open environment, shared by the threads that call this store.
        self.opener = Opener(path, max_bytes)

    def _failed(self, what: str, exc: BaseException) -> None:
        self.opener.failed(what, exc)

    def close(self) -> None:
        """Close this worker's handle (the store stays for the others; threads still using it
        close it when they are done)."""
        self.opener.close()

    # --- reading -------------------------------------------------------------------------------

    def read(self, keys: Sequence[bytes]) -> Found:
        """The cached outputs of each key, None where it is missing, expired or damaged (a store
        that fails: all None), without writing (the caller hands :attr:`Found.renew` and
        :attr:`Found.bad` to :meth:`refresh`)."""
        found: list[Item | None] = [None] * len(keys)
        renew: list[bytes] = []
        bad: list[bytes] = []
        if not keys:
            return Found(found, renew, bad)
        now = time.time()
        with self.opener.session() as handle:
            if handle is None:
                return Found(found, renew, bad)
            tables = handle.tables
            try:
                with handle.env.begin(buffers=True) as txn:
                    seq, count = writes.clock(txn, tables)
                    for i, key in enumerate(keys):
                        value = txn.get(key, db=tables.items)
                        if value is None:
                            continue
                        parsed = parse(key, value)
                        item = None if parsed is None else decode_item(bytes(parsed.payload))
                        if parsed is None or item is None:
                            bad.append(key)
                            continue
                        if self.ttl_s and now - parsed.written > self.ttl_s:
                            continue
                        found[i] = item
                        if seq - parsed.stamp > count // 2:
                            renew.append(key)
            except lmdb.Error as exc:
                self._failed("lookup failed", exc)
                return Found([None] * len(keys), [], [])
        return Found(found, renew, bad)

    def lookup(self, keys: Sequence[bytes]) -> list[Item | None]:
        """:meth:`read` and :meth:`refresh` in one call: each key's outputs, None where missing."""
        found = self.read(keys)
        self.refresh(found.renew, found.bad)
        return found.items

    def stats(self) -> dict[str, int]:
        """The store's figures: entries, their bytes (keys and values), stamps given, bytes of
        the pages its trees take; {} when it cannot be read."""
        with self.opener.session() as handle:
            if handle is None:
                return {}
            try:
                with handle.env.begin() as txn:
                    return writes.figures(txn, handle.tables)
            except lmdb.Error as exc:
                self._failed("cannot be read", exc)
                return {}

    # --- writing -------------------------------------------------------------------------------

    def refresh(self, renew: Sequence[bytes], bad: Sequence[bytes]) -> None:
        """Stamp the entries ``renew`` again and delete the damaged ``bad`` (:meth:`read`)."""
        if not renew and not bad:
            return
        counts = CacheCounts()
        with self.opener.session() as handle:
            if handle is None:
                return
            try:
                self._write(handle, lambda txn: writes.refresh(txn, handle.tables, renew, bad), counts)
            except lmdb.MapFullError:
                pass  # a second chance is not worth evicting for
            except lmdb.Error as exc:
                self._failed("write failed", exc)
        if counts and self.on_change is not None:
            self.on_change(counts)

    def insert(self, entries: Sequence[tuple[bytes, str, Item]]) -> None:
        """Store each ``(key, model name, outputs)`` not already stored (a valid, unexpired entry
        is kept), in transactions of :attr:`per_txn` entries, evicting the oldest entries once
        the store's pages pass :attr:`budget` (module docstring). What it cannot store is
        dropped and counted (:attr:`on_change`)."""
        counts = CacheCounts()
        blobs = []
        for key, model, item in entries:
            payload = encode_item(item)
            if payload is None:
                counts.drop(model, "unencodable")
            else:
                blobs.append((key, model, payload))
        with self.opener.session() as handle:
            for start in range(0, len(blobs), self.per_txn):
                chunk = blobs[start : start + self.per_txn]
                if handle is None or handle.retired:
                    for _, model, _ in chunk:
                        counts.drop(model, "store_error")
                    continue
                self._insert_chunk(handle, chunk, counts)
        if counts and self.on_change is not None:
            self.on_change(counts)

    def _insert_chunk(
        self, handle: Handle, chunk: list[tuple[bytes, str, bytes]], counts: CacheCounts
    ) -> None:
        """One bounded insert transaction, then eviction down to the budget; once more after
        evicting a quarter of the store when the map is full; else the chunk is dropped."""

        def body(txn: Txn) -> dict[str, int]:
            return writes.insert(txn, handle.tables, chunk, self.ttl_s)

        for attempt in range(2):
            try:
                self._write(handle, body, counts)
                break
            except lmdb.MapFullError as exc:
                if not attempt and self._make_room(handle, counts):
                    continue
                self._failed("is full", exc)
                reason = "store_full"
            except lmdb.Error as exc:
                self._failed("write failed", exc)
                reason = "store_error"
            for _, model, _ in chunk:
                counts.drop(model, reason)
            return
        try:
            self._evict_to_budget(handle, counts)
        except lmdb.MapFullError:
            self._make_room(handle, counts)
        except lmdb.Error as exc:
            self._failed("eviction failed", exc)

    @staticmethod
    def _write(handle: Handle, body: Callable[[Txn], dict[str, int]], counts: CacheCounts) -> None:
        """Run ``body`` in one write transaction; once it committed, its byte counts go to
        ``counts``.

        Raises:
            lmdb.MapFullError: the map had no room for the transaction (nothing written).
            lmdb.Error: the store failed (nothing written).
        """
        with handle.env.begin(write=True) as txn:
            changed = body(txn)
        counts.model_bytes.update(changed)

    def _evict(self, handle: Handle, drop: int, counts: CacheCounts, everything: bool = False) -> None:
        """Evict the ``drop`` oldest entries (``everything``: empty the store) in one write
        transaction; counted in ``counts`` once it committed.

        Raises:
            lmdb.MapFullError, lmdb.Error: as :meth:`_write`.
        """
        evicted: dict[str, int] = {}
        tables = handle.tables
        if everything:
            self._write(handle, lambda txn: writes.clear(txn, tables, evicted), counts)
        else:
            self._write(handle, lambda txn: writes.evict(txn, tables, drop, evicted), counts)
        for model, count in evicted.items():
            counts.evicted[model] = counts.evicted.get(model, 0) + count

    @staticmethod
    def _usage(handle: Handle) -> tuple[int, int]:
        """Bytes of the trees' pages, and the entries."""
        with handle.env.begin() as txn:
            return writes.pages_bytes(txn, handle.tables), writes.entry_count(txn, handle.tables)

    def _evict_to_budget(self, handle: Handle, counts: CacheCounts) -> None:
        """Evict the oldest entries, :attr:`per_txn` per transaction, while the trees' pages
        pass :attr:`budget`, down to :data:`LOW_WATER` of it.

        Raises:
            lmdb.MapFullError: a transaction found no room (what it would have evicted stays).
        """
        low = self.budget * LOW_WATER
        used, count = self._usage(handle)
        if used <= self.budget:
            return
        while used > low and count:
            # a share of the entries as large as the share of pages over the low water mark
            left = math.ceil(count * (used - low) / used)
            while left > 0:
                self._evict(handle, min(self.per_txn, left), counts)
                left -= self.per_txn
            after, count = self._usage(handle)
            if after >= used:  # a round that freed no page (entries of half-empty pages): enough
                return
            used = after

    def _make_room(self, handle: Handle, counts: CacheCounts) -> bool:
        """After a full map: free the slots of dead readers, evict a quarter of the entries in
        bounded transactions, and if even those find no room, empty the store. Whether a write
        may be tried again."""
        try:
            handle.env.reader_check()
            left = max(1, self._usage(handle)[1] // 4)
            while left > 0:
                self._evict(handle, min(self.per_txn, left), counts)
                left -= self.per_txn
            return True
        except lmdb.MapFullError:
            pass
        except lmdb.Error as exc:
            self._failed("write failed", exc)
            return False
        try:
            self._evict(handle, 0, counts, everything=True)
        except lmdb.Error as exc:
            self._failed("is full", exc)
            return False
        log.warning("response cache emptied: no room left even to evict in %s", self.path,
                    extra={"event": "response_cache_emptied"})  # fmt: skip
        return True
