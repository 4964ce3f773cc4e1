"""Decoder-only sequence classifiers (Llama, Qwen2, GPT-2 classes) through the
sequence-classification handler, on the small folders of ``tests/support/decoder_models.py``
(tokenizers without a pad token, as Llama's, Vicuna's and GPT-2's ship): the model becomes ready
in the server; a batch of 32 mixed-length posts equals the posts one by one; the probabilities
equal transformers' own forward on the same folder (one by one: the class needs no pad token for
one row; batched with the EOS token as pad, as its docs advise); padding on either side gives the
same results; bfloat16 serves."""

from __future__ import annotations

import json
import random
import shutil
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from app.handlers.sequence_classification import SequenceClassificationHandler
from app.handlers.windows import piece_spans
from app.models.base import PREPARED, Handler
from tests.support.decoder_models import CORPUS, LABELS
from tests.support.text_models import CLASSIFIER_TOML
from tests.unit.test_sequence_classification import Config, Spec, _bytes, _run, _windowed

CLASSIFIERS = ("llama-classifier", "qwen2-classifier", "gpt2-classifier")


def run(handler: Handler, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One batch through a text handler's preprocess, predict and postprocess."""
    with torch.inference_mode():
        return dict(handler.postprocess(handler.predict(handler.preprocess(inputs))))


def posts(count: int, seed: int = 0) -> list[str]:
    """``count`` posts of 1 to 12 sentences of the tokenizers' corpus (mixed lengths)."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(CORPUS, k=rng.randint(1, 12))) for _ in range(count)]


def load(folder: Path, **parameters: Any) -> SequenceClassificationHandler:
    handler = SequenceClassificationHandler()
    outputs = [Spec("probabilities", [len(LABELS)], list(LABELS)), Spec("score", [1])]
    handler.load(
        torch.device("cpu"), Config(folder.parent, {"model_dir": folder.name, **parameters}, outputs)
    )
    return handler


def reference_one_by_one(folder: Path, texts: list[str]) -> np.ndarray:
    """transformers' own: each text alone through the folder's class (no padding, so no pad token
    needed), softmax over the logits."""
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(folder, local_files_only=True).eval()
    rows = []
    with torch.inference_mode():
        for text in texts:
            rows.append(torch.softmax(model(**tokenizer(text, return_tensors="pt")).logits, -1)[0])
    return torch.stack(rows).numpy()


@pytest.mark.parametrize("kind", CLASSIFIERS)
def test_probabilities_equal_transformers_one_by_one(decoder_models: dict[str, Path], kind: str) -> None:
    texts = posts(6, seed=1)
    handler = load(decoder_models[kind], call_overhead_tokens=8.0, attention_knee_tokens=4096.0)
    assert handler.decoder and handler.tokenizer.pad_id is not None
    out = _run(handler, {"text": _bytes(*texts)})
    assert np.abs(out["probabilities"] - reference_one_by_one(decoder_models[kind], texts)).max() <= 1e-5


def test_a_batch_of_32_mixed_lengths_equals_the_posts_one_by_one(decoder_models: dict[str, Path]) -> None:
    texts = posts(32, seed=2)
    handler = load(decoder_models["llama-classifier"])
    batched = _run(handler, {"text": _bytes(*texts)})
    alone = np.concatenate([_run(handler, {"text": _bytes(t)})["probabilities"] for t in texts])
    assert len({len(handler.tokenizer.encode([t])[0]) for t in texts}) > 10  # mixed lengths
    assert np.abs(batched["probabilities"] - alone).max() <= 1e-5
    assert batched["tokens"].reshape(-1).tolist() == [len(handler.tokenizer.encode([t])[0]) for t in texts]


def test_the_eos_token_pads_and_the_config_agrees_with_transformers_batched(
    decoder_models: dict[str, Path],
) -> None:
    """transformers' class pools the last token that is not its config's pad id: told the same
    pad token, its batched forward gives the handler's probabilities."""
    folder = decoder_models["llama-classifier"]
    handler = load(folder)
    assert handler.tokenizer.pad_id == handler.tokenizer.token_to_id("</s>")
    assert handler.model.config.pad_token_id == handler.tokenizer.pad_id
    texts = posts(8, seed=3)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(folder, local_files_only=True).eval()
    model.config.pad_token_id = tokenizer.pad_token_id
    with torch.inference_mode():
        want = torch.softmax(model(**tokenizer(texts, padding=True, return_tensors="pt")).logits, -1)
    got = _run(handler, {"text": _bytes(*texts)})["probabilities"]
    assert np.abs(got - want.numpy()).max() <= 1e-5


def test_left_padding_gives_the_same_results(decoder_models: dict[str, Path], tmp_path: Path) -> None:
    """GPT-2's learned positions: rows padded on the left run with position ids from their
    first real token, so they equal the rows alone."""
    folder = shutil.copytree(decoder_models["gpt2-classifier"], tmp_path / "gpt2")
    config = (folder / "tokenizer_config.json").read_text().replace('"right"', '"left"')
    (folder / "tokenizer_config.json").write_text(config)
    handler = load(folder)
    assert handler.tokenizer.padding_side == "left"
    texts = posts(8, seed=4)
    got = _run(handler, {"text": _bytes(*texts)})["probabilities"]
    assert np.abs(got - reference_one_by_one(folder, texts)).max() <= 1e-5


def test_bfloat16_serves_close_to_float32(decoder_models: dict[str, Path]) -> None:
    texts = posts(8, seed=5)
    full = _run(load(decoder_models["llama-classifier"]), {"text": _bytes(*texts)})["probabilities"]
    half = load(decoder_models["llama-classifier"], dtype="bfloat16")
    assert next(half.model.parameters()).dtype == torch.bfloat16
    got = _run(half, {"text": _bytes(*texts)})["probabilities"]
    assert got.dtype == np.float32 and np.abs(got - full).max() < 0.05


def test_long_posts_take_windows_each_with_its_bos(decoder_models: dict[str, Path]) -> None:
    handler = load(decoder_models["llama-classifier"], max_seq_length=64, stride=8)
    windows = handler.split_windows([" ".join(CORPUS)], None)[0]
    assert len(windows) > 3
    bos = handler.tokenizer.token_to_id("<s>")
    assert all(int(w.prepared[0][0]) == bos and len(w.prepared[0]) <= 64 for w in windows)


def write_decoder_classifier(repo: Path, folder: Path, name: str = "radar", parameters: str = "") -> Path:
    """A model folder ``repo/name`` serving the decoder folder ``folder`` (copied in as ``hf``)."""
    model = repo / name
    model.mkdir(parents=True)
    shutil.copytree(folder, model / "hf")
    labels = "[" + ", ".join(f'"{label}"' for label in LABELS) + "]"
    toml = CLASSIFIER_TOML.format(name=name, num_labels=len(LABELS), labels=labels, parameters=parameters)
    (model / "model.toml").write_text(
        toml.replace("warmup_batch_sizes = [1, 16]", "warmup_batch_sizes = [1, 4]")
    )
    return model


async def test_the_llama_classifier_without_a_pad_token_becomes_ready(
    make_client: Any, decoder_models: dict[str, Path], tmp_path: Path
) -> None:
    """The server warms it up at batch sizes 1 and 4 (warmup texts of different lengths) and
    serves /v1/classify: padding needs the fallback pad token."""
    write_decoder_classifier(tmp_path, decoder_models["llama-classifier"])
    http = await make_client(tmp_path)
    texts = posts(5, seed=6)
    resp = await http.post("/v1/classify", json={"model": "radar", "input": texts})
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    got = np.array([row["probs"] for row in body["data"]])
    want = reference_one_by_one(decoder_models["llama-classifier"], texts)
    assert np.abs(got - want).max() <= 1e-5
    assert [row["label"] for row in body["data"]] == [LABELS[int(i)] for i in want.argmax(1)]


def test_a_long_post_in_pieces_gives_each_pieces_result_and_the_aggregate(
    decoder_models: dict[str, Path],
) -> None:
    """A 1,500-word post in pieces of at most 300 characters on word boundaries, through the
    window stage as the server runs it: the ``pieces`` output holds each piece's span and
    probabilities, equal to the piece run alone through transformers; ``probabilities`` is their
    ``aggregate`` (max), ``windows`` the pieces' count, in the same answer."""
    folder = decoder_models["llama-classifier"]
    handler = SequenceClassificationHandler()
    outputs = [
        Spec("probabilities", [len(LABELS)], list(LABELS)),
        Spec("score", [1]),
        Spec("windows", [1], datatype="INT64"),
        Spec("pieces", [1], datatype="BYTES"),
    ]
    parameters = {"model_dir": folder.name, "truncation": "pieces", "piece_chars": 300, "max_windows": 64}
    handler.load(torch.device("cpu"), Config(folder.parent, parameters, outputs))
    words = " ".join(CORPUS).split()
    post = " ".join(words[i % len(words)] for i in range(1500))
    short = "A short post."
    out, items = _windowed(handler, {"text": _bytes(short, post)})
    spans = piece_spans(post, 300)
    assert len(spans) > 25 and all(stop - start <= 300 for start, stop in spans)
    assert out["windows"].reshape(-1).tolist() == [1, len(spans)]
    pieces = [json.loads(row) for row in out["pieces"].reshape(-1)]
    assert [(p["start"], p["stop"]) for p in pieces[1]] == spans
    assert [(p["start"], p["stop"]) for p in pieces[0]] == [(0, len(short))]
    alone = reference_one_by_one(folder, [post[a:b] for a, b in spans])
    got = np.array([p["probabilities"] for p in pieces[1]])
    assert np.abs(got - alone).max() <= 1e-5
    assert np.abs(out["probabilities"][1] - alone.max(axis=0)).max() <= 1e-5
    assert np.abs(out["probabilities"][0] - reference_one_by_one(folder, [short])[0]).max() <= 1e-5
    assert len(items["text"]) == 1 + len(spans)
    whole = _run(handler, {"text": _bytes(short)})["pieces"]  # no split: tokenized when priced
    assert [(p["start"], p["stop"]) for p in json.loads(whole[0, 0])] == [(0, len(short))]


def pieces_handler(folder: Path) -> SequenceClassificationHandler:
    """The RADAR model.toml's cut (pieces of at most 300 characters, 128 tokens) with ``pieces``."""
    handler = SequenceClassificationHandler()
    outputs = [
        Spec("probabilities", [len(LABELS)], list(LABELS)),
        Spec("windows", [1], datatype="INT64"),
        Spec("tokens", [1], datatype="INT64"),
        Spec("pieces", [1], datatype="BYTES"),
    ]
    parameters = {"model_dir": folder.name, "truncation": "pieces", "piece_chars": 300,
                  "max_seq_length": 128, "max_windows": 64}  # fmt: skip
    handler.load(torch.device("cpu"), Config(folder.parent, parameters, outputs))
    return handler


def overflow_windows(folder: Path, text: str, max_length: int, stride: int) -> tuple[np.ndarray, list[list[int]]]:
    """transformers' tokenizer's overflow windows of ``text`` (``stride``) and each one's
    probabilities, run alone through the folder's class."""
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(folder, local_files_only=True).eval()
    ids = tokenizer(text, truncation=True, max_length=max_length, stride=stride, return_overflowing_tokens=True)
    with torch.inference_mode():
        rows = [torch.softmax(model(input_ids=torch.tensor([w])).logits, -1)[0] for w in ids["input_ids"]]
    return torch.stack(rows).numpy(), [list(w) for w in ids["input_ids"]]


def test_a_piece_over_max_seq_length_is_split_again_by_tokens(decoder_models: dict[str, Path]) -> None:
    """Chinese (about 3 byte-level tokens a character) and emoji in pieces shorter than 300
    characters and far longer than 128 tokens: each such piece is split into the tokenizer's
    overflow windows of that piece (128 tokens, the stride of windows), each scored, nothing cut
    silently. Each window's reported span is exact: a piece's windows cover it end to end,
    overlapping, each the characters its tokens come from."""
    folder = decoder_models["llama-classifier"]
    handler = pieces_handler(folder)
    chinese, emoji = "東京大學的圖書館" * 31, "🙂🚆🍞" * 40
    post = f"A short opening sentence. {chinese} and then {emoji} to end."
    out, items = _windowed(handler, {"text": _bytes(post)})
    pieces = json.loads(out["pieces"][0, 0])
    stride = handler.window_policy.stride
    spans: list[tuple[int, int]] = []
    rows: list[np.ndarray] = []
    ids: list[list[int]] = []
    for start, stop in piece_spans(post, 300):
        probabilities, windows = overflow_windows(folder, post[start:stop], 128, stride)
        got = [(p["start"], p["stop"]) for p in pieces[len(spans) : len(spans) + len(windows)]]
        assert got[0][0] == start and got[-1][1] == stop
        assert all(a < b and a2 < b <= b2 for (a, b), (a2, b2) in pairwise(got))
        spans += got
        rows += list(probabilities)
        ids += windows
    assert len(pieces) == len(ids) == int(out["windows"][0, 0]) > len(piece_spans(post, 300)) + 4
    assert [list(p[0]) for p in items[PREPARED]] == ids and all(len(w) <= 128 for w in ids)
    assert np.abs(np.array([p["probabilities"] for p in pieces]) - np.array(rows)).max() <= 1e-5
    assert int(out["tokens"][0, 0]) == sum(len(w) for w in ids)


def test_a_texts_surrounding_white_space_counts_the_same_at_any_length(decoder_models: dict[str, Path]) -> None:
    """In pieces a piece is its words and the spaces between them, whatever the text's length:
    a short text that skips the window stage and a longer one split there score the same with
    or without white space around them, and report the same spans."""
    handler = pieces_handler(decoder_models["llama-classifier"])
    short, longer = "Hello there.", " ".join(CORPUS[:2])
    assert len(short) + 4 <= 128 < len(longer) <= 300
    for text in (short, longer):
        plain, _ = _windowed(handler, {"text": _bytes(text)})
        for padded in (text + " ", text + "\n", "  " + text + " "):
            out, _ = _windowed(handler, {"text": _bytes(padded)})
            assert out["tokens"][0, 0] == plain["tokens"][0, 0], (padded, out["tokens"], plain["tokens"])
            assert np.array_equal(out["probabilities"], plain["probabilities"])
            start = padded.index(text[0])
            assert [(p["start"], p["stop"]) for p in json.loads(out["pieces"][0, 0])] == [(start, start + len(text))]


def test_piece_spans_cut_on_word_boundaries() -> None:
    text = "aaa bb  cccccccccc d e\nf"
    assert [text[a:b] for a, b in piece_spans(text, 4)] == ["aaa", "bb", "cccc", "cccc", "cc d", "e\nf"]
    assert piece_spans("   ", 3) == [(0, 3)] and piece_spans("", 3) == [(0, 0)]
    words = "the quick brown fox jumps over the lazy dog " * 50
    spans = piece_spans(words, 300)
    assert all(b - a <= 300 for a, b in spans)
    assert " ".join(words[a:b] for a, b in spans).split() == words.split()  # every word, once


async def test_pieces_over_v2_in_one_answer(
    make_client: Any, decoder_models: dict[str, Path], tmp_path: Path
) -> None:
    """The RADAR-style model.toml (pieces of at most 300 characters, batches of 32) over V2: one
    answer holds the aggregate and, as BYTES JSON, each piece's result."""
    model = write_decoder_classifier(
        tmp_path,
        decoder_models["llama-classifier"],
        parameters='truncation = "pieces"\npiece_chars = 300\nmax_windows = 64',
    )
    toml = (model / "model.toml").read_text().replace("max_batch_size = 16", "max_batch_size = 32")
    (model / "model.toml").write_text(
        toml + '\n[[outputs]]\nname = "pieces"\ndatatype = "BYTES"\nshape = [1]\n'
    )
    http = await make_client(tmp_path)
    words = " ".join(CORPUS).split()
    post = " ".join(words[(7 * i) % len(words)] for i in range(1500))
    body = {
        "inputs": [{"name": "text", "shape": [2, 1], "datatype": "BYTES", "data": ["Hello there.", post]}],
        "outputs": [{"name": "probabilities"}, {"name": "pieces"}, {"name": "windows"}],
    }
    resp = await http.post("/v2/models/radar/infer", json=body)
    assert resp.status == 200, await resp.text()
    outputs = {o["name"]: o for o in (await resp.json())["outputs"]}
    pieces = [json.loads(row) for row in outputs["pieces"]["data"]]
    spans = piece_spans(post, 300)
    assert outputs["windows"]["data"] == [1, len(spans)] and len(pieces[1]) == len(spans)
    probabilities = np.array(outputs["probabilities"]["data"]).reshape(2, len(LABELS))
    assert np.abs(probabilities[1] - np.array([p["probabilities"] for p in pieces[1]]).max(0)).max() <= 1e-6
