"""End to end: real gunicorn processes on 127.0.0.1 serving a model repository."""

from __future__ import annotations

import contextlib
import http.client
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.support.gunicorn import Gunicorn, wait_for
from tests.support.toy_models import TinyRanker, write_scale_model, write_tensor_model

BODY = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1.0, 2.0]}]}

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("e2e_repo")
    write_tensor_model(repo, "ranker-pt2", "torch_export")
    write_tensor_model(repo, "ranker-ts", "torchscript")
    write_scale_model(repo, "scale")
    return repo


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gunicorn]:
    tmp = tmp_path_factory.mktemp("e2e_server")
    with Gunicorn(tmp, {"SCORING_MODEL_REPOSITORY": str(repo), "SCORING_WORKERS": "2"}) as srv:
        srv.wait_ready()
        yield srv


def test_two_workers_serve_and_master_never_loads_torch(server: Gunicorn) -> None:
    workers = server.wait_workers(2)
    master_maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
    assert "libtorch" not in master_maps and "libcuda" not in master_maps
    pids = set()
    for _ in range(40):
        status, _, body = server.get("/v2")
        assert status == 200
        pids.add(body["worker"]["pid"])
    assert pids <= {w.pid for w in workers}
    assert any("libtorch" in Path(f"/proc/{w.pid}/maps").read_text() for w in workers)


@pytest.mark.parametrize("name", ["ranker-pt2", "ranker-ts"])
def test_tensor_models_match_in_process(server: Gunicorn, name: str) -> None:
    features = np.random.default_rng(1).normal(size=(7, 4)).astype(np.float32)
    expected = TinyRanker().eval()(torch.from_numpy(features)).detach().numpy()
    body = {
        "id": "e2e-1",
        "inputs": [{"name": "features", "shape": [7, 4], "datatype": "FP32", "data": features.tolist()}],
    }
    status, headers, out = server.post(f"/v2/models/{name}/infer", body)
    assert status == 200, out
    assert out["id"] == "e2e-1" and headers["X-Request-Id"]
    got = np.array(out["outputs"][0]["data"], dtype=np.float32).reshape(7, 1)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    status, _, v1 = server.post(f"/v1/models/{name}:predict", {"instances": features.tolist()})
    assert status == 200
    np.testing.assert_allclose(np.array(v1["predictions"]), expected, rtol=1e-6, atol=1e-6)


def test_v1_listing_and_metadata(server: Gunicorn) -> None:
    assert server.get("/v1/models")[2] == {"models": ["ranker-pt2", "ranker-ts", "scale"]}
    status, _, meta = server.get("/v2/models/ranker-pt2")
    assert status == 200 and meta["platform"] == "pytorch_torch_export"
    assert meta["inputs"] == [{"name": "features", "datatype": "FP32", "shape": [-1, 4]}]


def post_answered_early(server: Gunicorn, path: str, body: bytes) -> int:
    """POST ``body`` and return the status the server answered, also when it answered before the
    whole body was sent and closed the connection (no lingering close: ``app.http.edge``),
    so that the rest of the upload met a reset: the answer is read after the failed send, as
    curl does."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            conn.request("POST", path, body, {"Content-Type": "application/json"})
        return conn.getresponse().status
    finally:
        conn.close()


def test_bad_inputs_are_4xx_on_the_real_server(server: Gunicorn) -> None:
    status, _, body = server.post("/v2/models/ranker-pt2/infer", b"{oops")
    assert status == 400 and "invalid inference request" in body["error"]
    status, _, body = server.post("/v2/models/missing/infer", {"inputs": []})
    assert status == 404
    status, _, body = server.post(
        "/v2/models/ranker-pt2/infer", b"a=b", headers={"Content-Type": "text/plain"}
    )
    assert status == 415
    assert post_answered_early(server, "/v2/models/ranker-pt2/infer", b"[" * 20_000_000) == 413
    assert server.get("/v2/health/ready")[0] == 200  # and nobody died
    assert len(server.workers()) == 2


def test_stock_open_inference_protocol_client(server: Gunicorn) -> None:
    httpclient = pytest.importorskip("tritonclient.http")
    client = httpclient.InferenceServerClient(url=f"127.0.0.1:{server.port}")
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("ranker-pt2")
    meta = client.get_model_metadata("ranker-pt2")
    assert meta["inputs"][0]["shape"] == [-1, 4]
    features = np.random.default_rng(2).normal(size=(3, 4)).astype(np.float32)
    tensor = httpclient.InferInput("features", [3, 4], "FP32")
    tensor.set_data_from_numpy(features, binary_data=False)
    wanted = httpclient.InferRequestedOutput("probability", binary_data=False)
    result = client.infer("ranker-pt2", [tensor], outputs=[wanted], request_id="triton-1")
    expected = TinyRanker().eval()(torch.from_numpy(features)).detach().numpy()
    np.testing.assert_allclose(result.as_numpy("probability"), expected, rtol=1e-6, atol=1e-6)
    assert result.get_response()["id"] == "triton-1"
    text = httpclient.InferInput("x", [1, 2], "FP32")
    text.set_data_from_numpy(np.ones((1, 2), np.float32), binary_data=False)
    tag = httpclient.InferInput("tag", [1, 1], "BYTES")
    tag.set_data_from_numpy(np.array([["héllo".encode()]], dtype=object), binary_data=False)
    result = client.infer("scale", [text, tag])
    assert result.as_numpy("tag_length").tolist() == [[6]]
    client.close()


def test_readiness_is_503_until_warmup_on_gunicorn(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_scale_model(repo, "slow", load_delay_s=2.0)
    with Gunicorn(tmp_path, {"SCORING_MODEL_REPOSITORY": str(repo), "SCORING_WORKERS": "1"}) as srv:
        seen: list[int] = []

        def ready() -> bool:
            with contextlib.suppress(OSError):  # not listening yet
                seen.append(srv.get("/v2/health/ready", timeout=5)[0])
            return seen[-1:] == [200]

        wait_for(ready, 60, "readiness 200", srv)
        assert 503 in seen, (seen, srv.log())
        assert seen.index(200) > seen.index(503)
        assert srv.get("/v2/health/live")[0] == 200


def test_a_model_that_cannot_load_leaves_the_worker_up_retrying_until_it_can(tmp_path: Path) -> None:
    """The only model fails to load: the worker stays (no exit, no restart loop), readiness is
    503 with the reason, and once the cause is gone its retry makes the same worker ready."""
    repo = tmp_path / "repo"
    marker = tmp_path / "break-the-model"
    marker.touch()
    write_scale_model(repo, "scale", fail_load_if_exists=str(marker))
    with Gunicorn(tmp_path, {"SCORING_MODEL_REPOSITORY": str(repo), "SCORING_WORKERS": "1"}) as srv:
        worker = srv.wait_workers(1)[0].pid

        def unready_with_reason() -> dict[str, Any] | None:
            try:
                status, _, body = srv.get("/v2/health/ready", timeout=5)
            except OSError:
                return None
            return body if status == 503 and "unavailable" in body else None

        body = wait_for(unready_with_reason, 60, "readiness 503 naming the model", srv)
        assert "simulated load failure" in body["unavailable"]["scale/1"]
        status, _, error = srv.post("/v2/models/scale/infer", BODY)
        assert status == 503 and "unavailable" in error["error"]
        marker.unlink()
        wait_for(lambda: srv.get("/v2/health/ready")[0] == 200, 60, "the retried load", srv)
        assert [w.pid for w in srv.workers()] == [worker] and "exited with code" not in srv.log()
        assert srv.post("/v2/models/scale/infer", BODY)[0] == 200
