"""Logs: the JSON formatter and gunicorn log config, and on a real gunicorn the access line
with the request id and latency, and the workers' boot lines, in text and JSON."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gunicorn.glogging import CONFIG_DEFAULTS
from prometheus_client.parser import text_string_to_metric_families

from app.observability.logconfig import JsonFormatter, log_config
from tests.support.gunicorn import ROOT, Gunicorn, wait_for
from tests.support.toy_models import write_scale_model


def record(name: str, msg: str, *args: Any, **extra: Any) -> logging.LogRecord:
    rec = logging.LogRecord(name, logging.INFO, __file__, 1, msg, args, None)
    rec.__dict__.update(extra)
    return rec


def test_json_formatter_writes_one_object_with_extras() -> None:
    line = JsonFormatter().format(record("app.serving.lifecycle", "worker %d ready", 7, event="worker_ready", models=[{"a": 1}]))
    out = json.loads(line)
    assert out["message"] == "worker 7 ready" and out["logger"] == "app.serving.lifecycle" and out["level"] == "INFO"
    assert out["event"] == "worker_ready" and out["models"] == [{"a": 1}]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", out["ts"])
    assert "\n" not in line


def test_json_formatter_names_and_types_the_access_atoms() -> None:
    # What aiohttp's AccessLogger passes as extra= for gunicorn.conf.py's access_log_format.
    rec = record(
        "gunicorn.access",
        '127.0.0.1 "GET /v2 HTTP/1.1" 200 326 0.001000 rid=abc app;dur=0.412',
        remote_address="127.0.0.1",
        first_request_line="GET /v2 HTTP/1.1",
        response_status="200",
        response_size="326",
        request_time_frac="0.001000",
        response_header={"X-Request-Id": "abc", "Server-Timing": "app;dur=0.412"},
    )
    out = json.loads(JsonFormatter().format(rec))
    assert out["remote"] == "127.0.0.1" and out["request"] == "GET /v2 HTTP/1.1"
    assert out["status"] == 200 and out["bytes"] == 326 and out["latency_s"] == 0.001
    assert out["request_id"] == "abc" and out["duration_ms"] == 0.412


def test_json_formatter_keeps_tracebacks_on_one_line() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        rec = logging.LogRecord("app", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    line = JsonFormatter().format(rec)
    assert "\n" not in line and "ValueError: boom" in json.loads(line)["exc_info"]


def test_log_config_merges_gunicorn_defaults() -> None:
    before = json.dumps(CONFIG_DEFAULTS, sort_keys=True)
    config = log_config("json", "debug", "/var/log/access.log")
    assert json.dumps(CONFIG_DEFAULTS, sort_keys=True) == before  # not mutated
    assert config["disable_existing_loggers"] is False and config["version"] == 1
    assert {"console", "error_console", "access"} <= set(config["handlers"])
    for name in ("gunicorn.error", "app", "gpu_stat"):
        assert config["loggers"][name]["level"] == "DEBUG"
        assert config["loggers"][name]["handlers"] == ["error_console"]
    assert config["handlers"]["access"]["filename"] == "/var/log/access.log"
    assert config["handlers"]["access"]["formatter"] == "json"
    text = log_config("text", "info", "-")
    assert text["handlers"]["access"]["stream"] == "ext://sys.stdout"
    assert text["handlers"]["error_console"]["formatter"] == "text"


# --- real gunicorn ----------------------------------------------------------------------------


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


@pytest.mark.e2e
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


@pytest.mark.e2e
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
        assert "app.serving.lifecycle: worker" in line and "'device': 'cpu'" in line and "'load_s'" in line
        assert "app.serving.lifecycle: model ready" in log_line(server, "model ready")


def test_log_config_works_with_dict_config(tmp_path: Path) -> None:
    """In a child process: dictConfig is process-global."""
    code = f"""
import logging, logging.config
from app.observability.logconfig import log_config
logging.config.dictConfig(log_config("json", "info", {str(tmp_path / "access.log")!r}))
logging.getLogger("gunicorn.access").info("hello", extra={{"response_status": "201"}})
logging.getLogger("app.serving.lifecycle").debug("hidden")
logging.getLogger("app.serving.lifecycle").info("shown")
logging.getLogger("torch").info("library info is dropped")
logging.getLogger("torch").warning("library warning")
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    written = json.loads((tmp_path / "access.log").read_text())
    assert written["status"] == 201 and written["message"] == "hello"
    messages = [json.loads(line)["message"] for line in done.stderr.splitlines()]
    assert messages == ["shown", "library warning"]
