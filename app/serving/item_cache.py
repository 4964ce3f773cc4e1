"""The response cache in the data plane: an item stage (``app.serving.items``) that answers a
request's items from the host's store and sends only the rest to be computed.

:meth:`ItemCache.expand` takes a validated request's arrays: items whose key the store holds
never reach the queue (admission, balancing and batching see only the rest), equal items of the
request are computed once; :meth:`ItemCache.assemble` puts the outputs back ``[B, ...]`` in the
request's order, the cached rows the very bytes that were computed. What is computed is stored
by :meth:`ItemCache.computed`, which the data plane calls where a batch's outputs come back from
a serving unit of this worker, with the identity of that unit (the fingerprint read with it):
what a sibling worker (a shard) or a version replaced meanwhile computed is stored under its own
identity, never under another's.

The store's and Redis's I/O never runs on the event loop
(``app.serving.response_cache.background``): a lookup is waited for at most ``lookup_timeout_s``
(its items are then computed, and counted as misses and late), and what is computed is queued
for a writer thread (at most ``queue_items`` entries; more are dropped and counted). Until its
write lands, an entry queued by this worker answers this worker's lookups from memory.

A model version's identity (:meth:`ItemCache.identity`) is its name, version, the fingerprint of
its files as loaded (``app.models.repository.fingerprint``; "" until it is loaded: such a
version is not cached), the versions of the libraries that compute it and the worker's device
kind: a reload, a new version, a new library or another kind of device starts afresh.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from app.datatypes import ragged
from app.errors import InferenceFailed
from app.observability.metrics import ServerMetrics
from app.observability.tracing import Tracing
from app.serving.context import RequestContext
from app.serving.items import ItemStage
from app.serving.redis_tier import RedisTier
from app.serving.registry import ModelVersion
from app.serving.response_cache import CacheCounts, Found, Item, ResponseCache, environment, item_keys
from app.serving.response_cache.background import Reader, Writer
from app.settings import Settings

log = logging.getLogger(__name__)

Arrays = dict[str, np.ndarray]
Entries = list[tuple[bytes, str, Item]]


@dataclass(frozen=True, slots=True)
class Plan:
    """What :meth:`ItemCache.assemble` needs of one request: its model, every item's key in
    request order, what was found per distinct key (None: computed), and the row of the
    computed results that answers each computed key."""

    model: ModelVersion
    keys: list[bytes]
    found: dict[bytes, Item | None]
    rows: dict[bytes, int]


class ItemCache(ItemStage[Plan | None]):
    """This worker's side of the response cache (module docstring).

    Args:
        store: the host's store (``app.serving.response_cache.ResponseCache``).
        device: the torch device the worker's models run on ("cuda:0", "cpu"); its kind is
            part of every key.
        metrics: this process's metrics (None: off).
        tracing: the request spans (None: off).
        shared: the tier that several hosts share (``app.serving.redis_tier``), asked for what
            the host's store lacks and written with what is computed; None: none.
        lookup_timeout_s: the longest a request waits for its lookups (both tiers), seconds.
        queue_items: most entries waiting to be written, per tier.
    """

    keeps = True  # what a unit computed is stored

    def __init__(
        self,
        store: ResponseCache,
        device: str,
        metrics: ServerMetrics | None = None,
        tracing: Tracing | None = None,
        shared: RedisTier | None = None,
        *,
        lookup_timeout_s: float = 0.1,
        queue_items: int = 4096,
    ) -> None:
        self.store = store
        self.shared = shared
        self.device_kind = device.split(":", 1)[0]
        self.metrics = metrics
        self.tracing = tracing
        self.lookup_timeout_s = lookup_timeout_s
        self._environments: dict[str | None, str] = {}
        self._readers = {"host": Reader("response-cache-host"), "redis": Reader("response-cache-redis")}
        self._writer = Writer("response-cache-writer", queue_items)
        self._redis_writer = Writer("response-cache-redis-writer", queue_items)
        #: Entries queued for the host's store and not yet written: this worker reads its writes.
        self._pending: dict[bytes, Item] = {}
        if metrics is not None:
            store.on_change = self._changed

    def identity(self, model: ModelVersion, fingerprint: str) -> bytes:
        """What keys ``model``'s items besides their inputs: name, version, ``fingerprint`` (of
        the files its serving unit was loaded from), libraries, device kind."""
        config = model.config
        package = config.parameters.get("model_package")
        package = package if isinstance(package, str) else None
        env = self._environments.get(package)
        if env is None:
            env = self._environments[package] = environment(package)
        return "\0".join((config.name, config.version, fingerprint, env, self.device_kind)).encode()

    def applies(self, model: ModelVersion) -> bool:
        """Whether ``model`` has ``[response_cache] enable`` and is loaded (its files' identity
        known)."""
        return bool(model.config.response_cache.enable and model.fingerprint)

    def answers_without_model(self, model: ModelVersion) -> bool:
        """Whether ``model`` has ``[response_cache] enable``: the store may answer a request
        whole, so the data plane does not refuse it before its items are looked up."""
        return model.config.response_cache.enable

    async def expand(
        self, model: ModelVersion, context: RequestContext, inputs: Arrays
    ) -> tuple[Arrays | None, Plan | None]:
        """The items of ``inputs`` (one array ``[B, ...]`` per input) to compute: the distinct
        ones that neither this worker's queued writes, the store nor Redis hold within the
        lookup bound, in request order; None when every one was found. A model without
        ``[response_cache] enable`` (or not yet loaded) has all its items computed.

        Returns:
            ``(items, plan)`` (``app.serving.items.ItemStage``).
        """
        if not self.applies(model):
            return inputs, None
        keys = item_keys(self.identity(model, model.fingerprint), inputs)
        if keys is None:
            return inputs, None
        start = time.perf_counter()
        first: dict[bytes, int] = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        found = {key: self._pending.get(key) for key in first}
        late = await self._look_up(model, found)
        hits = sum(1 for key in keys if found[key] is not None)
        self._count(model, keys, hits, late, time.perf_counter() - start)
        missing = [i for key, i in first.items() if found[key] is None]
        plan = Plan(model, keys, found, {keys[i]: row for row, i in enumerate(missing)})
        if not missing:
            return None, plan
        if len(missing) == len(keys):
            return inputs, plan
        return {name: array[missing] for name, array in inputs.items()}, plan

    async def _look_up(self, model: ModelVersion, found: dict[bytes, Item | None]) -> dict[bytes, str]:
        """Fill ``found`` from the host's store, then Redis, within the lookup bound; the keys
        whose lookup passed it, with the tier that did not answer."""
        until = asyncio.get_running_loop().time() + self.lookup_timeout_s
        lacking = [key for key, item in found.items() if item is None]
        if not lacking:
            return {}
        answer: Found | None = await self._readers["host"].call(self.store.read, lacking, until=until)
        if answer is None:
            return dict.fromkeys(lacking, "host")
        found.update(zip(lacking, answer.items, strict=True))
        if answer.renew or answer.bad:
            self._writer.submit(len(answer.renew) + len(answer.bad),
                                lambda: self.store.refresh(answer.renew, answer.bad))  # fmt: skip
        lacking = [key for key in lacking if found[key] is None]
        if self.shared is None or not lacking:
            return {}
        remote = await self._readers["redis"].call(self.shared.lookup, lacking, until=until)
        if remote is None:
            return dict.fromkeys(lacking, "redis")
        fetched = [
            (key, model.config.name, item)
            for key, item in zip(lacking, remote, strict=True)
            if item is not None
        ]
        if fetched:
            found.update((key, item) for key, _, item in fetched)
            self._store(fetched, shared=False)  # copied into the host's store
        return {}

    def assemble(self, plan: Plan | None, results: Arrays | None) -> Arrays:
        """One output row per item of the request, in its order: a cached item's stored arrays,
        the others' rows of ``results`` (bit for bit either way).

        Raises:
            InferenceFailed: the cached and computed outputs differ in item shape or dtype (a model
                whose outputs depend on its batch must not enable the cache: 500, logged).
        """
        if plan is None:
            assert results is not None
            return results
        names = list(results) if results is not None else list(_first_item(plan.found))
        ragged_outputs = {s.name for s in plan.model.config.outputs if s.ragged}
        try:
            return {name: _assemble(name, plan, results, name in ragged_outputs) for name in names}
        except ValueError as exc:
            config = plan.model.config
            raise InferenceFailed(
                f"model {config.name} v{config.version}: cached and computed outputs differ ({exc}); "
                "a model whose outputs depend on its batch cannot enable [response_cache]"
            ) from exc

    def computed(self, model: ModelVersion, fingerprint: str, items: Arrays, outputs: Arrays) -> None:
        """Queue each item's outputs (``[B, ...]`` per output) to be stored under ``model``'s
        identity with ``fingerprint``, the one of the serving unit that computed them. The
        outputs are copied first: a unit may reuse its output buffers for its next batch."""
        keys = item_keys(self.identity(model, fingerprint), items) if fingerprint else None
        if keys is None:
            return
        rows = {name: np.array(array, copy=True) for name, array in outputs.items()}
        name = model.config.name
        self._store([(key, name, {n: a[i] for n, a in rows.items()}) for i, key in enumerate(keys)])

    def _store(self, entries: Entries, shared: bool = True) -> None:
        """Queue ``entries`` for the host's store (and Redis where ``shared``); what a full queue
        refuses is counted dropped."""
        pending = self._pending
        for key, _, item in entries:
            pending[key] = item

        def forget() -> None:  # unless a newer write of the key took its place
            for key, _, item in entries:
                if pending.get(key) is item:
                    pending.pop(key, None)

        def write() -> None:
            try:
                self.store.insert(entries)
            finally:
                forget()

        if not self._writer.submit(len(entries), write):
            forget()
            self._dropped(entries, "queue_full")
        tier = self.shared
        if not shared or tier is None:
            return

        def write_shared() -> None:
            if tier.insert([(key, item) for key, _, item in entries]):
                self._dropped(entries, "redis_error")

        if not self._redis_writer.submit(len(entries), write_shared):
            self._dropped(entries, "queue_full")

    def flush(self, timeout_s: float) -> bool:
        """Wait (blocking, at most ``timeout_s``) until what was queued so far is written;
        whether it was."""
        return self._writer.flush(timeout_s) and self._redis_writer.flush(timeout_s)

    def close(self, timeout_s: float = 2.0) -> None:
        """Write what is queued (at most ``timeout_s`` per tier), stop the threads, close the
        store's handle and the Redis connection. Blocks: call it on a thread."""
        for reader in self._readers.values():
            reader.close()
        self._writer.close(timeout_s)
        self._redis_writer.close(timeout_s)
        self.store.close()
        if self.shared is not None:
            self.shared.close()

    # --- counting ------------------------------------------------------------------------------

    def _count(
        self, model: ModelVersion, keys: list[bytes], hits: int, late: dict[bytes, str], seconds: float
    ) -> None:
        misses = len(keys) - hits
        share = seconds / len(keys)
        model.stats.cache_hit.add(hits, share * hits)  # Triton's statistics, per item here
        model.stats.cache_miss.add(misses, share * misses)
        if self.tracing is not None:
            self.tracing.cached(hits, hits + misses)
        metrics = self.metrics
        if metrics is None:
            return
        config = model.config
        if hits:
            metrics.cache_items.labels(config.name, config.version, "hit").inc(hits)
        if misses:
            metrics.cache_items.labels(config.name, config.version, "miss").inc(misses)
        if late:
            tiers: dict[str, int] = {}
            for key in keys:
                tier = late.get(key)
                if tier is not None:
                    tiers[tier] = tiers.get(tier, 0) + 1
            for tier, count in tiers.items():
                metrics.cache_late.labels(config.name, tier).inc(count)

    def _dropped(self, entries: Sequence[tuple[bytes, str, Item]], reason: str) -> None:
        counts = CacheCounts()
        for _, model, _ in entries:
            counts.drop(model, reason)
        if self.metrics is not None:
            self._changed(counts)

    def _changed(self, counts: CacheCounts) -> None:
        metrics = self.metrics
        assert metrics is not None
        for model, evicted in counts.evicted.items():
            metrics.cache_evictions.labels(model).inc(evicted)
        for model, held in counts.model_bytes.items():
            metrics.cache_bytes.labels(model).set(held)
        for (model, reason), dropped in counts.dropped.items():
            metrics.cache_dropped.labels(model, reason).inc(dropped)


