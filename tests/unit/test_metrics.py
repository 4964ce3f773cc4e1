"""Prometheus metrics in-process: the batch observer and middleware, rejections, the
multiprocess directory's timing, GPU figures from NVML; no PROMETHEUS_MULTIPROC_DIR
(tests/conftest.py), so a registry per app. Multiprocess aggregation on a real gunicorn:
tests/e2e/test_metrics.py."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from app.http.state import CORE
from gpu_stat.binding import BindingPolicy, bind_worker, release_binding
from tests.support.fake_gpus import GIB, gpu, gpu_uuid, write_fake
from tests.support.fixtures import eventually
from tests.support.metrics import Samples, parse, total, v2_body, value
from tests.support.toy_models import ScaleHandler, write_scale_model


async def scrape(client: Any) -> Samples:
    resp = await client.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain")
    return parse(await resp.text())


async def test_inference_requests_batches_and_worker_are_recorded(
    make_client: Callable[..., Any], scale_repo: Path
) -> None:
    client = await make_client(scale_repo)
    before = len(ScaleHandler.BATCHES["scale"])  # warmup, and admission's timed batch
    for i in range(3):
        assert (await client.post("/v2/models/scale/infer", json=v2_body(i))).status == 200
    for _ in range(2):
        resp = await client.post("/v1/models/scale:predict", json={"instances": [[1, 2], [3, 4]]})
        assert resp.status == 200
    assert (await client.post("/v2/models/nope/infer", json=v2_body(0))).status == 404
    assert (await client.get("/v2/models/scale")).status == 200  # not an inference request
    m = await scrape(client)
    scale = {"model": "scale", "version": "1"}
    assert value(m, "scoring_requests_total", **scale, protocol="v2", code="200") == 3
    assert value(m, "scoring_requests_total", **scale, protocol="v1", code="200") == 2
    assert value(m, "scoring_requests_total", model="", version="", protocol="v2", code="404") == 1
    assert total(m, "scoring_requests_total") == 6
    assert value(m, "scoring_request_duration_seconds_count", **scale, protocol="v2") == 3
    assert value(m, "scoring_batch_size_sum", **scale) == 3 + 2 * 2
    entry = client.server.app[CORE].registry.get("scale")
    assert entry.runner is not None
    batches = value(m, "scoring_batch_size_count", **scale)
    assert batches == len(ScaleHandler.BATCHES["scale"]) - before  # every batch the model ran
    assert value(m, "scoring_batch_requests_sum", **scale) == 5
    assert value(m, "scoring_compute_duration_seconds_count", **scale) == batches
    assert value(m, "scoring_queue_duration_seconds_count", **scale) == batches
    assert value(m, "scoring_queue_depth", **scale) == 0
    assert value(m, "scoring_requests_in_flight", **scale) == 0
    pid = str(os.getpid())
    assert value(m, "scoring_model_load_seconds", **scale, pid=pid) == entry.runner.load_seconds
    assert value(m, "scoring_model_warmup_seconds", **scale, pid=pid) == entry.runner.warmup_seconds
    assert value(m, "scoring_worker_binding_info", pid=pid, device="cpu", gpu="", slot="") == 1
    assert not [n for n, _, _ in m if n.startswith("scoring_gpu_")]  # CPU mode: no GPU figures
    assert (value(m, "process_cpu_seconds_total") or 0) > 0  # the default registry, in-process


async def test_rejections_are_counted_by_reason(make_client: Callable[..., Any], tmp_path: Path) -> None:
    write_scale_model(tmp_path, "slow", max_batch_size=1, queue_capacity=1, delay_ms=1000)
    client = await make_client(tmp_path)
    warmup_batches = len(ScaleHandler.BATCHES["slow"])
    running = asyncio.create_task(client.post("/v2/models/slow/infer", json=v2_body(1)))

    async def computing() -> bool:
        return len(ScaleHandler.BATCHES["slow"]) > warmup_batches

    await eventually(computing)  # A is on the inference thread
    # B waits in the queue (its only slot) and its 300 ms deadline passes while A runs.
    expiring = asyncio.create_task(
        client.post("/v2/models/slow/infer", json=v2_body(2), headers={"X-Request-Timeout-Ms": "300"})
    )

    async def queued() -> bool:
        return value(await scrape(client), "scoring_queue_depth", model="slow") == 1

    await eventually(queued)
    full = await client.post("/v2/models/slow/infer", json=v2_body(3))  # C: no room
    assert full.status == 503 and "Retry-After" in full.headers
    assert (await expiring).status == 504
    assert (await running).status == 200
    m = await scrape(client)
    slow = {"model": "slow", "version": "1"}
    assert value(m, "scoring_rejected_total", **slow, reason="queue_full") == 1
    assert value(m, "scoring_rejected_total", **slow, reason="deadline") == 1
    assert value(m, "scoring_requests_total", **slow, code="503") == 1
    assert value(m, "scoring_requests_total", **slow, code="504") == 1
    assert value(m, "scoring_requests_total", **slow, code="200") == 1


async def test_the_dashboards_series_exist_at_zero_once_a_model_loads(
    make_client: Callable[..., Any], tmp_path: Path
) -> None:
    """The shipped Grafana dashboard reads ``scoring_rejected_total`` by reason and the response
    cache's items and bytes: each exists at 0 as soon as its model is loaded (a panel then shows
    0, not "No data"), the cache's only for a model with a response cache."""
    write_scale_model(tmp_path / "repo", "plain")
    write_scale_model(tmp_path / "repo", "cached", response_cache=True)
    client = await make_client(tmp_path / "repo", response_cache_path=tmp_path / "cache")
    m = await scrape(client)
    for model in ("plain", "cached"):
        for reason in ("admission", "queue_full", "deadline", "out_of_memory", "disconnected"):
            assert value(m, "scoring_rejected_total", model=model, version="1", reason=reason) == 0.0
    for result in ("hit", "miss"):
        assert value(m, "scoring_response_cache_items_total", model="cached", result=result) == 0.0
        assert value(m, "scoring_response_cache_items_total", model="plain", result=result) is None
    assert value(m, "scoring_response_cache_bytes", model="cached") == 0.0
    assert value(m, "scoring_response_cache_bytes", model="plain") is None


