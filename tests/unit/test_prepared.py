"""Each item's preparation (``app.models.base.Priced``, kept under ``PREPARED``) travels with its
item through the serving core: the sort by cost, batches across requests, a request cut into
chunks, out-of-memory halving, per-request retries and the staged pipeline all hand
``preprocess`` each item's own; byte bounds do not count it; an item stage's preparations price
the request. The model runner, executor and unit are the real ones; only the handler is a
double."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Mapping
from typing import Any

import numpy as np
import pytest
import torch

from app.models.base import PREPARED, Priced
from app.serving.context import RequestContext
from app.serving.executor import InferenceThread, Threads
from app.serving.runner import ModelRunner
from app.serving.unit import ServingUnit
from tests.support.fixtures import eventually
from tests.support.toy_models import unit_config


def objects(values: list[Any]) -> np.ndarray:
    """An object array ``[N]`` of ``values`` (each element kept whole)."""
    array = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        array[i] = value
    return array


class Preparing:
    """y = 2x. Prices item ``x`` at ``x + 1`` tokens and prepares ``("prep", x)`` for it (an item
    ``x`` = ``plain`` is priced without preparations); an item stage's ``("stage", x)`` are priced
    from instead. ``preprocess`` records the x values and the preparations' x values of every
    batch it gets (None: none) and refuses x = -1; ``predict`` waits for ``gate`` and runs out
    of device memory on more than ``oom_above`` items."""

    def __init__(self, oom_above: int | None = None, plain: float | None = None) -> None:
        self.seen: list[tuple[list[float], list[float] | None]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.predicting = threading.Event()
        self.oom_above, self.plain = oom_above, plain
        self.priced_from_stage = 0

    def load(self, device: torch.device, config: Any) -> None:
        pass

    def item_costs(self, inputs: Mapping[str, np.ndarray]) -> np.ndarray | Priced:
        x = inputs["x"][:, 0]
        if PREPARED in inputs:  # an item stage's preparations: priced from them
            self.priced_from_stage += 1
            return np.array([int(tag[1]) + 1 for tag in inputs[PREPARED]], dtype=np.int64)
        costs = (x + 1).astype(np.int64)
        if self.plain is not None and (x == self.plain).any():
            return costs
        return Priced(costs, objects([("prep", float(v)) for v in x]))

    def preprocess(self, inputs: Mapping[str, np.ndarray]) -> torch.Tensor:
        x = inputs["x"]
        prepared = inputs.get(PREPARED)
        self.seen.append((x[:, 0].tolist(), None if prepared is None else [float(p[1]) for p in prepared]))
        if (x == -1).any():
            raise ValueError("x = -1 cannot be taken")
        return torch.from_numpy(x.copy())

    def predict(self, batch: torch.Tensor) -> torch.Tensor:
        self.predicting.set()
        assert self.gate.wait(10)
        if self.oom_above is not None and len(batch) > self.oom_above:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return batch * 2

    def postprocess(self, outputs: torch.Tensor) -> dict[str, np.ndarray]:
        return {"y": outputs.numpy()}

    def mismatched(self) -> list[tuple[list[float], list[float] | None]]:
        """The batches whose preparations were not their items' own, in order."""
        return [(xs, preps) for xs, preps in self.seen if preps is not None and preps != xs]


@pytest.fixture
async def threads() -> AsyncIterator[Threads]:
    made = Threads(InferenceThread("inference"), InferenceThread("prepare"), InferenceThread("finish"))
    yield made
    made.shutdown(wait=False)


def unit(handler: Preparing, threads: Threads, staged: bool = False, **fields: Any) -> ServingUnit:
    config = unit_config(**({"max_batch_size": 8, "max_queue_delay_ms": 0.0, "queue_capacity": 64} | fields))
    runner = ModelRunner(config, handler)
    made = ServingUnit(
        config, runner, threads, item_costs=runner.item_costs, batch_cost=runner.batch_cost, staged=staged,
        max_batch_bytes=fields.get("max_batch_bytes"),
    )  # fmt: skip
    made.start()
    return made


def items(*values: float, **extra: np.ndarray) -> dict[str, np.ndarray]:
    return {"x": np.array([[v, v] for v in values], dtype=np.float32), **extra}


def context(seconds: float = 30.0) -> RequestContext:
    return RequestContext("r", asyncio.get_running_loop().time() + seconds)


async def test_each_item_keeps_its_own_preparation_through_the_sort_by_cost(threads: Threads) -> None:
    handler = Preparing()
    b = unit(handler, threads)
    out = await b.infer(items(5, 1, 3, 0, 4), context())
    assert out["y"][:, 0].tolist() == [10, 2, 6, 0, 8]  # the sort undone
    assert handler.seen == [([0, 1, 3, 4, 5], [0, 1, 3, 4, 5])]  # sorted, each its own
    await b.stop()


