"""Logs: the JSON formatter and gunicorn log config. On a real gunicorn (the access line, the
workers' boot lines): tests/e2e/test_logging.py."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from gunicorn.glogging import CONFIG_DEFAULTS

from app.observability.logconfig import JsonFormatter, log_config
from tests.support.gunicorn import ROOT


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
