"""The response cache in the data plane: which items of a request are answered from the host's
store, which are computed, and the answer put back together in item order.

:meth:`ItemCache.run` takes a validated request's arrays: items whose key the store holds never
reach the queue (admission prices only the rest), equal items of the request are computed once,
and the outputs come back ``[B, ...]`` in the request's order, the cached rows the very bytes
that were computed. :meth:`ItemCache.store` is called where a batch's outputs come back from
this worker's serving unit, with the identity of the unit that computed them, so that what a
sibling worker or a replaced version computed is stored under its own identity, never under
another's.

A model version's identity (:meth:`ItemCache.identity`) is its name, version, the fingerprint of
its files as loaded (``app.models.repository.fingerprint``; "" until it is loaded: such a
version is not cached), the versions of the libraries that compute it and the worker's device
kind: a reload, a new version, a new library or another kind of device starts afresh.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import numpy as np

from app.observability.metrics import ServerMetrics
from app.observability.tracing import Tracing
from app.serving.registry import ModelVersion
from app.serving.response_cache import CacheCounts, ResponseCache, environment, item_keys

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
    """

    def __init__(
        self,
        store: ResponseCache,
        device: str,
        metrics: ServerMetrics | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.store = store
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

    async def run(
        self, model: ModelVersion, inputs: Arrays, compute: Callable[[Arrays], Awaitable[Arrays]]
    ) -> Arrays:
        """The outputs of ``inputs`` (one array ``[B, ...]`` per input), the cached items from
        the store and the others from ``compute`` (called once, with the distinct missing
        items, in request order; not called when every item is cached).

        Returns:
            One array ``[B, ...]`` per model output, in item order.

        Raises:
            What ``compute`` raises (the store's own failures are misses, never errors).
        """
        fingerprint = model.fingerprint
        keys = item_keys(self.identity(model, fingerprint), inputs) if fingerprint else None
        if keys is None:
            return await compute(inputs)
        first: dict[bytes, int] = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        distinct = list(first)
        found = dict(zip(distinct, self.store.lookup(distinct), strict=True))
        hits = sum(1 for key in keys if found[key] is not None)
        self._count(model, hits, len(keys) - hits)
        missing = [first[key] for key in distinct if found[key] is None]
        computed: Arrays = {}
        if missing:
            part = inputs if len(missing) == len(keys) else {n: a[missing] for n, a in inputs.items()}
            computed = await compute(part)
        rows = {key: row for row, key in enumerate(keys[i] for i in missing)}
        try:
            return {
                name: _assemble(name, keys, found, rows, array)
                for name, array in (computed or _empty_outputs(found)).items()
            }
        except ValueError:  # outputs whose item shape depends on the batch: compute them together
            log.warning("model %s v%s: cached and computed outputs differ in shape; computing all",
                        model.config.name, model.config.version)  # fmt: skip
            return await compute(inputs)

    def store_outputs(self, model: ModelVersion, fingerprint: str, inputs: Arrays, outputs: Arrays) -> None:
        """Store each item's outputs (``[B, ...]`` per output) under ``model``'s identity with
        ``fingerprint``, the one of the serving unit that computed them."""
        keys = item_keys(self.identity(model, fingerprint), inputs) if fingerprint else None
        if keys is None:
            return
        name = model.config.name
        entries = [(key, name, {n: a[i] for n, a in outputs.items()}) for i, key in enumerate(keys)]
        self.store.insert(entries)

    def _count(self, model: ModelVersion, hits: int, misses: int) -> None:
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


def _empty_outputs(found: dict[bytes, dict[str, np.ndarray] | None]) -> dict[str, None]:
    item = next(v for v in found.values() if v is not None)
    return dict.fromkeys(item)


def _assemble(
    name: str,
    keys: list[bytes],
    found: dict[bytes, dict[str, np.ndarray] | None],
    rows: dict[bytes, int],
    computed: np.ndarray | None,
) -> np.ndarray:
    """Output ``name`` for every key in order: a cached item's array, else its computed row.

    Raises:
        ValueError: the items' shapes or dtypes differ (a cached entry lacks the output, or the
            model's item shape depends on its batch).
    """
    parts = []
    for key in keys:
        item = found[key]
        if item is None:
            assert computed is not None
            parts.append(computed[rows[key]])
        else:
            cached = item.get(name)
            if cached is None or (computed is not None and cached.dtype != computed.dtype):
                raise ValueError(f"cached item lacks output {name!r} or differs in dtype")
            parts.append(cached)
    return np.stack(parts)
