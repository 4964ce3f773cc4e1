"""The response cache's item stage (app.serving.item_cache) in the data plane: cached items skip
the queue, bit for bit; a reload starts afresh; a failing store means computing; a cached model
is not refused early; a request that arrives while its model loads is looked up and counted
like any other. Its I/O off the event loop: a stalled Redis does not slow a request past the
lookup bound, an LMDB writer holding the store's lock stalls no request (the loop's longest
stall measured), a full write queue drops and counts. The Redis tier between two hosts."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from app.http.state import CORE
from app.models.base import PREPARED
from app.models.repository import read_config
from app.observability.metrics import ServerMetrics
from app.serving.context import RequestContext
from app.serving.item_cache import ItemCache
from app.serving.redis_tier import PREFIX, RedisTier
from app.serving.registry import ModelVersion
from app.serving.response_cache import ResponseCache
from tests.support.fixtures import MakeClient, eventually
from tests.support.redis_server import redis_server as support_redis_server
from tests.support.toy_models import ScaleHandler, write_scale_model

MIB = 1 << 20
#: A lookup bound no loaded test machine reaches: the tests of hits are not tests of timing.
PATIENT_MS = 60_000.0


def cached_scale_model(repo: Path, **parameters: Any) -> Path:
    return write_scale_model(repo, "scale", response_cache=True, **parameters)


def infer_body(*xs: float) -> dict[str, Any]:
    return {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [len(xs), 2], "data": [[x, x] for x in xs]}]
    }


def xs(*values: float) -> dict[str, np.ndarray]:
    return {"x": np.array([[v, v] for v in values], np.float32)}


def ys(*values: float) -> dict[str, np.ndarray]:
    return {"y": np.array([[3 * v, 3 * v] for v in values], np.float32)}


# --- in the data plane -------------------------------------------------------------------------


async def test_cached_items_skip_the_queue_and_equal_items_are_computed_once(
    tmp_path: Path, make_client: MakeClient
) -> None:
    repo = tmp_path / "repo"
    cached_scale_model(repo)
    client = await make_client(
        repo, response_cache_path=tmp_path / "cache", response_cache_lookup_timeout_ms=PATIENT_MS
    )
    ScaleHandler.BATCHES["scale"].clear()
    resp = await client.post("/v2/models/scale/infer", json=infer_body(1, 2, 1))
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["outputs"][0]["data"] == [2, 2, 4, 4, 2, 2]
    assert ScaleHandler.BATCHES["scale"] == [[1.0, 2.0]]
    resp = await client.post("/v2/models/scale/infer", json=infer_body(3, 2, 1, 3))
    assert resp.status == 200
    assert (await resp.json())["outputs"][0]["data"] == [6, 6, 4, 4, 2, 2, 6, 6]
    assert ScaleHandler.BATCHES["scale"] == [[1.0, 2.0], [3.0]]
    resp = await client.post("/v2/models/scale/infer", json=infer_body(2, 1))
    assert resp.status == 200 and ScaleHandler.BATCHES["scale"] == [[1.0, 2.0], [3.0]]  # all cached
    stats = (await (await client.get("/v2/models/scale/stats")).json())["model_stats"][0]["inference_stats"]
    assert (stats["cache_hit"]["count"], stats["cache_miss"]["count"]) == (4, 5)  # Triton's, per item
    config = await (await client.get("/v2/models/scale/config")).json()
    assert config["response_cache"] == {"enable": True}

    async def written() -> str | None:  # the store's bytes are reported once the writes landed
        scrape = await (await client.get("/metrics")).text()
        return scrape if 'scoring_response_cache_bytes{model="scale"}' in scrape else None

    scrape = await eventually(written)  # an item repeated in a request counts twice
    assert 'scoring_response_cache_items_total{model="scale",result="hit",version="1"} 4.0' in scrape
    assert 'scoring_response_cache_items_total{model="scale",result="miss",version="1"} 5.0' in scrape


async def test_cached_and_computed_outputs_are_bit_identical(tmp_path: Path, make_client: MakeClient) -> None:
    from app.protocols.infer import InferInput, InferRequest
    from app.serving.context import NO_DEADLINE, RequestContext

    repo = tmp_path / "repo"
    cached_scale_model(repo, factor=1 / 3)  # thirds: every bit of the float32 mantissa in use
    client = await make_client(
        repo, response_cache_path=tmp_path / "cache", response_cache_lookup_timeout_ms=PATIENT_MS
    )
    plane = client.app[CORE].dataplane
    x = np.random.default_rng(0).random((6, 2), dtype=np.float32)

    async def outputs() -> dict[str, tuple[str, str, bytes]]:
        request = InferRequest("scale", [InferInput("x", "FP32", [6, 2], x.copy())])
        context = RequestContext("t", NO_DEADLINE, arrival=asyncio.get_running_loop().time())
        response = await plane.infer(request, context)
        return {t.name: (t.datatype, t.array.dtype.str, t.array.tobytes()) for t in response.outputs}

    computed = await outputs()
    batches = len(ScaleHandler.BATCHES["scale"])
    cached = await outputs()  # from this worker's queued write, or from the store once written
    assert len(ScaleHandler.BATCHES["scale"]) == batches
    assert cached == computed


async def test_a_reloaded_model_never_answers_with_the_old_files_results(
    tmp_path: Path, make_client: MakeClient
) -> None:
    repo = tmp_path / "repo"
    folder = cached_scale_model(repo, factor=2)
    client = await make_client(repo, response_cache_path=tmp_path / "cache", model_control_mode="explicit",
                               models="scale")  # fmt: skip
    resp = await client.post("/v2/models/scale/infer", json=infer_body(5))
    assert (await resp.json())["outputs"][0]["data"] == [10, 10]
    toml = (folder / "model.toml").read_text().replace("factor = 2", "factor = 3")
    (folder / "model.toml").write_text(toml)
    resp = await client.post("/v2/repository/models/scale/load", json={})
    assert resp.status == 200, await resp.text()
    resp = await client.post("/v2/models/scale/infer", json=infer_body(5))
    assert (await resp.json())["outputs"][0]["data"] == [15, 15]


async def test_a_store_that_fails_means_computing(tmp_path: Path, make_client: MakeClient) -> None:
    repo = tmp_path / "repo"
    cached_scale_model(repo)
    (tmp_path / "file").write_text("not a folder")
    client = await make_client(repo, response_cache_path=tmp_path / "file" / "cache")
    for _ in range(2):
        resp = await client.post("/v2/models/scale/infer", json=infer_body(1, 2))
        assert resp.status == 200
        assert (await resp.json())["outputs"][0]["data"] == [2, 2, 4, 4]


async def test_a_cached_model_is_not_refused_before_its_items_are_looked_up(
    tmp_path: Path, make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Early refusal (before the body is decoded) would refuse requests the store answers whole;
    a cached model skips it (its stage may answer without the model), and admission prices only
    what is left."""
    from app.errors import QueueFull
    from tests.support.fixtures import served

    repo = tmp_path / "repo"
    cached_scale_model(repo)
    write_scale_model(repo, "plain")
    client = await make_client(repo, response_cache_path=tmp_path / "cache")
    for name in ("scale", "plain"):
        unit = served(client.app, name)
        monkeypatch.setattr(unit, "refuse_early", lambda deadline: QueueFull("busy", retry_after_s=1))
    assert (await client.post("/v2/models/plain/infer", json=infer_body(1))).status == 503
    assert (await client.post("/v2/models/scale/infer", json=infer_body(1))).status == 200


