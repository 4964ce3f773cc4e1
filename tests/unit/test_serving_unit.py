"""A model version's serving unit (queue, admission, executor): batch formation, splitting,
backpressure, admission by time, batch cost bound, deadlines, disconnects, faults."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from app.errors import (
    ClientDisconnected,
    DeadlineExceeded,
    InferenceFailed,
    InsufficientStorage,
    ModelLoadError,
    PayloadTooLarge,
    QueueFull,
)
from app.models.base import Segment
from app.models.repository import read_config
from app.serving.admission import SETTLED_BATCHES, MeasuredRate, ServiceRate
from app.serving.context import RequestContext
from app.serving.dataplane import check_capacity
from app.serving.queue import GATHER_IDLE_TURNS, ItemBytes
from app.serving.runner import ModelRunner
from app.serving.unit import ServingUnit
from tests.support.fixtures import eventually
from tests.support.toy_models import ScaleHandler, unit_config, write_scale_model


class Recorder:
    """BatchRunner double: y = 2x, records batches; can block, fail or be slow."""

    def __init__(self, delay_s: float = 0.0, fail_on: float | None = None) -> None:
        self.batches: list[list[float]] = []
        self.delay_s = delay_s
        self.fail_on = fail_on
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()

    def run_batch(self, inputs: Mapping[str, np.ndarray], groups: Sequence[tuple[int, int]] = ()) -> list[Segment]:
        x = inputs["x"]
        self.started.set()
        assert self.gate.wait(10)
        self.batches.append(x[:, 0].tolist())
        if self.fail_on is not None and (x == self.fail_on).any():
            raise RuntimeError("boom")
        time.sleep(self.delay_s)
        return [Segment(0, len(x), {"y": x * 2})]


@pytest.fixture
async def executor() -> AsyncIterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(max_workers=1)
    yield pool
    pool.shutdown(wait=True)


def soon(seconds: float) -> float:
    """A deadline ``seconds`` from now, on the event loop's clock."""
    return asyncio.get_running_loop().time() + seconds


def at(deadline: float, **context: Any) -> RequestContext:
    """A request's context with ``deadline`` (loop time) and ``context``'s other fields."""
    return RequestContext("-", deadline, **context)


def service_rate(unit: ServingUnit) -> ServiceRate:
    """The measured service rate of ``unit``'s admission policy."""
    assert isinstance(unit.admission, MeasuredRate)
    return unit.admission.rate


def make(executor: ThreadPoolExecutor, fn: Recorder, **kw: float) -> ServingUnit:
    opts = {"max_batch_size": 4, "max_queue_delay_ms": 20.0, "queue_capacity": 32} | kw
    bounds: dict[str, Any] = {"max_batch_size": int(opts["max_batch_size"]), "queue_capacity": int(opts["queue_capacity"])}
    batcher = ServingUnit(unit_config(max_queue_delay_ms=opts["max_queue_delay_ms"], **bounds), fn, executor)
    batcher.start()
    return batcher


async def start_held(
    b: ServingUnit, rec: Recorder, inputs: dict[str, np.ndarray], timeout_s: float
) -> asyncio.Task[dict[str, np.ndarray]]:
    """Hold the model (``rec.gate``), send ``inputs`` and return once their batch runs: the
    requests sent next queue behind it. ``rec.gate.set()`` lets it finish."""
    rec.gate.clear()
    task = asyncio.create_task(b.infer(inputs, at(soon(timeout_s))))
    await asyncio.to_thread(rec.started.wait, 5)
    return task


def items(*values: float) -> dict[str, np.ndarray]:
    return {"x": np.array([[v, v] for v in values], dtype=np.float32)}