def _first_item(found: dict[bytes, Item | None]) -> Item:
    return next(item for item in found.values() if item is not None)


def _assemble(name: str, plan: Plan, results: Arrays | None, is_ragged: bool = False) -> np.ndarray:
    """Output ``name`` for every item in order: a cached item's array, else its computed row;
    for a ragged output (``is_ragged``: an item's rows ``[n_i, ...]``, n_i its own) the items'
    arrays as one ragged tensor (``app.datatypes.ragged``).

    Raises:
        ValueError: the items' shapes or dtypes differ, or a cached entry lacks the output.
    """
    if is_ragged:
        return _assemble_ragged(name, plan, results)
    computed = results[name] if results is not None else None
    parts = []
    for key in plan.keys:
        item = plan.found[key]
        if item is None:
            assert computed is not None
            parts.append(computed[plan.rows[key]])
            continue
        cached = item.get(name)
        if cached is None:
            raise ValueError(f"a cached item lacks output {name!r}")
        if computed is not None and (cached.dtype != computed.dtype or cached.shape != computed.shape[1:]):
            raise ValueError(f"output {name!r}: {cached.dtype}{cached.shape} cached, "
                             f"{computed.dtype}{computed.shape[1:]} computed")  # fmt: skip
        parts.append(cached)
    return np.stack(parts)


