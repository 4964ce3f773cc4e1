"""Triton's model configuration, statistics and repository index extensions, ``GET /v2``'s
extension list, and KServe V1's ``GET /`` and ``{"inputs": ...}``, in-process."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.serving.siblings import Alone
from tests.support.fixtures import Client, MakeClient
from tests.support.fuzz import FUZZ, check, v1_bodies
from tests.support.toy_models import ScaleHandler, write_scale_model

V2_INFER = "/v2/models/scale/infer"
BODY = {"inputs": [{"name": "x", "shape": [3, 2], "datatype": "FP32", "data": [1, 2, 3, 4, 5, 6]}]}


async def test_server_metadata_lists_the_extensions_served(make_client: MakeClient, scale_repo: Path) -> None:
    client: Client = await make_client(scale_repo)
    meta = await (await client.get("/v2")).json()
    assert meta["extensions"] == [
        "binary_tensor_data",
        "classification",
        "model_configuration",
        "statistics",
        "model_repository",
    ]


async def test_model_config_is_tritons_shape_without_the_batch_dim(make_client: MakeClient, tmp_path: Path) -> None:
    write_scale_model(tmp_path, "scale", max_batch_size=16, max_queue_delay_ms=2.5)
    client: Client = await make_client(tmp_path)
    for path in ("/v2/models/scale/config", "/v2/models/scale/versions/1/config"):
        resp = await client.get(path)
        assert resp.status == 200
        config = await resp.json()
        assert config["name"] == "scale" and config["max_batch_size"] == 16
        assert config["platform"] == "python_handler" and config["backend"] == "python"
        assert config["input"][0] == {
            "name": "x", "data_type": "TYPE_FP32", "format": "FORMAT_NONE", "dims": [2],
            "is_shape_tensor": False, "allow_ragged_batch": False, "optional": False,
        }  # fmt: skip
        assert config["input"][1]["data_type"] == "TYPE_STRING" and config["input"][1]["optional"] is True
        assert [(o["name"], o["data_type"], o["dims"]) for o in config["output"]] == [
            ("y", "TYPE_FP32", [2]),
            ("tag_length", "TYPE_INT64", [1]),
        ]
        assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 2500
        assert config["instance_group"][0]["kind"] == "KIND_CPU"
    assert (await client.get("/v2/models/nope/config")).status == 404
    assert (await client.get("/v2/models/scale/versions/7/config")).status == 404


async def test_statistics_count_this_workers_inferences(make_client: MakeClient, scale_repo: Path) -> None:
    client: Client = await make_client(scale_repo)
    before = await (await client.get("/v2/models/scale/stats")).json()
    assert before["worker_pid"] == os.getpid()
    assert before["model_stats"][0]["execution_count"] == 0  # warmup runs before the batcher
    for _ in range(2):  # one after the other: two batches of 3 items
        assert (await client.post(V2_INFER, json=BODY)).status == 200
    after = await (await client.get("/v2/models/scale/versions/1/stats")).json()
    (stat,) = after["model_stats"]
    assert (stat["name"], stat["version"]) == ("scale", "1")
    assert (stat["inference_count"], stat["execution_count"]) == (6, 2)
    inference = stat["inference_stats"]
    assert inference["success"]["count"] == 2 and inference["fail"] == {"count": 0, "ns": 0}
    assert inference["compute_infer"]["count"] == 2 and inference["compute_infer"]["ns"] > 0
    assert inference["queue"]["count"] == 2
    assert inference["success"]["ns"] >= inference["compute_infer"]["ns"]
    assert {"compute_input", "compute_output", "cache_hit", "cache_miss"} <= set(inference)
    assert stat["last_inference"] > 0
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in stat["batch_stats"]] == [(3, 2)]
    every = await (await client.get("/v2/models/stats")).json()
    assert [s["name"] for s in every["model_stats"]] == ["scale"]
    assert (await client.get("/v2/models/nope/stats")).status == 404


def _stat(name: str, count: int, last: int, batches: dict[int, int]) -> dict[str, Any]:
    d = {"count": count, "ns": 10 * count}
    return {
        "name": name, "version": "1", "last_inference": last, "inference_count": 3 * count,
        "execution_count": count,
        "inference_stats": {k: dict(d) for k in ("success", "fail", "queue", "compute_infer")},
        "batch_stats": [
            {"batch_size": size, "compute_infer": {"count": n, "ns": 10 * n}} for size, n in batches.items()
        ],
        "memory_usage": [],
    }  # fmt: skip


def test_statistics_of_several_workers_sum_per_model_version() -> None:
    from app.protocols.triton import sum_statistics

    a = [_stat("scale", 2, 100, {3: 2}), _stat("other", 1, 50, {1: 1})]
    b = [_stat("scale", 5, 90, {3: 4, 8: 1})]
    (other, scale) = sum_statistics([a, b])
    assert other == a[1]  # a version one worker lacks counts what the others have
    assert (scale["inference_count"], scale["execution_count"], scale["last_inference"]) == (21, 7, 100)
    assert scale["inference_stats"]["success"] == {"count": 7, "ns": 70}
    assert [(x["batch_size"], x["compute_infer"]["count"]) for x in scale["batch_stats"]] == [(3, 6), (8, 1)]
    assert a[0]["inference_count"] == 6 and b[0]["batch_stats"][0]["compute_infer"]["count"] == 4  # unchanged


class CountingSiblings(Alone):
    """A sibling worker that has run the scale model 10 times in batches of 3."""

    async def statistics(self) -> list[list[dict[str, Any]]]:
        return [[_stat("scale", 10, 1, {3: 10})]]


async def test_statistics_are_the_servers_every_worker_summed(make_client: MakeClient, scale_repo: Path) -> None:
    """perf_analyzer subtracts two statistics answers that over HTTP may come from different
    workers: every worker answers the server's (its own plus its siblings'), HTTP and gRPC alike."""
    client: Client = await make_client(scale_repo, siblings=CountingSiblings())
    assert (await client.post(V2_INFER, json=BODY)).status == 200
    answer = await (await client.get("/v2/models/scale/stats")).json()
    assert answer["workers"] == 2 and answer["worker_pid"] == os.getpid()
    (stat,) = answer["model_stats"]
    assert (stat["inference_count"], stat["execution_count"]) == (30 + 3, 10 + 1)
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in stat["batch_stats"]] == [(3, 11)]
    every = await (await client.get("/v2/models/stats")).json()
    assert every["model_stats"] == answer["model_stats"]


async def test_statistics_count_a_missed_deadline_as_a_failure(make_client: MakeClient, tmp_path: Path) -> None:
    write_scale_model(tmp_path, "scale", delay_ms=300.0, max_queue_delay_ms=0.0)
    client: Client = await make_client(tmp_path)
    resp = await client.post(V2_INFER, json=BODY, headers={"X-Request-Timeout-Ms": "50"})
    assert resp.status == 504
    (stat,) = (await (await client.get("/v2/models/scale/stats")).json())["model_stats"]
    assert stat["inference_stats"]["fail"]["count"] == 1


async def test_repository_index_reports_loading_then_ready(make_client: MakeClient, tmp_path: Path) -> None:
    gate = threading.Event()
    ScaleHandler.GATES["index-test"] = gate
    write_scale_model(tmp_path, "scale", load_gate="index-test")
    client: Client = await make_client(tmp_path, wait=False)
    resp = await client.post("/v2/repository/index")
    assert await resp.json() == [{"name": "scale", "version": "1", "state": "LOADING", "reason": ""}]
    assert await (await client.post("/v2/repository/index", json={"ready": True})).json() == []
    gate.set()
    from tests.support.fixtures import wait_ready

    await wait_ready(client.app)
    index = await (await client.post("/v2/repository/index", json={"ready": True})).json()
    assert index == [{"name": "scale", "version": "1", "state": "READY", "reason": ""}]
    assert (await client.post("/v2/repository/index", data=b"{nope")).status == 400
    assert (await client.post("/v2/repository/index", json={"ready": "yes"})).status == 400


async def test_v1_root_liveness_is_open_like_the_other_probes(make_client: MakeClient, scale_repo: Path) -> None:
    client: Client = await make_client(scale_repo, api_keys="secret")
    assert (await client.get("/")).status == 200
    assert (await client.get("/v2/models/scale/config")).status == 401
    assert (await client.get("/v2/models/stats")).status == 401
    assert (await client.post("/v2/repository/index")).status == 401
    assert (await client.get("/v2/models/stats", headers={"X-API-Key": "secret"})).status == 200


async def test_v1_root_liveness_and_inputs_bodies(make_client: MakeClient, scale_repo: Path) -> None:
    client: Client = await make_client(scale_repo)
    resp = await client.get("/")
    assert resp.status == 200 and await resp.json() == {"status": "alive"}
    by_inputs = await client.post("/v1/models/scale:predict", json={"inputs": [[1, 2], [3, 4]]})
    by_instances = await client.post("/v1/models/scale:predict", json={"instances": [[1, 2], [3, 4]]})
    assert by_inputs.status == 200, await by_inputs.text()
    assert await by_inputs.json() == await by_instances.json()
    named = await client.post("/v1/models/scale:predict", json={"inputs": [{"x": [1, 1], "tag": "hey"}]})
    assert (await named.json())["predictions"] == [{"y": [2, 2], "tag_length": [3]}]
    both = await client.post("/v1/models/scale:predict", json={"inputs": [[1, 2]], "instances": [[1, 2]]})
    assert both.status == 400 and "not both" in (await both.json())["error"]


@pytest.fixture
async def v1_client(make_client: MakeClient, tmp_path: Path) -> Client:
    write_scale_model(tmp_path, "scale")
    client: Client = await make_client(tmp_path, max_items_per_request=64, max_json_depth=8)
    return client


@FUZZ
@given(body=v1_bodies(), key=st.sampled_from(["inputs", "both"]))
async def test_v1_inputs_bodies_never_5xx(v1_client: Client, body: dict[str, Any], key: str) -> None:
    """KServe V1 ``{"inputs": ...}`` (and both keys at once), fuzzed like ``instances``."""
    instances = body["instances"]
    payload = {"inputs": instances} if key == "inputs" else {"inputs": instances, "instances": instances}
    await check(v1_client, "/v1/models/scale:predict", json.dumps(payload).encode())
