"""The item stage (app.serving.items) in the data plane: identity by default; a stage that answers
items itself keeps them out of the queue (all of them: the request never reaches the model); a
stage that makes several items of one has them priced, admitted and batched one by one; results
come back in the request's order; stages compose. The rest of the seam: what a serving unit
computed is shown to the stages with the fingerprint read with that unit; a stage that may
answer without the model spares its requests the early refusal; stages decide on the model as
loaded (a request that arrives while it loads waits for it first)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.errors import InvalidInput, PayloadTooLarge
from app.models.base import Segment
from app.models.repository import read_config
from app.protocols.infer import InferInput, InferRequest
from app.protocols.tensors import RequestLimits
from app.serving.context import NO_DEADLINE, RequestContext
from app.serving.dataplane import DataPlane
from app.serving.items import IDENTITY, Arrays, ItemStage, Stages
from app.serving.registry import ModelRegistry, ModelVersion
from app.serving.siblings import Alone, Balancer, LocalRun
from app.serving.unit import ServingUnit
from app.settings import Settings
from tests.support.toy_models import write_scale_model


class Doubler:
    """BatchRunner double: y = 2x, tag_length = 0; records the first column of every batch."""

    def __init__(self) -> None:
        self.batches: list[list[float]] = []
        self.lock = threading.Lock()

    def run_batch(
        self, inputs: Mapping[str, np.ndarray], groups: Sequence[tuple[int, int]] = ()
    ) -> list[Segment]:
        x = inputs["x"]
        with self.lock:
            self.batches.append(x[:, 0].tolist())
        return [Segment(0, len(x), {"y": x * 2, "tag_length": np.zeros((len(x), 1), np.int64)})]

    @property
    def items(self) -> list[float]:
        return [v for batch in self.batches for v in batch]


class Cache(ItemStage[Any]):
    """A response cache in miniature: items whose x[0] it knows never reach the queue."""

    def __init__(self, known: dict[float, float]) -> None:
        self.known = known  # x[0] -> y[0] (y[1] = y[0] + 1)
        self.contexts: list[RequestContext] = []

    def applies(self, model: ModelVersion) -> bool:
        return True

    async def expand(
        self, model: ModelVersion, context: RequestContext, inputs: Arrays
    ) -> tuple[Arrays | None, Any]:
        self.contexts.append(context)
        keys = inputs["x"][:, 0].tolist()
        misses = [i for i, k in enumerate(keys) if k not in self.known]
        plan = (keys, misses)
        if not misses:
            return None, plan
        return {name: a[misses] for name, a in inputs.items()}, plan

    def assemble(self, plan: Any, results: Arrays | None) -> Arrays:
        keys, misses = plan
        y = np.array([[self.known.get(k, 0.0), self.known.get(k, 0.0) + 1] for k in keys], np.float32)
        lengths = np.zeros((len(keys), 1), np.int64)
        if results is not None:
            y[misses], lengths[misses] = results["y"], results["tag_length"]
            for i, row in zip(misses, results["y"], strict=True):
                self.known[keys[i]] = float(row[0])
        return {"y": y, "tag_length": lengths}


class Windows(ItemStage[Any]):
    """Long texts in miniature: each item becomes ``per_item`` items (x + window / 4), and an
    item's result is the mean over its windows."""

    def __init__(self, per_item: int) -> None:
        self.per_item = per_item

    def applies(self, model: ModelVersion) -> bool:
        return True

    async def expand(
        self, model: ModelVersion, context: RequestContext, inputs: Arrays
    ) -> tuple[Arrays | None, Any]:
        n = self.per_item
        items = {name: np.repeat(a, n, axis=0) for name, a in inputs.items()}
        items["x"] = items["x"] + np.tile(np.arange(n, dtype=np.float32) / 4, len(inputs["x"]))[:, None]
        return items, len(inputs["x"])

    def assemble(self, plan: Any, results: Arrays | None) -> Arrays:
        assert results is not None
        return {
            name: a.reshape(plan, self.per_item, *a.shape[1:]).mean(axis=1).astype(a.dtype)
            for name, a in results.items()
        }


@pytest.fixture
async def pool() -> AsyncIterator[ThreadPoolExecutor]:
    executor = ThreadPoolExecutor(max_workers=1)
    yield executor
    executor.shutdown(wait=True)


