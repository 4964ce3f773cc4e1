"""Prometheus metrics on a real gunicorn: multiprocess aggregation over two workers bound to two
fake GPUs, and counters that do not go back when a worker is killed."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.multiprocess import MultiProcessCollector

from tests.support.fake_gpus import GIB, gpu, gpu_uuid, write_fake
from tests.support.gunicorn import Gunicorn, wait_for
from tests.support.metrics import Samples, parse, v2_body, value
from tests.support.toy_models import write_scale_model

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gunicorn]:
    tmp = tmp_path_factory.mktemp("metrics_server")
    write_scale_model(tmp / "repo", "scale")
    fake = write_fake(tmp / "gpus.json", [gpu(0, memory_used=3 * GIB), gpu(1, memory_used=4 * GIB)])
    env = {
        "SCORING_MODEL_REPOSITORY": str(tmp / "repo"),
        "GPU_STAT_FAKE_NVML": str(fake),
        "SCORING_MAX_PROCESSES_PER_GPU": "1",
        "SCORING_GPU_METRICS_INTERVAL_S": "0.1",
    }
    with Gunicorn(tmp, env) as srv:
        srv.wait_ready()
        srv.wait_workers(2)
        yield srv


def scrape_server(server: Gunicorn) -> Samples:
    status, _, text = server.get("/metrics")
    assert status == 200 and isinstance(text, str), text
    return parse(text)


def metrics_dir(server: Gunicorn) -> Path:
    return server.pidfile.parent / f"run-{server.port}" / "prometheus"


def requests_of(server: Gunicorn, pid: int) -> float:
    """Inference requests counted by one worker, from its own counter file."""
    files = [str(f) for f in metrics_dir(server).glob(f"counter_{pid}.db")]
    return sum(
        s.value
        for metric in MultiProcessCollector.merge(files)  # type: ignore[no-untyped-call]
        for s in metric.samples
        if s.name == "scoring_requests_total"
    )


def test_one_scrape_counts_the_requests_of_every_worker(server: Gunicorn) -> None:
    workers = {w.pid for w in server.wait_workers(2)}
    with ThreadPoolExecutor(8) as pool:

        def pids_seen() -> bool:
            return {b["worker"]["pid"] for _, _, b in pool.map(lambda _: server.get("/v2"), range(16))} == workers

        wait_for(pids_seen, 30, "GET /v2 answered by both workers", server)
        sent = 0

        def both_served() -> bool:
            nonlocal sent
            statuses = list(pool.map(lambda i: server.post("/v2/models/scale/infer", v2_body(i))[0], range(16)))
            assert statuses == [200] * 16
            sent += 16
            return all(requests_of(server, pid) > 0 for pid in workers)

        wait_for(both_served, 30, "inference requests on both workers", server)
    for _ in range(4):  # whichever worker answers the scrape, it reports the whole server
        m = scrape_server(server)
        assert value(m, "scoring_requests_total", model="scale", protocol="v2", code="200") == sent
        assert value(m, "scoring_batch_requests_sum", model="scale") == sent
    assert sum(requests_of(server, pid) for pid in workers) == sent
    bindings = {lab["pid"]: lab for n, lab, _ in m if n == "scoring_worker_binding_info"}
    assert set(bindings) == {str(p) for p in workers}
    assert {b["gpu_uuid"] for b in bindings.values()} == {gpu_uuid(0), gpu_uuid(1)}

    def gpu_figures() -> Samples | None:
        m = scrape_server(server)
        return m if value(m, "scoring_gpu_memory_used_bytes", gpu="1", gpu_uuid=gpu_uuid(1)) else None

    m = wait_for(gpu_figures, 30, "GPU memory of the bound GPUs", server)
    assert value(m, "scoring_gpu_memory_used_bytes", gpu="1", gpu_uuid=gpu_uuid(1)) == 4 * GIB
    assert value(m, "scoring_gpu_memory_used_bytes", gpu="0", gpu_uuid=gpu_uuid(0)) == 3 * GIB
    assert value(m, "scoring_gpu_memory_total_bytes", gpu="0", gpu_uuid=gpu_uuid(0)) == 80 * GIB


def test_counters_do_not_go_back_when_a_worker_is_killed(server: Gunicorn) -> None:
    for i in range(4):
        assert server.post("/v1/models/scale:predict", {"instances": [[i, i]]})[0] == 200
    before = scrape_server(server)
    old = {w.pid for w in server.wait_workers(2)}
    victim = min(old)
    os.kill(victim, signal.SIGKILL)

    def replaced() -> set[int] | None:
        pids = {w.pid for w in server.workers()}
        return pids if len(pids) == 2 and victim not in pids else None

    live = wait_for(replaced, 30, "gunicorn's replacement worker", server)
    server.wait_ready()

    def bindings_are_live() -> Samples | None:
        m = scrape_server(server)
        pids = {lab["pid"] for n, lab, _ in m if n == "scoring_worker_binding_info"}
        return m if pids == {str(p) for p in live} else None

    after = wait_for(bindings_are_live, 30, "binding info of the live workers only (child_exit)", server)
    for name in ("scoring_requests_total", "scoring_batch_size_count", "scoring_request_duration_seconds_count"):
        for n, labels, v in before:
            if n == name:
                assert (value(after, name, **labels) or 0) >= v, (name, labels)
    assert value(after, "scoring_requests_total", model="scale", protocol="v1", code="200") == 4
    assert value(after, "scoring_requests_in_flight", model="scale") == 0
