"""The prefix cache: prefixes' keys and values kept across requests, so that the next request
with the same prefix (the next page of the same feed, the same query over more documents) runs
only its items.

:class:`PrefixCache` holds :class:`app.handlers.shared_prefix.PrefixState` objects on the
model's device, keyed by (the model version's identity, the prefix's token ids), bounded in
bytes (the states' own: keys, values, the last hidden state), the least recently used evicted
first. One cache belongs to one loaded model version: its handler makes it at load from
``[parameters] prefix_cache_bytes`` (:meth:`PrefixCache.from_parameters`) and it is freed with
the version, so a reload never serves an older version's keys and values (the identity in the
key says so again where one cache is handed several models). Why a model parameter and not a
server setting: the states live on the model's device beside its weights, their size per token
differs by model (layers x key/value heads x head size x dtype), and the model's GPU memory plan
(``app.models.memory``) is made per model from its ``model.toml``.

Beside the response cache (``app.serving.response_cache``), which answers an item whose whole
inputs were seen before (no model call at all), this cache answers nothing by itself: it spares
the forward of a prefix already seen, and the items after it still run.

Thread safety: lookups and stores hold one lock for their bookkeeping only; a prefix missing
is computed by the caller outside it (the model's inference thread). The states are never
written after they are made, so a state handed out stays valid when it is evicted meanwhile
(its memory goes when the last batch using it lets go). Pricing on a prepare thread may ask
:meth:`PrefixCache.holds` without touching the order or the counts.

Source: SGLang's RadixAttention and vLLM's automatic prefix caching keep prefixes' keys and
values across requests (per block, in the engine's paged memory); this is their idea per
whole prefix, for scoring (no generation, no pages).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from app.handlers.shared_prefix import PrefixState
from app.models.memory import PREFIX_CACHE_BYTES

__all__ = ["DEFAULT_BYTES", "PARAMETER", "PrefixCache", "PrefixCacheObserver", "PrefixCacheStats"]

#: The ``model.toml`` parameter that bounds a model's prefix cache, bytes; 0 turns it off.
PARAMETER = "prefix_cache_bytes"
#: Its default: 256 MiB (Qwen3-Reranker-0.6B in bfloat16 holds 112 KiB a token: about 2,300
#: prefix tokens, e.g. the 8 latest queries of 290 tokens), the memory plan's
#: (``app.models.memory``, which imports no torch, holds the number).
DEFAULT_BYTES = PREFIX_CACHE_BYTES


class PrefixCacheObserver(Protocol):
    """Who hears of the cache's work (``app.observability.metrics.PrefixCacheMetrics``)."""

    def looked_up(self, hits: int, misses: int, hit_tokens: int, miss_tokens: int) -> None:
        """Prefixes found and not found, and their tokens (found: not run again)."""

    def evicted(self, entries: int) -> None:
        """Entries evicted to keep the cache under its bound."""

    def held(self, nbytes: int) -> None:
        """The bytes the cache holds now."""


@dataclass(frozen=True)
class PrefixCacheStats:
    """The cache's counts since it was made: lookups ``hits`` and ``misses``, their tokens
    ``hit_tokens`` (not run again) and ``miss_tokens``, ``evictions``, ``entries`` and ``nbytes``
    held now, ``max_bytes`` (the bound)."""

    hits: int
    misses: int
    hit_tokens: int
    miss_tokens: int
    evictions: int
    entries: int
    nbytes: int
    max_bytes: int


def _key(identity: Hashable, ids: npt.NDArray[Any] | Sequence[int]) -> tuple[Hashable, bytes]:
    """The key of a prefix: int32 and int64 ids of the same tokens key alike."""
    return identity, np.asarray(ids, dtype=np.int64).tobytes()


