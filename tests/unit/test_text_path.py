"""The text path in process, through the HTTP app with real text models: each text (or
(query, text) pair) is tokenized exactly once between the request and the model, whether it is
priced for the queue, batched with other requests, split into windows or not; and the window
split runs on the window stage's threads, never on the event loop."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from app.handlers.tokenizing import TextTokenizer
from tests.support.fixtures import Client, MakeClient
from tests.support.gunicorn import ROOT
from tests.support.text_models import write_classifier_model

MINILM = ROOT / "model_repository" / "all-MiniLM-L6-v2"
LONG = " ".join(f"Paragraph {i}: the harbour, the boats and the fishermen at dawn." for i in range(60))
FEED = [f"A short feed text number {i} about the harbour and its boats" for i in range(7)]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    (tmp_path / MINILM.name).mkdir()
    toml = (MINILM / "model.toml").read_text()  # a loaded 2-core machine runs the long post for seconds
    (tmp_path / MINILM.name / "model.toml").write_text(
        toml.replace("timeout_ms = 5000", "timeout_ms = 60000")
    )
    write_classifier_model(
        tmp_path, "ce", ["relevance"], parameters="max_seq_length = 96\nstride = 8", seed=2
    )
    return tmp_path


class Tokenized:
    """Counts what the text tokenizers encode (each string, or (query, text) pair, per call) and
    on which threads."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.units: Counter[Any] = Counter()
        self.threads: set[str] = set()
        for name in ("encode", "encode_pairs", "windows", "count"):
            monkeypatch.setattr(TextTokenizer, name, self._counting(getattr(TextTokenizer, name), name))

    def _counting(self, method: Any, name: str) -> Any:
        def counted(tokenizer: TextTokenizer, *args: Any) -> Any:
            self.threads.add(threading.current_thread().name)
            if name == "encode_pairs":  # (queries, texts)
                self.units.update(zip(args[0], args[1], strict=True))
            elif name == "windows" and len(args) > 1 and args[1] is not None:  # (texts, queries)
                self.units.update((q, t) if q else t for t, q in zip(args[0], args[1], strict=True))
            else:
                self.units.update(args[0])
            return method(tokenizer, *args)

        return counted


async def _v2(http: Client, texts: list[str], query: str) -> dict[str, Any]:
    inputs = [
        {"name": "text", "shape": [len(texts), 1], "datatype": "BYTES", "data": texts},
        {"name": "query", "shape": [len(texts), 1], "datatype": "BYTES", "data": [query] * len(texts)},
    ]
    resp = await http.post(f"/v2/models/{MINILM.name}/infer", json={"inputs": inputs})
    assert resp.status == 200, await resp.text()
    return dict(await resp.json())


@pytest.mark.slow
async def test_each_text_is_tokenized_once_on_the_serving_path(
    make_client: MakeClient, repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    http: Client = await make_client(repo)
    tokenized = Tokenized(monkeypatch)  # after the loads: warmup and calibration tokenize their own
    loop_thread = threading.current_thread().name
    feed = [*FEED, FEED[0]]  # 8 items, one repeated: each distinct string once
    short, windowed = await asyncio.gather(
        _v2(http, feed, "boats at dawn"),
        _v2(http, ["a short title", LONG], "fishing boats"),
    )
    assert short["outputs"] and windowed["outputs"]
    resp = await http.post(
        "/v1/rerank", json={"model": "ce", "query": "weather at sea", "documents": [LONG, "a cat on a mat"]}
    )
    assert resp.status == 200, await resp.text()
    embeddings = await http.post("/v1/embeddings", json={"model": MINILM.name, "input": FEED[:3]})
    assert embeddings.status == 200, await embeddings.text()
    want: Counter[Any] = Counter(FEED)  # the feed's distinct texts, once (one repeated in the request)
    want.update(["boats at dawn", "a short title", LONG, "fishing boats"])
    want.update([("weather at sea", LONG), ("weather at sea", "a cat on a mat")])  # the pairs, once each
    for text in FEED[:3]:
        want[text] += 1  # a second request, tokenized once for it
    assert tokenized.units == want
    assert loop_thread not in tokenized.threads
