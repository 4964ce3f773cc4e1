"""Shared-prefix scoring (app.handlers.shared_prefix) on the small decoder folders of
tests/support/decoder_models.py: every item's hidden states, last-token score, classifier logits
and token log-probs equal the item scored alone after its prefix (one ordinary forward of
``prefix + item``) within 1e-5 in float32, both ways (expand, packed), for Llama, Qwen2, Qwen3 and
GPT-2, with items of different lengths and a batch that mixes prefixes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from app.handlers.decoder_math import yes_no_score_from_hidden
from app.handlers.shared_prefix import (
    PrefixState,
    common_prefix_length,
    distinct_prefixes,
    encode_prefixes,
    item_log_likelihood,
    item_rows,
    pad_items,
    run_items,
    run_packed,
    unsupported,
)

#: kind -> (transformers class, attention implementations tested)
KINDS = {
    "llama-lm": ("AutoModelForCausalLM", ("sdpa", "eager")),
    "qwen3-reranker": ("AutoModelForCausalLM", ("sdpa",)),
    "gpt2-lm": ("AutoModelForCausalLM", ("sdpa", "eager")),
    "qwen2-classifier": ("AutoModelForSequenceClassification", ("sdpa",)),
    "gpt2-classifier": ("AutoModelForSequenceClassification", ("sdpa",)),
}
CASES = [(kind, attention) for kind, (_, attentions) in KINDS.items() for attention in attentions]
TOLERANCE = 1e-5


def load(folder: Path, kind: str, attention: str = "sdpa") -> Any:
    model_class = getattr(transformers, KINDS[kind][0])
    return model_class.from_pretrained(
        str(folder), attn_implementation=attention, local_files_only=True
    ).eval()


def tokens(rng: np.random.Generator, vocab: int, *lengths: int) -> list[np.ndarray]:
    return [rng.integers(3, vocab, size=n).astype(np.int32) for n in lengths]


@torch.inference_mode()
def alone(base: Any, prefix: np.ndarray, item: np.ndarray) -> torch.Tensor:
    """The final hidden states of ``prefix + item`` run whole, ``[P + T, H]``."""
    ids = torch.from_numpy(np.concatenate((prefix, item)).astype(np.int64))[None]
    return base(input_ids=ids).last_hidden_state[0]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def batch() -> tuple[list[np.ndarray], list[np.ndarray], list[int]]:
    """Two prefixes (7 and 12 tokens), six items of 1 to 9 tokens, their prefixes interleaved."""
    rng = np.random.default_rng(5)
    prefixes = tokens(rng, 600, 7, 12)
    items = tokens(rng, 600, 1, 5, 9, 3, 6, 2)
    return prefixes, items, [0, 1, 0, 1, 1, 0]


@pytest.mark.parametrize(("kind", "attention"), CASES)
def test_each_item_equals_the_item_scored_alone_both_ways(
    decoder_models: dict[str, Path], batch: Any, kind: str, attention: str
) -> None:
    model = load(decoder_models[kind], kind, attention)
    assert unsupported(model) is None
    base = model.base_model
    prefixes, items, owner = batch
    expected = [alone(base, prefixes[g], item) for item, g in zip(items, owner, strict=True)]
    states = encode_prefixes(base, prefixes)
    single = [b for b, g in enumerate(owner) if g == 1]
    packed_rows = item_rows(items, owner)
    assert packed_rows.input_ids.shape == (4, 9)  # (9 | 2 1) and (6 3 | 5): 4 rows, not 6
    every = list(range(len(items)))
    ways = {
        "expand, mixed prefixes, items binned in rows": (run_items(base, states, packed_rows), every),
        "expand, mixed prefixes, an item a row": (
            run_items(base, states, item_rows(items, owner, pack=False)),
            every,
        ),
        "expand, one prefix": (run_items(base, [states[1]], item_rows([items[b] for b in single])), single),
        "packed, mixed prefixes": (run_packed(base, prefixes, items, owner), every),
    }
    for way, (got, rows) in ways.items():
        for row, b in enumerate(rows):
            want, length, start = expected[b], len(items[b]), len(prefixes[owner[b]])
            assert got.attention_mask[row].sum() == length, way
            assert torch.equal(got.input_ids[row, :length], torch.from_numpy(items[b].astype(np.int64))), way
            assert (got.hidden[row, :length] - want[start:]).abs().max() <= TOLERANCE, (way, b)
            assert (got.last()[row] - want[-1]).abs().max() <= TOLERANCE, (way, b)
            assert (got.context[row] - want[start - 1]).abs().max() <= TOLERANCE, (way, b)
            assert got.context_ids[row] == int(prefixes[owner[b]][-1]), way


def test_a_prefix_state_is_compact_and_its_length_and_bytes_are_its_own(
    decoder_models: dict[str, Path], batch: Any
) -> None:
    base = load(decoder_models["qwen3-reranker"], "qwen3-reranker").base_model
    prefixes, _, _ = batch
    short, long = encode_prefixes(base, prefixes)
    (again,) = encode_prefixes(base, prefixes[:1])
    for state, prefix in ((short, prefixes[0]), (long, prefixes[1]), (again, prefixes[0])):
        assert isinstance(state, PrefixState) and state.length == len(prefix)
        assert state.last_id == int(prefix[-1])
        for tensor in (*state.keys, *state.values):
            assert tensor.shape == (1, 2, len(prefix), 16) and tensor.is_contiguous()
            assert tensor.untyped_storage().nbytes() == tensor.numel() * 4  # no view of the padded batch
        # 2 layers x (keys + values) x 2 heads x 16 + the hidden state (64), float32
        assert state.nbytes == (2 * 2 * 2 * 16 * len(prefix) + 64) * 4
    assert all(torch.allclose(a, b, atol=TOLERANCE) for a, b in zip(short.keys, again.keys, strict=True))


def test_the_reranker_score_equals_the_prompt_scored_whole(decoder_models: dict[str, Path]) -> None:
    """Qwen3-Reranker's shape: a query's prefix, documents of different lengths each followed
    by the same suffix; the yes/no score from the item's last token."""
    model = load(decoder_models["qwen3-reranker"], "qwen3-reranker")
    rng = np.random.default_rng(11)
    (prefix,), suffix = tokens(rng, 600, 40), tokens(rng, 600, 9)[0]
    documents = tokens(rng, 600, 3, 17, 30, 8)
    items = [np.concatenate((d, suffix)) for d in documents]
    states = encode_prefixes(model.base_model, [prefix])
    got = yes_no_score_from_hidden(
        run_items(model.base_model, states, item_rows(items)).last(), model.lm_head.weight, 7, 9
    )
    with torch.inference_mode():
        for row, item in enumerate(items):
            logits = model(
                input_ids=torch.from_numpy(np.concatenate((prefix, item)).astype(np.int64))[None]
            ).logits
            want = torch.sigmoid(logits[0, -1, 7] - logits[0, -1, 9])
            assert abs(float(got[row] - want)) <= TOLERANCE


