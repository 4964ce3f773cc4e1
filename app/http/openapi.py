"""Generates ``app/openapi.json``, the OpenAPI 3.1 description served at ``GET /openapi.json``.

The inference operations come from the APIs' declarations (``app.protocols.apis.APIS``: paths,
operation, request and answer types, error shape); the component schemas from the msgspec types
the server decodes and answers with (theirs and :mod:`app.protocols.schemas`) through
``msgspec.json.schema_components``; what is kept by hand is the table of the other operations
and of error descriptions in :mod:`app.http.openapi_operations`. Regenerate after changing a
route or a type::

    python -m app.http.openapi          # rewrite app/openapi.json
    python -m app.http.openapi --check  # exit 1 if the file is out of date (tests run this)
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
from pathlib import Path
from typing import Any

import msgspec

from app import SERVER_NAME, __version__
from app.http.openapi_operations import ERRORS, INFER_ERRORS, OPERATIONS, PARAMS, REF, TYPES, Op
from app.protocols.apis import APIS
from app.protocols.codec import PLAIN_ERRORS, Api
from app.protocols.v2 import HEADER_LENGTH

PATH = Path(__file__).resolve().parent.parent / "openapi.json"

DESCRIPTION = (
    "Multi-GPU PyTorch model scoring server: the Open Inference Protocol (KServe V2) REST API with "
    "Triton's binary tensor data, model configuration, statistics and model repository (index) "
    "extensions, KServe V1, OpenAI's embeddings, Cohere's rerank and vLLM's classify APIs, plus "
    "Prometheus metrics. Every response carries X-Request-Id. Errors are "
    '{"error": "..."}, in OpenAI\'s shape on the OpenAI-style APIs. With API keys configured '
    "(SCORING_API_KEYS / SCORING_API_KEYS_FILE) every "
    "operation but the health probes (and /metrics when SCORING_METRICS_AUTH=false) needs a key. "
    "Limits (docs/reliability.md): body size (413), items per request (413), bytes per string (413), "
    "JSON depth (400), header fields (431). Protocol decisions: docs/protocols.md."
)


def _schema(ref: str | dict[str, Any]) -> dict[str, Any]:
    return {"$ref": REF.format(name=ref)} if isinstance(ref, str) else ref


def _content(kind: Any) -> dict[str, Any]:
    """A response body's JSON content: a reference to a msgspec struct's schema, or, for an
    answer that is no struct (TEI's bare array of sparse vectors), its schema inline."""
    if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
        return _json(kind.__name__)
    (schema,), _ = msgspec.json.schema_components([kind], ref_template=REF)
    return {"application/json": {"schema": schema}}


def _json(ref: str | dict[str, Any], content_type: str = "application/json") -> dict[str, Any]:
    return {content_type: {"schema": _schema(ref)}}


#: The binary alternative of an inference body or answer (Triton's binary tensor data).
_BINARY = {"type": "string", "format": "binary"}


def _operation(op: Op) -> dict[str, Any]:
    """One operation of the hand-kept table."""
    params = [PARAMS[p] for p in ("name", "version") if "{" + p + "}" in op.path]
    if op.content_type == "application/json" and op.path != "/openapi.json":
        params.append(PARAMS["request_id"])
    ok_schema, ok_text = op.ok
    ok = {"description": ok_text, "content": _json(ok_schema, op.content_type)}
    responses: dict[str, Any] = {"200": ok}
    if op.unavailable:
        responses["503"] = {"description": "Not ready, stuck or draining.", "content": _json(op.unavailable)}
    for name in op.errors:
        responses[ERRORS[name][0]] = {"$ref": f"#/components/responses/{name}"}
    result: dict[str, Any] = {"summary": op.summary, "operationId": op.op_id, "tags": [op.tag]}
    if params:
        result["parameters"] = params
    if op.open:
        result["security"] = []
    result["responses"] = dict(sorted(responses.items()))
    if op.body:
        result["requestBody"] = {"required": not op.path.endswith("index"), "content": _json(op.body)}
    return result


def openapi_path(path: str) -> str:
    """An aiohttp route pattern as an OpenAPI path (``{name:[^/:]+}`` -> ``{name}``)."""
    return re.sub(r"\{(\w+):[^}]*\}", r"{\1}", path)


def _inference(api: Api, path: str, operation: str) -> dict[str, Any]:
    """One URL of an inference API: its declaration's body, answer and errors (in its shape),
    the timeout and request id headers, and Triton's binary tensor data where it takes it."""
    params = [PARAMS[p] for p in ("name", "version") if "{" + p + "}" in path]
    params += [PARAMS["timeout"], *([PARAMS["header_length"]] if api.binary else []), PARAMS["request_id"]]
    ok: dict[str, Any] = {"description": api.answer, "content": _content(api.response)}
    body = _json(api.request.__name__)
    if api.binary:
        text = f"The response JSON ({HEADER_LENGTH} bytes), then binary outputs."
        ok["content"]["application/octet-stream"] = {"schema": {**_BINARY, "description": text}}
        ok["headers"] = {
            HEADER_LENGTH: {"schema": {"type": "integer"}, "description": "Set when binary outputs follow."}
        }
        text = f"JSON (all of it, or {HEADER_LENGTH} bytes then binary tensor data)."
        body["application/octet-stream"] = {"schema": {**_BINARY, "description": text}}
    responses: dict[str, Any] = {"200": ok}
    for name in INFER_ERRORS:
        status, text, headers = ERRORS[name]
        if api.errors is PLAIN_ERRORS:
            responses[status] = {"$ref": f"#/components/responses/{name}"}
        else:
            responses[status] = _error(text, headers, api.errors.schema.__name__)
    return {
        "summary": api.summary,
        "operationId": operation,
        "tags": [api.protocol],
        "parameters": params,
        "responses": dict(sorted(responses.items())),
        "requestBody": {"required": True, "content": body},
    }


def _error(text: str, headers: list[str], schema: str) -> dict[str, Any]:
    """An error answer: its description, headers, and body schema."""
    return {
        "description": text,
        **({"headers": {h: {"schema": {"type": "string"}} for h in headers}} if headers else {}),
        "content": _json(schema),
    }


def _clean(node: Any) -> Any:
    """Docstrings as readable descriptions; no "title" (the component name says it)."""
    if isinstance(node, dict):
        return {
            k: inspect.cleandoc(v) if k == "description" else _clean(v)
            for k, v in node.items()
            if k != "title"
        }
    if isinstance(node, list):
        return [_clean(v) for v in node]
    return node


def generate() -> dict[str, Any]:
    """The whole OpenAPI 3.1 document."""
    types = [*TYPES, *(t for api in APIS for t in (api.request, api.response, api.errors.schema))]
    _, components = msgspec.json.schema_components(list(dict.fromkeys(types)), ref_template=REF)
    paths: dict[str, dict[str, Any]] = {}
    for api in APIS:
        for route in api.routes:
            path = openapi_path(route.path)
            paths.setdefault(path, {})[api.method.lower()] = _inference(api, path, route.operation)
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method] = _operation(op)
    responses = {name: _error(text, headers, "Error") for name, (_, text, headers) in ERRORS.items()}
    tags = {api.protocol: api.title for api in APIS}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": SERVER_NAME,
            "version": __version__,
            "description": DESCRIPTION,
            "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"},
        },
        "servers": [{"url": "http://127.0.0.1:8080"}],
        "tags": [
            *({"name": name, "description": text} for name, text in tags.items()),
            {"name": "triton", "description": "Triton's extensions of the V2 protocol"},
            {"name": "health"},
            {"name": "server"},
        ],
        "security": [{}, {"bearerAuth": []}, {"apiKeyAuth": []}],
        "paths": paths,
        "components": {
            "securitySchemes": {
                "bearerAuth": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "Authorization: Bearer <API key>",
                },
                "apiKeyAuth": {"type": "apiKey", "in": "header", "name": "X-API-Key"},
            },
            "responses": responses,
            "schemas": _clean(dict(sorted(components.items()))),
        },
    }


def render() -> bytes:
    """The document as written to ``app/openapi.json`` (2-space indent, trailing newline)."""
    return (json.dumps(generate(), indent=2, ensure_ascii=False) + "\n").encode()


def main(argv: list[str] | None = None) -> int:
    """Write ``app/openapi.json``, or with ``--check`` report whether it is current (exit 1 if not)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check that the file is current")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if PATH.read_bytes() != text:
            print(f"{PATH} is out of date: run python -m app.http.openapi", file=sys.stderr)
            return 1
        return 0
    PATH.write_bytes(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
