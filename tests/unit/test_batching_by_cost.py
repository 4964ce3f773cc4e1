"""Batches formed by cost (a token budget, items grouped by length, no starvation, results in
order) and the staged pipeline (stages on their own threads, results to their own requests,
one request's bad items failing only that request, cancellation), with deterministic doubles
of a model; and the real sentence handler's pricing."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch

from app.errors import DeadlineExceeded, InvalidInput, QueueFull
from app.models.base import Segment
from app.models.repository import read_config
from app.serving.admission import Backlog, MeasuredRate
from app.serving.context import RequestContext
from app.serving.executor import InferenceThread, Threads
from app.serving.queue import Budget, QueuedRequest, RequestQueue, most_within
from app.serving.runner import ModelRunner
from app.serving.unit import ServingUnit
from tests.support.fixtures import eventually
from tests.support.gunicorn import ROOT
from tests.support.toy_models import unit_config, write_scale_model


class Priced:
    """A model double that prices its items by their ``len`` input (tokens) and runs y = 2x;
    it records the batches (their lengths) and the thread of every stage, and ``gate`` holds
    ``predict``. An item of length < 0 is refused by ``item_costs``; ``preprocess`` refuses
    x == -1 (ValueError: the handler cannot take it)."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.stages: list[tuple[str, str, list[float]]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.predicting = threading.Event()
        self.prices_items = True

    def item_costs(self, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        lengths = inputs["len"][:, 0].astype(np.int64)
        if (lengths < 0).any():
            raise InvalidInput("a length below zero")
        return lengths

    def prepare(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = inputs["x"]
        self.stages.append(("prepare", threading.current_thread().name, x[:, 0].tolist()))
        if (x == -1).any():
            raise ValueError("x = -1 cannot be taken")
        return dict(inputs)

    def predict(self, prepared: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.stages.append(("predict", threading.current_thread().name, prepared["x"][:, 0].tolist()))
        self.predicting.set()
        assert self.gate.wait(10)
        self.batches.append(prepared["len"][:, 0].astype(int).tolist())
        return {"y": prepared["x"] * 2}

    def finish(self, predicted: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.stages.append(("finish", threading.current_thread().name, predicted["y"][:, 0].tolist()))
        return predicted

    def run_batch(
        self, inputs: Mapping[str, np.ndarray], groups: Sequence[tuple[int, int]] = ()
    ) -> list[Segment]:
        n = len(inputs["x"])
        try:
            prepared = self.prepare(inputs)
        except ValueError as exc:
            if len(groups) > 1:
                out: list[Segment] = []
                for start, stop in groups:
                    part = {k: v[start:stop] for k, v in inputs.items()}
                    out += [
                        Segment(s.start + start, s.stop + start, s.outputs, s.error)
                        for s in self.run_batch(part)
                    ]
                return out
            return [Segment(0, n, None, InvalidInput(str(exc)))]
        return [Segment(0, n, self.finish(self.predict(prepared)))]


def items(*pairs: tuple[float, int]) -> dict[str, np.ndarray]:
    """Items (x, length): ``x`` FP32 [B, 2] and ``len`` INT64 [B, 1]."""
    x = np.array([[v, v] for v, _ in pairs], dtype=np.float32)
    return {"x": x, "len": np.array([[n] for _, n in pairs], dtype=np.int64)}


@pytest.fixture
async def threads() -> AsyncIterator[Threads]:
    made = Threads(InferenceThread("inference"), InferenceThread("prepare"), InferenceThread("finish"))
    yield made
    for pool in (made.inference, made.prepare, made.finish):
        assert pool is not None
        pool.shutdown(wait=False)


def soon(seconds: float) -> float:
    """A deadline ``seconds`` from now, on the event loop's clock."""
    return asyncio.get_running_loop().time() + seconds


def at(deadline: float, **context: Any) -> RequestContext:
    """A request's context with ``deadline`` (loop time) and ``context``'s other fields."""
    return RequestContext("-", deadline, **context)


def measured(unit: ServingUnit) -> MeasuredRate:
    """``unit``'s admission policy, the measured rate."""
    assert isinstance(unit.admission, MeasuredRate)
    return unit.admission


def batcher(model: Priced, threads: Threads, **kw: Any) -> ServingUnit:
    opts: dict[str, Any] = {"max_batch_size": 8, "max_queue_delay_ms": 0.0, "queue_capacity": 256} | kw
    staged = bool(opts.pop("staged", False))
    b = ServingUnit(unit_config(**opts), model, threads, item_costs=model.item_costs, staged=staged)
    b.start()
    return b


async def held(b: ServingUnit, model: Priced, first: dict[str, np.ndarray]) -> asyncio.Task[Any]:
    """Hold the model on a batch of ``first``: what is sent next queues behind it."""
    model.gate.clear()
    model.predicting.clear()
    task = asyncio.create_task(b.infer(first, at(soon(30))))
    await asyncio.to_thread(model.predicting.wait, 5)
    return task


# --- the queue alone ----------------------------------------------------------------------

#: A queue that closes a batch at its delay without gathering, aging at three quarters.
NO_GATHER: dict[str, Any] = {"gather_turns": 0, "gather_max_s": 0.0, "aging": 0.75}


def queued(tokens: list[int], arrival: float) -> QueuedRequest:
    t = np.sort(np.array(tokens, dtype=np.int64))
    return QueuedRequest(
        inputs={"x": np.zeros((len(t), 1), np.float32)}, size=len(t),
        context=RequestContext(f"r{arrival}", 1e9), arrival=arrival,
        future=asyncio.get_running_loop().create_future(), item_bytes=None, tokens=t,
    )  # fmt: skip


async def test_the_token_budget_counts_what_the_batch_computes() -> None:
    budget = Budget(items=100, tokens=100)
    r = queued([10, 10, 30, 60], 0)
    assert budget.fit(r, 0, 4) == 3  # padded: 3 x 30 = 90 fits; a 4th would make it 4 x 60
    budget.take(r, 0, 3)
    assert budget.fit(queued([5], 1), 0, 1) == 0  # 4 x 30 > 100
    unpadded = Budget(items=100, tokens=100, batch_cost=lambda costs: float(costs.sum()))
    assert unpadded.fit(r, 0, 4) == 3  # 10 + 10 + 30 = 50 fits, + 60 would not
    unpadded.take(r, 0, 3)
    assert unpadded.fit(queued([5, 40, 50], 1), 0, 3) == 2  # 50 + 5 + 40 = 95


async def test_requests_are_taken_oldest_first_whole_and_only_the_last_is_split() -> None:
    queue = RequestQueue(max_batch_size=8, max_queue_delay_s=0.0, **NO_GATHER)
    requests = [
        queued([200] * 4, 0.0),
        queued([10, 12], 1.0),
        queued([8, 100, 220], 2.0),
        queued([9] * 6, 3.0),
    ]
    for r in requests:
        queue.put(r)
    dropped: list[Any] = []

    def take() -> list[tuple[str, list[int]]]:
        chunks = queue.take(0.0, lambda *a: dropped.append(a))
        out = []
        for c in chunks:
            assert c.request.tokens is not None
            out.append((c.request.request_id, c.request.tokens[c.start : c.stop].tolist()))
        return out

    assert take() == [("r0.0", [200] * 4), ("r1.0", [10, 12]), ("r2.0", [8, 100])]
    assert take() == [("r2.0", [220]), ("r3.0", [9] * 6)]
    assert queue.items == 0 and queue.cost == 0 and dropped == []


# --- the serving unit ------------------------------------------------------------------------


async def test_batches_respect_the_token_budget_and_results_keep_their_order(threads: Threads) -> None:
    model = Priced()
    b = batcher(model, threads, max_batch_size=8, max_batch_tokens=400)
    first = await held(b, model, items((0, 1)))
    rng = np.random.default_rng(0)
    requests = [[(float(100 * r + i), int(rng.integers(5, 200))) for i in range(5)] for r in range(12)]
    tasks = [asyncio.create_task(b.infer(items(*req), at(soon(30)))) for req in requests]
    await eventually(lambda: b.queue.items == 60)
    model.gate.set()
    results = await asyncio.gather(first, *tasks)
    for req, out in zip(requests, results[1:], strict=True):
        assert out["y"][:, 0].tolist() == [2 * v for v, _ in req]  # each item's own answer, in order
    for lengths in model.batches[1:]:
        assert len(lengths) * max(lengths) <= 400  # padded tokens within the budget
    await b.stop()


async def test_the_handlers_batch_cost_is_what_the_batcher_counts(threads: Threads) -> None:
    """A handler that runs a batch without padding (its ``batch_cost``: the sum of the costs)
    is accounted as such: the padding waste reads 1, where padding to the longest reads more
    for the same traffic; a token budget admits batches by that cost."""

    async def padding(batch_cost: Any) -> tuple[float, list[list[int]]]:
        model = Priced()
        config = unit_config(
            max_batch_size=8, max_queue_delay_ms=0.0, queue_capacity=256, max_batch_tokens=1000
        )
        b = ServingUnit(config, model, threads, item_costs=model.item_costs, batch_cost=batch_cost)
        b.start()
        first = await held(b, model, items((0, 1)))
        lengths = [16, 200] * 8
        tasks = [
            asyncio.create_task(b.infer(items((float(i), n)), at(soon(30)))) for i, n in enumerate(lengths)
        ]
        await eventually(lambda: b.queue.items == 16)
        model.gate.set()
        await asyncio.gather(first, *tasks)
        await b.stop()
        return measured(b).padding, model.batches[1:]

    summed, batches = await padding(lambda costs: float(costs.sum()))
    assert summed == pytest.approx(1.0) and all(sum(t) <= 1000 for t in batches)
    padded, batches = await padding(None)
    assert padded > 1.3 and all(len(t) * max(t) <= 1000 for t in batches)


class PaddingSeen:
    """A unit observer double: the ``(real, padded)`` tokens of every batch."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, int]] = []

    def batch_done(self, items: int, requests: int, queue_s: float, compute_s: float) -> None:
        pass

    def padding(self, real_tokens: int, padded_tokens: int) -> None:
        self.batches.append((real_tokens, padded_tokens))

    def rejected(self, reason: str) -> None:
        pass

    def queue_depth(self, items: int) -> None:
        pass

    def restarted(self) -> None:
        pass

    def prioritized(self, level: int, outcome: str, waited_s: float | None = None) -> None:
        pass


class TimedPriced(Priced):
    """:class:`Priced` whose ``batch_cost`` is a modelled time (10 per token and 100 a batch, as
    a text handler's cost model) and whose ``padded_tokens`` pads every item to the longest."""

    def batch_cost(self, costs: np.ndarray) -> float:
        return 10.0 * float(costs.sum()) + 100.0

    def padded_tokens(self, costs: np.ndarray) -> int:
        return int(costs.max()) * len(costs)


@pytest.mark.parametrize("offers", [True, False])
async def test_the_padding_metric_counts_padded_tokens_not_the_modelled_time(
    threads: Threads, offers: bool
) -> None:
    """Where ``batch_cost`` is time, not tokens, the runner's ``padded_tokens`` says what the
    padding metric counts (``scoring_batch_tokens_total{kind="padded"}``); a runner without it
    has its batches counted at their cost."""
    model = TimedPriced() if offers else Priced()
    seen = PaddingSeen()
    config = unit_config(max_batch_size=8, max_queue_delay_ms=0.0, queue_capacity=64)
    b = ServingUnit(config, model, threads, item_costs=model.item_costs, batch_cost=TimedPriced().batch_cost,
                    observer=seen)  # fmt: skip
    b.start()
    out = await b.infer(items((1.0, 5), (2.0, 20)), at(soon(30)))
    await b.stop()
    assert out["y"][:, 0].tolist() == [2.0, 4.0]
    assert seen.batches == [(25, 40 if offers else 350)]


def test_the_runner_counts_padded_tokens_by_the_handler_else_by_batch_cost() -> None:
    costs = np.array([5, 20], dtype=np.int64)
    config = unit_config(max_batch_size=8, max_queue_delay_ms=0.0, queue_capacity=64)
    timed = ModelRunner(config, cast(Any, TimedPriced()))
    assert timed.batch_cost(costs) == 350.0 and timed.padded_tokens(costs) == 40
    plain = ModelRunner(config, cast(Any, Priced()))  # no batch_cost: padded to the longest
    assert plain.batch_cost(costs) == 40.0 and plain.padded_tokens(costs) == 40


async def test_no_request_is_passed_over_for_long(threads: Threads) -> None:
    """A long request queued first runs in the first batch after the one running, although
    many short ones queued after it would pad less without it; every request's batch comes no
    later than one batch per chunk queued before it."""
    model = Priced()
    b = batcher(model, threads, max_batch_size=4)
    first = await held(b, model, items((0, 1)))
    long = asyncio.create_task(b.infer(items((1, 250)), at(soon(30))))
    await eventually(lambda: b.queue.items == 1)
    shorts = [asyncio.create_task(b.infer(items((float(10 + i), 3)), at(soon(30)))) for i in range(12)]
    await eventually(lambda: b.queue.items == 13)
    model.gate.set()
    await asyncio.gather(first, long, *shorts)
    assert 250 in model.batches[1]
    await b.stop()


async def test_stages_run_on_their_own_threads_and_overlap(threads: Threads) -> None:
    model = Priced()
    b = batcher(model, threads, staged=True, max_batch_size=2)
    first = await held(b, model, items((1, 4), (2, 4)))
    second = asyncio.create_task(b.infer(items((3, 4), (4, 4)), at(soon(30))))
    # batch 2 is prepared while batch 1 is still on the (held) inference thread
    await eventually(lambda: ("prepare", "prepare", [3.0, 4.0]) in model.stages)
    assert not any(stage == "finish" for stage, _, _ in model.stages)
    model.gate.set()
    out1, out2 = await asyncio.gather(first, second)
    assert out1["y"][:, 0].tolist() == [2, 4] and out2["y"][:, 0].tolist() == [6, 8]
    assert {(stage, name) for stage, name, _ in model.stages} == {
        ("prepare", "prepare"), ("predict", "inference"), ("finish", "finish"),
    }  # fmt: skip
    await b.stop()


@pytest.mark.parametrize("pipelined", [True, False])
async def test_one_requests_bad_items_fail_only_that_request(threads: Threads, pipelined: bool) -> None:
    model = Priced()
    # the batch closes when 4 items are queued (a long delay otherwise): the four share it;
    # the deadline leaves the 20 s delay inside the admission headroom
    b = batcher(model, threads, staged=pipelined, max_batch_size=4, max_queue_delay_ms=20_000)
    good = [asyncio.create_task(b.infer(items((float(v), 5)), at(soon(60)))) for v in (1, 2, 3)]
    bad = asyncio.create_task(b.infer(items((-1, 5)), at(soon(60))))  # preprocess cannot take it
    results = await asyncio.gather(*good, bad, return_exceptions=True)
    assert [r["y"][0, 0] for r in results[:3]] == [2.0, 4.0, 6.0]  # type: ignore[index]
    assert isinstance(results[3], InvalidInput) and "cannot be taken" in str(results[3])
    assert len(model.stages[0][2]) == 4  # they did share the first batch
    with pytest.raises(InvalidInput, match="below zero"):  # refused by pricing, before the queue
        await b.infer(items((5, -3)), at(soon(30)))
    await b.stop()


async def test_stop_fails_queued_and_running_requests_with_503(threads: Threads) -> None:
    model = Priced()
    b = batcher(model, threads, staged=True, max_batch_size=1)
    first = await held(b, model, items((0, 1)))
    waiting = asyncio.create_task(b.infer(items((1, 1)), at(soon(30))))
    await eventually(lambda: b.queue.items == 1 or ("prepare", "prepare", [1.0]) in model.stages)
    await b.stop()
    model.gate.set()
    for task in (first, waiting):
        with pytest.raises(QueueFull, match="unloading"):
            await task


async def test_an_idle_model_admits_whatever_a_past_burst_taught_it(threads: Threads) -> None:
    model = Priced()
    b = batcher(model, threads)
    measured(b).rate.item_s, measured(b).rate.overhead_s = (
        10.0,
        5.0,
    )  # "learned" in an overload: 10 s per token
    out = await b.infer(items((1, 3)), at(soon(1.0)))
    assert out["y"][0, 0] == 2.0
    rate = measured(b).rate
    assert rate.item_s is not None and rate.item_s < 1.0  # the batch that ran corrected it
    rate.item_s, rate.overhead_s = 10.0, 5.0
    # busy, the same estimate refuses: 504 when even alone the request could not finish
    first = await held(b, model, items((0, 1)))
    with pytest.raises(DeadlineExceeded, match="even alone"):
        await b.infer(items((2, 3)), at(soon(1.0)))
    model.gate.set()
    await first
    await b.stop()


# --- the real handler: pricing ------------------------------------------------------------


@pytest.mark.slow
def test_the_sentence_handler_prices_texts_in_tokens_and_refuses_bad_utf8(tmp_path: Path) -> None:
    from app.handlers.sentence_embedding import SentenceEmbeddingHandler

    config = read_config(ROOT / "model_repository" / "all-MiniLM-L6-v2")
    handler = SentenceEmbeddingHandler()
    handler.load(torch.device("cpu"), config)
    texts = np.array([[b"a"], ["word " * 400], ["caf\u00e9"]], dtype=object)
    texts[2, 0] = texts[2, 0].encode()
    costs = handler.item_costs(
        {"text": texts, "query": np.array([[b""], [b""], [b"hello there"]], dtype=object)}
    ).costs
    assert costs.tolist()[0] == 3 and costs.tolist()[1] == handler.max_seq_length  # CLS a SEP; truncated
    assert costs.tolist()[2] > 3
    # what preprocess encodes once is priced once: a shared query, a repeated text
    shared = {
        "text": np.array([[b"a"], [b"b"], [b"a"]], dtype=object),
        "query": np.array([[b"hello there"]] * 3, dtype=object),
    }
    assert handler.item_costs(shared).costs.tolist() == [3 + 4, 3, 0]  # CLS hello there SEP: 4
    with pytest.raises(ValueError, match="not valid UTF-8"):
        handler.item_costs({"text": np.array([[b"\xff\xfe"]], dtype=object)})
    runner = ModelRunner(config, handler)
    assert runner.prices_items


def test_scale_model_does_not_price(tmp_path: Path) -> None:
    runner = ModelRunner(read_config(write_scale_model(tmp_path)))
    assert not runner.prices_items and runner.item_costs({"x": np.zeros((1, 2), np.float32)}) is None


# --- priority levels ----------------------------------------------------------------------


async def test_a_higher_level_is_batched_first_and_admitted_against_its_own_backlog(threads: Threads) -> None:
    """Triton's priority levels: with the model held and low-priority requests queued, a
    high-priority request joins the next batch ahead of them; admission judges it against the
    work at its level and above (and the batch running), not the low-priority backlog."""
    model = Priced()
    b = batcher(model, threads, max_batch_size=2, priority_levels=2, default_priority_level=2)
    measured(b).rate.item_s, measured(b).rate.overhead_s = 0.1, 0.0  # 10 tokens/s: 0.1 s per token
    first = await held(b, model, items((0, 1)))
    low = [asyncio.create_task(b.infer(items((float(10 + i), 1)), at(soon(60)))) for i in range(10)]
    await eventually(lambda: b.queue.items == 10)
    # alone behind the running batch: well within 2 s; behind the low backlog it would need 1+ s more
    high = asyncio.create_task(b.infer(items((99, 1)), at(soon(2.0), priority=1)))
    with pytest.raises(QueueFull):  # the same request at the low level does not fit 2 s
        await b.infer(items((98, 1)), at(soon(2.0)))
    await eventually(lambda: b.queue.items == 11)
    model.gate.set()
    await asyncio.gather(first, high, *low)
    assert 99 in [int(v) for v in model.stages[3][2]]  # the first batch after the held one
    await b.stop()


async def test_no_level_starves_a_waiting_request_goes_first_once_aged(threads: Threads) -> None:
    """Aging: a low-priority request that has waited ``priority_aging`` of its time to deadline
    is taken before the high-priority ones that keep arriving."""
    model = Priced()
    # an aging share so small that the low request has aged by the time the next batch forms
    b = batcher(
        model, threads, max_batch_size=1, priority_levels=2, default_priority_level=2, priority_aging=1e-9
    )
    first = await held(b, model, items((0, 1)))
    low = asyncio.create_task(b.infer(items((7, 1)), at(soon(60))))
    high = [
        asyncio.create_task(b.infer(items((float(20 + i), 1)), at(soon(60), priority=1))) for i in range(3)
    ]
    await eventually(lambda: b.queue.items == 4)
    model.gate.set()
    await asyncio.gather(first, low, *high)
    order = [int(stage[2][0]) for stage in model.stages if stage[0] == "predict"]
    assert order[:2] == [0, 7]  # the aged low request before every high one
    await b.stop()


def test_a_priority_above_the_levels_is_invalid() -> None:
    from app.serving.dataplane import parameters_priority

    three = unit_config(priority_levels=3, default_priority_level=3)
    assert [parameters_priority(three, {"priority": p}) for p in (0, 1, 3)] == [0, 1, 3]
    assert parameters_priority(three, {}) == 0
    with pytest.raises(InvalidInput, match=r"levels 1\.\.3"):
        parameters_priority(three, {"priority": 4})
    assert parameters_priority(unit_config(), {"priority": 7}) == 7  # no levels: the unit ignores it
    unit = ServingUnit(three, cast(Any, object()), cast(Any, None))
    assert [unit.level(p) for p in (None, 0, 1, 3)] == [2, 2, 0, 2]


def _queued(level: int, size: int, loop: asyncio.AbstractEventLoop) -> QueuedRequest:
    now = loop.time()
    inputs = {"x": np.zeros((size, 1), np.float32)}
    context = RequestContext(f"r{level}", now + 60)
    return QueuedRequest(inputs, size, context, now, loop.create_future(), None, level=level)


@pytest.mark.parametrize(("overhead_s", "item_s", "low_items"), [(0.0, 0.01, 1), (1.0, 0.001, 6)])
async def test_lower_levels_fill_a_higher_levels_batch_only_while_it_costs_little(
    overhead_s: float, item_s: float, low_items: int
) -> None:
    """``priority_fill``: 4 high-priority items cost ``t(4)``; low-priority items join their
    batch only while the batch stays within 1.25 t(4). Where the time grows with the items (a
    CPU: no overhead) 1 low item fits; where the overhead dominates (a GPU) the batch fills."""
    policy = MeasuredRate(cast(Backlog, None))  # the rate alone decides the bound
    policy.rate.overhead_s, policy.rate.item_s = overhead_s, item_s
    loop = asyncio.get_running_loop()
    for fill, expected in (
        (lambda cost: policy.fill_limit(cost, 0.25), low_items),
        (lambda cost: math.inf, 6),
    ):
        queue = RequestQueue(max_batch_size=10, max_queue_delay_s=0.0, levels=2, fill=fill, **NO_GATHER)
        queue.put(_queued(1, 6, loop))
        queue.put(_queued(0, 4, loop))
        batch = queue.take(loop.time(), lambda *_: None)
        assert [(c.request.level, c.stop - c.start) for c in batch] == [(0, 4), (1, expected)]


@pytest.mark.parametrize(
    ("longest_s", "aging", "low_first"),
    [(0.0, 0.75, False), (5.0, 0.75, False), (31.0, 0.75, True), (31.0, 1.0, False)],
)
async def test_a_lower_level_goes_first_when_two_of_the_longest_batches_are_left(
    longest_s: float, aging: float, low_first: bool
) -> None:
    """Aging keeps a margin: a low-priority request with 60 s to its deadline, far from its
    aging share, goes before the high level once two of the longest recent batches (``margin``,
    seconds) would not fit in what is left: the batch running and its own. With
    ``priority_aging = 1`` (strict priority) it never does."""
    loop = asyncio.get_running_loop()
    options = {**NO_GATHER, "aging": aging}
    queue = RequestQueue(
        max_batch_size=4, max_queue_delay_s=0.0, levels=2, margin=lambda: longest_s, **options
    )
    queue.put(_queued(1, 4, loop))
    queue.put(_queued(0, 4, loop))
    batch = queue.take(loop.time(), lambda *_: None)
    assert [(c.request.level, c.stop - c.start) for c in batch] == [(1 if low_first else 0, 4)]


def test_most_within_finds_the_largest_fit_and_asks_once_when_all_fit() -> None:
    for limit in range(0, 12):
        for n in range(0, 10):
            asked: list[int] = []

            def cost_of(k: int, asked: list[int] = asked) -> float:
                asked.append(k)
                return float(k)  # grows with k

            assert most_within(cost_of, n, limit) == min(n, limit)
            if n and n <= limit:
                assert asked == [n]  # the common case: everything fits, one pricing
