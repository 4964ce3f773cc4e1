"""The event-loop lag sampler (app.observability.looplag): the sliding-window maximum, what one
tick records, and a real stall of a running loop seen in both metrics."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from app.observability.looplag import LoopLag, WindowMax, loop_lag_ctx
from tests.support.fixtures import MakeClient, eventually

PID = str(os.getpid())


def lag_sample(registry: CollectorRegistry, suffix: str, **labels: str) -> float:
    value = registry.get_sample_value(f"scoring_event_loop_lag_{suffix}", {"pid": PID, **labels})
    return 0.0 if value is None else value


def test_the_window_maximum_forgets_what_left_the_window() -> None:
    window = WindowMax(10.0)
    assert window.observe(0.0, 0.5) == 0.5
    assert window.observe(1.0, 0.2) == 0.5
    assert window.observe(9.9, 0.1) == 0.5
    assert window.observe(10.0, 0.05) == 0.2  # the 0.5 of t=0 left the window
    assert window.observe(11.0, 0.0) == 0.1
    assert window.observe(30.0, 0.3) == 0.3  # everything before left


def test_a_tick_records_its_lateness_in_the_histogram_and_the_window_maximum() -> None:
    registry = CollectorRegistry()
    sampler = LoopLag(registry, interval_s=0.02, window_s=5.0)
    sampler.record(1.0, 0.0004)
    sampler.record(1.1, 0.3)
    sampler.record(1.2, -0.001)  # a timer that fired early: no lag
    assert lag_sample(registry, "seconds_count") == 3
    assert lag_sample(registry, "seconds_bucket", le="0.001") == 2
    assert lag_sample(registry, "seconds_bucket", le="0.25") == 2
    assert lag_sample(registry, "seconds_bucket", le="0.5") == 3
    assert lag_sample(registry, "max_seconds") == pytest.approx(0.3)
    sampler.record(7.0, 0.01)  # the 0.3 of t=1.1 is out of the 5 s window
    assert lag_sample(registry, "max_seconds") == pytest.approx(0.01)


def test_intervals_and_windows_must_be_positive() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        LoopLag(CollectorRegistry(), interval_s=0)


async def test_a_stalled_loop_shows_as_one_late_tick() -> None:
    registry = CollectorRegistry()
    ctx = loop_lag_ctx(registry, interval_s=0.01)(object())
    await anext(ctx)  # the app's startup: the sampler ticks on this loop
    await eventually(lambda: lag_sample(registry, "seconds_count") >= 2)
    time.sleep(0.3)  # noqa: ASYNC251 - the stall under measurement: the loop runs nothing meanwhile
    await eventually(lambda: lag_sample(registry, "max_seconds") >= 0.25)
    assert lag_sample(registry, "seconds_bucket", le="0.1") < lag_sample(registry, "seconds_count")
    with pytest.raises(StopAsyncIteration):
        await anext(ctx)  # cleanup: the sampler stops
    count = lag_sample(registry, "seconds_count")
    await asyncio.sleep(0.05)
    assert lag_sample(registry, "seconds_count") == count


@pytest.mark.parametrize(("interval_ms", "probed"), [(20.0, True), (0.0, False)])
async def test_the_setting_sets_the_probe_or_turns_it_off(
    make_client: MakeClient, scale_repo: Path, interval_ms: float, probed: bool
) -> None:
    client = await make_client(scale_repo, loop_lag_interval_ms=interval_ms)
    resp = await client.get("/metrics")
    assert resp.status == 200
    assert ("scoring_event_loop_lag_seconds_count" in await resp.text()) is probed
