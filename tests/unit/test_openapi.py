"""The OpenAPI 3 document (app/openapi.json): valid, served, covering every route; and a
schemathesis run against a real gunicorn server with a fixed budget: no 5xx, no worker death,
worker memory flat."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from openapi_spec_validator import validate

from app.http.openapi import main as openapi_main
from app.http.openapi import render
from app.http.routes import OPENAPI
from tests.support.fixtures import Client, MakeClient
from tests.support.gunicorn import ROOT, Gunicorn
from tests.support.toy_models import write_scale_model

SPEC_PATH = ROOT / "app" / "openapi.json"


def spec() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(SPEC_PATH.read_text())
    return document


def test_document_is_valid_openapi_3() -> None:
    validate(spec())
    assert spec()["openapi"].startswith("3.")


def test_document_is_generated_from_the_code() -> None:
    """app/openapi.json is what ``python -m app.http.openapi`` writes (rerun it after a change)."""
    assert SPEC_PATH.read_bytes() == render()
    assert openapi_main(["--check"]) == 0


def validator(schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    """A validator for ``schema`` whose ``#/components/schemas/...`` references resolve in the spec."""
    return jsonschema.Draft202012Validator({**schema, "components": spec()["components"]})


async def test_real_answers_validate_against_their_documented_schemas(make_client: MakeClient, scale_repo: Path) -> None:
    """Every documented 200 JSON answer of the in-process app matches the schema generated from
    the msgspec types, so the types and the handlers cannot drift apart."""
    client: Client = await make_client(scale_repo)
    x = {"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [1, 2, 3, 4]}
    bodies = {
        "/v2/models/{name}/infer": {"inputs": [x], "id": "a"},
        "/v2/models/{name}/versions/{version}/infer": {"inputs": [x], "outputs": [{"name": "y"}]},
        "/v1/models/{name}:predict": {"instances": [[1, 2]]},
        "/v2/repository/index": {"ready": True},
    }
    await client.post("/v2/models/scale/infer", json={"inputs": [x]})  # so the stats have batches
    checked = 0
    for path, ops in spec()["paths"].items():
        for method, op in ops.items():
            content = op["responses"]["200"]["content"]
            if "application/json" not in content or path == "/openapi.json":
                continue
            url = path.replace("{name}", "scale").replace("{version}", "1")
            resp = await client.request(method.upper(), url, json=bodies.get(path))
            assert resp.status == 200, (path, await resp.text())
            body = await resp.json()
            errors = [e.message for e in validator(content["application/json"]["schema"]).iter_errors(body)]
            assert not errors, (path, errors, body)
            checked += 1
    assert checked == len(spec()["paths"]) - 2  # all but /metrics and /openapi.json


async def test_served_at_openapi_json_and_covers_every_route(make_client: MakeClient, scale_repo: Path) -> None:
    client: Client = await make_client(scale_repo)
    resp = await client.get("/openapi.json")
    assert resp.status == 200 and resp.content_type == "application/json"
    assert await resp.read() == OPENAPI == SPEC_PATH.read_bytes()
    documented = {(path, method.upper()) for path, ops in spec()["paths"].items() for method in ops}
    served = set()
    for resource in client.app.router.resources():
        path = re.sub(r"\{(\w+)(:[^}]*)?\}", r"{\1}", resource.canonical)
        for route in resource:
            if route.method != "HEAD":
                served.add((path, route.method))
    assert served == documented


@pytest.mark.e2e
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
        started = time.monotonic()
        cmd = [
            sys.executable, "-m", "schemathesis.cli", "--config-file", str(config),
            "run", str(spec_file), "--url", srv.url,
            "--checks", "not_a_server_error,status_code_conformance,content_type_conformance",
            "--max-examples", "25", "--seed", "20261121", "--generation-database", "none",
            "--phases", "examples,coverage,fuzzing", "--workers", "1", "--request-timeout", "10",
            "--no-color", "--suppress-health-check", "all",
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                              env={**os.environ, "SCHEMATHESIS_HOOKS": ""})  # fmt: skip
        elapsed = time.monotonic() - started
        assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
        assert elapsed < 60, elapsed
        assert {w.pid for w in srv.workers()} == set(rss_before), srv.log()[-4000:]
        for worker in workers:
            grown = worker.memory_info().rss - rss_before[worker.pid]
            assert grown < 64 * 2**20, (worker.pid, grown)
        assert srv.get("/v2/health/ready")[0] == 200
