"""The response cache in the data plane: an item stage (``app.serving.items``) that answers a
request's items from the host's store and sends only the rest to be computed.

:meth:`ItemCache.expand` takes a validated request's arrays: items whose key the store holds
never reach the queue (admission, balancing and batching see only the rest), equal items of the
request are computed once; :meth:`ItemCache.assemble` puts the outputs back ``[B, ...]`` in the
request's order, the cached rows the very bytes that were computed. What is computed is stored
by :meth:`ItemCache.store_outputs`, called where a batch's outputs come back from a serving
unit of this worker, with the identity of that unit (the fingerprint read with it): what a
sibling worker (a shard) or a version replaced meanwhile computed is stored under its own
identity, never under another's.

A model version's identity (:meth:`ItemCache.identity`) is its name, version, the fingerprint of
its files as loaded (``app.models.repository.fingerprint``; "" until it is loaded: such a
version is not cached), the versions of the libraries that compute it and the worker's device
kind: a reload, a new version, a new library or another kind of device starts afresh.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from app.errors import InferenceFailed
from app.observability.metrics import ServerMetrics
from app.observability.tracing import Tracing
from app.serving.context import RequestContext
from app.serving.redis_tier import RedisTier
from app.serving.registry import ModelVersion
from app.serving.response_cache import CacheCounts, Item, ResponseCache, environment, item_keys

log = logging.getLogger(__name__)

Arrays = dict[str, np.ndarray]


class ItemCache:
    """This worker's side of the response cache (module docstring).

    Args:
        store: the host's store (``app.serving.response_cache.ResponseCache``).
        device: the torch device the worker's models run on ("cuda:0", "cpu"); its kind is
            part of every key.
        metrics: this process's metrics (None: off).
        tracing: the request spans (None: off).
        shared: the tier that several hosts share (``app.serving.redis_tier``), asked for what
            the host's store lacks and written with what is computed; None: none.
    """

    def __init__(
        self,
        store: ResponseCache,
        device: str,
        metrics: ServerMetrics | None = None,
        tracing: Tracing | None = None,
        shared: RedisTier | None = None,
    ) -> None:
        self.store = store
        self.shared = shared
        self.device_kind = device.split(":", 1)[0]
        self.metrics = metrics
        self.tracing = tracing
        self._environments: dict[str | None, str] = {}
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

    async def expand(
        self, model: ModelVersion, context: RequestContext, inputs: Arrays
    ) -> tuple[Arrays | None, Plan | None]:
        """The items of ``inputs`` (one array ``[B, ...]`` per input) to compute: the distinct
        ones the store lacks, in request order; None when the store holds every one. A model
        without ``[response_cache] enable`` (or not yet loaded) has all its items computed.

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
        distinct = list(first)
        found = dict(zip(distinct, self.store.lookup(distinct), strict=True))
        if self.shared is not None:
            lacking = [key for key in distinct if found[key] is None]
            answers = zip(lacking, self.shared.lookup(lacking), strict=True)
            fetched = [(key, item) for key, item in answers if item is not None]
            if fetched:
                found.update(fetched)
                self.store.insert([(key, model.config.name, item) for key, item in fetched])
        hits = sum(1 for key in keys if found[key] is not None)
        self._count(model, hits, len(keys) - hits, time.perf_counter() - start)
        missing = [first[key] for key in distinct if found[key] is None]
        plan = Plan(model, keys, found, {keys[i]: row for row, i in enumerate(missing)})
        if not missing:
            return None, plan
        if len(missing) == len(keys):
            return inputs, plan
        return {name: array[missing] for name, array in inputs.items()}, plan

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
        try:
            return {name: _assemble(name, plan, results) for name in names}
        except ValueError as exc:
            config = plan.model.config
            raise InferenceFailed(
                f"model {config.name} v{config.version}: cached and computed outputs differ ({exc}); "
                "a model whose outputs depend on its batch cannot enable [response_cache]"
            ) from exc

    def store_outputs(self, model: ModelVersion, fingerprint: str, inputs: Arrays, outputs: Arrays) -> None:
        """Store each item's outputs (``[B, ...]`` per output) under ``model``'s identity with
        ``fingerprint``, the one of the serving unit that computed them."""
        keys = item_keys(self.identity(model, fingerprint), inputs) if fingerprint else None
        if keys is None:
            return
        name = model.config.name
        entries = [(key, name, {n: a[i] for n, a in outputs.items()}) for i, key in enumerate(keys)]
        self.store.insert(entries)
        if self.shared is not None:
            self.shared.insert([(key, item) for key, _, item in entries])

    def _count(self, model: ModelVersion, hits: int, misses: int, seconds: float) -> None:
        share = seconds / (hits + misses)
        model.stats.cache_hit.add(hits, share * hits)  # Triton's statistics, per item here
        model.stats.cache_miss.add(misses, share * misses)
        if self.tracing is not None:
            self.tracing.cached(hits, hits + misses)
        metrics = self.metrics
        if metrics is None:
            return
        labels = (model.config.name, model.config.version)
        if hits:
            metrics.cache_items.labels(*labels, "hit").inc(hits)
        if misses:
            metrics.cache_items.labels(*labels, "miss").inc(misses)

    def _changed(self, counts: CacheCounts) -> None:
        metrics = self.metrics
        assert metrics is not None
        for model, evicted in counts.evicted.items():
            metrics.cache_evictions.labels(model).inc(evicted)
        for model, held in counts.model_bytes.items():
            metrics.cache_bytes.labels(model).set(held)


@dataclass(frozen=True, slots=True)
class Plan:
    """What :meth:`ItemCache.assemble` needs of one request: its model, every item's key in
    request order, what the store held per distinct key (None: computed), and the row of the
    computed results that answers each computed key."""

    model: ModelVersion
    keys: list[bytes]
    found: dict[bytes, Item | None]
    rows: dict[bytes, int]


def _first_item(found: dict[bytes, Item | None]) -> Item:
    return next(item for item in found.values() if item is not None)


def _assemble(name: str, plan: Plan, results: Arrays | None) -> np.ndarray:
    """Output ``name`` for every item in order: a cached item's array, else its computed row.

    Raises:
        ValueError: the items' shapes or dtypes differ, or a cached entry lacks the output.
    """
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
