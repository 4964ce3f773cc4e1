"""Hypothesis settings and request-body strategies for the fuzz tests of both protocols (HTTP and
gRPC), and their check: never a 5xx, and an error is a JSON ``{"error": ...}``; messages of any
type of the gRPC service drawn from its descriptors, and :func:`fuzz_grpc`, every method of a
running server fuzzed (tests/e2e/test_fuzz_routes.py, benchmarks/fuzz.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.parse
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hyp_seed
from hypothesis import strategies as st

from app.datatypes import DATATYPES
from tests.support.fixtures import Client

FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=40,
)
names = st.sampled_from(["x", "tag", "y", "", "X"]) | st.text(max_size=6)
datatypes = st.sampled_from(sorted(DATATYPES)) | st.text(max_size=6)
shapes = st.lists(st.integers(-2, 5) | st.sampled_from([2**31, 2**63 - 1]), max_size=4)
numbers = st.integers(-(2**70), 2**70) | st.floats() | st.booleans() | st.text(max_size=4)
data = st.lists(numbers | st.lists(numbers, max_size=4), max_size=12) | st.lists(
    st.text(max_size=12), max_size=6
)


@st.composite
def v2_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """Bodies with the V2 request's shape, valid or not in every field."""
    tensor: dict[str, Any] = {
        "name": draw(names),
        "shape": draw(shapes),
        "datatype": draw(datatypes),
        "data": draw(data),
    }
    if draw(st.booleans()):
        tensor["parameters"] = draw(st.dictionaries(st.text(max_size=5), scalars, max_size=2))
    body: dict[str, Any] = {"inputs": [tensor, *draw(st.lists(st.just(dict(tensor)), max_size=1))]}
    if draw(st.booleans()):
        body["id"] = draw(st.text(max_size=8) | st.integers())
    if draw(st.booleans()):
        body["parameters"] = {"timeout": draw(numbers | st.none())}
    if draw(st.booleans()):
        body["outputs"] = [{"name": draw(names)}]
    return body


@st.composite
def near_valid_v2_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """Valid requests for the scale model but for the values: any floats, any texts, off-by-one
    shapes, flat or nested data."""
    rows = draw(st.integers(0, 5))
    floats = st.floats() | st.integers(-(2**64), 2**64)
    values = draw(st.lists(floats, min_size=rows * 2, max_size=rows * 2 + draw(st.integers(0, 1))))
    nested = draw(st.booleans()) and len(values) == rows * 2
    x_data = [values[i : i + 2] for i in range(0, len(values), 2)] if nested else values
    shape = [rows + draw(st.sampled_from([0, 0, 0, 1, -1])), 2]
    inputs = [{"name": "x", "shape": shape, "datatype": "FP32", "data": x_data}]
    if draw(st.booleans()):
        texts = draw(st.lists(st.text(), min_size=rows, max_size=rows))
        inputs.append({"name": "tag", "shape": [rows], "datatype": "BYTES", "data": texts})
    return {"inputs": inputs}


@st.composite
def v1_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """Bodies with the V1 request's shape: instances of rows, objects or anything."""
    row = st.lists(numbers, max_size=4)
    instance = (
        row | st.fixed_dictionaries({"x": row}, optional={"tag": st.text(max_size=8) | numbers}) | json_values
    )
    return {"instances": draw(st.lists(instance, max_size=6))}


async def check(client: Client, path: str, payload: bytes, headers: dict[str, str] | None = None) -> None:
    resp = await client.post(
        path, data=payload, headers={"Content-Type": "application/json", **(headers or {})}
    )
    text = await resp.text()
    assert resp.status < 500, (resp.status, text, payload[:300])
    if resp.status == 400 and resp.content_type == "text/plain":
        return  # refused by aiohttp's HTTP parser before the app runs (app.http.edge)
    if resp.status >= 400:
        assert set(json.loads(text)) == {"error"}, text


# --- every gRPC method: messages of its request type, drawn from the proto's descriptors --------