async def test_concurrent_requests_share_batches_up_to_max(executor: ThreadPoolExecutor) -> None:
    rec = Recorder()
    b = make(executor, rec, max_batch_size=4, max_queue_delay_ms=5)
    first = await start_held(b, rec, items(0), timeout_s=5)  # hold the first batch so the rest queue up
    rest = [asyncio.create_task(b.infer(items(v), at(soon(5)))) for v in range(1, 11)]
    await eventually(lambda: b.queue.items == 10)
    rec.gate.set()
    results = await asyncio.gather(first, *rest)
    assert [r["y"][0, 0] for r in results] == [2.0 * v for v in range(11)]
    assert [len(batch) for batch in rec.batches] == [1, 4, 4, 2]
    await b.stop()


async def test_requests_within_the_max_queue_delay_share_a_batch(executor: ThreadPoolExecutor) -> None:
    rec = Recorder()
    b = make(executor, rec, max_batch_size=8, max_queue_delay_ms=10_000)
    first = asyncio.create_task(b.infer(items(1), at(soon(30))))
    await eventually(lambda: b.queue.holding)  # the batcher has seen one item and waits for more
    assert rec.batches == [] and b.queue.items == 1
    out = await b.infer(items(2, 3, 4, 5, 6, 7, 8), at(soon(30)))  # fills the batch: it closes
    assert (await first)["y"][0, 0] == 2.0 and out["y"][:, 0].tolist() == [4, 6, 8, 10, 12, 14, 16]
    assert rec.batches == [[1, 2, 3, 4, 5, 6, 7, 8]]
    await b.stop()


async def test_a_zero_delay_runs_a_lone_request_at_once(executor: ThreadPoolExecutor) -> None:
    rec = Recorder()
    b = make(executor, rec, max_batch_size=8, max_queue_delay_ms=0)
    assert (await b.infer(items(3), at(soon(20))))["y"].tolist() == [[6.0, 6.0]]
    assert rec.batches == [[3.0]]
    await b.stop()


async def test_full_batch_does_not_wait_for_the_delay(executor: ThreadPoolExecutor) -> None:
    rec = Recorder()
    b = make(executor, rec, max_batch_size=4, max_queue_delay_ms=10_000)
    out = await asyncio.wait_for(b.infer(items(1, 2, 3, 4), at(soon(20))), 5)
    assert out["y"][:, 0].tolist() == [2, 4, 6, 8]
    await b.stop()


async def test_large_request_is_split_and_reassembled_in_order(executor: ThreadPoolExecutor) -> None:
    rec = Recorder()
    b = make(executor, rec, max_batch_size=4, max_queue_delay_ms=1)
    values = list(range(10))
    out = await b.infer(items(*values), at(soon(5)))
    assert out["y"][:, 0].tolist() == [2.0 * v for v in values]
    assert [len(batch) for batch in rec.batches] == [4, 4, 2]
    assert all(len(batch) <= 4 for batch in rec.batches)
    await b.stop()


async def test_queue_full_is_rejected_at_once_with_retry_after(executor: ThreadPoolExecutor) -> None:
    rec = Recorder()
    b = make(executor, rec, max_batch_size=2, queue_capacity=4, max_queue_delay_ms=0)
    running = await start_held(b, rec, items(0, 0), timeout_s=5)
    queued = asyncio.create_task(b.infer(items(1, 2, 3, 4), at(soon(5))))
    await eventually(lambda: b.queue.items == 4)
    with pytest.raises(QueueFull) as info:
        await b.infer(items(5), at(soon(5)))
    assert info.value.retry_after_s == 1  # a small backlog: the shortest wait
    rec.gate.set()
    await asyncio.gather(running, queued)
    await b.stop()


