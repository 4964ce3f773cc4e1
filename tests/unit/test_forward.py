"""Forwarding of whole requests on pinned (gRPC) connections (app.server.router): the decision
(app.server.balance), deterministic on fake load table entries, and the forward itself against a
real sibling endpoint stand-in on a Unix socket (answers, unreachable, stalled); a client that
leaves while its request runs on a real sibling's internal endpoint (scattered or forwarded)."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
from aiohttp import web

from app import errors
from app.http.state import CORE
from app.server import wire
from app.server.balance import (
    BOOTING,
    DRAINING,
    READY,
    Load,
    LoadTable,
    WorkerBalancer,
    WorkerSlot,
    pick_target,
)
from app.server.peers import PATH, InternalEndpoint, PeerClient, socket_path
from app.server.router import Router
from app.serving.context import RequestContext
from app.serving.unit import ServingUnit
from tests.support.fixtures import MakeClient, eventually, hold
from tests.support.fixtures import served as unit_of
from tests.support.toy_models import ScaleHandler, write_scale_model

NOW = 100.5
SIBLING_PID = 4242


def sibling(slot: int, items: int, *, state: int = READY, beat: float = 100.0, pid: int = 0) -> Load:
    return Load(slot, pid or 1000 + slot, 1, state, items, 1, float(items), beat)


def test_an_idle_or_evenly_loaded_worker_keeps_its_requests() -> None:
    assert pick_target(0, [sibling(1, 0)], NOW) is None  # c = 1: never a hop
    assert pick_target(2, [sibling(1, 1)], NOW) is None  # 2:1 is left in place
    assert pick_target(5, [sibling(1, 3)], NOW) is None
    assert pick_target(5, [], NOW) is None


def test_a_clearly_busier_worker_forwards_to_its_least_loaded_live_sibling() -> None:
    assert pick_target(1, [sibling(1, 0)], NOW) == sibling(1, 0)
    assert pick_target(3, [sibling(1, 1)], NOW) == sibling(1, 1)
    assert pick_target(8, [sibling(1, 3), sibling(2, 1)], NOW) == sibling(2, 1)


@pytest.mark.parametrize(
    "unfit",
    [sibling(1, 0, state=DRAINING), sibling(1, 0, state=BOOTING), sibling(1, 0, beat=0.0)],
    ids=["draining", "booting", "stale heartbeat (stopped or dead)"],
)
def test_unready_or_stale_siblings_are_never_picked(unfit: Load) -> None:
    assert pick_target(10, [unfit], NOW) is None
    assert pick_target(10, [unfit, sibling(2, 4)], NOW) == sibling(2, 4)


def test_items_already_forwarded_count_until_the_sibling_publishes_them() -> None:
    idle = sibling(1, 0)
    assert pick_target(3, [idle], NOW, pending={idle.pid: 2}) is None  # 3 is not > 2 * 2 + 0.5
    assert pick_target(6, [idle], NOW, pending={idle.pid: 2}) == idle
    assert pick_target(3, [idle], NOW, pending={9999: 2}) == idle  # another sibling's


def test_power_of_two_choices_among_more_siblings() -> None:
    """Two siblings drawn at random, the less loaded kept: a heavily loaded one is never the
    target while two idle ones exist, and a lone idle one is missed when both draws are busy
    (that is what keeps several busy workers from herding onto it)."""
    idle, busy = [sibling(1, 0), sibling(2, 0)], sibling(3, 50)
    picks = [pick_target(10, [*idle, busy], NOW, rng=random.Random(seed)) for seed in range(50)]
    assert {p.slot for p in picks if p is not None} == {1, 2}
    lone = [sibling(1, 0), sibling(2, 50), sibling(3, 50)]
    outcomes = [pick_target(10, lone, NOW, rng=random.Random(seed)) for seed in range(50)]
    assert {None if p is None else p.slot for p in outcomes} == {None, 1}


# --- the forward itself ------------------------------------------------------------------


class FakeSlot:
    """What the Router reads of app.server.balance.WorkerSlot."""

    def __init__(self, items: int, siblings: list[Load]) -> None:
        self.ready = True
        self.items = items
        self._others = siblings

    def others(self) -> list[Load]:
        return self._others


def entry(wait_s: float = 1.0) -> ServingUnit:
    """A serving unit double: model scale v1, batches of 8, a request would wait ``wait_s``."""
    unit = SimpleNamespace(
        name="scale", version="1", scatter=True, max_batch_size=8, expected_wait_s=lambda now: wait_s
    )
    return cast(ServingUnit, unit)


def soon(seconds: float) -> float:
    return asyncio.get_running_loop().time() + seconds


def live_sibling() -> Load:
    return Load(1, SIBLING_PID, 1, READY, 0, 1, 0.0, time.monotonic() + 3600)


INPUTS = {"x": np.arange(6, dtype=np.float32).reshape(3, 2)}


async def run_here(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"y": -inputs["x"]}


async def served(tmp_path: Path, handler: Any) -> web.AppRunner:
    async def shard(request: web.Request) -> web.Response:
        reply = await handler(wire.decode_request(await request.read()))
        return web.Response(body=wire.encode(reply), content_type="application/msgpack")

    app = web.Application()
    app.router.add_post(PATH, shard)
    runner = web.AppRunner(app)
    await runner.setup()
    path = socket_path(tmp_path, SIBLING_PID)
    path.parent.mkdir(exist_ok=True)
    await web.UnixSite(runner, str(path)).start()
    return runner


def forwarder(tmp_path: Path, items_here: int, counted: list[tuple[str, str]]) -> Router:
    slot = cast(WorkerSlot, FakeSlot(items_here, [live_sibling()]))
    return Router(slot, PeerClient(tmp_path), on_forward=lambda m, v: counted.append((m, v)))


async def test_a_busy_worker_forwards_whole_keeping_id_deadline_and_priority(tmp_path: Path) -> None:
    seen: list[wire.ShardRequest] = []

    async def answer(shard: wire.ShardRequest) -> wire.ShardResponse:
        seen.append(shard)
        x = wire.from_tensor(shard.inputs["x"])
        return wire.ShardResponse(outputs={"y": wire.to_tensor(2 * x)})

    runner = await served(tmp_path, answer)
    counted: list[tuple[str, str]] = []
    forward = forwarder(tmp_path, 4, counted)
    try:
        out = await forward.route(
            entry(), INPUTS, RequestContext("rid-7", soon(5.0), 2, pinned=True), run_here
        )
    finally:
        await forward.peers.close()
        await runner.cleanup()
    assert out is not None and np.array_equal(out["y"], 2 * INPUTS["x"])
    (shard,) = seen
    assert (shard.model, shard.version, shard.request_id, shard.priority) == ("scale", "1", "rid-7", 2)
    assert 0 < shard.timeout_s <= 5.0
    assert counted == [("scale", "1")] and forward.pending == {}


async def test_an_idle_worker_runs_the_request_here(tmp_path: Path) -> None:
    counted: list[tuple[str, str]] = []
    forward = forwarder(tmp_path, 0, counted)
    assert (
        await forward.route(entry(), INPUTS, RequestContext("rid", soon(5.0), pinned=True), run_here) is None
    )
    assert counted == []


async def test_a_request_leaves_only_when_split_or_pinned_and_waiting_longer_than_the_hop(
    tmp_path: Path,
) -> None:
    """The balancer's cheap question, asked of every request: a pinned (gRPC) request may be
    forwarded only while it would wait at least MIN_WAIT_S here (a fast model's 1 ms backlog:
    the hop would cost more than it saves), HTTP (not pinned) only when it is split; nothing
    leaves a worker that is not ready or has no router (balancing off)."""
    slot = WorkerSlot(LoadTable(tmp_path), 1)
    balancer = WorkerBalancer(slot, Router(slot, PeerClient(tmp_path)).route)
    assert not balancer.may_leave(entry(), 3, pinned=True)  # not ready yet
    slot.tick(READY, 0)
    assert balancer.may_leave(entry(0.050), 3, pinned=True)
    assert not balancer.may_leave(entry(0.001), 3, pinned=True)
    assert not balancer.may_leave(entry(0.050), 3, pinned=False)
    assert balancer.may_leave(entry(0.001), 9, pinned=False)  # more than a batch: split
    assert not WorkerBalancer(slot, None).may_leave(entry(0.050), 9, pinned=True)
    slot.tick(DRAINING, 0)
    assert not balancer.may_leave(entry(0.050), 9, pinned=True)


async def test_an_unreachable_sibling_costs_nothing_the_request_runs_here(tmp_path: Path) -> None:
    counted: list[tuple[str, str]] = []
    forward = forwarder(tmp_path, 4, counted)  # no socket at the sibling's path
    try:
        out = await forward.route(entry(), INPUTS, RequestContext("rid", soon(5.0), pinned=True), run_here)
    finally:
        await forward.peers.close()
    assert out is not None and np.array_equal(out["y"], -INPUTS["x"])
    assert forward.pending == {}


async def test_a_sibling_with_a_full_queue_sends_the_request_back_here(tmp_path: Path) -> None:
    async def full(shard: wire.ShardRequest) -> wire.ShardResponse:
        return wire.ShardResponse(error="QueueFull", message="queue full", retry_after_s=1)

    runner = await served(tmp_path, full)
    forward = forwarder(tmp_path, 4, [])
    try:
        out = await forward.route(entry(), INPUTS, RequestContext("rid", soon(5.0), pinned=True), run_here)
    finally:
        await forward.peers.close()
        await runner.cleanup()
    assert out is not None and np.array_equal(out["y"], -INPUTS["x"])


async def test_a_stalled_sibling_costs_deadline_exceeded_not_a_hang(tmp_path: Path) -> None:
    never = asyncio.Event()

    async def stall(shard: wire.ShardRequest) -> wire.ShardResponse:
        await never.wait()
        raise AssertionError("unreachable")

    runner = await served(tmp_path, stall)
    forward = forwarder(tmp_path, 4, [])
    try:
        with pytest.raises(errors.DeadlineExceeded, match="did not answer"):
            # the outer bound only keeps a regression from hanging the suite
            await asyncio.wait_for(
                forward.route(entry(), INPUTS, RequestContext("rid", soon(0.2), pinned=True), run_here), 30
            )
    finally:
        never.set()
        await forward.peers.close()
        await runner.cleanup()
    assert forward.pending == {}


async def test_the_router_forwards_only_pinned_requests(tmp_path: Path) -> None:
    """HTTP (not pinned) never forwards; gRPC (pinned) does when busy."""

    async def answer(shard: wire.ShardRequest) -> wire.ShardResponse:
        return wire.ShardResponse(outputs={"y": wire.to_tensor(2 * wire.from_tensor(shard.inputs["x"]))})

    runner = await served(tmp_path, answer)
    counted: list[tuple[str, str]] = []
    router = forwarder(tmp_path, 4, counted)
    try:
        assert await router.route(entry(), INPUTS, RequestContext("http", soon(5.0)), run_here) is None
        out = await router.route(entry(), INPUTS, RequestContext("grpc", soon(5.0), pinned=True), run_here)
    finally:
        await router.peers.close()
        await runner.cleanup()
    assert out is not None and np.array_equal(out["y"], 2 * INPUTS["x"])
    assert counted == [("scale", "1")]


# --- a client that leaves -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("items", "pinned", "queued"),
    [(10, False, 5), (3, True, 3)],
    ids=["a shard of a scattered request", "a forwarded request"],
)
async def test_work_on_a_sibling_is_dropped_there_when_its_client_leaves(
    make_client: MakeClient, tmp_path: Path, items: int, pinned: bool, queued: int
) -> None:
    """While its part waits in a real sibling's queue (the sibling's model is busy), the client
    of a request leaves: the router answers ClientDisconnected at once rather than when the part
    is done, its call to the sibling closes, and the sibling drops the part's items: they never
    reach its model, counted as a failed request there."""
    write_scale_model(tmp_path / "repo", "scale")
    sibling = await make_client(tmp_path / "repo", hung_inference_s=0)
    (tmp_path / "peers").mkdir(mode=0o700)
    endpoint = await InternalEndpoint.start(sibling.app[CORE], tmp_path, SIBLING_PID)
    router = Router(cast(WorkerSlot, FakeSlot(4, [live_sibling()])), PeerClient(tmp_path))
    unit = unit_of(sibling.app, "scale")
    stats = sibling.app[CORE].registry.get("scale").stats
    held = hold(sibling.app, "scale")
    left = threading.Event()
    try:
        one = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1.0, 1.0]}]}
        first = asyncio.ensure_future(sibling.post("/v2/models/scale/infer", json=one))
        await eventually(lambda: unit.running_batch is not None)
        inputs = {
            "x": np.full((items, 2), 5.0, dtype=np.float32),
            "tag": np.full((items, 1), b"", dtype=object),
        }
        context = RequestContext("rid-left", soon(30.0), pinned=pinned, is_disconnected=left.is_set)
        routed = asyncio.ensure_future(router.route(entry(), inputs, context, run_here))
        await eventually(lambda: unit.queue.items == queued)  # its part waits on the sibling
        left.set()
        with pytest.raises(errors.ClientDisconnected, match="rid-left"):
            await asyncio.wait_for(routed, 30)  # the bound only keeps a regression from hanging
        server = endpoint.runner.server
        assert server is not None
        # the call to the sibling closed (its handler, still waiting, has lost its transport)
        await eventually(lambda: all(handler.transport is None for handler in server.connections))
        held.set()
        assert (await first).status == 200
        await eventually(lambda: stats.fail.count == 1)  # dropped when the next batch formed
        assert unit.queue.items == 0
        assert all(5.0 not in batch for batch in ScaleHandler.BATCHES["scale"])
    finally:
        held.set()
        await router.peers.close()
        await endpoint.close()
