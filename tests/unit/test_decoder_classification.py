"""Decoder-only sequence classifiers (Llama, Qwen2, GPT-2 classes) through the
sequence-classification handler, on the small folders of ``tests/support/decoder_models.py``
(tokenizers without a pad token, as Llama's, Vicuna's and GPT-2's ship): the model becomes ready
in the server; a batch of 32 mixed-length posts equals the posts one by one; the probabilities
equal transformers' own forward on the same folder (one by one: the class needs no pad token for
one row; batched with the EOS token as pad, as its docs advise); padding on either side gives the
same results; bfloat16 serves."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from app.handlers.sequence_classification import SequenceClassificationHandler
from tests.support.decoder_models import CORPUS, LABELS
from tests.support.text_models import CLASSIFIER_TOML
from tests.unit.test_sequence_classification import Config, Spec, _bytes, _run

CLASSIFIERS = ("llama-classifier", "qwen2-classifier", "gpt2-classifier")


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
