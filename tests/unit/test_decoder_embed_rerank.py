"""Decoder embedders and rerankers on the small Qwen3 folders of ``tests/support/decoder_models.py``
(no pad token, left padding): the embedder's last-token pooled embeddings equal
sentence-transformers' ``encode`` (with ``prompt_name="query"`` for queries, no prompt for
documents), a query scored against a document with its prompt equals the library's cosine; the
causal-LM reranker equals the model card's yes/no computation over the whole vocabulary; both
serve ``/v1/embeddings`` and ``/v1/rerank``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.handlers.causal_rerank import CausalRerankHandler
from app.handlers.decoder_math import RERANKER_PREFIX, RERANKER_SUFFIX
from app.handlers.sentence_embedding import SentenceEmbeddingHandler
from tests.support.decoder_models import EMBEDDING_QUERY_PROMPT, write_handler_model
from tests.unit.test_decoder_classification import posts, run
from tests.unit.test_sequence_classification import Config, Spec, _bytes

QUERIES = ["how do astronomers measure redshift", "when does the train leave", "bread"]


def library(folder: Path) -> Any:
    """sentence-transformers' own model of the folder, its tokenizer told to pad with EOS (it
    has no pad token: the library could not batch otherwise)."""
    model = SentenceTransformer(str(folder), device="cpu", local_files_only=True)
    model.tokenizer.pad_token = model.tokenizer.eos_token
    return model


def embedder(folder: Path, **parameters: Any) -> SentenceEmbeddingHandler:
    handler = SentenceEmbeddingHandler()
    config = Config(folder.parent, {"model_dir": folder.name, **parameters}, [Spec("embedding", [64])])
    handler.load(torch.device("cpu"), config)
    return handler


def test_embeddings_equal_the_librarys_with_and_without_the_query_prompt(
    decoder_models: dict[str, Path],
) -> None:
    folder = decoder_models["qwen3-embedder"]
    reference = library(folder)
    documents = posts(8, seed=12)
    plain = embedder(folder)
    assert plain.tokenizer.pad_id is not None and plain.tokenizer.padding_side == "left"
    got = run(plain, {"text": _bytes(*documents)})["embedding"]
    want = reference.encode(documents, batch_size=8, convert_to_numpy=True)
    assert np.abs(got - want).max() <= 1e-5
    queries = embedder(folder, prompt_name="query")
    assert queries.prompts.text == EMBEDDING_QUERY_PROMPT
    got = run(queries, {"text": _bytes(*QUERIES)})["embedding"]
    want = reference.encode(QUERIES, prompt_name="query", batch_size=8, convert_to_numpy=True)
    assert np.abs(got - want).max() <= 1e-5


def test_a_query_scores_with_its_prompt_against_documents_without(decoder_models: dict[str, Path]) -> None:
    """The ``query`` input (rerank and score by cosine) takes the query prompt; the text none."""
    folder = decoder_models["qwen3-embedder"]
    reference = library(folder)
    handler = embedder(folder, query_prompt_name="query")
    documents = posts(3, seed=13)
    out = run(handler, {"text": _bytes(*documents), "query": _bytes(*QUERIES)})
    q = reference.encode(QUERIES, prompt_name="query", convert_to_numpy=True)
    d = reference.encode(documents, convert_to_numpy=True)
    assert np.abs(out["score"][:, 0] - (q * d).sum(axis=1)).max() <= 1e-5
    assert np.abs(out["embedding"] - d).max() <= 1e-5


def test_prompts_are_checked(decoder_models: dict[str, Path]) -> None:
    folder = decoder_models["qwen3-embedder"]
    with pytest.raises(ValueError, match="not one of the folder's prompts"):
        embedder(folder, prompt_name="passage")
    with pytest.raises(ValueError, match="give one"):
        embedder(folder, prompt_name="query", prompt="Query: ")
    with pytest.raises(ValueError, match='truncation = "truncate"'):
        embedder(folder, prompt="Query: ", truncation="window")
    assert embedder(folder, query_prompt="Q: ", truncation="window").prompts.query == "Q: "


def model_card_scores(folder: Path, queries: list[str], documents: list[str], max_length: int) -> np.ndarray:
    """The Qwen3-Reranker model card's computation: prefix + the middle truncated to the room
    left + suffix, padded on the left, the last position's logits over the whole vocabulary,
    log-softmax over [no, yes], exp of yes."""
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, padding_side="left")
    tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    prefix = tokenizer.encode(RERANKER_PREFIX, add_special_tokens=False)
    suffix = tokenizer.encode(RERANKER_SUFFIX, add_special_tokens=False)
    instruction = "Given a web search query, retrieve relevant passages that answer the query"
    pairs = [
        f"<Instruct>: {instruction}\n<Query>: {q}\n<Document>: {d}"
        for q, d in zip(queries, documents, strict=True)
    ]
    inputs = tokenizer(pairs, padding=False, truncation="longest_first", return_attention_mask=False,
                       max_length=max_length - len(prefix) - len(suffix))  # fmt: skip
    inputs["input_ids"] = [prefix + ids + suffix for ids in inputs["input_ids"]]
    batch = tokenizer.pad(inputs, padding=True, return_tensors="pt")
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    with torch.inference_mode():
        logits = model(**batch).logits[:, -1, :]
        pair = torch.stack([logits[:, no], logits[:, yes]], dim=1)
        return torch.nn.functional.log_softmax(pair, dim=1)[:, 1].exp().numpy()


def reranker(folder: Path, **parameters: Any) -> CausalRerankHandler:
    handler = CausalRerankHandler()
    config = Config(folder.parent, {"model_dir": folder.name, **parameters}, [Spec("score", [1])])
    handler.load(torch.device("cpu"), config)
    return handler


@pytest.mark.parametrize("max_length", [1024, 160])
def test_reranker_equals_the_model_cards_computation(
    decoder_models: dict[str, Path], max_length: int
) -> None:
    """Mixed lengths in one batch; at 160 tokens the long documents are cut in the middle part,
    the prompt's head and tail kept."""
    folder = decoder_models["qwen3-reranker"]
    handler = reranker(folder, max_seq_length=max_length)
    documents = posts(6, seed=14)
    queries = [QUERIES[i % 3] for i in range(6)]
    out = run(handler, {"text": _bytes(*documents), "query": _bytes(*queries)})
    want = model_card_scores(folder, queries, documents, max_length)
    assert np.abs(out["score"][:, 0] - want).max() <= 1e-5
    assert int(out["tokens"].max()) <= max_length
    assert max_length == 1024 or int(out["tokens"].max()) == max_length  # a document was cut