async def test_metrics_can_be_turned_off(make_client: Callable[..., Any], scale_repo: Path) -> None:
    client = await make_client(scale_repo, metrics_enabled=False)
    assert (await client.get("/metrics")).status == 404
    assert (await client.post("/v2/models/scale/infer", json=v2_body(1))).status == 200


MODE_CHECK = """
import os, sys
from app.observability import metrics
print(metrics.multiprocess_dir())
os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
try:
    metrics.multiprocess_dir()
except RuntimeError as exc:
    print(exc)
"""


@pytest.mark.parametrize("set_before", [True, False], ids=["set before", "set after"])
def test_the_multiprocess_directory_must_be_set_before_prometheus_client_is_imported(
    tmp_path: Path, set_before: bool
) -> None:
    """prometheus_client picks in-process values or files at its first import: a directory
    named only after that would collect nothing of this process, so it is refused."""
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    if set_before:
        env["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", MODE_CHECK, str(tmp_path)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    first, *rest = done.stdout.splitlines()
    if set_before:
        assert (first, rest) == (str(tmp_path), [])
    else:
        assert first == "None" and "was set after prometheus_client was imported" in rest[0]


async def test_bound_gpu_memory_and_utilisation_come_from_nvml(
    make_client: Callable[..., Any],
    scale_repo: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    fake = tmp_path / "gpus.json"
    write_fake(fake, [gpu(0, memory_used=5 * GIB), gpu(1, memory_used=7 * GIB, utilization=42)])
    monkeypatch.setenv("GPU_STAT_FAKE_NVML", str(fake))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # restored after bind_worker sets it
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    bind_worker(BindingPolicy(run_dir=tmp_path / "run", allowed_gpus=("1",)))  # as post_fork does
    request.addfinalizer(release_binding)
    binding = {"device": "cuda:0", "gpu": "1", "gpu_uuid": gpu_uuid(1), "slot": "0"}
    client = await make_client(scale_repo, gpu_metrics_interval_s=0.05)
    bound = {"gpu": "1", "gpu_uuid": gpu_uuid(1)}

    def gpu_figure(name: str, expected: float) -> Callable[[], Awaitable[Samples | None]]:
        async def check() -> Samples | None:
            m = await scrape(client)
            return m if value(m, name, **bound) == expected else None

        return check

    m = await eventually(gpu_figure("scoring_gpu_memory_used_bytes", 7 * GIB))
    assert value(m, "scoring_gpu_memory_total_bytes", **bound) == 80 * GIB
    assert value(m, "scoring_gpu_utilization_percent", **bound) == 42
    assert value(m, "scoring_gpu_memory_used_bytes", gpu_uuid=gpu_uuid(0)) is None  # not ours
    assert value(m, "scoring_worker_binding_info", pid=str(os.getpid()), **binding) == 1
    write_fake(fake, [gpu(0), gpu(1, memory_used=9 * GIB, utilization=50)])
    await eventually(gpu_figure("scoring_gpu_memory_used_bytes", 9 * GIB))  # refreshed
