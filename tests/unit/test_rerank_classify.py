"""``POST /v1/rerank`` (Cohere's shape, through the stock ``cohere`` clients) and ``POST
/v1/classify`` (vLLM's shape) in process, on small BERT models: the same scores and probabilities
as the V2 path, long texts in windows, and what is refused in OpenAI's error shape while nothing
else in the batch fails."""

from __future__ import annotations

import asyncio
import re
import tomllib
from pathlib import Path
from typing import Any

import cohere
import grpc
import httpx
import numpy as np
import pytest
from transformers import AutoTokenizer

from app.grpc.generated import grpc_service_pb2 as pb
from app.grpc.generated import grpc_service_pb2_grpc as pb_grpc
from app.grpc.server import start_server
from app.http.state import CORE
from app.models.repository import ModelConfig, TensorSpec
from app.protocols import classify, rerank
from app.protocols.tensors import RequestLimits, deserialize_bytes
from tests.support.fixtures import Client, MakeClient
from tests.support.gunicorn import ROOT
from tests.support.text_models import write_classifier_folder, write_classifier_model

LABELS = ["ok", "insult", "threat"]
DOCS = ["the weather at sea", "a cat on a mat", "mountains in winter", "you are all wonderful"]
LONG = " ".join(f"sentence {i} talks about the weather and the sea and the mountains" for i in range(40))


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    write_classifier_model(tmp_path, "clf", LABELS, parameters="max_seq_length = 64\nstride = 8", seed=1)
    write_classifier_model(
        tmp_path, "ce", ["relevance"], parameters="max_seq_length = 48\nstride = 8\nmax_windows = 24", seed=2
    )
    return tmp_path


async def v2(http: Client, model: str, texts: list[str], query: str | None = None) -> dict[str, np.ndarray]:
    inputs: list[dict[str, Any]] = [
        {"name": "text", "shape": [len(texts), 1], "datatype": "BYTES", "data": texts}
    ]
    if query is not None:
        inputs.append(
            {"name": "query", "shape": [len(texts), 1], "datatype": "BYTES", "data": [query] * len(texts)}
        )
    resp = await http.post(f"/v2/models/{model}/infer", json={"inputs": inputs})
    assert resp.status == 200, await resp.text()
    return {o["name"]: np.array(o["data"]).reshape(o["shape"]) for o in (await resp.json())["outputs"]}


async def test_cohere_clients_get_the_v2_scores_in_order(make_client: MakeClient, repo: Path) -> None:
    http: Client = await make_client(repo)
    want = (await v2(http, "ce", [*DOCS, LONG], "weather"))["score"][:, 0]
    order = sorted(range(len(want)), key=lambda i: -want[i])
    base = str(http.make_url("")).rstrip("/")
    transport = httpx.AsyncClient()
    client_v2 = cohere.AsyncClientV2(api_key="unused", base_url=base, httpx_client=transport)
    got = await client_v2.rerank(model="ce", query="weather", documents=[*DOCS, LONG], top_n=3)
    assert [r.index for r in got.results] == order[:3]
    assert np.allclose([r.relevance_score for r in got.results], want[order[:3]], atol=1e-6)
    client_v1 = cohere.AsyncClient(api_key="unused", base_url=base, httpx_client=transport)
    got1 = await client_v1.rerank(model="ce", query="weather", documents=[*DOCS, LONG], return_documents=True)
    assert [r.index for r in got1.results] == order
    assert [r.document.text for r in got1.results if r.document] == [[*DOCS, LONG][i] for i in order]
    raw = await (
        await http.post("/v1/rerank", json={"model": "ce", "query": "weather", "documents": [DOCS[0], LONG]})
    ).json()
    windows = {r["index"]: r["windows"] for r in raw["results"]}
    assert windows[0] == 1 and windows[1] > 4 and raw["usage"]["total_tokens"] > 48 * 4
    await transport.aclose()