#: gRPC outcomes that are server errors (a fuzzed call must never get one).
GRPC_SERVER_ERRORS = frozenset({"INTERNAL", "UNKNOWN", "DATA_LOSS"})
_INTS = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def _scalars(field: FieldDescriptor, hints: Mapping[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """Values of one non-message field (one element of a repeated one): its hint where one is
    given for its name, else any value of its type (edges included: the integer range's ends,
    NaN and infinities)."""
    if field.name in hints:
        return hints[field.name]
    if field.type in _INTS:
        low, high = _INTS[field.type]
        return st.integers(low, high) | st.sampled_from([low, high, 0, -1 if low else 1])
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type == FieldDescriptor.TYPE_FLOAT:
        return st.floats(width=32)
    if field.type == FieldDescriptor.TYPE_DOUBLE:
        return st.floats()
    if field.type == FieldDescriptor.TYPE_STRING:
        return st.text(max_size=12)
    if field.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values])
    raise TypeError(f"no strategy for field {field.full_name} of type {field.type}")


def proto_messages(
    descriptor: Descriptor, hints: Mapping[str, st.SearchStrategy[Any]] | None = None, depth: int = 3
) -> st.SearchStrategy[Message]:
    """Messages of ``descriptor``'s type with any subset of its fields set, each to any value of
    its type (repeated fields: up to 4; maps: up to 3 entries; nested messages ``depth`` levels
    down). ``hints``: a strategy by field name, e.g. the server's model names for ``model_name``.
    Source: the shape of hypothesis-protobuf's ``modules_to_strategies``, without the package."""
    hints = hints or {}
    cls = message_factory.GetMessageClass(descriptor)
    optional: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            key = _scalars(entry.fields_by_name["key"], hints)
            value = _field_values(entry.fields_by_name["value"], hints, depth)
            if value is not None:
                optional[field.name] = st.dictionaries(key, value, max_size=3)
            continue
        values = _field_values(field, hints, depth)
        if values is None:
            continue
        optional[field.name] = st.lists(values, max_size=4) if field.is_repeated else values

    def build(fields: dict[str, Any]) -> Message:
        message = cls()
        for name, value in fields.items():
            _set(message, descriptor.fields_by_name[name], value)
        return message

    return st.fixed_dictionaries({}, optional=optional).map(build)


def _field_values(
    field: FieldDescriptor, hints: Mapping[str, st.SearchStrategy[Any]], depth: int
) -> st.SearchStrategy[Any] | None:
    if field.message_type is None:
        return _scalars(field, hints)
    if depth <= 0:
        return None
    return proto_messages(field.message_type, hints, depth - 1)


def _set(message: Message, field: FieldDescriptor, value: Any) -> None:
    target = getattr(message, field.name)
    entry = field.message_type
    if entry is not None and entry.GetOptions().map_entry:
        for key, item in value.items():
            if entry.fields_by_name["value"].message_type is not None:
                target[key].CopyFrom(item)
            else:
                target[key] = item
    elif field.is_repeated:
        target.extend(value)
    elif entry is not None:
        target.CopyFrom(value)
    else:
        setattr(message, field.name, value)


def grpc_methods() -> dict[str, Descriptor]:
    """Every method of ``inference.GRPCInferenceService`` (all unary): name -> request type."""
    from app.grpc.generated import grpc_service_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    return {method.name: method.input_type for method in service.methods}


