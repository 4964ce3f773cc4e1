"""The response cache: the host's store (app.serving.response_cache) and the data plane's use of
it (app.serving.item_cache): keys, bounds, eviction, corruption, a store that fails, and a model
whose cached items never reach its queue."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest

from app.http.state import CORE
from app.models.repository import read_config
from app.serving.context import RequestContext
from app.serving.item_cache import ItemCache
from app.serving.redis_tier import RedisTier
from app.serving.registry import ModelVersion
from app.serving.response_cache import CacheCounts, ResponseCache, decode_item, encode_item, item_keys
from tests.support.fixtures import MakeClient
from tests.support.gunicorn import ROOT
from tests.support.redis_server import redis_server as support_redis_server
from tests.support.toy_models import ScaleHandler, write_scale_model

MIB = 1 << 20
IDENTITY = b"model\x001\x00fingerprint\x00env\x00cpu"


def texts(*values: bytes) -> dict[str, np.ndarray]:
    arr = np.empty((len(values), 1), dtype=object)
    arr[:, 0] = list(values)
    return {"text": arr}


def vector(seed: int, size: int = 384) -> dict[str, np.ndarray]:
    return {"embedding": np.random.default_rng(seed).random(size, dtype=np.float32)}


def fresh(tmp_path: Path, max_bytes: int = 4 * MIB, **kw: Any) -> ResponseCache:
    store = ResponseCache(tmp_path / "cache", max_bytes, **kw)
    store.CHECK_S = 0.0  # look for a removed store on every call (no waiting in tests)
    return store


# --- keys and encoding -------------------------------------------------------------------------


def test_keys_are_per_item_and_differ_per_version_input_and_dtype() -> None:
    keys = item_keys(IDENTITY, texts(b"a", b"b", b"a"))
    assert keys is not None and len(keys) == 3
    assert keys[0] == keys[2] != keys[1]
    other_version = item_keys(IDENTITY.replace(b"\x001\x00", b"\x002\x00"), texts(b"a"))
    other_files = item_keys(IDENTITY.replace(b"fingerprint", b"fingerprint2"), texts(b"a"))
    assert other_version is not None and other_files is not None
    assert len({keys[0], other_version[0], other_files[0]}) == 3
    # the same bytes under another dtype, shape or input name are another item
    x32 = item_keys(IDENTITY, {"x": np.ones((1, 2), np.float32)})
    x64 = item_keys(IDENTITY, {"x": np.ones((1, 1), np.float64)})
    y32 = item_keys(IDENTITY, {"y": np.ones((1, 2), np.float32)})
    assert x32 is not None and x64 is not None and y32 is not None
    assert len({x32[0], x64[0], y32[0]}) == 3
    # BYTES elements are length-prefixed: ("ab", "c") is not ("a", "bc")
    two = np.array([[b"ab", b"c"], [b"a", b"bc"]], dtype=object)
    split = item_keys(IDENTITY, {"t": two})
    assert split is not None and split[0] != split[1]


def test_encoding_round_trips_bit_for_bit_and_refuses_what_it_cannot_hold() -> None:
    item: dict[str, np.ndarray] = {
        "f16": np.array([1.5, -0.0, np.nan], np.float16),
        "f32": np.random.default_rng(0).random((2, 3), dtype=np.float32),
        "i64": np.array([7], np.int64),
        "ok": np.array([True]),
        "label": np.array([b"cat", b""], dtype=object),
    }
    blob = encode_item(item)
    assert blob is not None
    back = decode_item(blob)
    assert back is not None and list(back) == list(item)
    for name, arr in item.items():
        assert back[name].dtype == arr.dtype and back[name].shape == arr.shape
        if arr.dtype != object:
            assert back[name].tobytes() == arr.tobytes()
    assert list(back["label"]) == [b"cat", b""]
    assert encode_item({"s": np.array(["text"], dtype=object)}) is None  # str, not bytes
    assert decode_item(b"\x93garbage") is None


# --- the store ---------------------------------------------------------------------------------


def test_a_stored_item_is_found_bit_identical_and_equal_keys_are_stored_once(tmp_path: Path) -> None:
    store = fresh(tmp_path)
    keys = item_keys(IDENTITY, texts(b"a", b"b"))
    assert keys is not None
    assert store.lookup(keys) == [None, None]
    first, second = vector(1), vector(2)
    store.insert([(keys[0], "model", first), (keys[0], "model", second)])
    found = store.lookup(keys)
    assert found[1] is None
    assert found[0] is not None and found[0]["embedding"].tobytes() == first["embedding"].tobytes()
    assert store.stats()["entries"] == 1


def test_the_byte_bound_holds_under_a_workload_ten_times_the_store(tmp_path: Path) -> None:
    evicted: dict[str, int] = {}

    def seen(counts: CacheCounts) -> None:
        for model, n in counts.evicted.items():
            evicted[model] = evicted.get(model, 0) + n

    store = fresh(tmp_path, 2 * MIB, on_change=seen)
    item_bytes = 384 * 4
    count = 10 * (2 * MIB) // item_bytes // 8 * 8  # ten times the whole map in values alone
    for start in range(0, count, 8):
        keys = item_keys(IDENTITY, texts(*(str(i).encode() for i in range(start, start + 8))))
        assert keys is not None
        store.insert([(key, "model", vector(start + j)) for j, key in enumerate(keys)])
        assert (tmp_path / "cache" / "data.mdb").stat().st_size <= 2 * MIB
    stats = store.stats()
    assert 0 < stats["bytes"] <= stats["pages_bytes"] <= store.budget
    assert evicted["model"] == count - stats["entries"]
    newest = item_keys(IDENTITY, texts(str(count - 1).encode()))
    oldest = item_keys(IDENTITY, texts(b"0"))
    assert newest is not None and oldest is not None
    assert store.lookup(newest)[0] is not None and store.lookup(oldest)[0] is None


def test_an_item_read_often_outlives_a_scan_of_new_ones(tmp_path: Path) -> None:
    """CLOCK-like LRU: a hit on an entry in the older half stamps it again."""
    store = fresh(tmp_path, 1 * MIB)
    hot = item_keys(IDENTITY, texts(b"hot"))
    assert hot is not None
    store.insert([(hot[0], "model", vector(0))])
    for start in range(0, 3000, 8):  # about eight times what the store holds
        keys = item_keys(IDENTITY, texts(*(f"scan {i}".encode() for i in range(start, start + 8))))
        assert keys is not None
        store.insert([(key, "model", vector(i)) for i, key in enumerate(keys)])
        assert store.lookup(hot)[0] is not None


def test_a_corrupt_entry_is_a_miss_and_is_replaced(tmp_path: Path) -> None:
    store = fresh(tmp_path)
    keys = item_keys(IDENTITY, texts(b"a"))
    assert keys is not None
    store.insert([(keys[0], "model", vector(1))])
    store.close()
    env = lmdb.open(str(tmp_path / "cache"), max_dbs=3)
    with env.begin(write=True) as txn:
        db = env.open_db(b"items", txn=txn)
        stored = txn.get(keys[0], db=db)
        assert stored is not None
        value = bytearray(stored)
        value[-1] ^= 0xFF  # one flipped bit of the payload
        txn.put(keys[0], bytes(value), db=db)
    env.close()
    assert store.lookup(keys) == [None]
    store.insert([(keys[0], "model", vector(2))])
    found = store.lookup(keys)[0]
    assert found is not None and found["embedding"].tobytes() == vector(2)["embedding"].tobytes()


def test_an_expired_entry_is_a_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    now = [1000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    store = fresh(tmp_path, ttl_s=60)
    keys = item_keys(IDENTITY, texts(b"a"))
    assert keys is not None
    store.insert([(keys[0], "model", vector(1))])
    now[0] += 59
    assert store.lookup(keys)[0] is not None
    now[0] += 2
    assert store.lookup(keys) == [None]
    store.insert([(keys[0], "model", vector(2))])  # an expired entry is replaced
    assert store.lookup(keys)[0] is not None


def test_a_store_that_cannot_be_made_misses_and_drops_without_an_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    store = ResponseCache(tmp_path / "file" / "cache", 4 * MIB)
    keys = item_keys(IDENTITY, texts(b"a"))
    assert keys is not None
    store.insert([(keys[0], "model", vector(1))])
    assert store.lookup(keys) == [None]
    assert store.stats() == {}


def test_a_store_removed_while_open_is_made_again(tmp_path: Path) -> None:
    store = fresh(tmp_path)
    keys = item_keys(IDENTITY, texts(b"a"))
    assert keys is not None
    store.insert([(keys[0], "model", vector(1))])
    shutil.rmtree(tmp_path / "cache")
    assert store.lookup(keys) == [None]  # a new, empty store where the old one was
    assert (tmp_path / "cache" / "data.mdb").exists()
    store.insert([(keys[0], "model", vector(1))])
    assert store.lookup(keys)[0] is not None


def test_a_full_map_evicts_and_keeps_storing(tmp_path: Path) -> None:
    """Values of 200 KB take whole overflow pages: LMDB's file fills before the data budget."""
    store = fresh(tmp_path, 1 * MIB)
    for i in range(40):
        keys = item_keys(IDENTITY, texts(str(i).encode()))
        assert keys is not None
        store.insert([(keys[0], "model", vector(i, 50_000))])
        assert store.lookup(keys)[0] is not None, f"item {i} not stored"
    assert (tmp_path / "cache" / "data.mdb").stat().st_size <= 1 * MIB


