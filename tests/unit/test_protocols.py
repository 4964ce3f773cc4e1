"""Both protocols in-process (pytest-aiohttp): happy paths, every bad input -> its 4xx, readiness."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from app.http.state import CORE
from tests.support.fixtures import Client, MakeClient, eventually, wait_ready
from tests.support.toy_models import ScaleHandler, TinyRanker, write_scale_model

V2_INFER = "/v2/models/scale/infer"


def v2_body(x: list[list[float]], **extra: Any) -> dict[str, Any]:
    return {
        "inputs": [{"name": "x", "shape": [len(x), 2], "datatype": "FP32", "data": x}],
        **extra,
    }


async def test_the_inference_routes_are_tried_first(make_client: MakeClient, scale_repo: Path) -> None:
    """aiohttp tries the resources under one static prefix in the order they were added: the
    inference POSTs go before the metadata, readiness, config and statistics routes, and a
    GET of those paths still resolves (405 with Allow), as do the routes behind them."""
    client = await make_client(scale_repo)
    order = [r.canonical for r in client.app.router.resources()]
    assert order[:3] == [
        "/v2/models/{name}/infer",
        "/v2/models/{name}/versions/{version}/infer",
        "/v1/models/{name}:predict",
    ]
    wrong_method = await client.get(V2_INFER)
    assert wrong_method.status == 405 and wrong_method.headers["Allow"] == "POST"
    assert (await client.get("/v2/models/stats")).status == 200
    assert (await client.get("/v2/models/scale")).status == 200
    assert (await client.post(V2_INFER, json=v2_body([[1.0, 2.0]]))).status == 200


async def test_v2_server_and_model_metadata(make_client: MakeClient, scale_repo: Path) -> None:
    client: Client = await make_client(scale_repo)
    meta = await (await client.get("/v2")).json()
    assert meta["name"] == "scoring-server" and meta["worker"]["device"] == "cpu"
    resp = await client.get("/v2/models/scale")
    assert resp.status == 200
    body = await resp.json()
    assert body["platform"] == "python_handler" and body["versions"] == ["1"]
    assert body["inputs"][0] == {"name": "x", "datatype": "FP32", "shape": [-1, 2]}
    assert (await client.get("/v2/models/scale/versions/1")).status == 200
    assert (await client.get("/v2/models/scale/ready")).status == 200
    assert (await client.get("/v2/models/scale/versions/1/ready")).status == 200
    assert (await client.get("/v2/health/live")).status == 200
    assert (await client.get("/v2/health/ready")).status == 200


async def test_v2_infer_flat_and_nested_data_echoes_id(make_client: MakeClient, scale_repo: Path) -> None:
    client: Client = await make_client(scale_repo)
    nested = await client.post(V2_INFER, json=v2_body([[1, 2], [3, 4]], id="req-7"))
    assert nested.status == 200, await nested.text()
    body = await nested.json()
    assert body["id"] == "req-7" and body["model_name"] == "scale" and body["model_version"] == "1"
    y = next(o for o in body["outputs"] if o["name"] == "y")
    assert y == {"name": "y", "datatype": "FP32", "shape": [2, 2], "data": [2, 4, 6, 8]}
    flat = {"inputs": [{"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    body2 = await (await client.post("/v2/models/scale/versions/1/infer", json=flat)).json()
    assert next(o for o in body2["outputs"] if o["name"] == "y")["data"] == [2, 4, 6, 8]
    assert "id" not in body2


async def test_v2_requested_outputs_and_bytes_input(make_client: MakeClient, scale_repo: Path) -> None:
    client: Client = await make_client(scale_repo)
    body = v2_body([[1, 1], [2, 2]], outputs=[{"name": "tag_length"}])
    body["inputs"].append({"name": "tag", "shape": [2], "datatype": "BYTES", "data": ["abc", "héllo"]})
    out = await (await client.post(V2_INFER, json=body)).json()
    assert [o["name"] for o in out["outputs"]] == ["tag_length"]
    assert out["outputs"][0]["data"] == [3, 6] and out["outputs"][0]["datatype"] == "INT64"


async def test_v1_models_and_predict(make_client: MakeClient, scale_repo: Path) -> None:
    client: Client = await make_client(scale_repo)
    assert await (await client.get("/v1/models")).json() == {"models": ["scale"]}
    assert await (await client.get("/v1/models/scale")).json() == {"name": "scale", "ready": True}
    resp = await client.post("/v1/models/scale:predict", json={"instances": [[1, 2], [3, 4]]})
    assert resp.status == 200, await resp.text()
    preds = (await resp.json())["predictions"]
    assert preds == [{"y": [2, 4], "tag_length": [0]}, {"y": [6, 8], "tag_length": [0]}]
    resp = await client.post("/v1/models/scale:predict", json={"instances": [{"x": [1, 1], "tag": "hey"}]})
    assert (await resp.json())["predictions"] == [{"y": [2, 2], "tag_length": [3]}]


@pytest.mark.parametrize(
    ("path", "payload", "status", "fragment"),
    [
        (V2_INFER, b"{not json", 400, "invalid inference request"),
        (V2_INFER, b'{"inputs": 3}', 400, "$.inputs"),
        (
            V2_INFER,
            {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "INT32", "data": [1, 2]}]},
            400,
            "expects FP32",
        ),
        (
            V2_INFER,
            {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]},
            400,
            "does not match [B, 2]",
        ),
        (
            V2_INFER,
            {"inputs": [{"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [1, 2, 3]}]},
            400,
            "needs 4 elements",
        ),
        (
            V2_INFER,
            {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": ["a", "b"]}]},
            400,
            "must be numbers",
        ),
        (
            V2_INFER,
            {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [[1], [2, 3]]}]},
            400,
            "ragged",
        ),
        (
            V2_INFER,
            {"inputs": [{"name": "z", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]},
            400,
            "unknown input",
        ),
        (V2_INFER, {"inputs": []}, 400, "missing required input"),
        (
            V2_INFER,
            {"inputs": [{"name": "x", "shape": [0, 2], "datatype": "FP32", "data": []}]},
            400,
            "batch dimension is 0",
        ),
        (
            V2_INFER,
            {"inputs": [{"name": "x", "shape": [-1, 2], "datatype": "FP32", "data": [1, 2]}]},
            400,
            "non-negative",
        ),
        (
            V2_INFER,
            b'{"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1e999, 0]}]}',
            400,
            "out of range",
        ),
        (
            V2_INFER,
            b'{"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1e39, 0]}]}',
            400,
            "NaN or infinity",
        ),
        (V2_INFER, {**v2_body([[1, 2]]), "outputs": [{"name": "nope"}]}, 400, "unknown output"),
        (V2_INFER, {**v2_body([[1, 2]]), "parameters": {"timeout": -5}}, 400, "parameters.timeout"),
        ("/v2/models/nope/infer", v2_body([[1, 2]]), 404, "model 'nope' not found"),
        ("/v2/models/scale/versions/9/infer", v2_body([[1, 2]]), 404, "no version '9'"),
        ("/v1/models/nope:predict", {"instances": [[1, 2]]}, 404, "not found"),
        ("/v1/models/scale:predict", {"instances": []}, 400, "empty"),
        ("/v1/models/scale:predict", {"instances": [[1, 2, 3]]}, 400, "does not match"),
        ("/v1/models/scale:predict", {"instances": [{"x": [1, 2]}, {"tag": "a"}]}, 400, "same inputs"),
        ("/v1/models/scale:predict", {"predictions": []}, 400, "instances"),
    ],
)
async def test_bad_input_gets_a_clear_4xx(
    make_client: MakeClient,
    scale_repo: Path,
    path: str,
    payload: bytes | dict[str, Any],
    status: int,
    fragment: str,
) -> None:
    client: Client = await make_client(scale_repo)
    if isinstance(payload, bytes):
        resp = await client.post(path, data=payload, headers={"Content-Type": "application/json"})
    else:
        resp = await client.post(path, json=payload)
    assert resp.status == status
    assert resp.content_type == "application/json"
    body = await resp.json()
    assert set(body) == {"error"} and fragment in body["error"], body
    assert resp.headers["X-Request-Id"]


async def test_wrong_content_type_is_415(make_client: MakeClient, scale_repo: Path) -> None:
    client: Client = await make_client(scale_repo)
    resp = await client.post(
        V2_INFER, data=b"x=1", headers={"Content-Type": "application/x-www-form-urlencoded"}
    )
    assert resp.status == 415
    assert "application/json" in (await resp.json())["error"]
    resp = await client.post(V2_INFER, data=b"x", headers={"Content-Type": "text/plain"})
    assert resp.status == 415


async def test_oversized_body_is_413(make_client: MakeClient, scale_repo: Path) -> None:
    client: Client = await make_client(scale_repo, max_request_bytes=4096)
    big = v2_body([[1.0, 2.0]] * 1000)
    resp = await client.post(V2_INFER, json=big)
    assert resp.status == 413
    assert "too large" in (await resp.json())["error"]


async def test_unknown_route_and_method_are_json(make_client: MakeClient, scale_repo: Path) -> None:
    client: Client = await make_client(scale_repo)
    resp = await client.get("/v3/nothing")
    assert resp.status == 404 and "error" in await resp.json()
    resp = await client.get(V2_INFER)
    assert resp.status == 405 and "error" in await resp.json()


async def test_request_id_is_accepted_and_echoed(make_client: MakeClient, scale_repo: Path) -> None:
    client: Client = await make_client(scale_repo)
    resp = await client.get("/v2/health/live", headers={"X-Request-Id": "abc-123"})
    assert resp.headers["X-Request-Id"] == "abc-123"
    resp = await client.get("/v2/health/live", headers={"X-Request-Id": "bad id\twith spaces"})
    assert resp.headers["X-Request-Id"] != "bad id\twith spaces"


async def test_model_failure_is_500_naming_model_and_request(make_client: MakeClient, tmp_path: Path) -> None:
    write_scale_model(tmp_path, "scale", fail_on=13.0)
    client: Client = await make_client(tmp_path)
    resp = await client.post(V2_INFER, json=v2_body([[13, 13]]), headers={"X-Request-Id": "r-13"})
    assert resp.status == 500
    error = (await resp.json())["error"]
    assert "scale" in error and "r-13" in error and "Traceback" not in error
    assert (await client.post(V2_INFER, json=v2_body([[1, 1]]))).status == 200


async def test_timeout_header_gives_504(make_client: MakeClient, tmp_path: Path) -> None:
    write_scale_model(tmp_path, "scale", delay_ms=300.0, max_queue_delay_ms=0.0)
    write_scale_model(tmp_path, "idle", delay_ms=300.0, max_queue_delay_ms=0.0)
    client: Client = await make_client(tmp_path)
    resp = await client.post(V2_INFER, json=v2_body([[1, 1]]), headers={"X-Request-Timeout-Ms": "50"})
    assert resp.status == 504
    # an idle model admits the next (one whose batch runs far past what its rate predicts
    # refuses it at once: tests/unit/test_limits.py::test_a_huge_client_deadline_is_clipped)
    idle = V2_INFER.replace("/scale/", "/idle/")
    resp = await client.post(idle, json=v2_body([[1, 1]], parameters={"timeout": 50_000}))
    assert resp.status == 504


async def test_readiness_is_503_until_warmup_then_200(make_client: MakeClient, tmp_path: Path) -> None:
    gate = threading.Event()
    ScaleHandler.GATES["ready-test"] = gate
    write_scale_model(tmp_path, "scale", load_gate="ready-test")
    client: Client = await make_client(tmp_path, wait=False)
    resp = await client.get("/v2/health/ready")
    assert resp.status == 503 and (await resp.json())["ready"] is False
    assert (await client.get("/v2/models/scale/ready")).status == 503
    assert (await client.get("/v1/models/scale")).status == 503
    short = await client.post(V2_INFER, json=v2_body([[1, 1]]), headers={"X-Request-Timeout-Ms": "50"})
    assert short.status == 503 and short.headers["Retry-After"] == "1"
    assert "not ready (loading)" in (await short.json())["error"]
    assert (await client.get("/v2/health/live")).status == 200
    # a request that arrives while the model loads waits for it (within its deadline)
    waiting = asyncio.ensure_future(client.post(V2_INFER, json=v2_body([[3, 4]])))
    in_flight = {"model": "scale", "version": "1"}
    server_metrics = client.app[CORE].metrics
    assert server_metrics is not None and server_metrics.registry is not None
    metrics = server_metrics.registry
    # until the request is in the handler, waiting for the model
    await eventually(lambda: metrics.get_sample_value("scoring_requests_in_flight", in_flight) == 1.0)
    assert not waiting.done()
    gate.set()
    resp = await waiting
    assert resp.status == 200 and (await resp.json())["outputs"][0]["data"] == [6, 8]
    await wait_ready(client.app)
    assert (await client.get("/v2/health/ready")).status == 200
    assert (await client.post(V2_INFER, json=v2_body([[1, 1]]))).status == 200


async def test_failed_model_load_keeps_readiness_503_with_the_error(make_client: MakeClient, tmp_path: Path) -> None:
    folder = write_scale_model(tmp_path, "scale")
    (folder / "model.toml").write_text(
        (folder / "model.toml").read_text().replace("tests.support.toy_models:ScaleHandler", "tests.support.toy_models:Nope")
    )
    client: Client = await make_client(tmp_path, wait=False)
    async def failed() -> dict[str, Any] | None:
        body: dict[str, Any] = await (await client.get("/v2/health/ready")).json()
        return body if "unavailable" in body else None

    body = await eventually(failed)
    assert body["ready"] is False and "cannot import handler" in body["unavailable"]["scale/1"]


@pytest.mark.parametrize("name", ["ranker-pt2", "ranker-ts"])
async def test_tensor_models_match_in_process_outputs(make_client: MakeClient, tensor_repo: Path, name: str) -> None:
    client: Client = await make_client(tensor_repo)
    features = np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)
    expected = TinyRanker().eval()(torch.from_numpy(features)).detach().numpy()
    body = {
        "inputs": [
            {"name": "features", "shape": [5, 4], "datatype": "FP32", "data": features.ravel().tolist()}
        ]
    }
    resp = await client.post(f"/v2/models/{name}/infer", json=body)
    assert resp.status == 200, await resp.text()
    out = (await resp.json())["outputs"][0]
    assert out["shape"] == [5, 1]
    np.testing.assert_allclose(np.array(out["data"]).reshape(5, 1), expected, rtol=1e-6, atol=1e-6)
    v1 = await client.post(f"/v1/models/{name}:predict", json={"instances": features.tolist()})
    preds = np.array((await v1.json())["predictions"])
    np.testing.assert_allclose(preds, expected, rtol=1e-6, atol=1e-6)