def fuzz_grpc(
    target: str, models: Sequence[str], examples: int, seed: int = 20261127, timeout_s: float = 30.0
) -> tuple[dict[str, int], list[str]]:
    """Send ``examples`` hypothesis-drawn messages to each gRPC method of the server at ``target``
    (host:port), and as many arbitrary byte strings as messages: (calls per method, what went
    wrong: a server error, or a call that got no answer from the server within ``timeout_s``).
    Model names, versions and datatypes are drawn from ``models`` and the server's datatypes as
    often as not (so that the calls reach past the lookup), from any text otherwise."""
    import grpc

    hints: dict[str, st.SearchStrategy[Any]] = {
        "model_name": st.sampled_from(list(models)) | st.text(max_size=8),
        "name": st.sampled_from([*models, "features", "text", "query", "x"]) | st.text(max_size=8),
        "model_version": st.sampled_from(["", "1", "2"]) | st.text(max_size=4),
        "version": st.sampled_from(["", "1", "2"]) | st.text(max_size=4),
        "datatype": st.sampled_from(sorted(DATATYPES)) | st.text(max_size=6),
        "shape": st.integers(-2, 8) | st.sampled_from([2**31, 2**63 - 1]),  # each dimension
    }
    calls: dict[str, int] = {}
    failures: list[str] = []
    with grpc.insecure_channel(target) as channel:
        for name, request in grpc_methods().items():
            method = channel.unary_unary(f"/inference.GRPCInferenceService/{name}")
            calls[name] = 0

            def one(raw: bytes, name: str = name, method: Any = method) -> None:
                calls[name] += 1
                try:
                    method(raw, timeout=timeout_s)
                except grpc.RpcError as exc:
                    trailers = dict(exc.trailing_metadata() or ())
                    code = exc.code().name
                    if code in GRPC_SERVER_ERRORS or "x-request-id" not in trailers:
                        failures.append(f"{name}: {code} {exc.details()!r} for {raw[:120]!r}")

            strategy = proto_messages(request, hints).map(lambda m: m.SerializeToString()) | st.binary(
                max_size=200
            )
            _run(strategy, one, 2 * examples, seed)
    return calls, failures


def _run(strategy: st.SearchStrategy[Any], check: Any, examples: int, seed: int) -> None:
    """``check`` on ``examples`` values of ``strategy``, outside pytest (hypothesis' own loop:
    shrinking and the seed as under ``@given``; failures are collected by ``check``)."""

    @settings(FUZZ, max_examples=examples, derandomize=False)
    @hyp_seed(seed)
    @given(strategy)
    def each(value: Any) -> None:
        check(value)

    each()


# --- every HTTP route: schemathesis against the served OpenAPI document ------------------------

#: Operations that take a model ``name`` in the path and that the stateful phase chains.
_CHAINED = (
    "repositoryModelUnload",
    "repositoryModelLoad",
    "modelInfer",
    "modelReady",
    "modelMetadata",
    "v1Predict",
)


def fuzz_document(models: Mapping[str, Sequence[str]], examples: Mapping[str, Any]) -> dict[str, Any]:
    """app/openapi.json narrowed to a server: the ``name`` and ``version`` path parameters and
    the ``model`` field of the ``examples``' request bodies drawn from ``models`` (name ->
    versions; schemathesis still sends other names in its negative cases), ``examples`` (schema
    name -> a valid body) as the request schemas' examples, so that every inference route
    reaches a model in the examples phase and, now and then, in the fuzzing phase, and OpenAPI
    links for the stateful phase: the repository index's entries to the model's
    operations, and an unload or a load to the same model's inference, metadata, readiness
    and the opposite call, so that sequences such as index -> unload -> infer -> load -> infer
    are sent."""
    from tests.support.openapi import spec

    doc = spec()
    for name, example in examples.items():
        schema = doc["components"]["schemas"][name]
        schema["example"] = example
        if schema.get("properties", {}).get("model", {}).get("type") == "string":
            schema["properties"]["model"] = {"type": "string", "enum": sorted(models)}
    versions = sorted({v for vs in models.values() for v in vs})
    by_id: dict[str, dict[str, Any]] = {}
    for ops in doc["paths"].values():
        for op in ops.values():
            by_id[op["operationId"]] = op
            for param in op.get("parameters", []):
                if param["in"] == "path" and param["name"] == "name":
                    param["schema"] = {"type": "string", "enum": sorted(models)}
                elif param["in"] == "path" and param["name"] == "version":
                    param["schema"] = {"type": "string", "enum": versions}
    index_links = {
        f"{target}{i}": {"operationId": target, "parameters": {"name": f"$response.body#/{i}/name"}}
        for target in _CHAINED
        for i in range(len(models))
    }
    by_id["repositoryIndex"]["responses"]["200"]["links"] = index_links
    for source in ("repositoryModelUnload", "repositoryModelLoad"):
        by_id[source]["responses"]["200"]["links"] = {
            target: {"operationId": target, "parameters": {"name": "$request.path.name"}}
            for target in _CHAINED
            if target != source
        }
    return doc