async def test_requests_a_stopping_unit_refuses_get_retry_after(executor: ThreadPoolExecutor) -> None:
    # A version swap stops the old version's unit: what it still queued, and what reaches it
    # after, is refused with a Retry-After (the new version serves by then), HTTP and gRPC alike.
    rec = Recorder()
    b = make(executor, rec, max_batch_size=1, max_queue_delay_ms=0)
    running = await start_held(b, rec, items(0), timeout_s=1)
    queued = asyncio.create_task(b.infer(items(1), at(soon(10))))
    await eventually(lambda: b.queue.items == 1)
    stopping = asyncio.create_task(b.stop())
    with pytest.raises(QueueFull, match="is unloading") as info:  # once the held batch is gone
        await queued
    assert info.value.retry_after_s == 1
    with pytest.raises(QueueFull, match="is unloading") as late:  # the unit is stopped by now
        await b.infer(items(2), at(soon(5)))
    assert late.value.retry_after_s == 1
    rec.gate.set()
    await asyncio.gather(running, stopping, return_exceptions=True)


def test_request_larger_than_the_queue_is_too_large() -> None:
    # one rule, one status: the data plane's cap, before a request is balanced (413)
    with pytest.raises(PayloadTooLarge, match="queues at most 8"):
        check_capacity(unit_config(queue_capacity=8), 9)
    check_capacity(unit_config(queue_capacity=8), 8)


async def test_deadline_gives_504_and_drops_queued_items(executor: ThreadPoolExecutor) -> None:
    rec = Recorder()
    b = make(executor, rec, max_batch_size=1, max_queue_delay_ms=0)
    blocker = await start_held(b, rec, items(0), timeout_s=5)
    with pytest.raises(DeadlineExceeded):
        await b.infer(items(99), at(soon(0.05)))
    assert b.queue.items == 0
    rec.gate.set()
    await blocker
    await b.infer(items(1), at(soon(5)))
    assert [99.0] not in rec.batches  # the expired item never reached the model
    await b.stop()


async def test_a_request_gets_its_504_at_its_deadline_in_a_long_batch(executor: ThreadPoolExecutor) -> None:
    # Its batch outlives its deadline: the answer comes at the deadline, not when the batch ends.
    rec = Recorder()
    b = make(executor, rec, max_batch_size=1, max_queue_delay_ms=0)
    held = await start_held(b, rec, items(7), timeout_s=0.1)
    with pytest.raises(DeadlineExceeded, match="did not finish within"):
        await asyncio.wait_for(held, 5)
    assert b.queue.items == 0
    rec.gate.set()
    assert (await b.infer(items(1), at(soon(5))))["y"].tolist() == [[2.0, 2.0]]  # the unit serves on
    await b.stop()


async def test_disconnected_client_items_never_reach_the_model(executor: ThreadPoolExecutor) -> None:
    rec = Recorder()
    b = make(executor, rec, max_batch_size=8, max_queue_delay_ms=0)
    blocker = await start_held(b, rec, items(0), timeout_s=5)
    gone = asyncio.create_task(b.infer(items(42), at(soon(5), is_disconnected=lambda: True)))
    stays = asyncio.create_task(b.infer(items(7), at(soon(5), is_disconnected=lambda: False)))
    await eventually(lambda: b.queue.items == 2)
    rec.gate.set()
    with pytest.raises(ClientDisconnected):
        await gone
    assert (await stays)["y"][0, 0] == 14.0
    await blocker
    assert all(42.0 not in batch for batch in rec.batches)
    await b.stop()


async def test_model_exception_fails_only_that_batch(executor: ThreadPoolExecutor) -> None:
    rec = Recorder(fail_on=13)
    b = make(executor, rec, max_batch_size=2, max_queue_delay_ms=1)
    with pytest.raises(InferenceFailed, match=r"model m .*request rid-1: RuntimeError") as info:
        await b.infer(items(13), RequestContext("rid-1", soon(5)))
    assert "Traceback" not in str(info.value)
    out = await b.infer(items(1), at(soon(5)))
    assert out["y"][0, 0] == 2.0
    await b.stop()


