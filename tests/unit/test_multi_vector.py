"""MultiVectorHandler against PyLate's own ColBERT on the same folder (a small ColBERT PyLate built
from a BERT folder and saved: tests/support/retrieval_models.py; PyLate runs in a process of its
own, tests/support/pylate_reference.py), in process: the same rows within 1e-5 for queries and
documents, MaxSim equal to PyLate's colbert_scores; long documents in windows; what the handler
refuses."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from app.handlers.multi_vector import MultiVectorHandler
from app.handlers.text_config import INPUT_TYPES
from app.handlers.windows import merge_outputs
from app.models.base import PREPARED
from tests.support.retrieval_models import colbert_config, write_colbert_folder

QUERIES = [
    "what is the sea?",
    "  Mountains and rivers ",
    "a",
    "ünïcödé question about everything and more, than twelve tokens",
]
DOCUMENTS = [
    "The sea, is big! and blue.",
    "hello",
    "Mountains (high ones) and rivers; lakes too... " * 3,
    "?!.",
    "  leading and trailing spaces  ",
    " ".join(f"sentence {i} talks about the weather and the sea" for i in range(12)),
]
TOLERANCE = 1e-5
DIM = 16


def _types(*tasks: str) -> np.ndarray:
    """``input_type`` per item: "" (0), "query" (1), "document" (2)."""
    return np.array([[INPUT_TYPES.index(t)] for t in tasks], dtype=np.int64)


def _bytes(*texts: str) -> np.ndarray:
    array = np.empty(len(texts), dtype=object)
    array[:] = [t.encode() for t in texts]
    return array


def _run(handler: MultiVectorHandler, inputs: Mapping[str, np.ndarray]) -> dict[str, Any]:
    priced = handler.item_costs(inputs)
    batch = handler.preprocess({**inputs, PREPARED: priced.prepared})
    with torch.inference_mode():
        return dict(handler.postprocess(handler.predict(batch)))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, np.ndarray]]]:
    tmp = tmp_path_factory.mktemp("colbert")
    reference = write_colbert_folder(
        tmp / "pylate", seed=4, embedding_size=DIM, query_length=12, document_length=40,
        queries=QUERIES, documents=DOCUMENTS,
    )  # fmt: skip
    yield tmp / "pylate", reference


def _load(folder: Path, **parameters: Any) -> MultiVectorHandler:
    handler = MultiVectorHandler()
    handler.load(torch.device("cpu"), colbert_config(folder, DIM, **parameters))
    return handler


def test_queries_and_documents_equal_pylate(model: tuple[Path, dict[str, np.ndarray]]) -> None:
    folder, reference = model
    handler = _load(folder)
    queries = _run(handler, {"text": _bytes(*QUERIES), "input_type": _types(*["query"] * len(QUERIES))})
    documents = _run(handler, {"text": _bytes(*DOCUMENTS)})  # no input_type: documents
    for i in range(len(QUERIES)):
        assert (
            queries["embedding"][i].shape == reference[f"q{i}"].shape == (12, DIM)
        )  # expanded to query_length
        np.testing.assert_allclose(queries["embedding"][i], reference[f"q{i}"], atol=TOLERANCE, rtol=0)
    for j in range(len(DOCUMENTS)):
        assert documents["embedding"][j].shape == reference[f"d{j}"].shape, f"document {j}"
        np.testing.assert_allclose(documents["embedding"][j], reference[f"d{j}"], atol=TOLERANCE, rtol=0)
    assert documents["embedding"][3].shape[0] == 3  # "?!.": [CLS] [D] [SEP], the punctuation dropped
    norms = np.linalg.norm(documents["embedding"][0], axis=1)
    np.testing.assert_allclose(norms, 1.0, atol=1e-6)
    assert queries["tokens"].reshape(-1).tolist() == [12] * len(QUERIES)
    assert documents["tokens"][2, 0] == 40  # cut at document_length, the marker included


def test_maxsim_equals_pylate_colbert_scores(model: tuple[Path, dict[str, np.ndarray]]) -> None:
    folder, reference = model
    handler = _load(folder)
    pairs = [(q, d) for q in QUERIES for d in DOCUMENTS]
    result = _run(handler, {"text": _bytes(*[d for _, d in pairs]), "query": _bytes(*[q for q, _ in pairs])})
    scores = result["score"].reshape(len(QUERIES), len(DOCUMENTS))
    np.testing.assert_allclose(scores, reference["scores"], atol=TOLERANCE, rtol=0)
    without = _run(handler, {"text": _bytes(DOCUMENTS[0]), "query": _bytes("")})
    assert without["score"][0, 0] == 0.0


def test_a_rerank_request_prices_and_encodes_its_query_once(
    model: tuple[Path, dict[str, np.ndarray]],
) -> None:
    folder, _ = model
    handler = _load(folder)
    inputs = {"text": _bytes(*DOCUMENTS[:3]), "query": _bytes(*[QUERIES[0]] * 3)}
    priced = handler.item_costs(inputs)
    documents = handler.item_costs({"text": _bytes(*DOCUMENTS[:3])})
    assert priced.costs.tolist() == [documents.costs[0] + 12, *documents.costs[1:].tolist()]
    batch = handler.preprocess({**inputs, PREPARED: priced.prepared})
    assert sum(int(g["input_ids"].shape[0]) for g in batch.groups) == 4  # three documents, one query


def test_a_long_document_in_windows_is_its_windows_rows_in_order(
    model: tuple[Path, dict[str, np.ndarray]],
) -> None:
    folder, reference = model
    handler = _load(folder, truncation="window")
    long_text = DOCUMENTS[-1]
    spans = handler.split_windows([long_text, QUERIES[0]], None)
    assert len(spans[0]) > 1 and len(spans[1]) == 1
    items = [s for text in spans for s in text]
    prepared = np.empty(len(items), dtype=object)
    prepared[:] = [s.prepared for s in items]
    texts = [long_text[s.start : s.stop] for s in spans[0]] + [QUERIES[0]]
    per_window = _run(handler, {"text": _bytes(*texts), PREPARED: prepared})
    counts = np.array([len(spans[0]), 1], dtype=np.int64)
    merged = merge_outputs(per_window, handler.window_merges, counts, np.ones(len(items), dtype=np.int64))
    rows = merged["embedding"][0]
    assert rows.shape == (sum(len(r) for r in per_window["embedding"][:-1]), DIM)
    np.testing.assert_array_equal(rows, np.concatenate(list(per_window["embedding"][:-1])))
    assert rows.shape[0] > reference["d5"].shape[0]  # the whole text, not its first 40 tokens
    # the first window is the first 40 tokens PyLate cuts the document to: the same rows
    np.testing.assert_allclose(rows[: len(reference["d5"])], reference["d5"], atol=TOLERANCE, rtol=0)
    np.testing.assert_array_equal(merged["embedding"][1], per_window["embedding"][-1])


def test_a_long_query_is_cut_at_query_length_in_windows_too(
    model: tuple[Path, dict[str, np.ndarray]],
) -> None:
    folder, _ = model
    handler = _load(folder, truncation="window")
    long_query = DOCUMENTS[-1]
    whole = _run(handler, {"text": _bytes(long_query), "input_type": _types("query")})
    spans = handler.split_windows([long_query], None)
    prepared = np.empty(len(spans[0]), dtype=object)
    prepared[:] = [s.prepared for s in spans[0]]
    texts = [long_query[s.start : s.stop] for s in spans[0]]
    inputs = {"text": _bytes(*texts), "input_type": _types(*["query"] * len(texts)), PREPARED: prepared}
    per_window = _run(handler, inputs)
    assert [len(r) for r in per_window["embedding"]] == [12] + [0] * (len(texts) - 1)
    merged = merge_outputs(per_window, handler.window_merges, np.array([len(texts)]), np.ones(len(texts)))
    np.testing.assert_allclose(merged["embedding"][0], whole["embedding"][0], atol=TOLERANCE, rtol=0)


def test_what_the_handler_refuses(model: tuple[Path, dict[str, np.ndarray]]) -> None:
    folder, _ = model
    handler = _load(folder)
    with pytest.raises(ValueError, match=r"is a query .* with a query to score"):
        handler.item_costs({"text": _bytes("a"), "query": _bytes("b"), "input_type": _types("query")})
    with pytest.raises(ValueError, match="truncate_prompt_tokens applies to documents"):
        handler.item_costs(
            {
                "text": _bytes("a b c"),
                "input_type": _types("query"),
                "truncate_prompt_tokens": np.array([[3]]),
            }
        )
    config = colbert_config(folder, 128)
    with pytest.raises(ValueError, match=r"shape = \[-1, 16\], ragged = true"):
        MultiVectorHandler().load(torch.device("cpu"), config)


def test_truncate_prompt_tokens_keeps_a_documents_last_tokens(
    model: tuple[Path, dict[str, np.ndarray]],
) -> None:
    folder, _ = model
    handler = _load(folder)
    inputs = {"text": _bytes("one two three four five six"), "truncate_prompt_tokens": np.array([[4]])}
    result = _run(handler, inputs)
    assert result["tokens"][0, 0] == 5  # [CLS] five six [SEP], and the marker
    cut = _run(handler, {"text": _bytes("five six")})
    np.testing.assert_allclose(result["embedding"][0], cut["embedding"][0], atol=TOLERANCE, rtol=0)


def test_transformers_encoder_gives_the_same_rows(model: tuple[Path, dict[str, np.ndarray]]) -> None:
    folder, reference = model
    handler = _load(folder, attn_implementation="eager")  # not our BERT encoder: transformers' AutoModel
    assert type(handler.model).__module__.startswith("transformers.")
    documents = _run(handler, {"text": _bytes(*DOCUMENTS)})
    for j in range(len(DOCUMENTS)):
        np.testing.assert_allclose(documents["embedding"][j], reference[f"d{j}"], atol=TOLERANCE, rtol=0)
