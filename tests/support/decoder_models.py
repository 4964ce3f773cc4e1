"""Small decoder-only models for tests: the session fixture ``decoder_models`` (every kind of
:mod:`benchmarks.decoder_folders`, built once per test session: kind -> folder), and the
``model.toml`` of a handler model serving one (:func:`write_handler_model`,
:func:`write_causal_lm`). The folders themselves are built by :mod:`benchmarks.decoder_folders`
(its table lists the kinds), which the stress run's repository shares; its names are
re-exported here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from benchmarks.decoder_folders import (
    CLASSES,
    CORPUS,
    EMBEDDING_QUERY_PROMPT,
    KINDS,
    LABELS,
    build_decoder_folder,
    train_tokenizer,
)

__all__ = [
    "CLASSES",
    "CORPUS",
    "EMBEDDING_QUERY_PROMPT",
    "KINDS",
    "LABELS",
    "build_decoder_folder",
    "decoder_models",
    "train_tokenizer",
    "write_causal_lm",
    "write_handler_model",
]


def write_handler_model(
    repo: Path,
    name: str,
    handler: str,
    folder: Path,
    inputs: Sequence[str],
    outputs: Sequence[str],
    parameters: str = "",
) -> Path:
    """A model folder ``repo/name`` whose ``model.toml`` serves ``folder`` with ``handler``
    (``module:Class``): batches of up to 8, warmed up at 1 and 4; ``inputs`` as ``"name
    DATATYPE"`` (``" optional"`` after it for an optional one), ``outputs`` as ``"name DATATYPE
    width"``, shape ``[1]`` each where not given; ``parameters``: more lines of ``[parameters]``."""
    lines = [f'name = "{name}"', 'version = "1"', 'format = "handler"', f'handler = "{handler}"',
             "max_batch_size = 8", "max_queue_delay_ms = 2.0", "warmup_batch_sizes = [1, 4]"]  # fmt: skip
    for spec in inputs:
        input_name, datatype, *optional = spec.split()
        lines += ["[[inputs]]", f'name = "{input_name}"', f'datatype = "{datatype}"', "shape = [1]"]
        lines += ["optional = true"] if optional else []
    for spec in outputs:
        output_name, datatype, *width = spec.split()
        lines += ["[[outputs]]", f'name = "{output_name}"', f'datatype = "{datatype}"']
        lines += [f"shape = [{width[0] if width else 1}]"]
    lines += ["[parameters]", f'model_dir = "{folder}"', parameters]
    (repo / name).mkdir(parents=True)
    (repo / name / "model.toml").write_text("\n".join(lines) + "\n")
    return repo / name


def write_causal_lm(repo: Path, name: str, folder: Path) -> Path:
    """A model of ``app.handlers.causal_lm`` serving ``folder`` (:func:`write_handler_model`):
    log-likelihood, perplexity, tokens and per-token log-probs, texts of up to 256 tokens."""
    return write_handler_model(
        repo, name, "app.handlers.causal_lm:CausalLMHandler", folder,
        ["text BYTES", "return_token_logprobs INT64 optional", "top_logprobs INT64 optional"],
        ["log_likelihood FP32", "perplexity FP32", "tokens INT64", "token_logprobs BYTES"],
        "max_seq_length = 256",
    )  # fmt: skip


@pytest.fixture(scope="session")
def decoder_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """Every kind of :data:`KINDS` built once per test session: kind -> its folder (do not
    modify it; build your own with :func:`build_decoder_folder` to change one)."""
    root = tmp_path_factory.mktemp("decoder-models")
    yield {kind: build_decoder_folder(root / kind, kind) for kind in KINDS}
