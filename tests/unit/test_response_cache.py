"""The response cache's host store (app.serving.response_cache): keys, encoding, bounds and
eviction (three models in a 1 MiB store: never full, nothing dropped), damaged entries and
entries under the wrong key, a store that fails, another process reading what one stored. The
item stage in the data plane: tests/unit/test_item_cache.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest

from app.models.base import PREPARED
from app.serving.response_cache import CacheCounts, ResponseCache, decode_item, encode_item, item_keys
from tests.support.gunicorn import ROOT

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
    store.opener.CHECK_S = 0.0  # look for a removed store on every call (no waiting in tests)
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


def test_an_items_preparation_is_part_of_its_key() -> None:
    """A window's text input is the span its tokens cover, and the span does not decide them
    (cut inside a word, "ing" is "##ing" in its window and "ing" alone): its token ids, carried
    as ``#prepared``, are keyed beside its inputs, each row length-prefixed, so the window never
    finds the standalone text's result, nor another window's of the same span. Other ``#``
    inputs are not keyed; a preparation that is not integer rows is not cached."""
    span = texts(b"ing", b"ing")
    alone = (np.array([101, 7, 102], np.int32), np.zeros(0, np.int32))
    in_a_word = (np.array([101, 8, 102], np.int32), np.zeros(0, np.int32))
    prepared = np.empty(2, dtype=object)
    prepared[:] = [alone, in_a_word]
    assert PREPARED.startswith("#")
    keys = item_keys(IDENTITY, {**span, PREPARED: prepared})
    assert keys is not None and keys[0] != keys[1]
    plain = item_keys(IDENTITY, span)
    assert plain is not None and plain[0] not in keys
    # the same ids in another integer dtype (as a sibling worker may decode them) key alike
    wide = np.empty(2, dtype=object)
    wide[:] = [tuple(row.astype(np.int64) for row in alone), tuple(row.astype(np.int64) for row in in_a_word)]
    assert item_keys(IDENTITY, {**span, PREPARED: wide}) == keys
    # rows are length-prefixed: ([1, 2], [3]) is not ([1], [2, 3])
    cut = np.empty(2, dtype=object)
    cut[:] = [(np.array([1, 2]), np.array([3])), (np.array([1]), np.array([2, 3]))]
    split = item_keys(IDENTITY, {**span, PREPARED: cut})
    assert split is not None and split[0] != split[1]
    assert item_keys(IDENTITY, {**span, "#other": np.zeros(2)}) == plain
    assert item_keys(IDENTITY, {PREPARED: prepared}) is None  # nothing keyed: not cached
    odd = np.empty(2, dtype=object)
    odd[:] = [None, None]
    assert item_keys(IDENTITY, {**span, PREPARED: odd}) is None


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
    seen: dict[str, dict[Any, int]] = {}
    store = fresh(tmp_path, 2 * MIB, on_change=counted(seen))
    item_bytes = 384 * 4
    count = 10 * (2 * MIB) // item_bytes // 8 * 8  # ten times the whole map in values alone
    for start in range(0, count, 8):
        keys = item_keys(IDENTITY, texts(*(str(i).encode() for i in range(start, start + 8))))
        assert keys is not None
        store.insert([(key, "model", vector(start + j)) for j, key in enumerate(keys)])
        assert (tmp_path / "cache" / "data.mdb").stat().st_size <= 2 * MIB
    stats = store.stats()
    assert 0 < stats["bytes"] <= stats["pages_bytes"] <= store.budget
    assert seen["evicted"]["model"] == count - stats["entries"] and seen["dropped"] == {}
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


def tamper(store: ResponseCache, key: bytes, into: bytes, change: Callable[[bytes], bytes]) -> None:
    """Put ``change(value of key)`` under ``into``, behind the store's back (it is closed first)."""
    store.close()
    env = lmdb.open(str(store.path), max_dbs=3)
    with env.begin(write=True) as txn:
        db = env.open_db(b"items", txn=txn)
        value = txn.get(key, db=db)
        assert value is not None
        txn.put(into, change(value), db=db)
    env.close()


