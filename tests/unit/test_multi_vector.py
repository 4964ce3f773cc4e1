"""MultiVectorHandler against PyLate's own ColBERT on the same folder (a small ColBERT PyLate built
from a BERT folder and saved: tests/support/retrieval_models.py; PyLate runs in a process of its
own, tests/support/pylate_reference.py), in process: the same rows within 1e-5 for queries and
documents, MaxSim equal to PyLate's colbert_scores; long documents in windows; what the handler
refuses."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from app.handlers.multi_vector import MultiVectorHandler
from app.models.base import PREPARED
from tests.support.retrieval_models import colbert_config, write_colbert_folder
from tests.support.text_handlers import input_types, run, run_in_windows, texts

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
    queries = run(handler, {"text": texts(*QUERIES), "input_type": input_types(*["query"] * len(QUERIES))})
    documents = run(handler, {"text": texts(*DOCUMENTS)})  # no input_type: documents
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
    result = run(handler, {"text": texts(*[d for _, d in pairs]), "query": texts(*[q for q, _ in pairs])})
    scores = result["score"].reshape(len(QUERIES), len(DOCUMENTS))
    np.testing.assert_allclose(scores, reference["scores"], atol=TOLERANCE, rtol=0)
    without = run(handler, {"text": texts(DOCUMENTS[0]), "query": texts("")})
    assert without["score"][0, 0] == 0.0


def test_a_rerank_request_prices_and_encodes_its_query_once(
    model: tuple[Path, dict[str, np.ndarray]],
) -> None:
    folder, _ = model
    handler = _load(folder)
    inputs = {"text": texts(*DOCUMENTS[:3]), "query": texts(*[QUERIES[0]] * 3)}
    priced = handler.item_costs(inputs)
    documents = handler.item_costs({"text": texts(*DOCUMENTS[:3])})
    assert priced.costs.tolist() == [documents.costs[0] + 12, *documents.costs[1:].tolist()]
    batch = handler.preprocess({**inputs, PREPARED: priced.prepared})
    assert sum(int(g["input_ids"].shape[0]) for g in batch.groups) == 4  # three documents, one query


def test_a_long_document_in_windows_is_its_windows_rows_in_order(
    model: tuple[Path, dict[str, np.ndarray]],
) -> None:
    folder, reference = model
    handler = _load(folder, truncation="window")
    windows = run_in_windows(handler, {"text": texts(DOCUMENTS[-1], QUERIES[0])})
    assert windows.counts[0] > 1 and windows.counts[1] == 1
    per_window, merged = windows.per_window, windows.merged
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
    long_query = {"text": texts(DOCUMENTS[-1]), "input_type": input_types("query")}
    whole = run(handler, long_query)
    windows = run_in_windows(handler, long_query)
    assert windows.counts[0] > 1
    assert [len(r) for r in windows.per_window["embedding"]] == [12] + [0] * (windows.counts[0] - 1)
    np.testing.assert_allclose(windows.merged["embedding"][0], whole["embedding"][0], atol=TOLERANCE, rtol=0)


def test_what_the_handler_refuses(model: tuple[Path, dict[str, np.ndarray]]) -> None:
    folder, _ = model
    handler = _load(folder)
    with pytest.raises(ValueError, match=r"is a query .* with a query to score"):
        handler.item_costs({"text": texts("a"), "query": texts("b"), "input_type": input_types("query")})
    with pytest.raises(ValueError, match="truncate_prompt_tokens applies to documents"):
        handler.item_costs(
            {
                "text": texts("a b c"),
                "input_type": input_types("query"),
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
    inputs = {"text": texts("one two three four five six"), "truncate_prompt_tokens": np.array([[4]])}
    result = run(handler, inputs)
    assert result["tokens"][0, 0] == 5  # [CLS] five six [SEP], and the marker
    cut = run(handler, {"text": texts("five six")})
    np.testing.assert_allclose(result["embedding"][0], cut["embedding"][0], atol=TOLERANCE, rtol=0)


def test_transformers_encoder_gives_the_same_rows(model: tuple[Path, dict[str, np.ndarray]]) -> None:
    folder, reference = model
    handler = _load(folder, attn_implementation="eager")  # not our BERT encoder: transformers' AutoModel
    assert type(handler.model).__module__.startswith("transformers.")
    documents = run(handler, {"text": texts(*DOCUMENTS)})
    for j in range(len(DOCUMENTS)):
        np.testing.assert_allclose(documents["embedding"][j], reference[f"d{j}"], atol=TOLERANCE, rtol=0)