async def test_classify_gives_the_v2_probabilities_and_windows(make_client: MakeClient, repo: Path) -> None:
    http: Client = await make_client(repo)
    texts = ["a short post", LONG]
    want = await v2(http, "clf", texts)
    resp = await http.post("/v1/classify", json={"model": "clf", "input": texts})
    body = await resp.json()
    assert resp.status == 200 and body["object"] == "list" and body["model"] == "clf"
    probs = np.array([d["probs"] for d in body["data"]])
    assert np.abs(probs - want["probabilities"]).max() <= 1e-6
    assert [d["label"] for d in body["data"]] == [LABELS[int(i)] for i in want["probabilities"].argmax(1)]
    assert [d["windows"] for d in body["data"]] == want["windows"].reshape(-1).tolist()
    assert body["data"][1]["windows"] > 4 and body["data"][0]["num_classes"] == 3
    assert body["usage"]["prompt_tokens"] == int(want["tokens"].sum())


def documented_models() -> dict[str, str]:
    """The ``model.toml`` examples of docs/text-models.md, by model name."""
    text = (ROOT / "docs" / "text-models.md").read_text()
    blocks = (
        tomllib.loads(block) | {"toml": block} for block in re.findall(r"```toml\n(.*?)```", text, re.S)
    )
    return {block["name"]: block["toml"] for block in blocks if "name" in block}


async def test_the_documented_classifier_reports_the_tokens_it_ran(
    make_client: MakeClient, tmp_path: Path
) -> None:
    """The classifier ``model.toml`` of docs/text-models.md, as a user copies it: ``usage`` counts
    the tokens its tokenizer made of the texts (special tokens included), not 0."""
    (name, toml), *_ = [(n, t) for n, t in documented_models().items() if "probabilities" in t]
    labels = tomllib.loads(toml)["outputs"][0]["labels"]
    folder = tmp_path / name
    tokenizer = AutoTokenizer.from_pretrained(
        write_classifier_folder(folder / "hf", labels, max_positions=512)
    )
    (folder / "model.toml").write_text(toml)
    http: Client = await make_client(tmp_path)
    texts = ["a short post", "another post, somewhat longer than the first one"]
    body = await (await http.post("/v1/classify", json={"model": name, "input": texts})).json()
    assert body["usage"]["prompt_tokens"] == sum(len(tokenizer(t)["input_ids"]) for t in texts), body


async def test_the_score_api_gives_the_v2_scores_of_its_pairs(make_client: MakeClient, repo: Path) -> None:
    """vLLM's ``/score``: ``text_1`` (the query) with each ``text_2`` (1:N) or pairwise (N:N), the
    scores of the same pairs over V2, in pair order; lengths that do not pair are a 400."""
    http: Client = await make_client(repo)
    one = (await v2(http, "ce", DOCS, "weather"))["score"][:, 0]
    resp = await http.post("/score", json={"model": "ce", "text_1": "weather", "text_2": DOCS})
    body = await resp.json()
    assert resp.status == 200 and body["object"] == "list" and body["model"] == "ce"
    assert [d["index"] for d in body["data"]] == list(range(len(DOCS)))
    assert np.abs(np.array([d["score"] for d in body["data"]]) - one).max() <= 1e-6
    assert body["usage"]["prompt_tokens"] > 0
    queries = ["weather", "cats"]
    pairwise = [(await v2(http, "ce", [d], q))["score"][0, 0] for q, d in zip(queries, DOCS[:2], strict=True)]
    body = await (
        await http.post("/v1/score", json={"model": "ce", "text_1": queries, "text_2": DOCS[:2]})
    ).json()
    assert np.abs(np.array([d["score"] for d in body["data"]]) - pairwise).max() <= 1e-6
    resp = await http.post("/score", json={"model": "ce", "text_1": queries, "text_2": DOCS[:3]})
    assert resp.status == 400 and "1:1, 1:N or N:N" in (await resp.json())["error"]["message"]