async def test_a_request_that_arrives_while_its_model_loads_is_looked_up_and_counted(
    tmp_path: Path, make_client: MakeClient
) -> None:
    """The stages decide on the model as loaded: a request that waits for its model's load goes
    through the cache like any other (its items counted as misses, its results stored), not
    around it as if the model had no cache."""
    gate = threading.Event()
    ScaleHandler.GATES["cache-while-loading"] = gate
    repo = tmp_path / "repo"
    cached_scale_model(repo, load_gate="cache-while-loading")
    client = await make_client(
        repo, wait=False, response_cache_path=tmp_path / "cache", response_cache_lookup_timeout_ms=PATIENT_MS
    )
    registry = client.app[CORE].registry
    metrics = client.app[CORE].metrics
    assert metrics is not None
    waiting = asyncio.ensure_future(client.post("/v2/models/scale/infer", json=infer_body(1, 2)))
    in_flight = {"model": "scale", "version": "1"}
    await eventually(lambda: sample(metrics, "scoring_requests_in_flight", **in_flight) == 1.0)
    assert registry.get("scale").runner is None and not waiting.done()  # waits for the load
    gate.set()
    resp = await waiting
    assert resp.status == 200 and (await resp.json())["outputs"][0]["data"] == [2, 2, 4, 4]
    stats = registry.get("scale").stats
    assert (stats.cache_hit.count, stats.cache_miss.count) == (0, 2)
    resp = await client.post("/v2/models/scale/infer", json=infer_body(1, 2))
    assert (await resp.json())["outputs"][0]["data"] == [2, 2, 4, 4]
    assert (stats.cache_hit.count, stats.cache_miss.count) == (2, 2)


