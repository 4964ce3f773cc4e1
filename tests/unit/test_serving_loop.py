"""A serving loop that cannot die: requests of different item shapes never share a batch
(Triton's rule for a variable dimension), a batch that cannot be formed or answered fails only
its own requests, and a loop that ends anyway is reported not ready, answers what waited with
503 + Retry-After and starts again."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from app.errors import InferenceFailed, QueueFull
from app.models.base import Segment
from app.models.repository import TensorSpec
from app.serving import queue as queue_module
from app.serving.context import RequestContext
from app.serving.registry import ModelState, ModelVersion
from app.serving.unit import RESTART_S, ServingUnit
from tests.support.fixtures import eventually
from tests.support.toy_models import unit_config


class RowSums:
    """A BatchRunner of a model with a variable dimension: ``y[i] = sum(x[i]) * 2``; records
    the shapes of the batches it ran (np.concatenate of unequal rows would have failed first)."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def run_batch(self, inputs: Mapping[str, np.ndarray], groups: Sequence[tuple[int, int]] = ()) -> list[Segment]:
        x = inputs["x"]
        self.shapes.append(x.shape)
        return [Segment(0, len(x), {"y": (x.sum(axis=1, keepdims=True) * 2).astype(np.float32)})]


@pytest.fixture
async def executor() -> AsyncIterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(max_workers=1)
    yield pool
    pool.shutdown(wait=True)


def variable_unit(executor: ThreadPoolExecutor, runner: Any) -> ServingUnit:
    config = unit_config(max_batch_size=8, max_queue_delay_ms=1.0, queue_capacity=1024)
    config.inputs = [TensorSpec("x", "FP32", [-1])]
    config.outputs = [TensorSpec("y", "FP32", [1])]
    unit = ServingUnit(config, runner, executor)
    unit.start()
    return unit


def context(seconds: float = 30.0) -> RequestContext:
    return RequestContext("-", asyncio.get_running_loop().time() + seconds)


async def test_requests_of_different_lengths_never_share_a_batch_and_all_answer(
    executor: ThreadPoolExecutor,
) -> None:
    runner = RowSums()
    unit = variable_unit(executor, runner)
    rng = random.Random(7)
    requests = [np.full((rng.randint(1, 3), rng.randint(1, 9)), i % 5, np.float32) for i in range(1000)]
    gate = asyncio.Semaphore(16)  # c = 16

    async def one(x: np.ndarray) -> np.ndarray:
        async with gate:
            return (await unit.infer({"x": x}, context()))["y"]

    answers = await asyncio.gather(*(one(x) for x in requests))
    for x, y in zip(requests, answers, strict=True):
        np.testing.assert_array_equal(y, x.sum(axis=1, keepdims=True) * 2)  # what it gives alone
    assert len(runner.shapes) < len(requests)  # requests of one length still batched together
    assert unit.serving
    await unit.stop()


async def test_a_batch_that_cannot_be_formed_fails_its_requests_and_the_loop_goes_on(
    executor: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = RowSums()
    unit = variable_unit(executor, runner)
    real = queue_module.Batch
    calls = {"n": 0}

    def batch_once_broken(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise ValueError("all the input array dimensions except for the concatenation axis must match")
        return real(*args, **kwargs)

    monkeypatch.setattr("app.serving.unit.Batch", batch_once_broken)
    with pytest.raises(InferenceFailed, match="could not form a batch"):
        await unit.infer({"x": np.ones((1, 2), np.float32)}, context())
    y = await unit.infer({"x": np.ones((2, 3), np.float32)}, context())
    np.testing.assert_array_equal(y["y"], [[6.0], [6.0]])
    assert unit.serving
    await unit.stop()


async def test_outputs_that_cannot_be_handed_back_fail_the_batch_not_the_loop(executor: ThreadPoolExecutor) -> None:
    class Short(RowSums):
        def run_batch(self, inputs: Mapping[str, np.ndarray], groups: Sequence[tuple[int, int]] = ()) -> list[Segment]:
            segments = super().run_batch(inputs, groups)
            if len(self.shapes) == 1:  # the first batch answers a segment that covers no item
                return [Segment(0, 0, {"y": np.zeros((0, 1), np.float32)})]
            return segments

    unit = variable_unit(executor, Short())
    with pytest.raises(InferenceFailed):
        await unit.infer({"x": np.ones((1, 2), np.float32)}, context())
    y = await unit.infer({"x": np.ones((1, 2), np.float32)}, context())
    np.testing.assert_array_equal(y["y"], [[4.0]])
    await unit.stop()


async def test_a_loop_that_ends_is_reported_not_ready_and_starts_again(executor: ThreadPoolExecutor) -> None:
    unit = variable_unit(executor, RowSums())
    model = ModelVersion(unit_config(), state=ModelState.READY, unit=unit)
    assert model.ready
    # a request that waits behind a loop about to die
    real_next = unit.queue.next_batch
    blocked = asyncio.Event()

    async def dies(drop: Any) -> Any:
        blocked.set()
        raise RuntimeError("a bug in forming batches")

    unit.queue.next_batch = dies  # type: ignore[method-assign]
    waiting = asyncio.create_task(unit.infer({"x": np.ones((1, 2), np.float32)}, context()))
    await blocked.wait()
    with pytest.raises(QueueFull, match="serving loop stopped") as info:
        await waiting  # answered at once, not at its deadline
    assert info.value.retry_after_s is not None and info.value.retry_after_s >= 1
    assert not model.ready and not unit.serving
    unit.queue.next_batch = real_next
    with pytest.raises(QueueFull, match="serving loop stopped"):  # refused at once meanwhile
        await unit.infer({"x": np.ones((1, 2), np.float32)}, context())
    loop = asyncio.get_running_loop()
    started = loop.time()
    await eventually(lambda: unit.serving, timeout_s=5.0)
    assert loop.time() - started <= RESTART_S + 1.0
    assert model.ready
    y = await unit.infer({"x": np.ones((1, 2), np.float32)}, context())
    np.testing.assert_array_equal(y["y"], [[4.0]])
    await unit.stop()


async def test_a_cancelled_loop_starts_again_and_a_stopped_unit_does_not(executor: ThreadPoolExecutor) -> None:
    unit = variable_unit(executor, RowSums())
    (task,) = [t for t in asyncio.all_tasks() if t.get_name() == f"unit:{unit.name}"]
    task.cancel()
    await eventually(lambda: not unit.serving, timeout_s=1.0)
    await eventually(lambda: unit.serving, timeout_s=5.0)
    await unit.stop()
    assert not unit.serving
