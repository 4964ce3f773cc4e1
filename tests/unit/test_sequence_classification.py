"""The sequence-classification handler in process, on small BERT classifiers of the real class:
probabilities and cross-encoder scores equal the libraries' own (transformers' forward with its
pipeline's activation, sentence-transformers' ``CrossEncoder.predict``); long texts in windows
equal the documented aggregation of the library's outputs on the same windows; bad input is
refused before it runs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from sentence_transformers import CrossEncoder
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from app.errors import PayloadTooLarge
from app.handlers import windows
from app.handlers.sequence_classification import SequenceClassificationHandler
from tests.support.text_models import write_classifier_folder

LABELS = ["ok", "insult", "threat"]
SHORT = ["a short post", "you are all wonderful people", "ünïcödé text"]
LONG = " ".join(f"sentence {i} talks about the weather and the sea and the mountains" for i in range(40))


@dataclass
class Spec:
    name: str
    shape: list[int]
    labels: list[str] | None = None


@dataclass
class Config:
    path: Path
    parameters: dict[str, Any]
    outputs: list[Spec] = field(default_factory=list)
    name: str = "clf"


def _bytes(*texts: str | bytes) -> np.ndarray:
    return np.array([t.encode() if isinstance(t, str) else t for t in texts], dtype=object).reshape(-1, 1)


def _run(handler: SequenceClassificationHandler, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    with torch.inference_mode():
        return handler.postprocess(handler.predict(handler.preprocess(inputs)))


def _load(folder: Path, labels: list[str], **parameters: Any) -> SequenceClassificationHandler:
    handler = SequenceClassificationHandler()
    outputs = [Spec("probabilities", [len(labels)], labels), Spec("score", [1])]
    handler.load(
        torch.device("cpu"), Config(folder.parent, {"model_dir": folder.name, **parameters}, outputs)
    )
    return handler


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_classifier_folder(tmp_path_factory.mktemp("clf") / "hf", LABELS, seed=1)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_classifier_folder(tmp_path_factory.mktemp("ce") / "hf", ["relevance"], seed=2)


def _reference_probabilities(folder: Path, texts: list[str]) -> np.ndarray:
    """transformers' own: the folder's model and tokenizer, softmax over the logits (what its
    text-classification pipeline applies to a single-label model)."""
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(folder, local_files_only=True).eval()
    with torch.inference_mode():
        logits = model(**tokenizer(texts, padding=True, truncation=True, return_tensors="pt")).logits
    return torch.softmax(logits, -1).numpy()


def test_probabilities_equal_transformers(classifier: Path) -> None:
    handler = _load(classifier, LABELS)
    out = _run(handler, {"text": _bytes(*SHORT)})
    want = _reference_probabilities(classifier, SHORT)
    assert out["probabilities"].shape == (3, 3) and out["probabilities"].dtype == np.float32
    assert np.abs(out["probabilities"] - want).max() <= 1e-5
    assert np.allclose(out["score"][:, 0], want[:, 2])  # score_label defaults to the last label
    assert out["windows"].reshape(-1).tolist() == [1, 1, 1]
    assert handler.labels == LABELS


def test_cross_encoder_scores_equal_crossencoder_predict(cross_encoder: Path) -> None:
    handler = _load(cross_encoder, ["relevance"])
    queries = ["weather at sea", "weather at sea", "a cat"]
    out = _run(handler, {"text": _bytes(*SHORT), "query": _bytes(*queries)})
    reference = CrossEncoder(str(cross_encoder), device="cpu", local_files_only=True)
    want = reference.predict(list(zip(queries, SHORT, strict=True)), batch_size=8)
    assert np.abs(out["score"][:, 0] - np.asarray(want)).max() <= 1e-5


def _library_windows(folder: Path, text: str, query: str | None, length: int, stride: int) -> np.ndarray:
    """The library's per-window activations: the tokenizer's own overflow windows, each run alone."""
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(folder, local_files_only=True).eval()
    args = (query, text) if query else (text,)
    enc = tokenizer(
        *args,
        truncation="only_second" if query else True,
        max_length=length,
        stride=stride,
        return_overflowing_tokens=True,
    )
    rows = []
    with torch.inference_mode():
        for i in range(len(enc["input_ids"])):
            one = {k: torch.tensor([enc[k][i]]) for k in ("input_ids", "attention_mask", "token_type_ids")}
            logits = model(**one).logits
            rows.append((torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, -1))[0])
    return torch.stack(rows).numpy()


@pytest.mark.parametrize("how", ["max", "mean"])
def test_long_text_windows_aggregate_the_librarys_windows(classifier: Path, how: str) -> None:
    handler = _load(classifier, LABELS, max_seq_length=64, stride=16, aggregate=how)
    out = _run(handler, {"text": _bytes(SHORT[0], LONG)})
    per_window = _library_windows(classifier, LONG, None, 64, 16)
    assert len(per_window) > 3
    want = per_window.max(0) if how == "max" else per_window.mean(0)
    assert out["windows"].reshape(-1).tolist() == [1, len(per_window)]
    assert np.abs(out["probabilities"][1] - want).max() <= 1e-5
    assert np.abs(out["probabilities"][0] - _reference_probabilities(classifier, SHORT[:1])[0]).max() <= 1e-5
    assert int(out["tokens"][1, 0]) == sum(
        len(ids)
        for ids in AutoTokenizer.from_pretrained(classifier)(
            LONG, truncation=True, max_length=64, stride=16, return_overflowing_tokens=True
        )["input_ids"]
    )


def test_cross_encoder_windows_take_maxp(cross_encoder: Path) -> None:
    handler = _load(cross_encoder, ["relevance"], max_seq_length=48, stride=8)
    out = _run(handler, {"text": _bytes(LONG, SHORT[1]), "query": _bytes("the sea", "")})
    per_window = _library_windows(cross_encoder, LONG, "the sea", 48, 8)
    assert int(out["windows"][0, 0]) == len(per_window) > 1
    assert abs(float(out["score"][0, 0]) - float(per_window[:, 0].max())) <= 1e-5


def test_truncate_and_error_modes(classifier: Path) -> None:
    truncating = _load(classifier, LABELS, max_seq_length=64, truncation="truncate")
    out = _run(truncating, {"text": _bytes(LONG)})
    assert out["windows"].tolist() == [[1]] and out["tokens"].tolist() == [[64]]
    refusing = _load(classifier, LABELS, max_seq_length=64, truncation="error")
    with pytest.raises(ValueError, match=r"item 1 has \d+ tokens, over the model's 64"):
        refusing.item_costs({"text": _bytes("short", LONG)})
    assert refusing.item_costs({"text": _bytes("short")}).tolist() == [3]


def test_limits_are_priced_before_anything_runs(classifier: Path) -> None:
    handler = _load(classifier, LABELS, max_seq_length=32, max_windows=4, max_request_tokens=200)
    with pytest.raises(PayloadTooLarge, match="max_windows"):
        handler.item_costs({"text": _bytes(LONG)})
    with pytest.raises(PayloadTooLarge, match="max_request_tokens"):
        handler.item_costs({"text": _bytes(*[LONG[:300]] * 8)})
    with pytest.raises(ValueError, match="not valid UTF-8"):
        handler.item_costs({"text": _bytes("fine", b"\xff\xfe")})
    with pytest.raises(ValueError, match="query of"):
        handler.item_costs({"text": _bytes("x"), "query": _bytes(LONG)})


def test_load_checks_labels_and_parameters(classifier: Path) -> None:
    with pytest.raises(ValueError, match=r"labels = \['ok', 'insult', 'threat'\]"):
        _load(classifier, ["a", "b", "c"])
    with pytest.raises(ValueError, match="truncation must be one of"):
        _load(classifier, LABELS, truncation="cut")
    with pytest.raises(ValueError, match="stride"):
        _load(classifier, LABELS, max_seq_length=32, stride=16)
    with pytest.raises(ValueError, match="score_label"):
        _load(classifier, LABELS, score_label="spam")
    with pytest.raises(ValueError, match="exceeds"):
        _load(classifier, LABELS, max_seq_length=4096)
    assert _load(classifier, LABELS, score_label="insult").score_index == 1


def test_weighted_mean_renormalises() -> None:
    vectors = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    out = windows.weighted_mean(vectors, torch.tensor([3, 1, 5]), torch.tensor([0, 0, 1]), 2)
    want0 = np.array([3.0, 1.0]) / np.sqrt(10.0)
    assert np.allclose(out[0].numpy(), want0) and np.allclose(out[1].numpy(), [0.6, 0.8])
    agg = windows.aggregate(
        torch.tensor([[0.1, 0.9], [0.7, 0.2], [0.5, 0.5]]), torch.tensor([0, 0, 1]), 2, "max"
    )
    assert np.allclose(agg.numpy(), [[0.7, 0.9], [0.5, 0.5]])
