"""The sequence-classification handler in process, on small BERT classifiers of the real class:
probabilities and cross-encoder scores equal the libraries' own (transformers' forward with its
pipeline's activation, sentence-transformers' ``CrossEncoder.predict``); long texts in windows
equal the documented aggregation of the library's outputs on the same windows; bad input is
refused before it runs."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from sentence_transformers import CrossEncoder
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from app.errors import InvalidInput, PayloadTooLarge
from app.handlers.sequence_classification import SequenceClassificationHandler
from app.models import windows
from app.models.base import PREPARED
from app.serving.context import RequestContext
from app.serving.windows import WindowStage
from tests.support.text_models import library_windows, write_classifier_folder
from tests.support.tools import load_tool

LABELS = ["ok", "insult", "threat"]
SHORT = ["a short post", "you are all wonderful people", "ünïcödé text"]
LONG = " ".join(f"sentence {i} talks about the weather and the sea and the mountains" for i in range(40))


@dataclass
class Spec:
    name: str
    shape: list[int]
    labels: list[str] | None = None
    datatype: str = "FP32"


@dataclass
class Config:
    path: Path
    parameters: dict[str, Any]
    outputs: list[Spec] = field(default_factory=list)
    name: str = "clf"
    inputs: list[Spec] = field(default_factory=list)


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


def _library(folder: Path, texts: list[str], queries: list[str] | None = None) -> np.ndarray:
    """The library's activations of each text alone (with its query), truncated as the folder says."""
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(folder, local_files_only=True).eval()
    rows = []
    with torch.inference_mode():
        for i, text in enumerate(texts):
            args = (queries[i], text) if queries else (text,)
            logits = model(**tokenizer(*args, truncation=True, return_tensors="pt")).logits
            rows.append((torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, -1))[0])
    return torch.stack(rows).numpy()


def _windowed(
    handler: SequenceClassificationHandler, inputs: dict[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], Any]:
    """The request through the window stage, the handler and back, as the data plane runs it."""
    model = SimpleNamespace(runner=SimpleNamespace(handler=handler), config=SimpleNamespace(name="clf"))
    stage = WindowStage()
    context = RequestContext("r", 0.0)
    if not stage.applies(model):  # type: ignore[arg-type]
        return stage.assemble(None, _run(handler, inputs)), inputs  # the data plane skips the stage
    items, plan = asyncio.run(stage.expand(model, context, inputs))  # type: ignore[arg-type]
    assert items is not None
    return stage.assemble(plan, _run(handler, items)), items


@pytest.mark.parametrize("how", ["max", "mean"])
def test_long_text_windows_aggregate_the_librarys_windows(classifier: Path, how: str) -> None:
    handler = _load(classifier, LABELS, max_seq_length=64, stride=16, aggregate=how)
    out, items = _windowed(handler, {"text": _bytes(SHORT[0], LONG)})
    pieces = [t.decode() for t in items["text"].reshape(-1)]
    assert pieces[0] == SHORT[0] and len(pieces) > 4 and all(p in LONG for p in pieces[1:])
    per_window, ids = library_windows(classifier, LONG, 64, 16)
    assert [list(p[0]) for p in items[PREPARED][1:]] == ids  # each window runs the overflow's ids
    want = per_window.max(0) if how == "max" else per_window.mean(0)
    assert out["windows"].reshape(-1).tolist() == [1, len(pieces) - 1] == [1, len(ids)]
    assert np.abs(out["probabilities"][1] - want).max() <= 1e-5
    assert np.abs(out["probabilities"][0] - _library(classifier, SHORT[:1])[0]).max() <= 1e-5
    assert int(out["tokens"][1, 0]) == sum(len(w) for w in ids) and all(len(w) <= 64 for w in ids)
    assert pieces[1].startswith("sentence 0") and pieces[-1].endswith(LONG[-20:])


def test_cross_encoder_windows_take_maxp(cross_encoder: Path) -> None:
    handler = _load(cross_encoder, ["relevance"], max_seq_length=48, stride=8)
    out, items = _windowed(handler, {"text": _bytes(LONG, SHORT[1]), "query": _bytes("the sea", "")})
    pieces = [t.decode() for t in items["text"].reshape(-1)]
    queries = [q.decode() for q in items["query"].reshape(-1)]
    assert queries[:-1] == ["the sea"] * (len(pieces) - 1) and queries[-1] == ""
    per_window, ids = library_windows(cross_encoder, LONG, 48, 8, query="the sea")
    assert [list(p[0]) for p in items[PREPARED][:-1]] == ids
    assert int(out["windows"][0, 0]) == len(per_window) > 1
    assert abs(float(out["score"][0, 0]) - float(per_window[:, 0].max())) <= 1e-5