# --- off the event loop -------------------------------------------------------------------------


def fresh(tmp_path: Path, max_bytes: int = 4 * MIB) -> ResponseCache:
    store = ResponseCache(tmp_path / "cache", max_bytes)
    store.opener.CHECK_S = 0.0
    return store


def scale_version(tmp_path: Path) -> ModelVersion:
    model = ModelVersion(read_config(write_scale_model(tmp_path / "repo", "scale", response_cache=True)))
    model.fingerprint = "files"
    return model


@pytest.fixture
def metrics() -> ServerMetrics:
    return ServerMetrics(CollectorRegistry())


def sample(metrics: ServerMetrics, name: str, **labels: str) -> float:
    assert metrics.registry is not None
    return metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    with support_redis_server(tmp_path) as server:
        yield server


class LoopLag:
    """The event loop's longest stall while it runs: a task that ticks every 10 ms and keeps
    the longest gap between two ticks, seconds."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(0.01)
            now = loop.time()
            self.worst = max(self.worst, now - last)
            last = now

    async def __aenter__(self) -> LoopLag:
        self._task = asyncio.ensure_future(self._tick())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


@pytest.fixture
async def closing() -> AsyncIterator[list[ItemCache]]:
    caches: list[ItemCache] = []
    yield caches
    for cache in caches:
        await asyncio.to_thread(cache.close, 10.0)


async def test_a_stalled_redis_does_not_slow_a_request_past_the_lookup_bound(
    tmp_path: Path, redis_server: tuple[str, subprocess.Popen[bytes]], metrics: ServerMetrics,
    closing: list[ItemCache],
) -> None:  # fmt: skip
    """Redis stopped (SIGSTOP: connections open, nothing answered) with a socket timeout of 30 s:
    a lookup gives up at the bound (0.3 s), its items computed and counted late; the host's
    store still answers what it holds."""
    url, proc = redis_server
    cache = ItemCache(
        fresh(tmp_path), "cpu", metrics, shared=RedisTier(url, timeout_s=30.0), lookup_timeout_s=0.3
    )
    closing.append(cache)
    model = scale_version(tmp_path)
    context = RequestContext("r", 0.0)
    queued, _ = await cache.expand(model, context, xs(1, 2))  # connects while Redis answers
    assert queued is not None
    cache.computed(model, model.fingerprint, queued, ys(1, 2))
    assert await asyncio.to_thread(cache.flush, 30)
    loop = asyncio.get_running_loop()
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        async with LoopLag() as lag:
            start = loop.time()
            queued, plan = await cache.expand(model, context, xs(1, 2, 3))
            took = loop.time() - start
            assert queued is not None and queued["x"].tolist() == [[3.0, 3.0]]  # 1 and 2 from the host
            cache.computed(model, model.fingerprint, queued, ys(3))  # its Redis write waits: not us
            assert cache.assemble(plan, ys(3))["y"][:, 0].tolist() == [3.0, 6.0, 9.0]
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert took < 5.0, f"a lookup took {took:.1f} s with a bound of 0.3 s"
    assert lag.worst < 1.0, f"the event loop stalled {lag.worst:.2f} s"
    assert sample(metrics, "scoring_response_cache_late_items_total", model="scale", tier="redis") == 1


def token_rows(*rows: list[int]) -> np.ndarray:
    """Items' preparations as a text handler makes them: ``(ids,)`` each, object ``[B]``."""
    out = np.empty(len(rows), dtype=object)
    out[:] = [(np.array(row, np.int32),) for row in rows]
    return out


