"""Sparse (SPLADE, inference-free SPLADE) and multi-vector (ColBERT) models on a real gunicorn server
of two workers (one per module), small models of the libraries' own folder layouts
(tests/support/retrieval_models.py): what TEI's ``/embed_sparse``, ``/v1/embeddings`` (stock
``openai`` client), ``/v1/rerank`` (stock ``cohere`` client), ``/score`` and V2 answer equals
the libraries' own answers on the same folders (sentence-transformers' ``SparseEncoder``,
PyLate's ``ColBERT`` and ``colbert_scores``); a long text in windows, a request scattered over
both workers and the response cache give the same answers as one worker, one window, no cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from sentence_transformers import SparseEncoder

from app.handlers.sparse_embedding import SparseEmbeddingHandler
from tests.support.gunicorn import Gunicorn, repository_env
from tests.support.model_toml import write_model
from tests.support.retrieval_models import (
    colbert_model,
    sparse_config,
    sparse_model,
    write_colbert_folder,
    write_inference_free_folder,
    write_splade_folder,
)

pytestmark = pytest.mark.e2e

TEXTS = ["what is the sea?", "Mountains, rivers and lakes", "ünïcödé text", "a"]
LONG = " ".join(f"sentence {i} talks about the weather and the sea and the mountains" for i in range(12))
QUERIES = ["what is the sea?", "mountains"]
DOCUMENTS = ["The sea, is big! and blue.", "Mountains (high ones) and rivers; lakes too.", "hello", LONG]
TOLERANCE = 1e-5
DIM = 16
#: Small batches, so that a request of 16 texts is scattered over both workers.
SMALL_BATCHES: dict[str, Any] = {"max_batch_size": 4, "warmup_batch_sizes": [1, 4]}
WINDOWS: dict[str, Any] = {"truncation": "window", "max_seq_length": 32, "stride": 4}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gunicorn, dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("retrieval")
    repo = tmp / "repo"
    repo.mkdir()
    splade = sparse_model("splade", parameters=WINDOWS, response_cache={"enable": True}, **SMALL_BATCHES)
    write_model(repo, splade, lambda p: write_splade_folder(p, seed=1))
    write_model(repo, sparse_model("free", **SMALL_BATCHES), lambda p: write_inference_free_folder(p, seed=2))
    reference: dict[str, Any] = {}

    def colbert(path: Path) -> None:
        reference.update(
            write_colbert_folder(path, seed=3, embedding_size=DIM, queries=QUERIES, documents=DOCUMENTS)
        )

    write_model(repo, colbert_model(dim=DIM, **SMALL_BATCHES), colbert)
    same = str(repo / "colbert" / "pylate")  # colbert's folder, in windows
    windows = colbert_model("colbert-windows", model_dir=same, dim=DIM, parameters={"truncation": "window"})
    write_model(repo, windows)
    env = repository_env(repo, 2, SCORING_RESPONSE_CACHE_LOOKUP_TIMEOUT_MS="60000")
    with Gunicorn(tmp, env) as srv:
        srv.wait_ready(300)
        yield srv, {"repo": repo, **reference}


def _library(repo: Path, name: str) -> SparseEncoder:
    return SparseEncoder(str(repo / name / "st"), device="cpu", local_files_only=True)


def _sparse(answer: list[list[dict[str, Any]]], item: int) -> tuple[np.ndarray, np.ndarray]:
    terms = answer[item]
    return np.array([t["index"] for t in terms], np.int64), np.array([t["value"] for t in terms], np.float32)


def _assert_terms(ids: np.ndarray, values: np.ndarray, expected: np.ndarray) -> None:
    terms = np.flatnonzero(expected)
    assert np.array_equal(ids, terms)
    np.testing.assert_allclose(values, expected[terms], atol=TOLERANCE, rtol=0)


def test_embed_sparse_equals_sparse_encoder(server: tuple[Gunicorn, dict[str, Any]]) -> None:
    srv, ref = server
    status, _, answer = srv.post("/embed_sparse", {"model": "splade", "inputs": TEXTS})
    assert status == 200, answer
    expected = _library(ref["repo"], "splade").encode(TEXTS, convert_to_tensor=True).to_dense().numpy()
    for item in range(len(TEXTS)):
        _assert_terms(*_sparse(answer, item), expected[item])
    status, _, top = srv.post("/embed_sparse", {"model": "splade", "inputs": TEXTS[0], "top_k": 5})
    ids, values = _sparse(answer, 0)
    best = np.sort(np.argsort(-values, kind="stable")[:5])
    assert status == 200 and [t["index"] for t in top[0]] == ids[best].tolist()


def test_inference_free_queries_and_documents_take_their_routes(
    server: tuple[Gunicorn, dict[str, Any]],
) -> None:
    srv, ref = server
    library = _library(ref["repo"], "free")
    for input_type, encode in (("query", library.encode_query), ("document", library.encode_document)):
        status, _, answer = srv.post(
            "/embed_sparse", {"model": "free", "inputs": TEXTS, "input_type": input_type}
        )
        assert status == 200, answer
        expected = encode(TEXTS, convert_to_tensor=True).to_dense().numpy()
        for item in range(len(TEXTS)):
            _assert_terms(*_sparse(answer, item), expected[item])


def test_a_long_text_in_windows_is_the_maximum_over_its_windows(
    server: tuple[Gunicorn, dict[str, Any]],
) -> None:
    srv, ref = server
    status, _, answer = srv.post("/embed_sparse", {"model": "splade", "inputs": [LONG, TEXTS[0]]})
    assert status == 200, answer
    handler = SparseEmbeddingHandler()  # the server's split, in process
    handler.load(torch.device("cpu"), sparse_config(ref["repo"] / "splade" / "st", **WINDOWS))
    (spans,) = handler.split_windows([LONG], None)
    library = _library(ref["repo"], "splade")
    with torch.inference_mode():
        windows = [
            library.forward({"input_ids": torch.from_numpy(s.prepared[0].astype(np.int64))[None],
                             "attention_mask": torch.ones(1, len(s.prepared[0]), dtype=torch.int64)})
            ["sentence_embedding"][0].numpy()
            for s in spans
        ]  # fmt: skip
    assert len(windows) > 2
    _assert_terms(*_sparse(answer, 0), np.max(windows, axis=0))


def _ragged(outputs: list[dict[str, Any]], name: str) -> list[np.ndarray]:
    """A V2 ragged output (``name`` ``[sum n_i, ...]`` and ``name_lengths`` ``[B]``) as its items."""
    found = {o["name"]: o for o in outputs}
    flat, lengths = found[name], found[f"{name}_lengths"]["data"]
    data = np.asarray(flat["data"]).reshape(flat["shape"])
    return np.split(data, np.cumsum(lengths)[:-1]) if lengths else []


def test_v2_sends_a_sparse_row_as_its_terms_and_lengths(server: tuple[Gunicorn, dict[str, Any]]) -> None:
    srv, _ = server
    body = {"inputs": [{"name": "text", "shape": [len(TEXTS), 1], "datatype": "BYTES", "data": TEXTS}]}
    status, _, answer = srv.post("/v2/models/splade/infer", body)
    assert status == 200, answer
    _, _, tei = srv.post("/embed_sparse", {"model": "splade", "inputs": TEXTS})
    indices, values = _ragged(answer["outputs"], "indices"), _ragged(answer["outputs"], "values")
    for item in range(len(TEXTS)):
        ids, weights = _sparse(tei, item)
        assert indices[item].tolist() == ids.tolist()
        np.testing.assert_array_equal(np.asarray(values[item], np.float32), weights)


def test_a_scattered_cached_request_answers_as_one_worker(server: tuple[Gunicorn, dict[str, Any]]) -> None:
    """16 texts, batches of 4, two workers: scattered, gathered in order, the library's terms
    and weights; asked again, answered from the response cache, bit-identical."""
    srv, ref = server
    texts = [f"{TEXTS[i % len(TEXTS)]} number {i}" for i in range(16)]
    first = srv.post("/embed_sparse", {"model": "splade", "inputs": texts})
    second = srv.post("/embed_sparse", {"model": "splade", "inputs": texts})
    assert first[0] == second[0] == 200, (first, second)
    expected = _library(ref["repo"], "splade").encode(texts, convert_to_tensor=True).to_dense().numpy()
    for item in range(len(texts)):
        _assert_terms(*_sparse(first[2], item), expected[item])
    assert first[2] == second[2]
    metrics = srv.scrape()
    assert 'scoring_scattered_requests_total{model="splade",version="1"}' in metrics
    hits = [
        line
        for line in metrics.splitlines()
        if "response_cache_items_total{" in line and 'model="splade"' in line and 'result="hit"' in line
    ]
    assert hits and float(hits[0].rsplit(" ", 1)[1]) >= len(texts)


def test_openai_embeddings_of_colbert_equal_pylate(server: tuple[Gunicorn, dict[str, Any]]) -> None:
    import openai

    srv, ref = server
    with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0) as client:
        documents = client.embeddings.create(model="colbert", input=DOCUMENTS, encoding_format="float")
        queries = client.embeddings.create(
            model="colbert", input=QUERIES, encoding_format="float", extra_body={"input_type": "query"}
        )
        with pytest.raises(openai.BadRequestError, match="multi-vector"):
            client.embeddings.create(model="colbert", input=["a"], dimensions=8)
    for j, row in enumerate(documents.data):
        np.testing.assert_allclose(np.asarray(row.embedding, np.float32), ref[f"d{j}"], atol=TOLERANCE, rtol=0)
    for i, row in enumerate(queries.data):
        np.testing.assert_allclose(np.asarray(row.embedding, np.float32), ref[f"q{i}"], atol=TOLERANCE, rtol=0)
    assert documents.usage.prompt_tokens > 0
    status, _, refused = srv.post("/embed_sparse", {"model": "colbert", "inputs": "a"})
    assert status == 400 and "does not produce sparse embeddings" in refused["error"]


def test_rerank_and_score_are_pylate_maxsim(server: tuple[Gunicorn, dict[str, Any]]) -> None:
    import cohere

    srv, ref = server
    with httpx.Client() as transport:
        client = cohere.ClientV2(api_key="unused", base_url=srv.url, httpx_client=transport)
        ranked = [client.rerank(model="colbert", query=query, documents=DOCUMENTS) for query in QUERIES]
    for i, got in enumerate(ranked):
        want = ref["scores"][i]
        assert [r.index for r in got.results] == sorted(range(len(DOCUMENTS)), key=lambda j: (-want[j], j))
        for r in got.results:
            assert abs(r.relevance_score - want[r.index]) <= TOLERANCE
    status, _, scored = srv.post("/score", {"model": "colbert", "text_1": QUERIES[0], "text_2": DOCUMENTS})
    assert status == 200, scored
    np.testing.assert_allclose([d["score"] for d in scored["data"]], ref["scores"][0], atol=TOLERANCE, rtol=0)


def test_a_long_document_in_windows_is_its_windows_rows(server: tuple[Gunicorn, dict[str, Any]]) -> None:
    srv, ref = server
    whole = srv.post("/v1/embeddings", {"model": "colbert", "input": [LONG]})[2]["data"][0]["embedding"]
    windowed = srv.post("/v1/embeddings", {"model": "colbert-windows", "input": [LONG]})[2]["data"][0][
        "embedding"
    ]
    assert len(whole) == len(ref["d3"]) < len(windowed)  # cut at document_length; every token's row
    np.testing.assert_allclose(
        np.asarray(windowed[: len(whole)], np.float32), ref["d3"], atol=TOLERANCE, rtol=0
    )
