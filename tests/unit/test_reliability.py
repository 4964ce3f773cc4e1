"""In-process reliability: the hung-inference watchdog, the daemon inference thread,
isolation between models, requests served while draining, the worker's sibling view."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from app.http.state import CORE
from app.server import balance
from app.server.balance import LoadTable, WorkerSlot
from app.server.restarts import RestartBackoff
from app.serving.executor import InferenceThread
from tests.support.fixtures import Client, MakeClient, eventually, served
from tests.support.toy_models import ScaleHandler, write_scale_model

V2 = "/v2/models/scale/infer"


def body(x: float) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [x, x]}]}


async def test_hung_batch_is_reported_and_stops_the_worker(
    make_client: MakeClient, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_scale_model(tmp_path, "scale", hang_on=7.0, hang_s=1.5)
    stops: list[str] = []

    class Supervisor:
        def request_stop(self, reason: str) -> bool:
            stops.append(reason)
            return True

    client: Client = await make_client(tmp_path, hung_inference_s=0.3, supervisor=Supervisor())
    with caplog.at_level(logging.ERROR, logger="app.serving.watchdog"):
        stuck = asyncio.ensure_future(client.post(V2, json=body(7.0), headers={"X-Request-Id": "stuck-1"}))
        await eventually(lambda: stops)
        assert stops == ["hung inference"]
        live = await client.get("/v2/health/live")
        assert live.status == 503 and "inference thread stuck" in (await live.json())["error"]
        assert (await client.get("/v2/health/ready")).status == 503
        metrics = await (await client.get("/metrics")).text()
        assert 'scoring_hung_batches_total{model="scale",version="1"} 1.0' in metrics
        assert (await stuck).status == 200  # it was slow, not dead: it still answers
    assert "stuck-1" in caplog.text and "SCORING_HUNG_INFERENCE_S=0.3" in caplog.text
    assert stops == ["hung inference"]  # reported once


async def test_watchdog_in_process_without_a_process_manager(
    make_client: MakeClient, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_scale_model(tmp_path, "scale", hang_on=7.0, hang_s=0.6)
    client: Client = await make_client(tmp_path, hung_inference_s=0.2)
    with caplog.at_level(logging.WARNING, logger="app.serving.watchdog"):
        assert (await client.post(V2, json=body(7.0))).status == 200
    assert "nothing restarts this process" in caplog.text


async def test_fast_batches_never_trip_the_watchdog(make_client: MakeClient, scale_repo: Path) -> None:
    client: Client = await make_client(scale_repo, hung_inference_s=0.2)
    lifecycle = client.app[CORE].health
    for _ in range(5):
        assert (await client.post(V2, json=body(1.0))).status == 200
    passes = lifecycle.watchdog_passes
    await eventually(lambda: lifecycle.watchdog_passes >= passes + 2)  # it looked, twice, since
    assert lifecycle.hung is None
    assert (await client.get("/v2/health/live")).status == 200


async def test_a_long_batch_of_one_model_does_not_hold_another(
    make_client: MakeClient, tmp_path: Path
) -> None:
    """Each model has its own inference thread: while "big" runs a batch that does not end
    until the test says so, "small" answers every request (with one shared thread, all of
    them would wait for the gate and get 504)."""
    gate = threading.Event()
    ScaleHandler.GATES["isolation"] = gate
    write_scale_model(tmp_path, "big", hang_on=7.0, hang_gate="isolation")
    write_scale_model(tmp_path, "small", max_batch_size=16, queue_capacity=256)
    client: Client = await make_client(tmp_path, hung_inference_s=0)
    try:
        long = asyncio.ensure_future(client.post("/v2/models/big/infer", json=body(7.0)))
        big = served(client.app, "big")
        await eventually(lambda: big.running_batch is not None)
        headers = {"X-Request-Timeout-Ms": "5000"}
        statuses = await asyncio.gather(
            *(client.post("/v2/models/small/infer", json=body(float(i)), headers=headers) for i in range(200))
        )
        assert [r.status for r in statuses] == [200] * 200
        assert big.running_batch is not None and not long.done()  # the long batch still runs
    finally:
        gate.set()
    assert (await long).status == 200


async def test_a_draining_worker_still_serves_what_reaches_it(
    make_client: MakeClient, scale_repo: Path
) -> None:
    client: Client = await make_client(scale_repo)
    client.app[CORE].registry.begin_drain("test")
    resp = await client.post("/v1/models/scale:predict", json={"instances": [[1, 2]]})
    assert resp.status == 200 and resp.headers["Connection"] == "close"


def test_inference_thread_runs_in_order_and_never_blocks_exit() -> None:
    executor = InferenceThread()
    order: list[int] = []
    futures = [executor.submit(order.append, i) for i in range(5)]
    assert [f.result(5) for f in futures] == [None] * 5 and order == [0, 1, 2, 3, 4]
    assert executor.submit(lambda a, b=0: a + b, 2, b=3).result(5) == 5
    failing = executor.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.result(5)
    gate, running = threading.Event(), threading.Event()

    def stuck_call() -> bool:
        running.set()
        return gate.wait()

    stuck = executor.submit(stuck_call)
    queued = executor.submit(order.append, 99)
    assert running.wait(5)
    start = time.monotonic()
    executor.shutdown(wait=False, cancel_futures=True)
    assert time.monotonic() - start < 1 and queued.cancelled() and not stuck.done()
    assert all(t.daemon for t in executor._threads)  # a stuck call does not keep the process alive
    with pytest.raises(RuntimeError):
        executor.submit(order.append, 1)
    gate.set()
    stuck.result(5)
    for thread in executor._threads:
        thread.join(5)
    assert not executor.alive and 99 not in order


def test_inference_thread_initializer_runs_on_the_thread_and_its_failure_reaches_callers() -> None:
    seen: list[str] = []
    executor = InferenceThread(
        name="inference:init", initializer=lambda: seen.append(threading.current_thread().name)
    )
    assert executor.submit(lambda: seen[:]).result(5) == ["inference:init"]
    executor.shutdown()

    def broken() -> None:
        raise OSError("no device")

    failed = InferenceThread(initializer=broken)
    with pytest.raises(OSError, match="no device"):
        failed.submit(int, "1").result(5)
    failed.shutdown()


def openmp_max_threads() -> int:
    """``omp_get_max_threads()`` of the calling thread, from the OpenMP runtime torch loaded
    (an OpenMP ICV: per thread, and what MKL's sgemm sizes its team by). Other wheels bring
    their own copy (scikit-learn's, once sentence-transformers is imported): torch's is the
    one under ``torch/lib``."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    runtime = next(
        line.split()[-1]
        for line in maps
        if "/torch/lib/" in line and ("libgomp" in line or "libiomp" in line)
    )
    return int(ctypes.CDLL(runtime).omp_get_max_threads())


async def test_the_inference_thread_runs_with_the_workers_torch_threads(
    make_client: MakeClient, scale_repo: Path
) -> None:
    """torch.set_num_threads is per thread for OpenMP: the inference thread must set it
    itself, or every worker's sgemm forks a team of one thread per core under load (on the
    2-core VM that halved the feed-ranker's throughput at c = 64)."""
    import torch

    client: Client = await make_client(scale_repo, torch_threads=1)
    assert (await client.post(V2, json=body(1.0))).status == 200
    threads = client.app[CORE].registry.get("scale").threads
    assert threads is not None
    executor = threads.inference
    # OpenMP first: torch.get_num_threads() itself lazily sets up a new thread's count.
    assert executor.submit(openmp_max_threads).result(5) == 1
    assert executor.submit(torch.get_num_threads).result(5) == 1


def test_sibling_states_drive_drain_and_recycling(tmp_path: Path) -> None:
    from app.server.balance import BINDING, BOOTING, DRAINING, LOADING, READY

    views = [[], [BINDING], [BOOTING], [LOADING, DRAINING], [READY], [DRAINING]]
    # replacement_booting: hold the listener while a new worker boots (has its slot) and none
    # is ready; one still waiting for a GPU slot may need ours
    assert [balance.replacement_booting(v) for v in views[:4]] == [False, False, True, True]
    # may_recycle: another worker is ready (or there is none)
    assert [balance.may_recycle(v) for v in ([], [READY], [DRAINING])] == [True, True, False]
    # others_serving: a new worker waits for its models before it listens
    assert [balance.others_serving(v) for v in ([], [LOADING], [READY], [DRAINING])] == [
        False, False, True, True,
    ]  # fmt: skip
    # the states come from the one record, the load table, of live processes only
    slot = WorkerSlot(LoadTable(tmp_path), os.getpid())
    slot.publish(READY)
    assert slot.table.states() == {os.getpid(): READY}
    slot.release()
    assert slot.table.states() == {}


def test_workers_that_keep_dying_while_they_boot_are_forked_more_and_more_slowly() -> None:
    backoff = RestartBackoff(window_s=120.0, first_s=1.0, max_s=60.0)
    assert backoff.delay_s(0.0) == 0.0
    backoff.exited_early(0.0)
    assert backoff.delay_s(1.0) == 0.0  # a lone crash is replaced at once
    delays = []
    for t in range(1, 10):
        backoff.exited_early(float(t))
        delays.append(backoff.delay_s(float(t)))
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]
    assert backoff.delay_s(500.0) == 0.0  # quiet for the window: forgiven