async def test_simulated_oom_splits_the_batch_and_every_request_succeeds(
    tmp_path: Path, executor: ThreadPoolExecutor
) -> None:
    config = read_config(write_scale_model(tmp_path, "oom", max_batch_size=8, oom_above=2))
    runner = ModelRunner(config)
    runner.load(torch.device("cpu"))
    b = ServingUnit(unit_config("oom", max_batch_size=8, max_queue_delay_ms=50, queue_capacity=64), runner, executor)
    b.start()
    tag = np.array([[b""]], dtype=object)
    reqs = [b.infer({"x": np.full((1, 2), v, np.float32), "tag": tag}, at(soon(5))) for v in range(8)]
    outs = await asyncio.gather(*reqs)
    assert [o["y"][0, 0] for o in outs] == [2.0 * v for v in range(8)]
    seen = ScaleHandler.BATCHES["oom"]
    # the whole batch, then halves, then quarters, which fit
    assert [len(s) for s in seen] == [8, 4, 2, 2, 4, 2, 2]
    await b.stop()


async def test_an_item_that_fails_alone_gets_507_and_the_rest_succeed(
    executor: ThreadPoolExecutor,
) -> None:
    def run(inputs: Mapping[str, np.ndarray]) -> list[Segment]:
        x = inputs["x"]
        # item with value 5 "does not fit"; the runner reports it as its own segment
        segs, start = [], 0
        for i, v in enumerate(x[:, 0]):
            if v == 5:
                if i > start:
                    segs.append(Segment(start, i, {"y": x[start:i] * 2}))
                segs.append(Segment(i, i + 1, None))
                start = i + 1
        if start < len(x):
            segs.append(Segment(start, len(x), {"y": x[start:] * 2}))
        return segs

    b = ServingUnit(unit_config(max_batch_size=8, max_queue_delay_ms=30, queue_capacity=64), Runs(run), executor)
    b.start()
    results = await asyncio.gather(
        b.infer(items(1), at(soon(5))),
        b.infer(items(4, 5, 6), at(soon(5))),
        b.infer(items(7), at(soon(5))),
        return_exceptions=True,
    )
    assert isinstance(results[1], InsufficientStorage)
    first, last = results[0], results[2]
    assert isinstance(first, dict) and isinstance(last, dict)
    assert first["y"][0, 0] == 2.0 and last["y"][0, 0] == 14.0
    await b.stop()


class Runs:
    """A BatchRunner of a plain function."""

    def __init__(self, fn: Callable[[Mapping[str, np.ndarray]], list[Segment]]) -> None:
        self.fn = fn

    def run_batch(self, inputs: Mapping[str, np.ndarray], groups: Sequence[tuple[int, int]] = ()) -> list[Segment]:
        return self.fn(inputs)


class Counts:
    """BatchObserver double: rejections by reason."""

    def __init__(self) -> None:
        self.rejections: dict[str, int] = {}

    def batch_done(self, items: int, requests: int, queue_s: float, compute_s: float) -> None:
        pass

    def padding(self, real_tokens: int, padded_tokens: int) -> None:
        pass

    def rejected(self, reason: str) -> None:
        self.rejections[reason] = self.rejections.get(reason, 0) + 1

    def queue_depth(self, items: int) -> None:
        pass

    def restarted(self) -> None:
        pass

    def prioritized(self, level: int, outcome: str, waited_s: float | None = None) -> None:
        pass


def observed(executor: ThreadPoolExecutor, fn: Recorder, **kw: Any) -> tuple[ServingUnit, Counts]:
    counts = Counts()
    opts: dict[str, Any] = {"max_batch_size": 4, "max_queue_delay_ms": 0.0, "queue_capacity": 64} | kw
    batcher = ServingUnit(unit_config(**opts), fn, executor, observer=counts)
    batcher.start()
    return batcher, counts