def test_the_reranker_refuses_cuts_it_cannot_make(decoder_models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="truncate"):
        reranker(decoder_models["qwen3-reranker"], truncation="window")
    with pytest.raises(ValueError, match="leaves"):
        reranker(decoder_models["qwen3-reranker"], max_seq_length=40)


def test_a_query_that_leaves_the_document_too_little_room_is_refused(decoder_models: dict[str, Path]) -> None:
    """A cross-encoder's rule: a query (here with the instruction and the prompt's lines around
    it) may take at most half of what the prompt leaves; longer, the request is refused naming
    both, where it used to be cut until the documents were gone from the prompt and every one
    scored the same. A query within the bound still scores each document on its own."""
    handler = reranker(decoder_models["qwen3-reranker"], max_seq_length=160)
    documents = posts(3, seed=16)
    long_query = " ".join(posts(4, seed=17))
    with pytest.raises(ValueError, match=r"a query of \d+\+? tokens .*max_seq_length 160.*at most \d+"):
        handler.item_costs({"text": _bytes(*documents), "query": _bytes(*[long_query] * 3)})
    out = run(handler, {"text": _bytes(*documents), "query": _bytes(*[QUERIES[0]] * 3)})
    assert len(set(out["score"][:, 0].tolist())) == 3


def write_reranker(repo: Path, name: str, folder: Path) -> Path:
    """A model of ``app.handlers.causal_rerank`` serving ``folder``."""
    handler = "app.handlers.causal_rerank:CausalRerankHandler"
    return write_handler_model(
        repo, name, handler, folder, ["text BYTES", "query BYTES"], ["score FP32", "tokens INT64"]
    )


def write_embedder(repo: Path, name: str, folder: Path, parameters: str = "") -> Path:
    """A model of ``app.handlers.sentence_embedding`` serving ``folder`` (64-wide embeddings)."""
    handler = "app.handlers.sentence_embedding:SentenceEmbeddingHandler"
    outputs = ["embedding FP32 64", "tokens INT64"]
    return write_handler_model(repo, name, handler, folder, ["text BYTES"], outputs, parameters)


async def test_served_by_rerank_and_embeddings(
    make_client: Any, decoder_models: dict[str, Path], tmp_path: Path
) -> None:
    write_reranker(tmp_path, "reranker", decoder_models["qwen3-reranker"])
    write_embedder(tmp_path, "embedder", decoder_models["qwen3-embedder"])
    write_embedder(tmp_path, "embedder-query", decoder_models["qwen3-embedder"], 'prompt_name = "query"')
    http = await make_client(tmp_path)
    documents = posts(4, seed=15)
    resp = await http.post(
        "/v1/rerank", json={"model": "reranker", "query": QUERIES[0], "documents": documents}
    )
    assert resp.status == 200, await resp.text()
    ranked = (await resp.json())["results"]
    want = model_card_scores(decoder_models["qwen3-reranker"], [QUERIES[0]] * 4, documents, 1024)
    assert [r["index"] for r in ranked] == sorted(range(4), key=lambda i: -want[i])
    assert np.abs(np.array([r["relevance_score"] for r in ranked]) - np.sort(want)[::-1]).max() <= 1e-5
    long_query = " ".join(posts(40, seed=18))
    resp = await http.post("/v1/rerank", json={"model": "reranker", "query": long_query, "documents": documents})
    assert resp.status == 400 and "leaves too little room" in (await resp.json())["error"]["message"]
    reference = library(decoder_models["qwen3-embedder"])
    for name, texts, prompt in (("embedder", documents, None), ("embedder-query", QUERIES, "query")):
        resp = await http.post("/v1/embeddings", json={"model": name, "input": texts})
        assert resp.status == 200, await resp.text()
        got = np.array([row["embedding"] for row in (await resp.json())["data"]])
        assert np.abs(got - reference.encode(texts, prompt_name=prompt, convert_to_numpy=True)).max() <= 1e-5