def test_another_process_reads_what_this_one_stored(tmp_path: Path) -> None:
    store = fresh(tmp_path)
    keys = item_keys(IDENTITY, texts(b"shared"))
    assert keys is not None
    store.insert([(keys[0], "model", vector(7))])
    script = (
        "import sys; from pathlib import Path; from app.serving.response_cache import ResponseCache; "
        f"found = ResponseCache(Path(sys.argv[1]), {4 * MIB}).lookup([bytes.fromhex(sys.argv[2])])[0]; "
        "sys.stdout.write(found['embedding'].tobytes().hex())"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "cache"), keys[0].hex()],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert bytes.fromhex(out.stdout) == vector(7)["embedding"].tobytes()


# --- in the data plane -------------------------------------------------------------------------


def cached_scale_model(repo: Path, **parameters: Any) -> Path:
    return write_scale_model(repo, "scale", response_cache=True, **parameters)


def infer_body(*xs: float) -> dict[str, Any]:
    return {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [len(xs), 2], "data": [[x, x] for x in xs]}]
    }


async def test_cached_items_skip_the_queue_and_equal_items_are_computed_once(
    tmp_path: Path, make_client: MakeClient
) -> None:
    repo = tmp_path / "repo"
    cached_scale_model(repo)
    client = await make_client(repo, response_cache_path=tmp_path / "cache")
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
    scrape = await (await client.get("/metrics")).text()  # an item repeated in a request counts twice
    assert 'scoring_response_cache_items_total{model="scale",result="hit",version="1"} 4.0' in scrape
    assert 'scoring_response_cache_items_total{model="scale",result="miss",version="1"} 5.0' in scrape
    assert 'scoring_response_cache_bytes{model="scale"}' in scrape