def test_windows_cut_inside_words_run_the_overflow_not_the_retokenized_span(cross_encoder: Path) -> None:
    """Windows whose edges fall inside words (WordPiece continuations): each runs the tokenizer's
    own overflow ids (the item's text is still its span), and a text that fits in one window
    runs exactly what it runs without windows."""
    text = " ".join(f"electroencephalographically{i} unquestionably" for i in range(30))
    handler = _load(cross_encoder, ["relevance"], max_seq_length=32, stride=4)
    out, items = _windowed(handler, {"text": _bytes(text, SHORT[2]), "query": _bytes("brain", "brain")})
    per_window, ids = library_windows(cross_encoder, text, 32, 4, query="brain")
    windows = int(out["windows"][0, 0])
    assert [list(p[0]) for p in items[PREPARED][:windows]] == ids and windows == len(ids) > 2
    spans = [t.decode() for t in items["text"].reshape(-1)[:windows]]
    tokenizer = AutoTokenizer.from_pretrained(cross_encoder, local_files_only=True)
    assert any(tokenizer("brain", span)["input_ids"] != w for span, w in zip(spans, ids, strict=True))
    assert abs(float(out["score"][0, 0]) - float(per_window[:, 0].max())) <= 1e-5
    alone = _run(handler, {"text": _bytes(SHORT[2]), "query": _bytes("brain")})
    assert out["score"][1, 0] == alone["score"][0, 0] and out["tokens"][1, 0] == alone["tokens"][0, 0]


def test_truncate_and_error_modes(classifier: Path) -> None:
    truncating = _load(classifier, LABELS, max_seq_length=64, truncation="truncate")
    out, _ = _windowed(truncating, {"text": _bytes(LONG)})
    assert out["windows"].tolist() == [[1]] and out["tokens"].tolist() == [[64]]
    refusing = _load(classifier, LABELS, max_seq_length=64, truncation="error")
    with pytest.raises(InvalidInput, match=r"item 1 has \d{3} tokens, over the model's 64 "):
        _windowed(refusing, {"text": _bytes("short", LONG)})
    assert refusing.item_costs({"text": _bytes("short")}).costs.tolist() == [3]


def test_limits_are_priced_before_anything_runs(classifier: Path) -> None:
    handler = _load(classifier, LABELS, max_seq_length=32, max_windows=4, max_request_tokens=200)
    with pytest.raises(PayloadTooLarge, match="max_windows"):
        _windowed(handler, {"text": _bytes(LONG)})
    with pytest.raises(PayloadTooLarge, match="max_request_tokens"):
        _windowed(handler, {"text": _bytes(*[LONG[:300]] * 8)})
    with pytest.raises(InvalidInput, match="not valid UTF-8"):
        _windowed(handler, {"text": _bytes("fine", b"\xff\xfe" * 40)})
    with pytest.raises(InvalidInput, match="query of"):
        _windowed(handler, {"text": _bytes("x"), "query": _bytes(LONG)})


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
    vectors = np.array([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]], np.float32)
    out = windows.weighted_mean(vectors, np.array([3, 1, 5]), np.array([2, 1]))
    assert np.allclose(out[0], np.array([3.0, 1.0]) / np.sqrt(10.0)) and np.allclose(out[1], [0.6, 0.8])
    agg = windows.aggregate(np.array([[0.1, 0.9], [0.7, 0.2], [0.5, 0.5]]), np.array([2, 1]), "max")
    assert np.allclose(agg, [[0.7, 0.9], [0.5, 0.5]])
    assert np.allclose(
        windows.aggregate(np.array([[1.0], [3.0], [5.0]]), np.array([2, 1]), "mean"), [[2.0], [5.0]]
    )


def test_onnx_backend_equals_torch(classifier: Path, tmp_path: Path) -> None:
    """The classifier exported by scripts/export_sequence_classification.py runs on ONNX Runtime
    with the same probabilities as transformers' own (<= 1e-5)."""
    pytest.importorskip("onnxruntime")
    folder = tmp_path / "clf"
    folder.mkdir()
    (folder / "hf").symlink_to(classifier)
    script = load_tool("export_sequence_classification.py")
    assert script.main(["--model-dir", str(classifier), "--out", str(folder / "model.onnx")]) == 0
    handler = _load(folder / "hf", LABELS, backend="onnx")
    assert handler.session is not None
    out = _run(handler, {"text": _bytes(*SHORT)})
    assert np.abs(out["probabilities"] - _reference_probabilities(classifier, SHORT)).max() <= 1e-5
    with pytest.raises(ValueError, match="backend"):
        _load(classifier, LABELS, backend="tensorflow")


def test_the_export_refuses_a_graph_further_from_torch_than_asked(classifier: Path, tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    script = load_tool("export_sequence_classification.py")
    out = tmp_path / "model.onnx"
    # no difference is below a negative bound: the check fails and the file is not kept
    assert script.main(["--model-dir", str(classifier), "--out", str(out), "--atol", "-1"]) == 1
    assert not out.exists()
    assert script.main(["--model-dir", str(tmp_path / "none"), "--out", str(out)]) == 1
