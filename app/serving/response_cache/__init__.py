"""The response cache: per-item results of a model, in one store that every worker of a host
shares (Triton's *response cache*, keyed per item instead of per request).

A feed request rarely repeats whole, but its items do: a popular post is a candidate in many
users' requests within minutes. Rooms, by job:

- :mod:`~app.serving.response_cache.keys`: an item's key, a hash of what decides its outputs
  (the model version's identity and the item's inputs in a canonical encoding);
- :mod:`~app.serving.response_cache.entries`: the value, every output of the item encoded
  without pickle, behind a header with a checksum of the key and payload;
- :mod:`~app.serving.response_cache.store`: the host's LMDB store, its bounds and eviction
  (:mod:`~app.serving.response_cache.writes`: its write transactions;
  :mod:`~app.serving.response_cache.opening`: its environment shared by a worker's threads);
- :mod:`~app.serving.response_cache.background`: the threads that keep the store's and Redis's
  I/O off the event loop (lookups bounded in time, writes queued with a bound).

The data plane reaches all of it through one item stage, ``app.serving.item_cache.ItemCache``;
the tier that hosts share is ``app.serving.redis_tier``. docs/response-cache.md says how to run it.

Source: Triton's response cache (``docs/user_guide/response_cache.md``: opt-in per model,
``response_cache { enable: true }``, a local tier and a Redis tier).
"""

from app.serving.response_cache.entries import Item, decode_item, encode_item, pack_entry, unpack_entry
from app.serving.response_cache.keys import environment, item_keys
from app.serving.response_cache.store import DATA_SHARE, Found, ResponseCache
from app.serving.response_cache.writes import CacheCounts

__all__ = [
    "DATA_SHARE",
    "CacheCounts",
    "Found",
    "Item",
    "ResponseCache",
    "decode_item",
    "encode_item",
    "environment",
    "item_keys",
    "pack_entry",
    "unpack_entry",
]