class Halves(Alone):
    """Two workers that share every request of more than one item: one half runs here, the other
    half as a sibling's shard would (forwarded, on a queue of the same capacity)."""

    def may_leave(self, unit: ServingUnit, items: int, pinned: bool) -> bool:
        return items > 1

    async def route(
        self, unit: ServingUnit, inputs: Arrays, context: RequestContext, local: LocalRun
    ) -> Arrays:
        half = len(next(iter(inputs.values()))) // 2
        parts = [
            {name: a[:half] for name, a in inputs.items()},
            {name: a[half:] for name, a in inputs.items()},
        ]
        outputs = await asyncio.gather(*(local(part) for part in parts))
        return {name: np.concatenate([o[name] for o in outputs]) for name in outputs[0]}


def plane_for(
    tmp_path: Path,
    pool: ThreadPoolExecutor,
    runner: Doubler,
    stage: ItemStage[Any] | None = None,
    capacity: int = 64,
    balancer: Balancer | None = None,
) -> DataPlane:
    """A data plane over one started scale model (max batch size 4) whose unit runs ``runner``."""
    model = ModelVersion(
        read_config(write_scale_model(tmp_path, "scale", max_batch_size=4, queue_capacity=capacity))
    )
    unit = ServingUnit(model.config, runner, pool)
    unit.start()
    model.unit = unit
    registry = ModelRegistry()
    registry.versions["scale"] = {"1": model}
    registry.refresh("scale")
    return DataPlane(
        registry,
        Settings(model_repository=tmp_path),
        RequestLimits(),
        Alone(),
        items=stage,
        balancer=balancer,
    )


def request(*first: float, priority: int | None = None) -> InferRequest:
    """A V2 request for the scale model: one item per value, x = [value, value + 1]."""
    data = [[v, v + 1] for v in first]
    parameters = {"priority": priority} if priority is not None else {}
    return InferRequest(
        "scale",
        [InferInput("x", "FP32", [len(first), 2], data)],
        parameters=parameters,
    )


def arrived(request_id: str) -> RequestContext:
    """The context a front end gives a request that arrives now, its transport naming no deadline."""
    return RequestContext(request_id, NO_DEADLINE, arrival=asyncio.get_running_loop().time())


@pytest.mark.parametrize("stage", [None, IDENTITY], ids=["none", "identity"])
async def test_the_default_stage_queues_every_item_as_it_is(
    tmp_path: Path, pool: ThreadPoolExecutor, stage: ItemStage[Any] | None
) -> None:
    runner = Doubler()
    plane = plane_for(tmp_path, pool, runner, stage)
    response = await plane.infer(request(1.0, 2.0, 3.0), arrived("r1"))
    y = response.outputs[0]
    assert y.name == "y" and y.array.tolist() == [[2.0, 4.0], [4.0, 6.0], [6.0, 8.0]]
    assert runner.items == [1.0, 2.0, 3.0]


