"""One broken model never takes down what others are using, under gunicorn: a repository with a
good model beside models broken in every way an operator can break one serves the good one,
reports each broken one as unavailable with its reason (no absolute paths), and no worker
restarts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.gunicorn import Gunicorn
from tests.support.toy_models import assert_no_absolute_paths, write_broken_models, write_scale_model

pytestmark = pytest.mark.e2e

V2 = "/v2/models/{}/infer"
BODY = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1.0, 2.0]}]}


def test_under_gunicorn_no_worker_restarts_and_the_good_model_serves(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_scale_model(repo, "good")
    expected = write_broken_models(repo)
    # Lenient readiness: ready with the broken models reported unavailable (the default is strict).
    env = {"SCORING_MODEL_REPOSITORY": str(repo), "SCORING_WORKERS": "2", "SCORING_STRICT_READINESS": "false"}
    with Gunicorn(tmp_path, env) as srv:
        srv.wait_ready(120, count=2)
        first = {w.pid for w in srv.workers()}
        status, _, body = srv.get("/v2/health/ready")
        assert status == 200 and set(body["unavailable"]) == set(expected), body
        for _ in range(20):
            status, _, out = srv.post(V2.format("good"), BODY)
            assert status == 200 and out["outputs"][0]["data"] == [2.0, 4.0]
        status, _, error = srv.post(V2.format("missing-weights"), BODY)
        assert status == 503 and "not found" in error["error"]
        assert_no_absolute_paths(json.dumps(body) + json.dumps(error), repo)
        assert {w.pid for w in srv.workers()} == first  # nobody exited, nobody was replaced
        assert "exited with code" not in srv.log()
