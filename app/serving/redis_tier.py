"""The response cache's second tier: a Redis or Valkey server that the hosts of a deployment
share (Triton's ``redis_cache``), off unless ``SCORING_RESPONSE_CACHE_REDIS_URL`` names one.

It sits behind each host's store (``app.serving.response_cache``): an item the host's store
lacks is asked of Redis (one ``MGET`` per request), an answer found there is copied into the
host's store, and what a worker computes is written to both (one pipelined ``SET`` per batch,
with the TTL when one is set; otherwise Redis's own ``maxmemory-policy`` evicts). Values are the
host store's (:func:`app.serving.response_cache.pack_entry`: no pickle, a checksum of the key and
payload); a value that fails it is a miss.

The calls block, each with a short socket timeout (``SCORING_RESPONSE_CACHE_REDIS_TIMEOUT_MS``),
and run on threads of the item stage (``app.serving.response_cache.background``), which waits
for a lookup only until its bound: a Redis that is slow, stopped or unreachable costs its
thread at most one timeout, after which the tier is skipped for :attr:`RedisTier.PAUSE_S`
seconds (logged at most once a minute); requests are computed meanwhile, never failed.

Source: Triton's ``redis_cache`` (triton-inference-server/redis_cache); redis-py's client.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from app.serving.response_cache import Item, pack_entry, unpack_entry

log = logging.getLogger(__name__)

PREFIX = b"scoring:response-cache:"


class RedisTier:
    """One worker's connection to the shared tier (module docstring); any thread may call it.

    Args:
        url: ``redis://host:port/db`` (``rediss://`` for TLS; redis-py's URL forms).
        timeout_s: connect and socket timeout of each call, seconds.
        ttl_s: expiry of what is written, seconds; 0 = none (Redis's eviction policy decides).
    """

    #: Seconds the tier is skipped after a failed call.
    PAUSE_S = 5.0
    LOG_S = 60.0

    def __init__(self, url: str, timeout_s: float = 0.05, ttl_s: float = 0.0) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self._client: Any = None
        self._lock = threading.Lock()
        self._paused_until = 0.0
        self._logged = -self.LOG_S

    def _connection(self) -> Any:
        if time.monotonic() < self._paused_until:
            return None
        with self._lock:
            if self._client is None:  # made in the worker that uses it: a connection must not cross a fork
                import redis

                self._client = redis.Redis.from_url(
                    self.url, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s
                )
            return self._client

    def _failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        self._paused_until = now + self.PAUSE_S
        if now - self._logged >= self.LOG_S:
            self._logged = now
            log.warning("response cache redis tier: %s: %s; skipped for %.0f s", type(exc).__name__, exc,
                        self.PAUSE_S, extra={"event": "response_cache_redis_error"})  # fmt: skip

    def lookup(self, keys: Sequence[bytes]) -> list[Item | None]:
        """The outputs Redis holds for each key; None where it holds none, or a damaged or
        expired one, and for every key while the tier fails. Blocks up to the socket timeout."""
        client = self._connection()
        if client is None or not keys:
            return [None] * len(keys)
        import redis

        try:
            values = client.mget([PREFIX + key for key in keys])
        except (redis.RedisError, OSError) as exc:
            self._failed(exc)
            return [None] * len(keys)
        return [
            unpack_entry(key, v, self.ttl_s) if isinstance(v, bytes) else None
            for key, v in zip(keys, values, strict=True)
        ]

    def insert(self, entries: Sequence[tuple[bytes, Item]]) -> int:
        """Write each ``(key, outputs)``. Blocks up to the socket timeout.

        Returns:
            How many were not written (the tier fails or is paused; outputs it cannot hold).
        """
        client = self._connection()
        if client is None:
            return len(entries)
        if not entries:
            return 0
        import redis

        values = [(PREFIX + key, pack_entry(key, item)) for key, item in entries]
        try:
            pipe = client.pipeline(transaction=False)
            for key, value in values:
                if value is not None:
                    pipe.set(key, value, px=int(self.ttl_s * 1000) or None)
            pipe.execute()
        except (redis.RedisError, OSError) as exc:
            self._failed(exc)
            return len(entries)
        return sum(1 for _, value in values if value is None)

    def close(self) -> None:
        """Close the connection pool (a later call makes a new one)."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
