"""The response cache under a feed workload: items drawn Zipf from a pool of feed texts, the same
server and model with the cache on and off, and the hit ratio against an ideal LRU run offline
on the same sequence.

The pool: ``--pool`` feed texts (titles and descriptions, ``benchmarks.payloads.feed_texts`` over
MiniLM's vocabulary), ranked at random; each item is the text of rank k with probability
proportional to k^-s (``--s``, a finite Zipf law), ``--items`` per request, every item scored
against one query (a user's interest text). One server (``--workers`` workers) serves
all-MiniLM-L6-v2 twice: as ``minilm-cached`` (``[response_cache] enable = true``, the store empty
at start) and ``minilm`` (no cache). Per concurrency level in ``--concurrency`` (highest first), a
closed loop of ``--seconds`` on the uncached model, then on the cached one, each walking the same
request sequence from its start (the cached model's store stays warm from one level to the
next). Printed per run: items/s, p50 and p99; for the cached model the hit ratio its metrics
counted (``scoring_response_cache_items_total``) beside the hit ratio of an ideal LRU as large as
the store, over the requests the run sent, and for smaller LRUs (what a smaller store would get).

    python -m benchmarks.cache --seconds 8 --out docs/benchmarks/cache-cpu.json

Traffic goes only to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import driver, payloads, report, server
from benchmarks.server import MINILM

CACHED, PLAIN = "minilm-cached", "minilm"


def zipf_ranks(pool: int, s: float, draws: int, seed: int = 0) -> np.ndarray:
    """``draws`` ranks in ``0 .. pool-1``, rank k drawn with probability proportional to
    (k + 1)^-s (a Zipf law truncated to the pool)."""
    weights = np.arange(1, pool + 1, dtype=np.float64) ** -s
    return np.random.default_rng(seed).choice(pool, size=draws, p=weights / weights.sum())


def lru_hits(sequence: Sequence[int] | np.ndarray, capacity: int) -> int:
    """Hits of a least-recently-used cache of ``capacity`` entries over ``sequence`` (cold at
    start; an item repeated within one request counts as the sequence says)."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for item in sequence:
        if item in cache:
            hits += 1
            cache.move_to_end(item)
            continue
        cache[item] = None
        if len(cache) > capacity:
            cache.popitem(last=False)
    return hits


