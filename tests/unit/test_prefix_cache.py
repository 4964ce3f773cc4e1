"""The prefix cache (app.handlers.prefix_cache): the same prefix in the next request is not run
again (the tokens the model runs are counted), its answers unchanged; least recently used
evicted first by bytes; keyed by model version; counted, and exported as Prometheus metrics."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry
from transformers import AutoModelForCausalLM

from app.handlers.prefix_cache import DEFAULT_BYTES, PrefixCache
from app.handlers.shared_prefix import PrefixState, encode_prefixes, item_rows, run_items
from app.observability.metrics import ServerMetrics


class Recorder:
    """An observer that writes down what it hears."""

    def __init__(self) -> None:
        self.lookups = [0, 0, 0, 0]
        self.evictions = 0
        self.nbytes = -1

    def looked_up(self, hits: int, misses: int, hit_tokens: int, miss_tokens: int) -> None:
        self.lookups = [
            a + b for a, b in zip(self.lookups, (hits, misses, hit_tokens, miss_tokens), strict=True)
        ]

    def evicted(self, entries: int) -> None:
        self.evictions += entries

    def held(self, nbytes: int) -> None:
        self.nbytes = nbytes


def state(length: int) -> PrefixState:
    """A state of one layer and one head of 1 wide, float32: 8 x length + 4 bytes."""
    return PrefixState((torch.zeros(1, 1, length, 1),), (torch.zeros(1, 1, length, 1),), torch.zeros(1), 0)


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def test_the_same_prefix_in_the_next_request_is_not_run_again(decoder_models: dict[str, Path]) -> None:
    model = AutoModelForCausalLM.from_pretrained(
        str(decoder_models["qwen3-reranker"]), local_files_only=True
    ).eval()
    base = model.base_model
    ran: list[int] = []  # tokens each forward ran, padding included
    base.get_input_embeddings().register_forward_pre_hook(lambda _, args: ran.append(args[0].numel()))
    rng = np.random.default_rng(3)
    prefix = rng.integers(3, 600, size=50)
    pages = [[rng.integers(3, 600, size=n) for n in lengths] for lengths in ((4, 9, 6), (7, 3, 5, 2))]
    cache = PrefixCache(DEFAULT_BYTES)

    def request(items: list[np.ndarray]) -> torch.Tensor:
        states = cache.states(("reranker", "1"), [prefix], lambda missing: encode_prefixes(base, missing))
        return run_items(base, states, item_rows(items, pack=False)).last()

    first = request(pages[0])
    assert ran == [50, 3 * 9]  # the prefix, then the items
    ran.clear()
    second = request(pages[1])
    assert ran == [4 * 7]  # the items only
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.hit_tokens, stats.miss_tokens, stats.entries) == (1, 1, 50, 50, 1)
    with torch.inference_mode():
        for got, page in ((first, pages[0]), (second, pages[1])):
            for row, item in enumerate(page):
                text = torch.from_numpy(np.concatenate((prefix, item)))[None]
                assert (got[row] - base(input_ids=text).last_hidden_state[0, -1]).abs().max() <= 1e-5


def test_the_least_recently_used_goes_first_and_the_bytes_stay_under_the_bound() -> None:
    recorder = Recorder()
    cache = PrefixCache(3 * state(10).nbytes, recorder)  # room for three states of 10 tokens
    for first in (1, 2, 3):
        assert cache.put("m", ids(first), state(10))
    assert cache.get("m", ids(1)) is not None  # 1 is now the most recently used; 2 the least
    assert cache.put("m", ids(4), state(10))
    assert cache.get("m", ids(2)) is None and cache.holds("m", ids(1)) and cache.holds("m", ids(3))
    assert cache.put("m", ids(5), state(25))  # 2.5 states' bytes: 3 and 1 (then 4) must go
    assert [cache.holds("m", ids(i)) for i in (1, 3, 4, 5)] == [False, False, False, True]
    stats = cache.stats()
    assert stats.nbytes == state(25).nbytes <= stats.max_bytes and stats.entries == 1
    assert stats.evictions == recorder.evictions == 4
    assert (stats.hits, stats.misses) == (1, 1) and recorder.lookups[:2] == [1, 1]
    assert recorder.nbytes == stats.nbytes
    assert not cache.put("m", ids(6), state(40)) and cache.holds("m", ids(5))  # larger than the bound
    cache.clear()
    assert cache.stats().entries == 0 and recorder.nbytes == 0


def test_a_prefix_is_keyed_by_its_model_version_and_its_tokens() -> None:
    cache = PrefixCache(1 << 20)
    kept = state(3)
    cache.put(("reranker", "1"), ids(1, 2, 3), kept)
    assert cache.get(("reranker", "1"), np.array([1, 2, 3], dtype=np.int64)) is kept  # int64 keys alike
    assert cache.get(("reranker", "2"), ids(1, 2, 3)) is None
    assert cache.get(("reranker", "1"), ids(1, 2)) is None


def test_states_computes_each_missing_prefix_once_in_one_call() -> None:
    cache = PrefixCache(1 << 20)
    cache.put("m", ids(1), state(1))
    calls: list[list[list[int]]] = []

    def compute(missing: list[np.ndarray]) -> list[PrefixState]:
        calls.append([m.tolist() for m in missing])
        return [state(len(m)) for m in missing]

    got = cache.states("m", [ids(1), ids(2, 2), ids(3, 3, 3), ids(2, 2)], compute)
    assert calls == [[[2, 2], [3, 3, 3]]]
    assert [s.length for s in got] == [1, 2, 3, 2] and got[1] is got[3]
    assert cache.states("m", [ids(3, 3, 3)], compute)[0] is got[2] and len(calls) == 1


def test_the_bound_is_a_model_parameter() -> None:
    assert PrefixCache.from_parameters({}) is not None
    assert PrefixCache.from_parameters({}).max_bytes == DEFAULT_BYTES  # type: ignore[union-attr]
    assert PrefixCache.from_parameters({"prefix_cache_bytes": 0}) is None
    assert PrefixCache.from_parameters({"prefix_cache_bytes": 4096}).max_bytes == 4096  # type: ignore[union-attr]
    for bad in (-1, 1.5, "1GiB", True):
        with pytest.raises(ValueError, match="prefix_cache_bytes must be an integer >= 0"):
            PrefixCache.from_parameters({"prefix_cache_bytes": bad})


def test_threads_storing_and_looking_up_keep_the_bytes_true() -> None:
    cache = PrefixCache(10 * state(4).nbytes)
    barrier = threading.Barrier(4)

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        barrier.wait()
        for _ in range(500):
            key = ids(int(rng.integers(0, 30)))
            if cache.get("m", key) is None:
                cache.put("m", key, state(4))

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stats = cache.stats()
    assert stats.nbytes == stats.entries * state(4).nbytes <= stats.max_bytes
    assert stats.hits + stats.misses == 4 * 500


def test_the_counts_are_exported_with_the_model_and_version_labels() -> None:
    registry = CollectorRegistry()
    metrics = ServerMetrics(registry)
    cache = PrefixCache(2 * state(10).nbytes, metrics.prefix_cache("reranker", "3"))
    cache.states("v", [ids(*range(10))], lambda missing: [state(10) for _ in missing])
    cache.states("v", [ids(*range(10))], lambda missing: [state(10) for _ in missing])
    for first in (20, 30):
        cache.put("v", ids(first), state(10))
    labels = {"model": "reranker", "version": "3"}
    expected = {
        ("scoring_prefix_cache_lookups_total", "hit"): 1.0,
        ("scoring_prefix_cache_lookups_total", "miss"): 1.0,
        ("scoring_prefix_cache_tokens_total", "hit"): 10.0,
        ("scoring_prefix_cache_tokens_total", "miss"): 10.0,
        ("scoring_prefix_cache_evictions_total", None): 1.0,
        ("scoring_prefix_cache_bytes", None): float(2 * state(10).nbytes),
    }
    for (name, result), value in expected.items():
        asked = labels if result is None else {**labels, "result": result}
        assert registry.get_sample_value(name, asked) == value, (name, result)