async def test_admission_refuses_at_once_what_cannot_finish_in_time(executor: ThreadPoolExecutor) -> None:
    rec = Recorder()
    b, counts = observed(executor, rec, max_batch_size=4)
    service_rate(b).observe(10, 1.0)  # a known service rate: 10 items/s, as seeded from warmup
    running = await start_held(b, rec, items(0), timeout_s=60)
    queued = asyncio.create_task(b.infer(items(*range(1, 21)), at(soon(60))))  # 2 s of work
    await eventually(lambda: b.queue.items == 20)
    assert b.admission.backlog_s(asyncio.get_running_loop().time()) >= 2.0
    with pytest.raises(QueueFull, match="cannot take request r-late within its deadline") as info:
        await b.infer(items(99), RequestContext("r-late", soon(1.0)))  # needs >= 2.1 s
    assert info.value.retry_after_s in (2, 3)  # the backlog, in whole seconds
    assert counts.rejections == {"admission": 1}
    # The same request with a deadline that fits is admitted.
    fits = asyncio.create_task(b.infer(items(7), at(soon(60))))
    await eventually(lambda: b.queue.items == 21)
    rec.gate.set()
    await asyncio.gather(running, queued, fits)
    assert all(99.0 not in batch for batch in rec.batches)
    await b.stop()


async def late(b: ServingUnit, value: float, turns: int) -> dict[str, np.ndarray]:
    """A request that reaches the batcher ``turns`` event-loop turns from now (as a gRPC call
    or an HTTP body already read takes a few turns to reach the queue)."""
    for _ in range(turns):
        await asyncio.sleep(0)
    return await b.infer(items(value), at(soon(5)))


@pytest.mark.parametrize(("gather_turns", "batches"), [(32, [[1.0, 2.0]]), (0, [[1.0], [2.0]])])
async def test_a_partial_batch_waits_a_few_loop_turns_for_requests_on_their_way(
    executor: ThreadPoolExecutor, gather_turns: int, batches: list[list[float]]
) -> None:
    rec = Recorder()
    # Turns, not time: a long gather_max_ms, or three turns on a loaded machine outlast it.
    b, _ = observed(executor, rec, max_batch_size=4, gather_turns=gather_turns, gather_max_ms=10_000.0)
    await asyncio.gather(b.infer(items(1), at(soon(5))), late(b, 2, 3))
    assert rec.batches == batches
    await b.stop()


async def test_gathering_stops_after_idle_loop_turns(executor: ThreadPoolExecutor) -> None:
    rec = Recorder()
    b, _ = observed(executor, rec, max_batch_size=4, gather_turns=32)
    # one request alone waits GATHER_IDLE_TURNS turns, not 32; one due later runs apart
    await asyncio.gather(b.infer(items(1), at(soon(5))), late(b, 2, 3 * GATHER_IDLE_TURNS))
    assert rec.batches == [[1.0], [2.0]]
    # a full batch closes at once
    await asyncio.gather(*(b.infer(items(v), at(soon(5))) for v in (3, 4, 5, 6)), late(b, 7, 2))
    assert rec.batches[2] == [3.0, 4.0, 5.0, 6.0]
    await b.stop()


async def test_a_batch_late_by_scheduling_noise_does_not_stretch_the_queue(executor: ThreadPoolExecutor) -> None:
    rec = Recorder()
    b, _ = observed(executor, rec, max_batch_size=4)
    service_rate(b).observe(1, 0.0005)  # a fast model: 0.5 ms per item
    now = asyncio.get_running_loop().time()
    running = await start_held(b, rec, items(0), timeout_s=60)
    queued = asyncio.create_task(b.infer(items(*range(1, 21)), at(soon(60))))  # 10 ms of work
    await eventually(lambda: b.queue.items == 20)
    # 10 ms late (a thread waiting two switch intervals for the interpreter lock): no stretch
    assert b.admission.backlog_s(now + 0.010) < 0.030
    # a second late: it needs about as much again, and what waits is stretched by that ratio
    assert b.admission.backlog_s(now + 1.0) > 1.0 + 20 * 0.0005 * 40
    rec.gate.set()
    await asyncio.gather(running, queued)
    await b.stop()