async def test_cached_and_computed_outputs_are_bit_identical(tmp_path: Path, make_client: MakeClient) -> None:
    import asyncio

    from app.protocols.infer import InferInput, InferRequest
    from app.serving.context import NO_DEADLINE, RequestContext

    repo = tmp_path / "repo"
    cached_scale_model(repo, factor=1 / 3)  # thirds: every bit of the float32 mantissa in use
    client = await make_client(repo, response_cache_path=tmp_path / "cache")
    plane = client.app[CORE].dataplane
    x = np.random.default_rng(0).random((6, 2), dtype=np.float32)

    async def outputs() -> dict[str, tuple[str, str, bytes]]:
        request = InferRequest("scale", [InferInput("x", "FP32", [6, 2], x.copy())])
        context = RequestContext("t", NO_DEADLINE, arrival=asyncio.get_running_loop().time())
        response = await plane.infer(request, context)
        return {t.name: (t.datatype, t.array.dtype.str, t.array.tobytes()) for t in response.outputs}

    computed = await outputs()
    batches = len(ScaleHandler.BATCHES["scale"])
    cached = await outputs()
    assert len(ScaleHandler.BATCHES["scale"]) == batches  # the second answer came from the store
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


# --- the Redis tier (a real redis-server, started here) ----------------------------------------


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    with support_redis_server(tmp_path) as server:
        yield server