def _assemble_ragged(name: str, plan: Plan, results: Arrays | None) -> np.ndarray:
    computed = results[name] if results is not None else None
    rows = []
    for key in plan.keys:
        item = plan.found[key]
        row = computed[plan.rows[key]] if item is None and computed is not None else (item or {}).get(name)
        if row is None:
            raise ValueError(f"a cached item lacks output {name!r}")
        rows.append(row)
    first = rows[0]
    for row in rows[1:]:
        if row.dtype != first.dtype or row.shape[1:] != first.shape[1:]:
            raise ValueError(f"ragged output {name!r}: items of {first.dtype}{first.shape[1:]} and "
                             f"{row.dtype}{row.shape[1:]}")  # fmt: skip
    return ragged(rows)


def response_cache(
    settings: Settings, device: str, metrics: ServerMetrics | None, tracing: Tracing | None
) -> ItemCache | None:
    """The host's response cache as this worker sees it: at ``response_cache_path``, else in the
    run directory, with the Redis tier where ``response_cache_redis_url`` names one; None where
    no path is set (in-process, without a path)."""
    folder = settings.response_cache_path
    if folder is None and settings.run_dir is not None:
        folder = settings.run_dir / "response-cache"
    if folder is None:
        return None
    store = ResponseCache(folder, settings.response_cache_bytes, settings.response_cache_ttl_s)
    shared = None
    if settings.response_cache_redis_url:
        shared = RedisTier(
            settings.response_cache_redis_url,
            settings.response_cache_redis_timeout_ms / 1000.0,
            settings.response_cache_ttl_s,
        )
    lookup_timeout_s = settings.response_cache_lookup_timeout_ms / 1000.0
    return ItemCache(store, device, metrics, tracing, shared, lookup_timeout_s=lookup_timeout_s)