async def test_a_window_item_is_keyed_by_its_token_ids_which_are_cut_with_the_other_inputs(
    tmp_path: Path, closing: list[ItemCache]
) -> None:
    """Items with the same inputs (a window's span of text) and other token ids (``#prepared``)
    are other items: the stored result of the one never answers the other. Items found in the
    store leave the request with their preparations: what is queued keeps each item's own."""
    cache = ItemCache(fresh(tmp_path), "cpu", lookup_timeout_s=PATIENT_MS / 1000)
    closing.append(cache)
    model = scale_version(tmp_path)
    context = RequestContext("r", 0.0)
    alone = {**xs(1, 2), PREPARED: token_rows([101, 7, 102], [101, 9, 102])}
    queued, _ = await cache.expand(model, context, alone)
    assert queued is not None
    cache.computed(model, model.fingerprint, queued, ys(1, 2))
    assert await asyncio.to_thread(cache.flush, 30)
    # the same inputs with other ids, the same with the same ids, a new item
    windows = {**xs(1, 2, 5), PREPARED: token_rows([101, 8, 102], [101, 9, 102], [101, 5, 102])}
    queued, plan = await cache.expand(model, context, windows)
    assert queued is not None and queued["x"][:, 0].tolist() == [1.0, 5.0]
    assert [rows[0].tolist() for rows in queued[PREPARED]] == [[101, 8, 102], [101, 5, 102]]
    assert cache.assemble(plan, ys(10, 50))["y"][:, 0].tolist() == [30.0, 6.0, 150.0]


HOLDER = """
import lmdb, signal, sys
signal.alarm(20)  # never holds it longer, whatever the test does
env = lmdb.open(sys.argv[1], map_size=int(sys.argv[2]), max_dbs=3)
with env.begin(write=True):
    print("held", flush=True)
    sys.stdin.read()
"""


async def test_a_writer_holding_the_stores_lock_stalls_no_request(
    tmp_path: Path, metrics: ServerMetrics, closing: list[ItemCache]
) -> None:
    """Another process holds the store's write lock: lookups (lock-free readers) still answer,
    computed items queue for the writer thread, a full queue drops (counted), the loop never
    stalls; once the lock is free what was queued is written."""
    store = fresh(tmp_path)
    cache = ItemCache(store, "cpu", metrics, lookup_timeout_s=PATIENT_MS / 1000, queue_items=16)
    closing.append(cache)
    model = scale_version(tmp_path)
    context = RequestContext("r", 0.0)
    cache.computed(model, model.fingerprint, xs(1), ys(1))
    assert await asyncio.to_thread(cache.flush, 30)
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLDER, str(tmp_path / "cache"), str(store.max_bytes),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert await holder.stdout.readline() == b"held\n"
        async with LoopLag() as lag:
            for batch in range(3):  # 8 items each: the third finds 16 queued and is dropped
                values = [100.0 * (batch + 1) + i for i in range(8)]
                queued, _ = await cache.expand(model, context, xs(1, *values))
                assert queued is not None and len(queued["x"]) == 8  # 1 came from the store
                cache.computed(model, model.fingerprint, queued, ys(*values))
        assert holder.returncode is None, "the lock was let go of before the requests were done"
    finally:
        holder.stdin.close()
        await holder.wait()
    assert lag.worst < 1.0, f"the event loop stalled {lag.worst:.2f} s"
    dropped = sample(
        metrics, "scoring_response_cache_dropped_writes_total", model="scale", reason="queue_full"
    )
    assert dropped == 8
    assert await asyncio.to_thread(cache.flush, 30)
    assert all(item is not None for item in store.lookup(cache_keys(cache, model, xs(1, 100, 107, 200, 207))))