async def test_service_rate_is_measured_from_batches(executor: ThreadPoolExecutor) -> None:
    b, _ = observed(executor, Recorder(), max_batch_size=4)
    assert service_rate(b).item_s is None and service_rate(b).seconds_for(100) == 0.0  # unknown: admit
    await b.infer(items(1, 2, 3, 4), at(soon(5)))
    item_s = service_rate(b).item_s
    rate = 1.0 / item_s if item_s else None
    assert rate is not None and rate > 0 and service_rate(b).overhead_s == 0.0  # the first batch seeds it
    await b.stop()


def test_batch_cost_fit_separates_overhead_from_per_item_cost() -> None:
    rate = ServiceRate()
    rate.observe(100, 0.01 + 100 * 0.002)  # the seed: 2.1 ms per item, as timed
    for n in (10, 50, 200, 30, 120, 5, 80, 160) * 3:  # t(n) = 10 ms + 2 ms per item
        rate.observe(n, 0.01 + n * 0.002)
    assert rate.item_s == pytest.approx(0.002, rel=0.02)
    assert rate.overhead_s == pytest.approx(0.01, rel=0.1)
    assert rate.seconds_for(100, 2) == pytest.approx(2 * 0.01 + 100 * 0.002, rel=0.05)


def test_slow_small_batches_raise_the_overhead_not_the_cost_per_item() -> None:
    """Event-loop lag under load makes every batch slow whatever its size. Read as a cost per
    item, it made a model that serves 20,000 items/s look like 100 and refuse nearly
    everything (the queue stays short, batches stay small, the estimate never recovers)."""
    rate = ServiceRate()
    rate.observe(256, 256 * 0.0001)  # the seed: 0.1 ms per item, timed alone after warmup
    for _ in range(50):
        rate.observe(8, 0.08)  # 8-item batches that take 80 ms of lag each
    assert rate.item_s == pytest.approx(0.0001)
    assert rate.overhead_s == pytest.approx(0.08 - 8 * 0.0001, rel=0.01)
    # 134 items in one batch: about 93 ms, well inside a 1 s deadline (a proportional rate said 1.34 s)
    assert rate.seconds_for(134, 1) == pytest.approx(0.0792 + 0.0134, rel=0.01)