async def test_bad_requests_get_a_4xx_in_the_apis_shape(make_client: MakeClient, repo: Path) -> None:
    http: Client = await make_client(repo, max_items_per_request=8)
    cases = [
        ("/v1/rerank", {"model": "ce", "query": "q", "documents": []}, 400, "non-empty list of documents"),
        ("/v1/rerank", {"model": "ce", "documents": ["a"]}, 400, "query"),
        ("/v1/rerank", {"model": "ce", "query": "", "documents": ["a"]}, 400, "non-empty query"),
        ("/v1/rerank", {"model": "ce", "query": "q", "documents": ["a"] * 9}, 413, "at most 8"),
        ("/v1/rerank", {"model": "ce", "query": "q", "documents": ["a"], "top_n": 0}, 400, "top_n"),
        ("/v1/rerank", {"model": "clf", "query": "q", "documents": ["a"]}, 200, ""),
        ("/v1/rerank", {"model": "nowhere", "query": "q", "documents": ["a"]}, 404, "not found"),
        ("/v1/rerank", {"model": "ce", "query": "q", "documents": [LONG * 3]}, 413, "max_windows"),
        ("/v1/rerank", {"model": "ce", "query": LONG, "documents": ["a"]}, 400, "query of"),
        ("/v1/classify", {"model": "clf", "input": []}, 400, "non-empty"),
        ("/v1/classify", {"model": "clf", "input": [[1, 2]]}, 400, "token arrays"),
        ("/v1/classify", {"model": "clf", "input": [LONG * 3]}, 413, "max_windows"),
        # what the server does not implement is refused, not ignored (it would rank something else)
        ("/v1/rerank", {"model": "ce", "query": "q", "documents": ["a"], "rank_fields": ["title"]}, 400,
         "rank_fields"),
        ("/v1/rerank", {"model": "ce", "query": "q", "documents": ["a"], "rank_fields": ["text"]}, 200, ""),
        ("/v1/rerank", {"model": "ce", "query": "q", "documents": ["a"], "max_chunks_per_doc": 4}, 400,
         "max_chunks_per_doc is not supported"),
        ("/v2/rerank", {"model": "ce", "query": "q", "documents": ["a"], "max_tokens_per_doc": 512}, 400,
         "max_tokens_per_doc is not supported"),
        ("/v1/rerank", {"model": "ce", "query": "q", "documents": ["a"], "truncate_prompt_tokens": 8}, 400,
         "model 'ce' does not truncate on request"),
        ("/v1/classify", {"model": "clf", "input": ["a"], "truncate_prompt_tokens": -1}, 400,
         "model 'clf' does not truncate on request"),
        ("/v1/classify", {"model": "clf", "input": ["a"], "truncate_prompt_tokens": 0}, 400,
         "truncate_prompt_tokens must be -1"),
    ]  # fmt: skip
    for path, body, status, message in cases:
        resp = await http.post(path, json=body)
        assert resp.status == status, (path, body, await resp.text())
        if status != 200:
            error = (await resp.json())["error"]
            assert message in error["message"] and error["type"] == "invalid_request_error", error
    bad = b'{"model": "ce", "query": "q", "documents": ["\xff\xfe"]}'
    resp = await http.post("/v1/rerank", data=bad, headers={"Content-Type": "application/json"})
    assert resp.status == 400 and "UTF-8" in (await resp.json())["error"]["message"]


def test_truncate_prompt_tokens_goes_to_each_item_of_a_model_that_takes_it() -> None:
    """vLLM's ``truncate_prompt_tokens`` on rerank and classify: one INT64 value per document or
    text, under the input of that name, for the model's handler to cut its text by."""
    truncate = TensorSpec("truncate_prompt_tokens", "INT64", [1], optional=True)
    config = ModelConfig(
        name="m", format="handler", handler="h",
        inputs=[TensorSpec("text", "BYTES", [1]), TensorSpec("query", "BYTES", [1], optional=True), truncate],
        outputs=[TensorSpec("score", "FP32", [1]), TensorSpec("probabilities", "FP32", [2], labels=["a", "b"])],
    )  # fmt: skip
    ranked = rerank.infer_request(
        config,
        rerank.decode(
            b'{"model": "m", "query": "q", "documents": ["a", "b"], "truncate_prompt_tokens": 7}',
            RequestLimits(),
        ),
    )
    classified = classify.infer_request(
        config,
        classify.decode(
            b'{"model": "m", "input": ["a", "b", "c"], "truncate_prompt_tokens": -1}', RequestLimits()
        ),
    )
    for request, value, items in ((ranked, 7, 2), (classified, -1, 3)):
        (given,) = [t for t in request.inputs if t.name == "truncate_prompt_tokens"]
        assert given.datatype == "INT64" and given.shape == [items, 1]
        assert np.asarray(given.data).tolist() == [[value]] * items