def test_a_corrupt_entry_is_a_miss_and_is_replaced(tmp_path: Path) -> None:
    store = fresh(tmp_path)
    keys = item_keys(IDENTITY, texts(b"a"))
    assert keys is not None
    store.insert([(keys[0], "model", vector(1))])
    tamper(store, keys[0], keys[0], lambda value: value[:-1] + bytes([value[-1] ^ 0xFF]))  # a flipped bit
    assert store.lookup(keys) == [None]
    store.insert([(keys[0], "model", vector(2))])
    found = store.lookup(keys)[0]
    assert found is not None and found["embedding"].tobytes() == vector(2)["embedding"].tobytes()


def test_an_entry_under_another_key_is_a_miss(tmp_path: Path) -> None:
    """The checksum covers the key: a value that a torn copy of the store (or any bug) puts
    under another key is never answered for it."""
    store = fresh(tmp_path)
    keys = item_keys(IDENTITY, texts(b"a", b"b"))
    assert keys is not None
    store.insert([(keys[0], "model", vector(1))])
    tamper(store, keys[0], keys[1], lambda value: value)  # a's value, whole and valid, under b's key
    found = store.lookup(keys)
    assert found[0] is not None and found[1] is None


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


def counted(into: dict[str, dict[Any, int]]) -> Callable[[CacheCounts], None]:
    """An ``on_change`` that sums what each write evicted and dropped into ``into``."""
    into.setdefault("evicted", {})
    into.setdefault("dropped", {})

    def seen(counts: CacheCounts) -> None:
        for model, n in counts.evicted.items():
            into["evicted"][model] = into["evicted"].get(model, 0) + n
        for key, n in counts.dropped.items():
            into["dropped"][key] = into["dropped"].get(key, 0) + n

    return seen


def test_three_models_in_a_1_mib_store_never_fill_it_and_drop_nothing(tmp_path: Path) -> None:
    """Embeddings, click probabilities and class probabilities of three models, in batches of
    1 to 63, through a 1 MiB store many times over: eviction runs in bounded transactions and
    before the map is full, so no write meets a full map and none is dropped; the newest items
    of every batch are found."""
    seen: dict[str, dict[Any, int]] = {}
    store = fresh(tmp_path, 1 * MIB, on_change=counted(seen))
    rng = np.random.default_rng(0)
    models: dict[str, Callable[[], dict[str, np.ndarray]]] = {
        "minilm": lambda: {"embedding": rng.random(384, dtype=np.float32), "tokens": np.array([7])},
        "feed": lambda: {"click_probability": rng.random(1, dtype=np.float32)},
        "clf": lambda: {"probabilities": rng.random(3, dtype=np.float32), "windows": np.array([1])},
    }
    start = 0
    for _ in range(150):
        for model, make in models.items():
            size = int(rng.integers(1, 64))
            keys = item_keys(model.encode(), {"x": np.arange(start, start + size)[:, None]})
            assert keys is not None
            start += size
            store.insert([(key, model, make()) for key in keys])
            assert all(item is not None for item in store.lookup(keys[-4:])), model
    assert seen["dropped"] == {}
    assert set(seen["evicted"]) == set(models)
    assert (tmp_path / "cache" / "data.mdb").stat().st_size <= 1 * MIB
    assert store.stats()["pages_bytes"] <= store.budget


def test_every_write_a_failing_store_drops_is_counted(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    seen: dict[str, dict[Any, int]] = {}
    store = ResponseCache(tmp_path / "file" / "cache", 4 * MIB, on_change=counted(seen))
    keys = item_keys(IDENTITY, texts(b"a", b"b"))
    assert keys is not None
    store.insert([(keys[0], "model", vector(1)), (keys[1], "model", {"s": np.array(["str"], dtype=object)})])
    assert seen["dropped"] == {("model", "store_error"): 1, ("model", "unencodable"): 1}


def test_a_full_map_evicts_and_keeps_storing(tmp_path: Path) -> None:
    """Values of 200 KB take whole overflow pages: LMDB's file fills before the data budget."""
    seen: dict[str, dict[Any, int]] = {}
    store = fresh(tmp_path, 1 * MIB, on_change=counted(seen))
    for i in range(40):
        keys = item_keys(IDENTITY, texts(str(i).encode()))
        assert keys is not None
        store.insert([(keys[0], "model", vector(i, 50_000))])
        assert store.lookup(keys)[0] is not None, f"item {i} not stored"
    assert (tmp_path / "cache" / "data.mdb").stat().st_size <= 1 * MIB
    assert seen["dropped"] == {}


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