def test_a_young_fit_keeps_its_seed_slope() -> None:
    """Two batches of different sizes after the seed do not make a slope (through so few
    points it swung to 0.91 ms per token for MiniLM, which pays 0.33): the seed's slope
    stays until ``SETTLED_BATCHES`` batches, and only the overhead moves."""
    rate = ServiceRate()
    rate.observe(500, 0.08)  # the seed: 0.16 ms per token
    rate.observe(516, 0.18)
    rate.observe(1945, 0.67)
    assert rate.item_s == pytest.approx(0.08 / 500) and rate.lag == 1.0
    for n in [600, 2000] * (SETTLED_BATCHES // 2):
        rate.observe(n, 0.01 + n * 0.00033)
    assert rate.item_s == pytest.approx(0.00033, rel=0.15)


def test_a_seed_from_one_small_batch_comes_down_to_what_batches_take() -> None:
    """A seed timed on one small batch counts its overhead as cost per item (50 ms for 1 item);
    batches of one size give no slope to refit, so the seed stayed and predicted 400 ms for the
    8-item batches that took 10 ms: a model stuck refusing under steady load. The slope comes
    down to the line through the origin and the mean of what ran."""
    rate = ServiceRate()
    rate.observe(1, 0.05)
    for _ in range(40):
        rate.observe(8, 0.01)
    assert rate.seconds_for(8) == pytest.approx(0.01, rel=0.05)


def test_one_stalled_batch_does_not_become_the_cost_per_item() -> None:
    """Batches of 1-4 ms and one of 260 ms for 104 items (the feed-ranker under gRPC load, its
    inference thread descheduled): through that one point a least-squares slope read 3.5 ms
    per item, and admission refused requests it would have answered in 30 ms."""
    rate = ServiceRate()
    rate.observe(64, 0.002)
    for n in (24, 72, 40, 64, 48, 96, 32, 56) * 4:  # t(n) = 1.5 ms + 10 us per item
        rate.observe(n, 0.0015 + n * 0.00001)
    before = rate.seconds_for(512, 8)
    rate.observe(104, 0.26)
    assert rate.item_s is not None and 1.0 / rate.item_s > 10_000  # it serves 100,000
    assert rate.seconds_for(512, 8) < 2 * before
    for n in (112, 32, 40, 24, 48):  # what followed it: normal batches
        rate.observe(n, 0.0015 + n * 0.00001)
    assert rate.seconds_for(512, 8) < 1.5 * before


def test_lag_follows_a_sustained_slowdown_not_one_stalled_batch() -> None:
    """Once settled, one batch five times slower than predicted (a stall) leaves the
    estimate alone; two in a row 1.6 times slower (an overload taking CPU from the model)
    raise every prediction 1.6 times at once, and faster batches bring it back down."""
    def settled() -> ServiceRate:
        rate = ServiceRate()
        for _ in range(SETTLED_BATCHES + 2):
            rate.observe(1000, 0.3)
        return rate

    stalled = settled()
    stalled.observe(1000, 1.5)
    assert stalled.lag == 1.0
    rate = settled()
    before = rate.seconds_for(1000)
    rate.observe(1000, 0.48)
    rate.observe(1000, 0.48)
    assert rate.lag > 1.3 and rate.seconds_for(1000) > 1.5 * before
    for _ in range(20):
        rate.observe(1000, 0.3)
    assert rate.lag < 1.05


async def test_a_request_expiring_in_the_queue_is_counted_once(executor: ThreadPoolExecutor) -> None:
    rec = Recorder()
    # capacity admission: admitted whatever the held batch's age, they expire in the queue
    b, counts = observed(executor, rec, max_batch_size=1, admission="capacity")
    blocker = await start_held(b, rec, items(0), timeout_s=30)
    expiring = [asyncio.create_task(b.infer(items(9), at(soon(0.01)))) for _ in range(5)]
    done, _ = await asyncio.wait(expiring)
    rec.gate.set()
    await blocker
    await b.infer(items(1), at(soon(5)))  # _take now sees (and skips) the expired requests
    assert all(isinstance(t.exception(), DeadlineExceeded) for t in done)
    assert counts.rejections == {"deadline": 5}
    await b.stop()


async def test_batches_are_split_by_input_bytes(executor: ThreadPoolExecutor) -> None:
    rec = Recorder()
    row = items(0)["x"].nbytes  # 8 bytes per item
    b, _ = observed(executor, rec, max_batch_size=16, max_batch_bytes=3 * row)
    out = await b.infer(items(*range(8)), at(soon(5)))
    assert out["y"][:, 0].tolist() == [2.0 * v for v in range(8)]
    assert [len(batch) for batch in rec.batches] == [3, 3, 2]
    await b.stop()


async def test_an_item_over_the_batch_cost_bound_is_413(executor: ThreadPoolExecutor) -> None:
    rec = Recorder()
    b, _ = observed(executor, rec, max_batch_bytes=100)
    texts = np.array([[b"short"], [b"x" * 101]], dtype=object)
    with pytest.raises(PayloadTooLarge, match="109 bytes of input; model m runs at most 100"):
        await b.infer({"x": np.zeros((2, 2), np.float32), "t": texts}, at(soon(5)))
    assert rec.batches == [] and b.queue.items == 0
    await b.stop()


def test_item_costs_count_bytes_per_item() -> None:
    texts = np.array([[b"ab", b""], [b"abcd", b"x"]], dtype=object)
    costs = ItemBytes({"t": texts, "x": np.zeros((2, 3), np.float32)})
    assert costs.cumulative == [0, 2 + 12, 2 + 12 + 5 + 12]
    assert costs.items_within(0, 2, 14) == 1 and costs.items_within(0, 2, 13) == 0
    assert costs.items_within(1, 2, 1e9) == 1 and costs.largest() == 17
    one_each = ItemBytes({"t": np.array([[b"abc"], ["é"], [b""]], dtype=object)})  # a text an item
    assert one_each.cumulative == [0, 3, 4, 4] and one_each.largest() == 3 and one_each.between(1, 3) == 1
    numeric = ItemBytes({"x": np.zeros((4, 3), np.float32)})
    assert numeric.each == 12 and numeric.between(1, 3) == 24 and numeric.items_within(0, 4, 30) == 2


async def test_refuse_early_judges_the_smallest_recent_request(executor: ThreadPoolExecutor) -> None:
    rec = Recorder()
    b, counts = observed(executor, rec, max_batch_size=4)
    service_rate(b).observe(10, 1.0)  # 10 items/s
    assert b.refuse_early(soon(0.5)) is None  # nothing queued, 1 item: 0.1 s
    running = await start_held(b, rec, items(0), timeout_s=60)
    queued = asyncio.create_task(b.infer(items(*range(1, 11)), at(soon(60))))  # 1 s queued
    await eventually(lambda: b.queue.items == 10)
    # The smallest recent request has 1 item: 1.1 s and more, over 80 % of 1 s.
    refusal = b.refuse_early(soon(1.0))
    assert isinstance(refusal, QueueFull) and refusal.retry_after_s == 2
    assert b.refuse_early(soon(10.0)) is None
    assert counts.rejections == {"admission": 1}
    rec.gate.set()
    await asyncio.gather(running, queued)
    await b.stop()


def test_gather_turns_is_read_from_model_toml(tmp_path: Path) -> None:
    write_scale_model(tmp_path, "scale")
    toml = tmp_path / "scale" / "model.toml"
    assert read_config(tmp_path / "scale").gather_turns == 32  # the default
    toml.write_text("gather_turns = 0\n" + toml.read_text())
    assert read_config(tmp_path / "scale").gather_turns == 0
    toml.write_text(toml.read_text().replace("gather_turns = 0", "gather_turns = -1"))
    with pytest.raises(ModelLoadError, match="gather_turns must be >= 0"):
        read_config(tmp_path / "scale")


async def test_capacity_admission_refuses_only_a_full_queue(executor: ThreadPoolExecutor) -> None:
    """The plain policy (TEI's and Triton's queue policy): no rate, no prediction; 503 with
    Retry-After 1 when the queue cannot hold the items, and a deadline is the queue's to enforce."""
    rec = Recorder()
    b, counts = observed(executor, rec, max_batch_size=2, queue_capacity=4, admission="capacity")
    running = await start_held(b, rec, items(0), timeout_s=30)
    queued = asyncio.create_task(b.infer(items(1, 2, 3, 4), at(soon(30))))  # would wait long: admitted
    await eventually(lambda: b.queue.items == 4)
    with pytest.raises(QueueFull, match="queue is full") as info:
        await b.infer(items(5), at(soon(30)))
    assert info.value.retry_after_s == 1.0 and counts.rejections == {"queue_full": 1}
    assert b.refuse_early(soon(0.001)) is None  # no early refusal: the size decides
    rec.gate.set()
    await asyncio.gather(running, queued)
    with pytest.raises(ValueError, match="measured_rate' or 'capacity"):
        fifo: Any = "fifo"
        ServingUnit(unit_config(max_batch_size=1, max_queue_delay_ms=0, queue_capacity=1, admission=fifo), rec, executor)
    await b.stop()