def cache_keys(cache: ItemCache, model: ModelVersion, inputs: dict[str, np.ndarray]) -> list[bytes]:
    from app.serving.response_cache import item_keys

    keys = item_keys(cache.identity(model, model.fingerprint), inputs)
    assert keys is not None
    return keys


# --- the Redis tier (a real redis-server, started here) ----------------------------------------


def two_hosts(tmp_path: Path, url: str, closing: list[ItemCache]) -> tuple[ItemCache, ItemCache]:
    """Two hosts' caches: stores of their own, one Redis tier."""
    hosts = []
    for name in ("a", "b"):
        cache = ItemCache(fresh(tmp_path / name), "cpu", shared=RedisTier(url, timeout_s=5.0),
                          lookup_timeout_s=PATIENT_MS / 1000)  # fmt: skip
        closing.append(cache)
        hosts.append(cache)
    return hosts[0], hosts[1]


async def test_an_item_one_host_computed_is_found_by_another_through_redis(
    tmp_path: Path, redis_server: tuple[str, subprocess.Popen[bytes]], closing: list[ItemCache]
) -> None:
    url, proc = redis_server
    a, b = two_hosts(tmp_path, url, closing)
    model = scale_version(tmp_path)
    context = RequestContext("r", 0.0)
    queued, plan = await a.expand(model, context, xs(1, 2))
    assert queued is not None and len(queued["x"]) == 2
    a.computed(model, model.fingerprint, queued, ys(1, 2))
    assert await asyncio.to_thread(a.flush, 30)
    queued, plan = await b.expand(model, context, xs(1, 2))
    assert queued is None  # both items came from host a, through Redis
    assert b.assemble(plan, None)["y"].tobytes() == ys(1, 2)["y"].tobytes()
    assert await asyncio.to_thread(b.flush, 30)
    proc.terminate()
    proc.wait(10)
    queued, plan = await b.expand(model, context, xs(1, 2))  # copied into host b's own store
    assert queued is None and b.assemble(plan, None)["y"].tobytes() == ys(1, 2)["y"].tobytes()


async def test_a_stopped_or_corrupt_redis_means_computing(
    tmp_path: Path, redis_server: tuple[str, subprocess.Popen[bytes]], metrics: ServerMetrics,
    closing: list[ItemCache],
) -> None:  # fmt: skip
    import redis

    url, proc = redis_server
    a, b = two_hosts(tmp_path, url, closing)
    b.metrics = metrics
    model = scale_version(tmp_path)
    context = RequestContext("r", 0.0)
    queued, _ = await a.expand(model, context, xs(5))
    assert queued is not None
    a.computed(model, model.fingerprint, queued, ys(5))
    assert await asyncio.to_thread(a.flush, 30)
    client = redis.Redis.from_url(url)
    (key,) = client.keys(PREFIX + b"*")
    stored = client.get(key)
    assert isinstance(stored, bytes)
    value = bytearray(stored)
    value[-1] ^= 0xFF
    client.set(key, bytes(value))
    client.close()
    queued, _ = await b.expand(model, context, xs(5))
    assert queued is not None  # a damaged value is a miss
    proc.terminate()
    proc.wait(10)
    queued, _ = await b.expand(model, context, xs(7))  # Redis gone: computed, no error
    assert queued is not None
    b.computed(model, model.fingerprint, queued, ys(7))
    assert await asyncio.to_thread(b.flush, 30)
    assert (
        sample(metrics, "scoring_response_cache_dropped_writes_total", model="scale", reason="redis_error")
        == 1
    )
    queued, _ = await b.expand(model, context, xs(7))
    assert queued is None  # host b's own store still serves


def test_the_stage_holds_no_thread_before_its_first_request(tmp_path: Path) -> None:
    """Threads are made in the worker that uses them (never across a fork) and stop on close."""
    before = threading.active_count()
    cache = ItemCache(fresh(tmp_path), "cpu")
    assert threading.active_count() == before
    cache.computed(scale_version(tmp_path), "files", xs(1), ys(1))
    assert cache.flush(30)
    cache.close(10)
    assert threading.active_count() == before
