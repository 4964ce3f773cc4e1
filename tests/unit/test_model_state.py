"""A model version's state (Triton's LOADING, READY, UNLOADING, UNAVAILABLE) changes only through
its transition methods, and the registry's index, readiness and answers follow it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import pytest

from app.errors import ModelNotReady
from app.models.repository import ModelConfig, read_config
from app.serving.registry import IllegalTransition, ModelRegistry, ModelState, ModelVersion
from tests.support.toy_models import write_scale_model


class Unit:
    """A stand-in serving unit whose loop runs."""

    serving = True

    def __init__(self, tag: str) -> None:
        self.tag = tag


def copy(tag: str) -> tuple[Any, Any, Any]:
    """A stand-in (unit, runner, threads): the transitions only hold them."""
    return cast(Any, Unit(tag)), cast(Any, f"runner {tag}"), cast(Any, f"threads {tag}")


A, B, OLD, NEW = copy("a"), copy("b"), copy("old"), copy("new")


@pytest.fixture
def config(tmp_path: Path) -> ModelConfig:
    return read_config(write_scale_model(tmp_path, "scale"))


def soon() -> float:
    return asyncio.get_running_loop().time() + 0.05


async def test_the_legal_path_loading_ready_unloading_retired(config: ModelConfig) -> None:
    registry = ModelRegistry()
    model = registry.add(config)
    assert (model.state, model.ready, model.settled.is_set()) == (ModelState.LOADING, False, False)
    assert registry.index() == [("scale", "1", ModelState.LOADING, "")]
    assert not registry.ready

    old = model.serve(config, "files", *A)
    registry.refresh("scale")
    assert old == (None, None, None)
    assert (model.state, model.ready, model.settled.is_set(), model.error) == (
        ModelState.READY,
        True,
        True,
        None,
    )
    assert (model.unit, model.fingerprint) == (A[0], "files")
    assert registry.index(only_ready=True) == [("scale", "1", ModelState.READY, "")]
    assert registry.ready and registry.latest["scale"] is model
    assert await registry.serving_unit(model, soon()) == A[0]

    model.begin_unload()
    registry.refresh("scale")
    assert (model.state, model.unloading, model.ready) == (ModelState.UNLOADING, True, False)
    assert model.unit == A[0]  # still drains what was routed to it
    assert "scale" not in registry.latest  # new requests without a version no longer get it
    assert registry.index() == [("scale", "1", ModelState.UNLOADING, "")]

    registry.remove(model)
    assert model.retired and model.state == ModelState.UNLOADING
    assert (model.unit, model.runner, model.threads) == (None, None, None)
    assert registry.index() == [] and "scale" not in registry.versions
    with pytest.raises(ModelNotReady, match=r"not ready \(unloaded\)"):
        await registry.serving_unit(model, soon())


async def test_a_failed_load_is_unavailable_until_a_load_succeeds(config: ModelConfig) -> None:
    registry = ModelRegistry()
    model = registry.add(config)
    model.fail("model scale: weights.pt is missing")
    assert (model.state, model.ready, model.settled.is_set()) == (ModelState.UNAVAILABLE, False, True)
    assert registry.index() == [("scale", "1", ModelState.UNAVAILABLE, "model scale: weights.pt is missing")]
    assert registry.failures() == {"scale/1": "model scale: weights.pt is missing"}
    assert not registry.ready  # no model serves
    with pytest.raises(ModelNotReady, match=r"unavailable: model scale: weights\.pt is missing"):
        await registry.serving_unit(model, soon())

    model.fail("still missing")  # a retry failed again: the reason is the latest one
    assert (model.state, model.error) == (ModelState.UNAVAILABLE, "still missing")

    assert registry.to_load(config) is model  # model control loads it again
    assert (model.state, model.error, model.settled.is_set()) == (ModelState.LOADING, None, False)
    model.serve(config, "files", *A)
    assert (model.state, model.error, registry.failures()) == (ModelState.READY, None, {})

    retried = registry.add(
        config
    )  # a retry that succeeds goes from ModelState.UNAVAILABLE to ModelState.READY directly
    retried.fail("busy")
    retried.serve(config, "files", *B)
    assert (retried.state, retried.error) == (ModelState.READY, None)


async def test_a_reload_that_fails_leaves_the_old_copy_serving(config: ModelConfig) -> None:
    registry = ModelRegistry()
    model = registry.add(config)
    model.serve(config, "old files", *OLD)
    registry.refresh("scale")

    assert registry.to_load(config) is model  # a reload: the new copy loads beside the old one
    assert (model.state, model.unit, model.settled.is_set()) == (ModelState.READY, OLD[0], False)
    assert await registry.serving_unit(model, soon()) == OLD[0]  # requests need not wait

    model.fail("CUDA out of memory")
    assert (model.state, model.ready, model.unit, model.error) == (
        ModelState.READY,
        True,
        OLD[0],
        "CUDA out of memory",
    )
    assert model.settled.is_set()
    assert registry.index() == [("scale", "1", ModelState.READY, "CUDA out of memory")]
    assert registry.ready and registry.failures() == {}
    assert await registry.serving_unit(model, soon()) == OLD[0]

    registry.to_load(config)
    old = model.serve(config, "new files", *NEW)
    assert old == OLD  # for the caller to drain and free
    assert (model.state, model.unit, model.error, model.fingerprint) == (
        ModelState.READY,
        NEW[0],
        None,
        "new files",
    )


async def test_an_illegal_transition_raises_naming_the_model_state_and_transition(
    config: ModelConfig,
) -> None:
    model = ModelVersion(config)
    with pytest.raises(IllegalTransition, match=r"model scale v1: cannot retire in state LOADING"):
        model.retire()
    model.serve(config, "files", *A)
    with pytest.raises(RuntimeError, match=r"cannot retire in state READY"):
        model.retire()
    model.begin_unload()
    for transition, call in [
        ("begin an unload", model.begin_unload),
        ("serve", lambda: model.serve(config, "files", *B)),
        ("fail a load", lambda: model.fail("late")),
        ("begin a load", lambda: model.begin_load(config)),
    ]:
        with pytest.raises(
            IllegalTransition, match=rf"model scale v1: cannot {transition} in state UNLOADING"
        ):
            call()
    assert (model.state, model.unit, model.error) == (ModelState.UNLOADING, A[0], None)  # unchanged
    model.retire()
    with pytest.raises(IllegalTransition, match=r"cannot retire in state UNLOADING, retired"):
        model.retire()


async def test_release_at_stop_frees_any_state(config: ModelConfig) -> None:
    model = ModelVersion(config)
    model.serve(config, "files", *A)
    model.release()
    assert (model.state, model.unit, model.runner, model.threads) == (ModelState.UNLOADING, None, None, None)


async def test_a_request_waiting_for_a_load_is_refused_when_the_worker_drains(config: ModelConfig) -> None:
    # A worker stopped before it was ready (a HUP while it boots) must answer what it accepted:
    # the request waiting for the model's load gets 503 + Retry-After at the drain, not silence.
    registry = ModelRegistry()
    model = registry.add(config)
    waiting = asyncio.create_task(registry.serving_unit(model, asyncio.get_running_loop().time() + 30))
    await asyncio.sleep(0)  # one loop turn: the request waits for the load
    assert not waiting.done()
    registry.begin_drain("SIGTERM")
    with pytest.raises(ModelNotReady, match=r"not ready \(draining\)") as refused:
        await asyncio.wait_for(waiting, 1)
    assert refused.value.retry_after_s == 1
    model.serve(config, "files", *A)  # the load finishing later changes nothing for it
    assert model.settled.is_set()
