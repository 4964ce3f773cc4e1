"""A schemathesis run from the OpenAPI 3 document (app/openapi.json) against a real gunicorn
server with a fixed budget: no 5xx, no worker death, worker memory flat."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.gunicorn import Gunicorn
from tests.support.openapi import spec
from tests.support.toy_models import write_scale_model

pytestmark = pytest.mark.e2e


def test_schemathesis_against_gunicorn_finds_no_5xx_and_no_worker_dies(tmp_path: Path) -> None:
    pytest.importorskip("schemathesis")
    repo = tmp_path / "repo"
    write_scale_model(repo, "scale")
    # The served document is generic; point the fuzzer at the model this server has (it
    # still generates other names in negative mode), with a valid request as the example.
    doc = spec()
    x = {"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [1, 2, 3, 4]}
    examples = {"InferenceRequest": {"inputs": [x]}, "PredictRequest": {"instances": [[1, 2], [3, 4]]}}
    for name, example in examples.items():
        doc["components"]["schemas"][name]["example"] = example
    for ops in doc["paths"].values():
        for op in ops.values():
            for param in op.get("parameters", []):
                if param["in"] == "path" and param["name"] == "name":
                    param["schema"] = {"type": "string", "enum": ["scale"]}
                elif param["in"] == "path" and param["name"] == "version":
                    param["schema"] = {"type": "string", "enum": ["1"]}
    spec_file = tmp_path / "openapi.json"
    spec_file.write_text(json.dumps(doc))
    # 503 and 504 answer the request's own deadline (X-Request-Timeout-Ms: 5e-324 is a valid
    # header) or overload; any other 5xx is a bug.
    config = tmp_path / "schemathesis.toml"
    config.write_text(
        '[checks.not_a_server_error]\nexpected-statuses = ["1xx", "2xx", "3xx", "4xx", "503", "504"]\n'
    )
    env = {"SCORING_MODEL_REPOSITORY": str(repo), "SCORING_WORKERS": "2", "SCORING_ACCESS_LOG": ""}
    with Gunicorn(tmp_path, env) as srv:
        srv.wait_ready()
        workers = srv.wait_workers(2)
        for _ in range(50):  # warm both workers up before measuring memory
            srv.post(
                "/v2/models/scale/infer",
                {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]},
            )
        rss_before = {w.pid: w.memory_info().rss for w in workers}
        cmd = [
            sys.executable, "-m", "schemathesis.cli", "--config-file", str(config),
            "run", str(spec_file), "--url", srv.url,
            "--checks", "not_a_server_error,status_code_conformance,content_type_conformance",
            "--max-examples", "25", "--seed", "20261121", "--generation-database", "none",
            "--phases", "examples,coverage,fuzzing", "--workers", "1", "--request-timeout", "10",
            "--no-color", "--suppress-health-check", "all",
        ]  # fmt: skip
        # A hung request fails its own check (--request-timeout); the whole run's time is not
        # held to a bound (it shares the CPU with the other tests), only kept finite.
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path,
                              env={**os.environ, "SCHEMATHESIS_HOOKS": ""})  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
        assert {w.pid for w in srv.workers()} == set(rss_before), srv.log()[-4000:]
        for worker in workers:
            grown = worker.memory_info().rss - rss_before[worker.pid]
            assert grown < 64 * 2**20, (worker.pid, grown)
        assert srv.get("/v2/health/ready")[0] == 200