def sent_items(ranks: np.ndarray, items: int, requests: int, concurrency: int, start: int = 0) -> np.ndarray:
    """The items of the requests a closed loop of ``concurrency`` clients sent over the request
    sequence rotated to begin at request ``start`` (client i sends requests i, i + c, i + 2c, ...;
    ``benchmarks.driver.cycling``), in request order."""
    per_client = -(-requests // concurrency)
    sent = sorted(i + k * concurrency for i in range(concurrency) for k in range(per_client))[:requests]
    order = (start + np.array(sent, dtype=np.int64)) % (len(ranks) // items)
    return ranks.reshape(-1, items)[order].ravel()


def lru_hits_after(history: Sequence[np.ndarray], seen: np.ndarray, capacity: int) -> int:
    """Hits of an LRU of ``capacity`` entries over ``seen`` alone, its state being what
    ``history`` (the items sent before, in order) left in it."""
    before = np.concatenate(history) if history else np.zeros(0, dtype=np.int64)
    return lru_hits(np.concatenate([before, seen]), capacity) - lru_hits(before, capacity)


def repository(tmp: Path, demo: Path) -> Path:
    """MiniLM twice: ``minilm-cached`` with the response cache, ``minilm`` without."""
    repo = tmp / "repo"
    source = (demo / MINILM / "model.toml").read_text()
    for name, cached in ((CACHED, True), (PLAIN, False)):
        folder = repo / name
        folder.mkdir(parents=True)
        toml = source.replace(f'name = "{MINILM}"', f'name = "{name}"')
        if cached:
            toml += "\n[response_cache]\nenable = true\n"
        (folder / "model.toml").write_text(toml)
        for extra in (demo / MINILM).iterdir():
            if extra.name != "model.toml":
                (folder / extra.name).symlink_to(extra)
    return repo


def cache_counts(scrape: str, model: str) -> tuple[float, float]:
    """(hits, misses) of ``model`` in a ``/metrics`` scrape."""
    found = {"hit": 0.0, "miss": 0.0}
    for line in scrape.splitlines():
        if line.startswith("scoring_response_cache_items_total{") and f'model="{model}"' in line:
            for result in found:
                if f'result="{result}"' in line:
                    found[result] += float(line.rsplit(" ", 1)[1])
    return found["hit"], found["miss"]


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    words = payloads.model_words(args.repository)
    pool = payloads.feed_texts(words, args.pool, seed=1)
    random.Random(2).shuffle(pool)  # rank k is any text, title or description
    ranks = zipf_ranks(args.pool, args.s, args.requests * args.items, seed=3)
    bodies = payloads.feed_bodies([pool[r] for r in ranks], args.items)
    print(f"pool {args.pool} texts, Zipf s={args.s}, {args.items} items per request, {len(bodies)} requests "
          f"prepared ({len(set(ranks.tolist()))} distinct texts among them)")  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="cache-bench-"))
    rows: list[dict[str, Any]] = []
    try:
        repo = repository(tmp, args.repository)
        with server.start(tmp, repo, f"{CACHED},{PLAIN}", args.workers) as srv:
            srv.wait_ready(600, count=args.workers)
            rows = measure(srv, bodies, ranks, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = report.record(
        benchmark="cache", pool=args.pool, s=args.s, items=args.items, seconds=args.seconds,
        warm_seconds=args.warm_seconds, warm_concurrency=args.warm_concurrency,
        workers=args.workers, store_items=args.store_items, runs=rows,
    )  # fmt: skip
    report.write_json(args.out, result)


def measure(srv: Any, bodies: list[bytes], ranks: np.ndarray, args: Any) -> list[dict[str, Any]]:
    """The runs: the warm-up of the cached model, then per level the uncached and the cached
    model on the same stretch of the request sequence, each stretch continuing where the cached
    model's last run stopped (a feed's stream of requests goes on; the store stays warm)."""
    rows: list[dict[str, Any]] = []
    history: list[np.ndarray] = []  # the items the cached model was sent, in order
    offset = 0

    def drive(model: str, concurrency: int, seconds: float) -> dict[str, Any]:
        rotated = bodies[offset:] + bodies[:offset]
        url = f"{srv.url}/v2/models/{model}/infer"
        row: dict[str, Any] = asyncio.run(driver.drive(url, rotated, args.items, concurrency, seconds))
        row["model"] = model
        return row

    plan = [(args.warm_concurrency, [(CACHED, args.warm_seconds)])] if args.warm_seconds > 0 else []
    plan += [
        (c, [(PLAIN, args.seconds), (CACHED, args.seconds)]) for c in sorted(args.concurrency, reverse=True)
    ]
    for concurrency, runs in plan:
        for model, seconds in runs:
            before = cache_counts(srv.scrape(), model)
            row = drive(model, concurrency, seconds)
            row["concurrency"], row["warm_up"] = concurrency, len(runs) == 1
            if model == CACHED:
                hits, misses = (a - b for a, b in zip(cache_counts(srv.scrape(), model), before, strict=True))
                row["hit_ratio"] = hits / max(1.0, hits + misses)
                seen = sent_items(ranks, args.items, row["requests"] + row["errors"], concurrency, offset)
                row["ideal_lru_hit_ratio"] = lru_hits_after(history, seen, args.store_items) / max(
                    1, len(seen)
                )
                row["lru_hit_ratio_by_capacity"] = {
                    str(c): lru_hits_after(history, seen, c) / max(1, len(seen)) for c in args.lru_sizes
                }
                history.append(seen)
                offset = (offset + row["requests"] + row["errors"]) % len(bodies)
            rows.append(row)
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    return rows


def parse(argv: list[str] | None) -> Any:
    result = server.parser(__doc__)
    result.add_argument("--pool", type=int, default=20_000, help="feed texts in the pool (>= 20,000)")
    result.add_argument("--s", type=float, default=1.1, help="Zipf exponent (1.0 - 1.2)")
    result.add_argument("--items", type=int, default=8, help="items per request")
    result.add_argument("--requests", type=int, default=20_000, help="requests prepared (cycled)")
    result.add_argument("--seconds", type=float, default=8.0, help="length of each closed-loop run")
    result.add_argument(
        "--warm-seconds", type=float, default=0.0,
        help="a run of the cached model before the measured ones (0: the store starts cold)",
    )  # fmt: skip
    result.add_argument("--warm-concurrency", type=int, default=8, help="closed-loop clients of the warm-up")
    result.add_argument("--concurrency", type=server.levels, default=[1, 64])
    result.add_argument(
        "--store-items", type=int, default=163_000,
        help="entries the store holds, the ideal LRU's size (1 GiB of MiniLM: docs/response-cache.md)",
    )  # fmt: skip
    result.add_argument("--lru-sizes", type=server.levels, default=[500, 2000, 8000])
    result.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    return result.parse_args(argv)


if __name__ == "__main__":
    main()