async def test_cached_items_skip_the_queue_and_results_keep_the_request_order(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    runner = Doubler()
    cache = Cache({2.0: 40.0, 4.0: 80.0})
    plane = plane_for(tmp_path, pool, runner, cache)
    response = await plane.infer(request(1.0, 2.0, 3.0, 4.0, 5.0, priority=1), arrived("r2"))
    assert runner.items == [1.0, 3.0, 5.0]  # only the misses were batched
    assert response.outputs[0].array[:, 0].tolist() == [2.0, 40.0, 6.0, 80.0, 10.0]
    context = cache.contexts[0]
    assert (context.request_id, context.priority) == ("r2", 1)
    assert context.deadline > asyncio.get_running_loop().time()


async def test_a_request_answered_whole_by_the_stage_never_reaches_the_model(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    runner = Doubler()
    plane = plane_for(tmp_path, pool, runner, Cache({7.0: 1.0, 8.0: 2.0}))
    model = plane.registry.latest["scale"]
    assert model.unit is not None
    await model.unit.stop()  # a queue that would refuse it (503): the request does not need it
    response = await plane.infer(request(8.0, 7.0), arrived("r3"))
    assert response.outputs[0].array[:, 0].tolist() == [2.0, 1.0]
    assert runner.batches == []


async def test_expanded_items_are_admitted_and_batched_one_by_one(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    runner = Doubler()
    plane = plane_for(tmp_path, pool, runner, Windows(3), capacity=8)
    response = await plane.infer(request(1.0, 10.0), arrived("r4"))
    assert len(runner.items) == 6 and max(len(b) for b in runner.batches) <= 4  # 6 windows, batches of 4
    assert np.allclose(response.outputs[0].array[:, 0], [2.5, 20.5])
    # 3 items are 9 windows: more than the queue's capacity of 8 (admission sees the windows)
    with pytest.raises(PayloadTooLarge, match=r"request has 9 items to run .*\(queue_capacity"):
        await plane.infer(request(1.0, 2.0, 3.0), arrived("r5"))


@pytest.mark.parametrize("balancer", [Alone(), Halves()], ids=["one worker", "two workers"])
async def test_a_requests_cap_is_its_models_queue_capacity_whatever_the_workers(
    tmp_path: Path, pool: ThreadPoolExecutor, balancer: Balancer
) -> None:
    """One cap, named: a request of more items than ``queue_capacity`` is a 413 saying so, on one
    worker or shared by two (each half would fit a queue); at the cap it runs."""
    runner = Doubler()
    plane = plane_for(tmp_path, pool, runner, capacity=8, balancer=balancer)
    with pytest.raises(PayloadTooLarge, match=r"request has 12 items .* at most 8 \(queue_capacity"):
        await plane.infer(request(*range(12)), arrived("r9"))
    assert runner.items == []
    response = await plane.infer(request(*range(8)), arrived("r10"))
    assert response.outputs[0].array[:, 0].tolist() == [2.0 * v for v in range(8)]


async def test_stages_expand_in_order_and_assemble_in_reverse(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    runner = Doubler()
    windows, cache = Windows(2), Cache({5.25: 100.0})  # the second window of item 5 is cached
    plane = plane_for(tmp_path, pool, runner, Stages([windows, cache]))
    response = await plane.infer(request(5.0, 6.0), arrived("r6"))
    assert runner.items == [5.0, 6.0, 6.25]
    assert np.allclose(response.outputs[0].array[:, 0], [(10.0 + 100.0) / 2, 12.25])


async def test_a_stage_that_leaves_nothing_ends_the_expansion(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    runner = Doubler()
    cache, after = Cache({1.0: 3.0}), Windows(4)
    plane = plane_for(tmp_path, pool, runner, Stages([cache, after]))
    response = await plane.infer(request(1.0), arrived("r7"))
    assert response.outputs[0].array.tolist() == [[3.0, 4.0]] and runner.batches == []


async def test_a_stage_refusing_a_request_is_its_error(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    class Refuses(ItemStage[None]):
        def applies(self, model: ModelVersion) -> bool:
            return True

        async def expand(
            self, model: ModelVersion, context: RequestContext, inputs: Arrays
        ) -> tuple[Arrays | None, None]:
            raise InvalidInput("text too long for its windows")

        def assemble(self, plan: None, results: Arrays | None) -> Arrays:
            raise AssertionError("not reached")

    runner = Doubler()
    plane = plane_for(tmp_path, pool, runner, Refuses())
    with pytest.raises(InvalidInput, match="too long"):
        await plane.infer(request(1.0), arrived("r8"))
    assert runner.batches == []


class Asked(ItemStage[None]):
    """A stage that counts how often the data plane asks whether it applies, and fails if run
    where it said it does not."""

    def __init__(self, applies: bool) -> None:
        self.answer = applies
        self.asked = 0

    def applies(self, model: ModelVersion) -> bool:
        self.asked += 1
        return self.answer

    async def expand(
        self, model: ModelVersion, context: RequestContext, inputs: Arrays
    ) -> tuple[Arrays | None, None]:
        assert self.answer, "expand of a stage that does not apply"
        return inputs, None

    def assemble(self, plan: None, results: Arrays | None) -> Arrays:
        assert self.answer and results is not None, "assemble of a stage that does not apply"
        return results


async def test_a_stage_that_does_not_apply_is_left_out_asked_once_per_loaded_runner(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    runner = Doubler()
    never, always = Asked(False), Asked(True)
    plane = plane_for(tmp_path, pool, runner, Stages([never, always]))
    model = plane.registry.versions["scale"]["1"]
    model.runner = runner  # type: ignore[assignment]  # loaded
    for value in (1.0, 2.0, 3.0):
        response = await plane.infer(request(value), arrived(f"r{value}"))
        assert response.outputs[0].array.tolist() == [[2 * value, 2 * value + 2]]
    assert (never.asked, always.asked) == (1, 1)
    model.runner = Doubler()  # type: ignore[assignment]  # a reload: a new runner, asked again
    await plane.infer(request(4.0), arrived("r4"))
    assert (never.asked, always.asked) == (2, 2)


class Seen(ItemStage[None]):
    """A stage that records what the data plane shows it: the model's runner when it expands,
    and every batch a unit computed (fingerprint, first column of the items, of the outputs)."""

    def __init__(self, answers: bool = False) -> None:
        self.answers = answers
        self.runners: list[Any] = []
        self.batches: list[tuple[str, list[float], list[float]]] = []

    def applies(self, model: ModelVersion) -> bool:
        return True

    def answers_without_model(self, model: ModelVersion) -> bool:
        return self.answers

    async def expand(
        self, model: ModelVersion, context: RequestContext, inputs: Arrays
    ) -> tuple[Arrays | None, None]:
        self.runners.append(model.runner)
        return inputs, None

    def assemble(self, plan: None, results: Arrays | None) -> Arrays:
        assert results is not None
        return results

    def computed(self, model: ModelVersion, fingerprint: str, items: Arrays, outputs: Arrays) -> None:
        self.batches.append((fingerprint, items["x"][:, 0].tolist(), outputs["y"][:, 0].tolist()))


async def test_what_a_unit_computed_is_shown_to_the_stages_with_its_fingerprint(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    runner = Doubler()
    seen, windows = Seen(), Windows(2)
    plane = plane_for(tmp_path, pool, runner, Stages([windows, seen]))
    model = plane.registry.versions["scale"]["1"]
    model.fingerprint = "files-1"
    await plane.infer(request(1.0), arrived("r1"))
    assert seen.batches == [("files-1", [1.0, 1.25], [2.0, 2.5])]  # the items as queued: windows
    # a shard a sibling sent arrives expanded: shown as it ran here, under this unit's files
    context = RequestContext("shard", asyncio.get_running_loop().time() + 10, forwarded=True)
    await plane.run(model, {"x": np.array([[7.0, 8.0]], np.float32)}, context)
    assert seen.batches[-1] == ("files-1", [7.0], [14.0])


async def test_a_stage_that_answers_without_the_model_spares_its_requests_the_early_refusal(
    tmp_path: Path, pool: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.errors import QueueFull

    for answers in (False, True):
        plane = plane_for(tmp_path / str(answers), pool, Doubler(), Seen(answers=answers))
        unit = plane.registry.versions["scale"]["1"].unit
        monkeypatch.setattr(unit, "refuse_early", lambda deadline: QueueFull("busy", retry_after_s=1))
        if answers:
            assert plane.admit("scale", None, arrived("r"))[0].config.name == "scale"
        else:
            with pytest.raises(QueueFull):
                plane.admit("scale", None, arrived("r"))


async def test_a_request_that_arrives_while_its_model_loads_meets_the_stages_once_it_is_loaded(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    """The stages decide on the loaded model (its handler's windows, its files' identity): a
    stage that ran before the load would leave a request's texts unsplit or its items uncached,
    an answer unlike the next one's."""
    runner = Doubler()
    seen = Seen()
    plane = plane_for(tmp_path, pool, runner, seen)
    model = plane.registry.versions["scale"]["1"]
    unit = model.unit
    model.unit = None  # loading: not yet served
    model.settled.clear()
    waiting = asyncio.ensure_future(plane.infer(request(1.0), arrived("r1")))
    for _ in range(3):  # let it run to where it waits (every step before is synchronous)
        await asyncio.sleep(0)
    assert not waiting.done() and seen.runners == []  # no stage asked before the load
    model.unit, model.runner = unit, runner  # type: ignore[assignment]  # served
    model.settled.set()
    response = await waiting
    assert response.outputs[0].array.tolist() == [[2.0, 4.0]]
    assert seen.runners == [runner]
