"""The fuzzers' own parts (tests/support/fuzz.py): messages drawn for every gRPC method's request
type are messages of that type and set its fields, nested and mapped ones included; the OpenAPI
document narrowed for schemathesis keeps every route, draws the server's model names (in paths
and request bodies) and links the stateful chain; a HAR report's answers are counted per route
and status; the routes that serve inference are those taking an inference request body."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from app.grpc.generated import grpc_service_pb2 as pb
from tests.support.fuzz import fuzz_document, grpc_methods, proto_messages, routes_taking, statuses_per_route
from tests.support.openapi import spec


def test_every_method_of_the_service_is_fuzzed() -> None:
    methods = grpc_methods()
    assert {"ModelInfer", "RepositoryModelLoad", "ServerLive"} <= set(methods)
    assert methods["ModelInfer"] is pb.ModelInferRequest.DESCRIPTOR


@settings(max_examples=60, derandomize=True, database=None, deadline=None)
@given(data=st.data())
def test_drawn_messages_are_of_the_request_type_and_round_trip(data: st.DataObject) -> None:
    for descriptor in grpc_methods().values():
        message = data.draw(proto_messages(descriptor, {"model_name": st.just("clf")}))
        assert message.DESCRIPTOR is descriptor
        again = type(message).FromString(message.SerializeToString())
        assert again == message
        if descriptor is pb.ModelInferRequest.DESCRIPTOR and message.model_name:
            assert message.model_name == "clf"  # the hint, not any text


def test_nested_repeated_and_mapped_fields_are_reached() -> None:
    seen: set[str] = set()

    @settings(max_examples=200, derandomize=True, database=None, deadline=None)
    @given(proto_messages(pb.ModelInferRequest.DESCRIPTOR))
    def look(message: pb.ModelInferRequest) -> None:
        seen.update(field.name for field, _ in message.ListFields())
        for tensor in message.inputs:
            seen.update(f"inputs.{field.name}" for field, _ in tensor.ListFields())

    look()
    assert {
        "parameters",
        "inputs",
        "outputs",
        "raw_input_contents",
        "inputs.shape",
        "inputs.contents",
    } <= seen


def test_the_fuzzed_document_keeps_every_route_and_links_the_model_chain() -> None:
    doc = fuzz_document({"clf": ["1"], "ce": ["1", "2"]}, {"ClassifyRequest": {"model": "clf", "input": "x"}})
    assert doc["paths"].keys() == spec()["paths"].keys()
    infer = doc["paths"]["/v2/models/{name}/versions/{version}/infer"]["post"]
    assert [p["schema"] for p in infer["parameters"] if p["in"] == "path"] == [
        {"type": "string", "enum": ["ce", "clf"]},
        {"type": "string", "enum": ["1", "2"]},
    ]
    index_links = doc["paths"]["/v2/repository/index"]["post"]["responses"]["200"]["links"]
    assert index_links["repositoryModelUnload1"]["parameters"] == {"name": "$response.body#/1/name"}
    unload_links = doc["paths"]["/v2/repository/models/{name}/unload"]["post"]["responses"]["200"]["links"]
    assert unload_links["modelInfer"] == {
        "operationId": "modelInfer",
        "parameters": {"name": "$request.path.name"},
    }
    classify = doc["components"]["schemas"]["ClassifyRequest"]
    assert classify["example"] == {"model": "clf", "input": "x"}
    assert classify["properties"]["model"] == {"type": "string", "enum": ["ce", "clf"]}
    assert doc["components"]["schemas"]["ScoreRequest"]["properties"]["model"] == {
        "type": "string"
    }  # no example


def test_the_routes_that_serve_inference_are_those_taking_an_inference_body() -> None:
    inference = ["InferenceRequest", "PredictRequest", "CompletionRequest", "ScoreRequest"]
    assert routes_taking(spec(), inference) == [
        "POST /v2/models/{name}/infer",
        "POST /v2/models/{name}/versions/{version}/infer",
        "POST /v1/models/{name}:predict",
        "POST /score",
        "POST /v1/score",
        "POST /v1/completions",
    ]


def test_answers_are_counted_per_route_and_status(tmp_path: Path) -> None:
    urls = [
        ("GET", "/v2/models/stats", 200),  # a literal path, not /v2/models/{name}
        ("GET", "/v2/models/clf", 200),
        ("POST", "/v2/models/clf/versions/1/infer", 400),
        ("POST", "/v2/models/ce/versions/1/infer", 200),
        ("POST", "/v2/models/clf/versions/1/infer", 0),  # no answer
        ("TRACE", "/v2/models/clf", 405),
        ("GET", "/nowhere", 404),
    ]
    entries = [
        {
            "request": {"method": m, "url": f"http://127.0.0.1:9/{p.lstrip('/')}?q=1"},
            "response": {"status": status},
        }
        for m, p, status in urls
    ]
    har = tmp_path / "requests.har"
    har.write_text(json.dumps({"log": {"entries": entries}}))
    assert statuses_per_route(har, spec()) == {
        "GET /v2/models/stats": {200: 1},
        "GET /v2/models/{name}": {200: 1},
        "POST /v2/models/{name}/versions/{version}/infer": {400: 1, 200: 1, 0: 1},
        "other methods /v2/models/{name}": {405: 1},
        "GET /nowhere (no route)": {404: 1},
    }
    assert statuses_per_route(tmp_path / "none.har", spec()) == {}
