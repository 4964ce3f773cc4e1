"""Small decoder-only models for tests: the session fixture ``decoder_models`` (every kind of
:mod:`benchmarks.decoder_folders`, built once per test session: kind -> folder) and the
``model.toml`` of a causal LM serving one (:func:`write_causal_lm`). The folders and any handler
model's ``model.toml`` (``write_handler_model``) are :mod:`benchmarks.decoder_folders`' (its
table lists the kinds), which the stress run's repository shares; its names are re-exported
here.
"""

from __future__ import annotations

from collections.abc import Iterator
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
    write_handler_model,
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


def write_causal_lm(repo: Path, name: str, folder: Path, parameters: str = "") -> Path:
    """A model of ``app.handlers.causal_lm`` serving ``folder`` (:func:`write_handler_model`):
    log-likelihood, perplexity, tokens and per-token log-probs (the greedy next token and a cut
    on request: ``/v1/completions`` as lm-evaluation-harness calls it), texts of up to 256
    tokens; ``parameters``: more lines of ``[parameters]``."""
    return write_handler_model(
        repo, name, "app.handlers.causal_lm:CausalLMHandler", folder,
        ["text BYTES", "return_token_logprobs INT64 optional", "top_logprobs INT64 optional",
         "next_token INT64 optional", "truncate_prompt_tokens INT64 optional"],
        ["log_likelihood FP32", "perplexity FP32", "tokens INT64", "token_logprobs BYTES"],
        "max_seq_length = 256\n" + parameters,
    )  # fmt: skip


@pytest.fixture(scope="session")
def decoder_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """Every kind of :data:`KINDS` built once per test session: kind -> its folder (do not
    modify it; build your own with :func:`build_decoder_folder` to change one)."""
    root = tmp_path_factory.mktemp("decoder-models")
    yield {kind: build_decoder_folder(root / kind, kind) for kind in KINDS}