@pytest.mark.parametrize("kind", ["qwen2-classifier", "gpt2-classifier"])
def test_a_classifiers_logits_equal_transformers_for_the_text_whole(
    decoder_models: dict[str, Path], batch: Any, kind: str
) -> None:
    model = load(decoder_models[kind], kind)
    prefixes, items, owner = batch
    states = encode_prefixes(model.base_model, prefixes)
    got = model.score(run_items(model.base_model, states, item_rows(items, owner)).last())
    with torch.inference_mode():
        for b, (item, g) in enumerate(zip(items, owner, strict=True)):
            text = torch.from_numpy(np.concatenate((prefixes[g], item)).astype(np.int64))[None]
            assert (got[b] - model(input_ids=text).logits[0]).abs().max() <= TOLERANCE


@pytest.mark.parametrize("kind", ["llama-lm", "gpt2-lm", "qwen3-reranker"])
def test_item_log_likelihood_scores_every_item_token_the_first_from_the_prefix(
    decoder_models: dict[str, Path], batch: Any, kind: str
) -> None:
    model = load(decoder_models[kind], kind)
    prefixes, items, owner = batch
    for way in ("expand", "packed"):
        states = (
            run_items(model.base_model, encode_prefixes(model.base_model, prefixes), item_rows(items, owner))
            if way == "expand"
            else run_packed(model.base_model, prefixes, items, owner)
        )
        got = item_log_likelihood(model.get_output_embeddings(), states, per_token=True, chunk_bytes=1)
        assert got.token_logprobs is not None
        assert got.count.tolist() == [len(item) for item in items]
        with torch.inference_mode():
            for b, (item, g) in enumerate(zip(items, owner, strict=True)):
                text = np.concatenate((prefixes[g], item)).astype(np.int64)
                logits = model(input_ids=torch.from_numpy(text)[None]).logits[0].float()
                start = len(prefixes[g])
                want = torch.log_softmax(logits[start - 1 : -1], dim=-1).gather(
                    -1, torch.from_numpy(item.astype(np.int64))[:, None]
                )[:, 0]
                assert (got.token_logprobs[b, 1 : 1 + len(item)] - want).abs().max() <= TOLERANCE, (way, b)
                assert got.token_logprobs[b, 0] == 0 and (got.token_logprobs[b, 1 + len(item) :] == 0).all()
                assert abs(float(got.total[b] - want.sum())) <= TOLERANCE * len(item)