class PrefixCache:
    """Prefixes' keys and values by (model version identity, token ids), least recently used
    evicted first once their bytes pass ``max_bytes`` (module docstring).

    Args:
        max_bytes: the bound, bytes of the states held (> 0).
        observer: told of lookups, evictions and the bytes held (metrics); None: nobody.

    Raises:
        ValueError: ``max_bytes`` < 1.
    """

    def __init__(self, max_bytes: int, observer: PrefixCacheObserver | None = None) -> None:
        if max_bytes < 1:
            raise ValueError(f"a prefix cache needs a bound of at least 1 byte, got {max_bytes}")
        self.max_bytes = max_bytes
        self._observer = observer
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[Hashable, bytes], PrefixState] = OrderedDict()
        self._bytes = 0
        self._hits = self._misses = self._hit_tokens = self._miss_tokens = self._evictions = 0

    @classmethod
    def from_parameters(
        cls, parameters: Mapping[str, Any], observer: PrefixCacheObserver | None = None
    ) -> PrefixCache | None:
        """The cache ``[parameters] prefix_cache_bytes`` asks for (default
        :data:`DEFAULT_BYTES`), None where it is 0.

        Raises:
            ValueError: not an integer >= 0.
        """
        value = parameters.get(PARAMETER, DEFAULT_BYTES)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(
                f"parameters.{PARAMETER} must be an integer >= 0 (bytes; 0 = off), got {value!r}"
            )
        return cls(value, observer) if value else None

    def observe(self, observer: PrefixCacheObserver | None) -> None:
        """Tell ``observer`` of the cache's work from now on (the server hands its metrics to
        a model's cache once the model is loaded); it hears the bytes held now at once."""
        self._observer = observer
        if observer is not None:
            observer.held(self.stats().nbytes)

    def get(self, identity: Hashable, ids: npt.NDArray[Any] | Sequence[int]) -> PrefixState | None:
        """The state of the prefix ``ids`` of ``identity``'s model, now the most recently used,
        or None; counted as a hit or a miss."""
        return self._lookup(identity, [ids])[0]

    def holds(self, identity: Hashable, ids: npt.NDArray[Any] | Sequence[int]) -> bool:
        """Whether the prefix is held now; neither counted nor made more recent (pricing)."""
        with self._lock:
            return _key(identity, ids) in self._entries

    def put(self, identity: Hashable, ids: npt.NDArray[Any] | Sequence[int], state: PrefixState) -> bool:
        """Keep ``state`` as the prefix ``ids`` of ``identity``'s model, the most recently used,
        evicting the least recently used while the bytes pass the bound. Returns False (nothing
        kept, nothing evicted) for a state larger than the whole bound."""
        if state.nbytes > self.max_bytes:
            return False
        key = _key(identity, ids)
        with self._lock:
            old = self._entries.pop(key, None)
            self._bytes -= old.nbytes if old is not None else 0
            self._entries[key] = state
            self._bytes += state.nbytes
            evicted = 0
            while self._bytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= dropped.nbytes
                evicted += 1
            self._evictions += evicted
            held = self._bytes
        if self._observer is not None:
            if evicted:
                self._observer.evicted(evicted)
            self._observer.held(held)
        return True

    def states(
        self,
        identity: Hashable,
        prefixes: Sequence[npt.NDArray[Any]],
        compute: Callable[[list[npt.NDArray[Any]]], list[PrefixState]],
    ) -> list[PrefixState]:
        """Each prefix's state, in order: those held from the cache (hits), the others made by
        one call of ``compute`` (e.g. ``lambda missing: encode_prefixes(base, missing)``; each
        distinct missing prefix once) and kept. Call it on the thread that may run the model.

        Raises:
            what ``compute`` raises (nothing is kept then).
        """
        found = self._lookup(identity, prefixes)
        first: dict[bytes, int] = {}  # each distinct missing prefix's first place
        for i, state in enumerate(found):
            if state is None:
                first.setdefault(_key(identity, prefixes[i])[1], i)
        if first:
            made = dict(zip(first, compute([prefixes[i] for i in first.values()]), strict=True))
            for ids, i in first.items():
                self.put(identity, prefixes[i], made[ids])
            found = [
                made[_key(identity, p)[1]] if s is None else s for s, p in zip(found, prefixes, strict=True)
            ]
        return found  # type: ignore[return-value]

    def _lookup(
        self, identity: Hashable, prefixes: Sequence[npt.NDArray[Any] | Sequence[int]]
    ) -> list[PrefixState | None]:
        """Each prefix's state or None, the found ones made the most recently used; counted."""
        keys = [_key(identity, ids) for ids in prefixes]
        with self._lock:
            found = [self._entries.get(key) for key in keys]
            for key, state in zip(keys, found, strict=True):
                if state is not None:
                    self._entries.move_to_end(key)
            hits = sum(state is not None for state in found)
            tokens = [len(ids) for ids in prefixes]
            hit_tokens = sum(t for state, t in zip(found, tokens, strict=True) if state is not None)
            miss_tokens = sum(tokens) - hit_tokens
            self._hits += hits
            self._misses += len(found) - hits
            self._hit_tokens += hit_tokens
            self._miss_tokens += miss_tokens
        if self._observer is not None:
            self._observer.looked_up(hits, len(found) - hits, hit_tokens, miss_tokens)
        return found

    def clear(self) -> None:
        """Drop every entry (not counted as evictions)."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0
        if self._observer is not None:
            self._observer.held(0)

    def stats(self) -> PrefixCacheStats:
        """The counts now (:class:`PrefixCacheStats`)."""
        with self._lock:
            return PrefixCacheStats(
                self._hits, self._misses, self._hit_tokens, self._miss_tokens, self._evictions,
                len(self._entries), self._bytes, self.max_bytes,
            )  # fmt: skip
