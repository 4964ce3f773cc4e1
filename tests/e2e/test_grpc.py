"""gRPC end to end: real gunicorn with two workers sharing the gRPC port (SO_REUSEPORT), the
stock clients at their defaults (tritonclient.grpc, tritonclient.grpc.aio, kserve's
InferenceGRPCClient with raw and with typed contents), each in a process of its own
(``tests/support/grpc_clients.py``); every answer equals the V2 JSON path's. The gunicorn master
never loads grpc. A SIGTERM drains gRPC like HTTP."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from app.grpc.generated import grpc_service_pb2 as pb
from app.grpc.generated import grpc_service_pb2_grpc as pb_grpc
from app.settings import Settings
from tests.support.fixtures import DEMO_GROUP
from tests.support.gunicorn import ROOT, Gunicorn, wait_for
from tests.support.toy_models import write_scale_model

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group(DEMO_GROUP)]

MINILM = "all-MiniLM-L6-v2"
RANKER = "feed-ranker"
SENTENCES = ["A man is eating food.", "The stock market fell sharply today.", "héllo wörld"]
FEATURES = np.random.default_rng(7).normal(size=(4, 32)).astype(np.float32)
INPUTS = {
    RANKER: {"features": {"datatype": "FP32", "shape": [4, 32], "data": FEATURES.ravel().tolist()}},
    MINILM: {"text": {"datatype": "BYTES", "shape": [3, 1], "data": SENTENCES}},
}


@pytest.fixture
def ranker(demo_server: Gunicorn) -> Gunicorn:
    """The shared demo server (``tests.support.fixtures.demo_server``): 2 workers, both models."""
    return demo_server


@pytest.fixture
def minilm(demo_server: Gunicorn) -> Gunicorn:
    """The shared demo server, as the MiniLM's."""
    return demo_server


def json_outputs(server: Gunicorn, model: str) -> dict[str, np.ndarray]:
    """The reference: the plain V2 JSON path's outputs."""
    inputs = [{"name": n, **spec} for n, spec in INPUTS[model].items()]
    status, _, body = server.post(f"/v2/models/{model}/infer", {"inputs": inputs})
    assert status == 200, body
    return {o["name"]: np.array(o["data"], dtype=np.float32).reshape(o["shape"]) for o in body["outputs"]}


def call(client: str, server: Gunicorn, model: str, tmp: Path) -> dict[str, Any]:
    """Run ``tests/support/grpc_clients.py`` with ``client`` against ``server``; its JSON answer."""
    inputs = tmp / f"{model}.json"
    inputs.write_text(json.dumps(INPUTS[model]))
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.grpc_clients", client, server.grpc_url, model, str(inputs)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, f"{done.stderr[-4000:]}\n--- server log:\n{server.log()[-3000:]}"
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


def assert_same_outputs(answer: dict[str, Any], expected: dict[str, np.ndarray]) -> None:
    got = {n: np.array(o["data"], dtype=np.float32).reshape(o["shape"]) for n, o in answer["outputs"].items()}
    assert set(got) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("client", ["triton", "triton-aio", "kserve", "kserve-typed"])
def test_stock_clients_on_the_ranker(ranker: Gunicorn, tmp_path: Path, client: str) -> None:
    answer = call(client, ranker, RANKER, tmp_path)
    assert answer["live"] and answer["ready"] and answer["model_ready"]
    assert_same_outputs(answer, json_outputs(ranker, RANKER))
    if client == "triton":
        assert answer["id"] == "triton-1"
        assert answer["metadata_inputs"] == ["features", "user"] and set(answer["index"]) == {MINILM, RANKER}
        assert answer["stats_models"] == [RANKER]
    if client.startswith("triton"):
        assert answer["config_max_batch_size"] == 256
    if client == "kserve":
        assert answer["id"] == "ks-1"


def test_every_worker_listens_and_the_master_has_no_grpc(ranker: Gunicorn) -> None:
    workers = ranker.wait_workers(2)
    wait_for(
        lambda: all(f"worker {w.pid}: gRPC listening on {ranker.grpc_url}" in ranker.log() for w in workers),
        30, "every worker's gRPC listener", ranker,
    )  # fmt: skip
    master_maps = Path(f"/proc/{ranker.proc.pid}/maps").read_text()
    assert "cygrpc" not in master_maps  # grpcio's core, loaded by `import grpc`
    for worker in workers:
        assert "cygrpc" in Path(f"/proc/{worker.pid}/maps").read_text()
        # SCORING_GRPC_SERVERS (default 4) grpc.aio servers, each with its own listener on the port
        listening = [
            c for c in worker.connections("tcp") if c.status == "LISTEN" and c.laddr.port == ranker.grpc_port
        ]
        assert len(listening) == Settings().grpc_servers == 4
    assert "Traceback" not in ranker.log()


@pytest.mark.slow
@pytest.mark.parametrize("client", ["triton", "kserve"])
def test_stock_clients_on_minilm(minilm: Gunicorn, tmp_path: Path, client: str) -> None:
    answer = call(client, minilm, MINILM, tmp_path)
    assert answer["model_ready"]
    assert_same_outputs(answer, json_outputs(minilm, MINILM))


def scale_infer(x: float) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="scale")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 2]).contents.fp32_contents.extend([x, x])
    return request


def in_flight(srv: Gunicorn) -> float:
    status, _, text = srv.get("/metrics")
    assert status == 200
    for line in str(text).splitlines():
        if line.startswith("scoring_requests_in_flight{") and 'model="scale"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_sigterm_drain_unready_still_serving_in_flight_finishes(tmp_path: Path) -> None:
    """SIGTERM: ServerReady turns false while calls are still served on the open channel, the
    call in flight finishes, the worker exits cleanly and its replacement serves gRPC."""
    repo = tmp_path / "repo"
    write_scale_model(repo, "scale", hang_on=5.0, hang_s=1.5)
    env = {"SCORING_MODEL_REPOSITORY": str(repo), "SCORING_WORKERS": "1", "SCORING_DRAIN_GRACE_S": "2"}
    with Gunicorn(tmp_path, env) as srv, grpc.insecure_channel(srv.grpc_url) as channel:
        (first,) = srv.wait_workers(1)
        srv.wait_ready(60)
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        slow = stub.ModelInfer.future(scale_infer(5.0), timeout=30)
        wait_for(lambda: in_flight(srv) == 1.0, 10, "the slow call on the inference thread", srv)
        first.send_signal(signal.SIGTERM)
        wait_for(lambda: not stub.ServerReady(pb.ServerReadyRequest()).ready, 5, "gRPC readiness false", srv)
        assert list(stub.ModelInfer(scale_infer(1.0), timeout=10).outputs[0].contents.fp32_contents) == [
            2.0,
            2.0,
        ]
        assert list(slow.result(timeout=10).outputs[0].contents.fp32_contents) == [10.0, 10.0]
        first.wait(20)
        wait_for(
            lambda: len(srv.workers()) == 1 and srv.workers()[0].pid != first.pid, 30, "replacement", srv
        )
        srv.wait_ready(60)
        with grpc.insecure_channel(srv.grpc_url) as fresh:
            reply = pb_grpc.GRPCInferenceServiceStub(fresh).ModelInfer(scale_infer(1.0), timeout=10)
            assert list(reply.outputs[0].contents.fp32_contents) == [2.0, 2.0]
        assert "Traceback" not in srv.log()