def test_what_cannot_be_shared_says_why(decoder_models: dict[str, Path]) -> None:
    model = load(decoder_models["qwen3-reranker"], "qwen3-reranker")
    config = model.config
    config._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in str(unsupported(model))
    config._attn_implementation = "sdpa"
    config.layer_types = ["full_attention", "sliding_attention"]
    assert "sliding window" in str(unsupported(model))
    config.layer_types = ["full_attention", "full_attention"]
    config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    assert "dynamic" in str(unsupported(model))
    config.model_type = "gemma2"
    assert "gemma2" in str(unsupported(model))


def test_equal_prefixes_run_once_and_a_common_prefix_leaves_each_row_a_token() -> None:
    a, b = np.array([1, 2, 3], dtype=np.int32), np.array([1, 2], dtype=np.int64)
    distinct, owner = distinct_prefixes([a, b, a.astype(np.int64), b])
    assert [d.tolist() for d in distinct] == [[1, 2, 3], [1, 2]] and owner.tolist() == [0, 1, 0, 1]
    rows = [np.array(r) for r in ([5, 6, 7, 8], [5, 6, 7, 9, 1], [5, 6, 2])]
    assert common_prefix_length(rows) == 2
    assert common_prefix_length([np.array([5, 6]), np.array([5, 6, 7])]) == 1  # the shorter keeps one
    assert common_prefix_length([np.array([5, 6])]) == 0
    assert common_prefix_length([np.array([4, 6]), np.array([5, 6])]) == 0
    with pytest.raises(ValueError, match="at least one token"):
        pad_items([np.array([1]), np.array([], dtype=np.int64)])


def test_items_are_binned_by_prefix_in_rows_of_the_longest_items_length() -> None:
    items = [np.arange(n) + 1 for n in (8, 3, 5, 2, 4, 1, 7)]
    rows = item_rows(items, [0, 0, 0, 0, 1, 1, 0])
    assert rows.input_ids.shape[1] == 8 and rows.tokens == rows.input_ids.numel()
    # prefix 0, longest first: 8 | 7 | 5, then 3 in the fullest bin it fits (beside 5) | 2; prefix 1: 4 1
    bins = {tuple(sorted(set(row.tolist()) - {-1})) for row in rows.segment}
    assert bins == {(0,), (6,), (1, 2), (3,), (4, 5)}
    for b, item in enumerate(items):
        row, start = int(rows.row[b]), int(rows.start[b])
        assert rows.input_ids[row, start : start + len(item)].tolist() == item.tolist()
        assert rows.offset[row, start : start + len(item)].tolist() == list(range(len(item)))
        assert int(rows.owner[row]) == [0, 0, 0, 0, 1, 1, 0][b]
    alone = item_rows(items, pack=False)
    assert alone.input_ids.shape == (7, 8) and alone.row.tolist() == list(range(7))
    with pytest.raises(ValueError, match="owner must give"):
        item_rows(items, [0, 1])
