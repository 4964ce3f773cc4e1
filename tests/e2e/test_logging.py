"""Logs on a real gunicorn, in text and JSON: the access line with the request id and latency,
and the workers' boot lines."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.gunicorn import Gunicorn, wait_for
from tests.support.toy_models import write_scale_model

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=["text", "json"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gunicorn]:
    tmp = tmp_path_factory.mktemp(f"logging_{request.param}")
    write_scale_model(tmp / "repo", "scale")
    env = {
        "SCORING_MODEL_REPOSITORY": str(tmp / "repo"),
        "SCORING_WORKERS": "1",
        "SCORING_LOG_FORMAT": request.param,
    }
    with Gunicorn(tmp, env) as srv:
        srv.wait_ready()
        yield srv


def log_line(server: Gunicorn, needle: str, timeout_s: float = 10.0) -> str:
    """The first log line containing ``needle``, polling the log file until it appears."""

    def line() -> str | None:
        return next((x for x in server.log().splitlines() if needle in x), None)

    return wait_for(line, timeout_s, f"a log line with {needle!r}", server)


def model_seconds(server: Gunicorn, pid: int) -> tuple[float, float]:
    """(load, warmup) seconds of the scale model in worker ``pid``, from ``/metrics``."""
    status, _, text = server.get("/metrics")
    assert status == 200, text
    found = {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("pid") == str(pid) and s.labels.get("model") == "scale"
    }
    return found["scoring_model_load_seconds"], found["scoring_model_warmup_seconds"]


def is_json_mode(server: Gunicorn) -> bool:
    return server.log().lstrip().startswith("{")


def test_request_id_is_echoed_and_in_the_access_line_with_latency(server: Gunicorn) -> None:
    rid = f"it-{server.port}-42"
    body = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}
    status, headers, _ = server.post("/v2/models/scale/infer", body, headers={"X-Request-Id": rid})
    assert status == 200 and headers["X-Request-Id"] == rid
    assert re.fullmatch(r"app;dur=\d+\.\d{3}", headers["Server-Timing"])
    line = log_line(server, rid)
    if is_json_mode(server):
        out = json.loads(line)
        assert out["logger"] == "gunicorn.access" and out["request_id"] == rid
        assert out["request"] == "POST /v2/models/scale/infer HTTP/1.1" and out["status"] == 200
        assert isinstance(out["latency_s"], float) and out["duration_ms"] > 0
    else:
        pattern = rf'\[ACCESS\] 127\.0\.0\.1 "POST /v2/models/scale/infer HTTP/1\.1" 200 \d+ \d+\.\d{{6}} rid={rid} app;dur=\d+\.\d{{3}}$'
        assert re.search(pattern, line), line
    # A generated id is echoed and logged too.
    status, headers, _ = server.get("/v2/health/live")
    assert status == 200 and re.fullmatch(r"[0-9a-f]{32}", headers["X-Request-Id"])
    log_line(server, headers["X-Request-Id"])


def test_each_worker_logs_its_binding_and_model_times_at_boot(server: Gunicorn) -> None:
    (worker,) = server.wait_workers(1)
    line = log_line(server, f"worker {worker.pid} ready")
    if is_json_mode(server):
        out = json.loads(line)
        assert out["event"] == "worker_ready" and out["pid"] == worker.pid
        assert out["binding"]["device"] == "cpu"
        (model,) = out["models"]
        load_s, warmup_s = model_seconds(server, worker.pid)  # the same figures, to the ms
        assert (model["model"], model["load_s"], model["warmup_s"]) == ("scale", round(load_s, 3), round(warmup_s, 3))
        lines = [json.loads(raw) for raw in server.log().splitlines() if raw.strip()]  # all JSON
        assert {"gunicorn.error", "gunicorn.access", "app.serving.lifecycle"} <= {x["logger"] for x in lines}
    else:
        assert "app.serving.boot: worker" in line and "'device': 'cpu'" in line and "'load_s'" in line
        assert "app.serving.lifecycle: model scale v1 ready" in log_line(server, "model scale v1 ready")