async def test_batches_across_requests_and_chunks_carry_each_items_preparation(threads: Threads) -> None:
    handler = Preparing()
    b = unit(handler, threads, max_batch_size=4)
    handler.gate.clear()
    first = asyncio.create_task(b.infer(items(9), context()))
    await asyncio.to_thread(handler.predicting.wait, 5)
    sent = [items(3, 1), items(7, 2, 6), items(8, 4, 5, 0, 1)]  # the last is cut across batches
    rest = [asyncio.create_task(b.infer(i, context())) for i in sent]
    await eventually(lambda: b.queue.items == 10)
    handler.gate.set()
    results = await asyncio.gather(first, *rest)
    for request, result in zip([items(9), *sent], results, strict=True):
        assert result["y"].tolist() == (request["x"] * 2).tolist()
    assert handler.mismatched() == [] and all(preps is not None for _, preps in handler.seen)
    assert max(len(xs) for xs, _ in handler.seen) == 4  # requests shared batches
    assert len(handler.seen) >= 4  # 1 + 10 items in batches of at most 4
    await b.stop()


async def test_out_of_memory_halving_and_per_request_retries_carry_it(threads: Threads) -> None:
    handler = Preparing(oom_above=2)
    b = unit(handler, threads, max_batch_size=8)
    out = await b.infer(items(6, 2, 5, 3, 1), context())
    assert out["y"][:, 0].tolist() == [12, 4, 10, 6, 2]
    assert handler.mismatched() == [] and [len(xs) for xs, _ in handler.seen] == [5, 2, 3, 1, 2]  # halved
    handler.seen.clear()
    handler.gate.clear()
    handler.predicting.clear()
    first = asyncio.create_task(b.infer(items(9), context()))
    await asyncio.to_thread(handler.predicting.wait, 5)
    bad = asyncio.create_task(b.infer(items(4, -1), context()))
    good = asyncio.create_task(b.infer(items(2, 1), context()))
    await eventually(lambda: b.queue.items == 4)
    handler.gate.set()
    await first
    assert (await good)["y"][:, 0].tolist() == [4, 2]
    with pytest.raises(Exception, match="cannot take these items"):
        await bad
    assert handler.mismatched() == []
    assert ([-1.0, 4.0], [-1.0, 4.0]) in handler.seen and ([1.0, 2.0], [1.0, 2.0]) in handler.seen  # alone
    await b.stop()


async def test_the_staged_pipeline_carries_it(threads: Threads) -> None:
    handler = Preparing()
    b = unit(handler, threads, staged=True, max_batch_size=4)
    outs = await asyncio.gather(*(b.infer(items(v, v + 3, v + 1), context()) for v in (4, 0, 8)))
    assert [o["y"][:, 0].tolist() for o in outs] == [[8, 14, 10], [0, 6, 2], [16, 22, 18]]
    assert handler.mismatched() == [] and all(preps is not None for _, preps in handler.seen)
    await b.stop()


async def test_byte_bounds_do_not_count_the_preparations(threads: Threads) -> None:
    handler = Preparing()
    handler.item_costs = lambda inputs: Priced(  # type: ignore[method-assign]
        np.ones(len(inputs["x"]), np.int64),
        objects([("prep", float(v), b"p" * 1000) for v in inputs["x"][:, 0]]),
    )
    b = unit(handler, threads, max_batch_bytes=4 * 8)  # 4 items of 8 bytes: no room for 1,000 more
    out = await b.infer(items(1, 2, 3, 4), context())
    assert out["y"][:, 0].tolist() == [2, 4, 6, 8] and len(handler.seen) == 1
    await b.stop()


async def test_an_item_stages_preparations_price_the_request_and_reach_preprocess(threads: Threads) -> None:
    handler = Preparing()
    b = unit(handler, threads)
    stage = objects([("stage", v) for v in (3.0, 0.0, 2.0)])
    out = await b.infer(items(3, 0, 2, **{PREPARED: stage}), context())
    assert out["y"][:, 0].tolist() == [6, 0, 4] and handler.priced_from_stage == 1
    assert handler.seen == [([0, 2, 3], [0, 2, 3])]  # sorted by the costs the stage's made
    await b.stop()


async def test_a_batch_with_a_request_priced_without_preparations_has_none(threads: Threads) -> None:
    handler = Preparing(plain=7)
    b = unit(handler, threads)
    handler.gate.clear()
    first = asyncio.create_task(b.infer(items(9), context()))
    await asyncio.to_thread(handler.predicting.wait, 5)
    both = [asyncio.create_task(b.infer(i, context())) for i in (items(1, 2), items(7))]
    await eventually(lambda: b.queue.items == 3)
    handler.gate.set()
    await first
    assert [(await t)["y"][:, 0].tolist() for t in both] == [[2, 4], [14]]
    assert handler.seen[-1] == ([1.0, 2.0, 7.0], None)  # preprocess prepares such a batch itself
    await b.stop()
