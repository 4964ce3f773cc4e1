"""The OpenAPI 3 document (app/openapi.json) against the in-process app: every documented
answer validates against its schema, and it is served and covers every route. That the file is
valid and current: tests/deploy/test_openapi.py; schemathesis against real gunicorn:
tests/e2e/test_openapi.py."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema

from app.http.routes import OPENAPI
from tests.support.decoder_models import write_causal_lm
from tests.support.fixtures import Client, MakeClient
from tests.support.model_toml import write_model
from tests.support.openapi import SPEC_PATH, spec
from tests.support.retrieval_models import sparse_model, write_splade_folder
from tests.support.text_models import write_classifier_model
from tests.support.toy_models import write_embed_model


def validator(schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    """A validator for ``schema`` whose ``#/components/schemas/...`` references resolve in the spec."""
    return jsonschema.Draft202012Validator({**schema, "components": spec()["components"]})


async def test_real_answers_validate_against_their_documented_schemas(
    make_client: MakeClient, scale_repo: Path, decoder_models: dict[str, Path]
) -> None:
    """Every documented 200 JSON answer of the in-process app matches the schema generated from
    the msgspec types, so the types and the handlers cannot drift apart."""
    write_embed_model(scale_repo)
    write_classifier_model(scale_repo, "clf", ["ok", "spam"])
    write_causal_lm(scale_repo, "lm", decoder_models["gpt2-lm"])
    write_model(scale_repo, sparse_model(), write_splade_folder)
    client: Client = await make_client(scale_repo, model_control_mode="explicit")
    x = {"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [1, 2, 3, 4]}
    bodies = {
        "/v2/models/{name}/infer": {"inputs": [x], "id": "a"},
        "/v2/models/{name}/versions/{version}/infer": {"inputs": [x], "outputs": [{"name": "y"}]},
        "/v1/models/{name}:predict": {"instances": [[1, 2]]},
        "/v2/repository/index": {"ready": True},
        "/v1/embeddings": {"model": "embed", "input": ["a text", "another"]},
        "/v1/rerank": {"model": "clf", "query": "q", "documents": ["a", "b"], "return_documents": True},
        "/v2/rerank": {"model": "clf", "query": "q", "documents": ["a", "b"], "top_n": 1},
        "/v1/classify": {"model": "clf", "input": ["a text", "another"]},
        "/embed_sparse": {"model": "sparse", "inputs": ["a text", "another"], "top_k": 5},
        "/score": {"model": "clf", "text_1": "q", "text_2": ["a", "b"]},
        "/v1/score": {"model": "clf", "text_1": ["q", "r"], "text_2": ["a", "b"]},
        "/v1/completions": {
            "model": "lm",
            "prompt": ["a", "b c"],
            "echo": True,
            "max_tokens": 0,
            "logprobs": 2,
        },
    }
    await client.post("/v2/models/scale/infer", json={"inputs": [x]})  # so the stats have batches
    checked = 0
    # the model's unload last: every other call needs it loaded
    for path, ops in sorted(spec()["paths"].items(), key=lambda item: item[0].endswith("/unload")):
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
