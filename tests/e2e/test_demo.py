"""The demo repository end to end: all-MiniLM-L6-v2 under gunicorn with 2 workers (the shared
demo server)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.support.fixtures import DEMO_GROUP
from tests.support.gunicorn import ROOT, Gunicorn

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group(DEMO_GROUP)]

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The stock market fell sharply today.",
]


@pytest.fixture
def demo(demo_server: Gunicorn) -> Gunicorn:
    """The shared demo server (``tests.support.fixtures.demo_server``)."""
    return demo_server


def test_v2_embeddings_rank_related_above_unrelated(demo: Gunicorn) -> None:
    body = {
        "id": "demo-1",
        "inputs": [{"name": "text", "shape": [3], "datatype": "BYTES", "data": SENTENCES}],
        "outputs": [{"name": "embedding"}],
    }
    status, _, out = demo.post("/v2/models/all-MiniLM-L6-v2/infer", body)
    assert status == 200, out
    (emb,) = out["outputs"]
    assert emb["shape"] == [3, 384] and emb["datatype"] == "FP32"
    e = np.array(emb["data"], dtype=np.float32).reshape(3, 384)
    cos = e @ e.T / np.outer(np.linalg.norm(e, axis=1), np.linalg.norm(e, axis=1))
    assert cos[0, 1] > 0.5 > cos[0, 2]
    status, _, v1 = demo.post("/v1/models/all-MiniLM-L6-v2:predict", {"instances": SENTENCES})
    assert status == 200, v1
    v1_emb = np.array([p["embedding"] for p in v1["predictions"]], dtype=np.float32)
    np.testing.assert_allclose(v1_emb, e, atol=1e-5)


def test_relevance_score_for_query_candidate_pairs(demo: Gunicorn) -> None:
    query = "I like cooking and good food"
    body = {
        "inputs": [
            {"name": "text", "shape": [3, 1], "datatype": "BYTES", "data": SENTENCES},
            {"name": "query", "shape": [3, 1], "datatype": "BYTES", "data": [query] * 3},
        ],
        "outputs": [{"name": "score"}],
    }
    status, _, out = demo.post("/v2/models/all-MiniLM-L6-v2/infer", body)
    assert status == 200, out
    scores = out["outputs"][0]["data"]
    assert out["outputs"][0]["shape"] == [3, 1]
    assert scores[0] > scores[2] and scores[1] > scores[2]


def test_metadata_names_the_handler_platform(demo: Gunicorn) -> None:
    status, _, meta = demo.get("/v2/models/all-MiniLM-L6-v2")
    assert status == 200
    assert meta["platform"] == "python_handler"
    outputs = {o["name"]: (o["datatype"], o["shape"]) for o in meta["outputs"]}
    assert outputs == {
        "embedding": ("FP32", [-1, 384]),
        "score": ("FP32", [-1, 1]),
        "tokens": ("INT64", [-1, 1]),
        "windows": ("INT64", [-1, 1]),
    }
    assert Path(ROOT / "model_repository" / "all-MiniLM-L6-v2" / "model.toml").is_file()


def test_statistics_are_the_servers_whichever_worker_answers(demo: Gunicorn) -> None:
    """Triton's statistics are the server's, as perf_analyzer reads them (two answers, before and
    after a window, from whichever worker its connection reaches): each worker adds its
    siblings' statistics to its own."""
    path = "/v2/models/all-MiniLM-L6-v2/stats"
    assert len(demo.wait_workers(2)) == 2
    before = demo.get(path)[2]["model_stats"][0]["inference_count"]
    body = {"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": SENTENCES[:2]}]}
    for _ in range(10):  # each on a new connection: the workers take them as they balance
        assert demo.post("/v2/models/all-MiniLM-L6-v2/infer", body)[0] == 200
    answers = [demo.get(path)[2] for _ in range(6)]
    assert {a["workers"] for a in answers} == {2}
    assert {a["model_stats"][0]["inference_count"] - before for a in answers} == {20}
    assert {a["worker_pid"] for a in answers} <= {w.pid for w in demo.workers()}