def two_hosts(tmp_path: Path, url: str) -> tuple[ItemCache, ItemCache]:
    """Two hosts' caches: stores of their own, one Redis tier."""
    hosts = []
    for name in ("a", "b"):
        store = fresh(tmp_path / name)
        hosts.append(ItemCache(store, "cpu", shared=RedisTier(url, timeout_s=0.5)))
    return hosts[0], hosts[1]


def scale_version(tmp_path: Path) -> ModelVersion:
    model = ModelVersion(read_config(write_scale_model(tmp_path / "repo", "scale", response_cache=True)))
    model.fingerprint = "files"
    return model


def test_an_item_one_host_computed_is_found_by_another_through_redis(
    tmp_path: Path, redis_server: tuple[str, subprocess.Popen[bytes]]
) -> None:
    url, proc = redis_server
    a, b = two_hosts(tmp_path, url)
    model = scale_version(tmp_path)
    inputs = {"x": np.array([[1.0, 1.0], [2.0, 2.0]], np.float32)}
    outputs = {"y": np.array([[3.0, 3.0], [6.0, 6.0]], np.float32)}
    context = RequestContext("r", 0.0)
    queued, plan = asyncio.run(a.expand(model, context, inputs))
    assert queued is not None and len(queued["x"]) == 2
    a.store_outputs(model, model.fingerprint, queued, outputs)
    queued, plan = asyncio.run(b.expand(model, context, inputs))
    assert queued is None  # both items came from host a, through Redis
    assert b.assemble(plan, None)["y"].tobytes() == outputs["y"].tobytes()
    proc.terminate()
    proc.wait(10)
    queued, plan = asyncio.run(b.expand(model, context, inputs))  # copied into host b's own store
    assert queued is None and b.assemble(plan, None)["y"].tobytes() == outputs["y"].tobytes()


def test_a_stopped_or_corrupt_redis_means_computing(
    tmp_path: Path, redis_server: tuple[str, subprocess.Popen[bytes]]
) -> None:
    import redis

    from app.serving.redis_tier import PREFIX

    url, proc = redis_server
    a, b = two_hosts(tmp_path, url)
    model = scale_version(tmp_path)
    inputs = {"x": np.array([[5.0, 5.0]], np.float32)}
    context = RequestContext("r", 0.0)
    queued, _ = asyncio.run(a.expand(model, context, inputs))
    assert queued is not None
    a.store_outputs(model, model.fingerprint, queued, {"y": np.array([[15.0, 15.0]], np.float32)})
    client = redis.Redis.from_url(url)
    (key,) = client.keys(PREFIX + b"*")
    stored = client.get(key)
    assert isinstance(stored, bytes)
    value = bytearray(stored)
    value[-1] ^= 0xFF
    client.set(key, bytes(value))
    client.close()
    queued, _ = asyncio.run(b.expand(model, context, inputs))
    assert queued is not None  # a corrupt value is a miss
    proc.terminate()
    proc.wait(10)
    other = {"x": np.array([[7.0, 7.0]], np.float32)}
    queued, _ = asyncio.run(b.expand(model, context, other))  # Redis gone: computed, no error
    assert queued is not None
    b.store_outputs(model, model.fingerprint, queued, {"y": np.array([[21.0, 21.0]], np.float32)})
    queued, _ = asyncio.run(b.expand(model, context, other))
    assert queued is None  # host b's own store still serves


async def test_a_cached_model_is_not_refused_before_its_items_are_looked_up(
    tmp_path: Path, make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Early refusal (before the body is decoded) would refuse requests the store answers whole;
    a cached model skips it, and admission prices only what is left."""
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