async def test_a_lone_surrogate_is_a_400_naming_its_field(make_client: MakeClient, repo: Path) -> None:
    """A JSON string with half a UTF-16 pair (``\\ud800`` alone) is not text: the 400 says
    which field holds it (msgspec alone said "Input data was truncated"); a whole pair is fine."""
    http: Client = await make_client(repo)
    cases = [
        ("/v1/classify", rb'{"model": "clf", "input": ["fine", "\ud800"]}', "$.input[1]"),
        ("/v1/rerank", rb'{"model": "ce", "query": "q\udc00?", "documents": ["a"]}', "$.query"),
        ("/v2/models/clf/infer", rb'{"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", '
         rb'"data": ["\ud83d"]}]}', "$.inputs[0].data[0]"),
    ]  # fmt: skip
    for path, body, field in cases:
        resp = await http.post(path, data=body, headers={"Content-Type": "application/json"})
        error = (await resp.json())["error"]
        message = error if isinstance(error, str) else error["message"]
        assert resp.status == 400 and f"{field} holds a lone UTF-16 surrogate" in message, (path, message)
    pair = rb'{"model": "clf", "input": ["a smile \ud83d\ude00"]}'
    resp = await http.post("/v1/classify", data=pair, headers={"Content-Type": "application/json"})
    assert resp.status == 200, await resp.text()


async def test_a_refused_request_fails_alone(make_client: MakeClient, repo: Path) -> None:
    """Requests sent together: the one with too many windows gets its 413; the others, batched
    beside it, their scores."""
    http: Client = await make_client(repo)
    good = {"model": "ce", "query": "weather", "documents": [DOCS[0], LONG]}
    bad = {"model": "ce", "query": "weather", "documents": [LONG * 3]}
    answers = await asyncio.gather(*(http.post("/v1/rerank", json=b) for b in [good, bad, good, bad, good]))
    assert [a.status for a in answers] == [200, 413, 200, 413, 200]
    scores = [[r["relevance_score"] for r in (await a.json())["results"]] for a in answers[::2]]
    assert scores[0] == scores[1] == scores[2]


async def test_tritons_classification_extension_over_http_and_grpc(
    make_client: MakeClient, repo: Path
) -> None:
    """``"parameters": {"classification": 2}`` on ``probabilities``: the top 2 labels per text as
    "score:index:label", highest first, the same over HTTP and gRPC."""
    http: Client = await make_client(repo)
    texts = ["a short post", LONG]
    want = (await v2(http, "clf", texts))["probabilities"]
    expected = [
        [f"{want[b, i]:f}:{i}:{LABELS[i]}".encode() for i in np.argsort(-want[b], kind="stable")[:2]]
        for b in range(2)
    ]
    text = {"name": "text", "shape": [2, 1], "datatype": "BYTES", "data": texts}
    body = {"inputs": [text], "outputs": [{"name": "probabilities", "parameters": {"classification": 2}}]}
    answer = await (await http.post("/v2/models/clf/infer", json=body)).json()
    out = answer["outputs"][0]
    assert out["datatype"] == "BYTES" and out["shape"] == [2, 2]
    assert [s.encode() for s in out["data"]] == [s for row in expected for s in row]
    for k in (0, "2", True):
        body["outputs"][0]["parameters"]["classification"] = k  # type: ignore[index]
        resp = await http.post("/v2/models/clf/infer", json=body)
        assert resp.status == 400 and "classification" in (await resp.json())["error"]
    assert http.app is not None
    server, port = await start_server(http.app[CORE], "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            request = pb.ModelInferRequest(model_name="clf")
            tensor = request.inputs.add(name="text", datatype="BYTES", shape=[2, 1])
            tensor.contents.bytes_contents.extend(t.encode() for t in texts)
            output = request.outputs.add(name="probabilities")
            output.parameters["classification"].int64_param = 2
            stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            reply = await stub.ModelInfer(request)
    finally:
        await server.stop(None)
    assert reply.outputs[0].datatype == "BYTES" and list(reply.outputs[0].shape) == [2, 2]
    got = (
        list(deserialize_bytes(memoryview(reply.raw_output_contents[0]), 4, "probabilities", 1 << 16))
        if reply.raw_output_contents
        else list(reply.outputs[0].contents.bytes_contents)
    )
    assert got == [s for row in expected for s in row]