def routes_taking(document: Mapping[str, Any], schemas: Iterable[str]) -> list[str]:
    """The operations (``"POST /v1/rerank"``) of ``document`` whose JSON request body is one of
    the component ``schemas`` (by name): with the inference request schemas, the routes that
    serve inference."""
    refs = {f"#/components/schemas/{name}" for name in schemas}
    return [
        f"{method.upper()} {path}"
        for path, ops in document["paths"].items()
        for method, op in ops.items()
        if op.get("requestBody", {})
        .get("content", {})
        .get("application/json", {})
        .get("schema", {})
        .get("$ref")
        in refs
    ]


def run_schemathesis(
    url: str,
    document: Mapping[str, Any],
    folder: Path,
    *,
    max_examples: int,
    seed: int = 20261127,
    max_time_s: int | None = None,
    timeout_s: float = 1800,
) -> tuple[int, str, dict[str, Counter[int]]]:
    """schemathesis (its CLI, in a process of its own) against ``url`` with ``document``, every
    phase (examples, coverage, fuzzing, stateful), the checks not_a_server_error (503 and 504
    expected: a request's own deadline or overload), status_code_conformance and
    content_type_conformance, each request bounded at 10 s (a hang fails its check);
    ``max_time_s`` repeats the fuzzing and stateful phases until it is spent. Returns the exit
    status, the output's tail and the answers' statuses per operation (``"POST /v1/rerank"``,
    from the HAR report: :func:`statuses_per_route`)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "openapi.json").write_text(json.dumps(document))
    (folder / "schemathesis.toml").write_text(
        '[checks.not_a_server_error]\nexpected-statuses = ["1xx", "2xx", "3xx", "4xx", "503", "504"]\n'
    )
    command = [
        sys.executable, "-m", "schemathesis.cli", "--config-file", str(folder / "schemathesis.toml"),
        "run", str(folder / "openapi.json"), "--url", url,
        "--checks", "not_a_server_error,status_code_conformance,content_type_conformance",
        "--max-examples", str(max_examples), "--seed", str(seed), "--generation-database", "none",
        "--phases", "examples,coverage,fuzzing,stateful", "--workers", "1", "--request-timeout", "10",
        "--no-color", "--suppress-health-check", "all", "--report", "har",
        "--report-har-path", str(folder / "requests.har"),
    ]  # fmt: skip
    if max_time_s is not None:
        command += ["--max-time", str(max_time_s)]
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=folder,
        env={**os.environ, "SCHEMATHESIS_HOOKS": ""},
    )
    return (
        done.returncode,
        done.stdout[-8000:] + done.stderr[-2000:],
        statuses_per_route(folder / "requests.har", document),
    )


def statuses_per_route(har: Path, document: Mapping[str, Any]) -> dict[str, Counter[int]]:
    """The answers' statuses of a HAR file's requests by operation (``"<METHOD> <path
    template>"`` of ``document``; ``"other methods <path template>"`` for a method the route does
    not serve); a request without an answer counts under status 0."""
    routes = [  # literal paths first: /v2/models/stats before /v2/models/{name}
        (method.upper(), path, re.compile("^" + re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(path)) + "$"))
        for path, ops in sorted(document["paths"].items(), key=lambda item: item[0].count("{"))
        for method in ops
    ]
    statuses: dict[str, Counter[int]] = {}
    if not har.exists():
        return statuses
    for entry in json.loads(har.read_text())["log"]["entries"]:
        method, path = entry["request"]["method"].upper(), urllib.parse.urlsplit(entry["request"]["url"]).path
        templates = [(m, template) for m, template, pattern in routes if pattern.match(path)]
        same = [f"{m} {template}" for m, template in templates if m == method]
        other = [f"other methods {template}" for _, template in templates]
        route = (same or other or [f"{method} {path} (no route)"])[0]
        statuses.setdefault(route, Counter())[int((entry.get("response") or {}).get("status") or 0)] += 1
    return statuses
