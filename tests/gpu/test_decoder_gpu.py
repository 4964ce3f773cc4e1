"""The decoder handlers on a CUDA device, against themselves on the CPU (float32, the same small
folders of ``tests/support/decoder_models.py``): the Llama classifier in pieces, the causal-LM
scorer and the yes/no reranker give the CPU's figures through pinned host buffers and the
device, and the Llama classifier in bfloat16 stays close. Marked ``gpu``: skipped without a CUDA
device."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from app.handlers.causal_lm import CausalLMHandler
from app.handlers.causal_rerank import CausalRerankHandler
from app.handlers.sequence_classification import SequenceClassificationHandler
from tests.support.decoder_models import LABELS
from tests.unit.test_causal_lm import INPUTS, OUTPUTS
from tests.unit.test_decoder_classification import posts, run
from tests.unit.test_sequence_classification import Config, Spec, _bytes

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda:0")
CPU = torch.device("cpu")


def loaded(handler: Any, device: torch.device, folder: Path, outputs: list[Spec], **parameters: Any) -> Any:
    config = Config(folder.parent, {"model_dir": folder.name, **parameters}, outputs, "m", INPUTS)
    handler.load(device, config)
    return handler


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_llama_classifier_on_the_gpu(decoder_models: dict[str, Path], dtype: str) -> None:
    folder = decoder_models["llama-classifier"]
    outputs = [Spec("probabilities", [len(LABELS)], list(LABELS))]
    texts = posts(32, seed=20)
    want = run(loaded(SequenceClassificationHandler(), CPU, folder, outputs), {"text": _bytes(*texts)})
    got = run(
        loaded(SequenceClassificationHandler(), CUDA, folder, outputs, dtype=dtype), {"text": _bytes(*texts)}
    )
    tolerance = 1e-4 if dtype == "float32" else 0.05
    assert np.abs(got["probabilities"] - want["probabilities"]).max() <= tolerance


def test_the_causal_lm_and_the_reranker_on_the_gpu(decoder_models: dict[str, Path]) -> None:
    texts = posts(8, seed=21)
    inputs = {"text": _bytes(*texts), "return_token_logprobs": np.ones((8, 1), np.int64),
              "top_logprobs": np.full((8, 1), 2, np.int64)}  # fmt: skip
    lm = [run(loaded(CausalLMHandler(), d, decoder_models["gpt2-lm"], OUTPUTS), inputs) for d in (CPU, CUDA)]
    assert np.abs(lm[0]["log_likelihood"] - lm[1]["log_likelihood"]).max() <= 1e-3
    pairs = {"text": _bytes(*texts), "query": _bytes(*(["bread"] * 8))}
    folder = decoder_models["qwen3-reranker"]
    scores = [run(loaded(CausalRerankHandler(), d, folder, [Spec("score", [1])]), pairs) for d in (CPU, CUDA)]
    assert np.abs(scores[0]["score"] - scores[1]["score"]).max() <= 1e-4
