"""The load table (app.server.balance), the balancing rules (app.server.balance), and a
worker's side of them: its slot (app.server.balance), its connections (app.server.balance)
and its siblings (app.server.siblings)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import cast

import pytest

from app.server.balance import (
    BOOTING,
    DRAINING,
    EMPTY,
    LOADING,
    READY,
    STALE_S,
    Load,
    LoadTable,
    WorkerConnections,
    WorkerSlot,
    least_loaded,
    may_accept,
    should_shed,
)
from app.server.peers import PeerClient
from app.server.siblings import WorkerSiblings


def load(
    slot: int, connections: int, recent: float = 0.0, *, state: int = READY, beat: float = 100.0
) -> Load:
    return Load(slot, 1000 + slot, 1, state, int(recent), connections, recent, beat)


NOW = 100.5


def test_table_round_trip_between_two_mappings(tmp_path: Path) -> None:
    writer, reader = LoadTable(tmp_path), LoadTable(tmp_path)
    slot = writer.claim(os.getpid())
    writer.set_items(slot, 24)
    writer.set_connections(slot, 3)
    writer.set_recent(slot, 12.25)
    writer.set_state(slot, READY)
    writer.beat(slot, 42.5)
    assert reader.slots_in_use == 1
    assert reader.read(slot) == Load(slot, os.getpid(), 1, READY, 24, 3, 12.25, 42.5)
    writer.release(slot, os.getpid())
    assert reader.read(slot).pid == 0 and reader.read(slot).state == EMPTY


def test_claim_skips_live_slots_and_reuses_a_dead_pid(tmp_path: Path) -> None:
    table = LoadTable(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert table.claim(os.getppid()) == 0
    assert table.claim(dead.pid) == 1  # a worker that was SIGKILLed: its slot stays behind
    assert table.claim(os.getpid()) == 1  # its pid is dead: reused, next generation
    assert table.read(1).generation == 2 and table.read(1).pid == os.getpid()
    assert table.slots_in_use == 2


def test_stale_and_unready_slots_are_not_live() -> None:
    assert load(0, 1).live(NOW)
    assert not load(0, 1, beat=NOW - STALE_S - 0.1).live(NOW)  # stopped or killed
    assert not load(0, 1, state=DRAINING).live(NOW)
    assert not load(0, 1, state=BOOTING).live(NOW)


def test_least_loaded_orders_by_connections_then_items() -> None:
    siblings = [load(1, 3), load(2, 1, 16.0), load(3, 1, 8.0), load(4, 0, state=DRAINING)]
    best = least_loaded(siblings, NOW)
    assert best is not None and best.slot == 3


@pytest.mark.parametrize(
    ("me", "siblings", "accept"),
    [
        (load(0, 4), [load(1, 4)], True),  # balanced: both race, as without balancing
        (load(0, 5), [load(1, 4)], False),  # one connection more: let the sibling take it
        (load(0, 4, 32.0), [load(1, 4, 8.0)], False),  # as many connections, clearly busier
        (load(0, 4, 16.0), [load(1, 4, 8.0)], True),  # not clearly
        (load(0, 1, 7.0), [load(1, 1, 0.0)], False),  # a busy connection vs an idle one
        (load(0, 5), [load(1, 0, beat=NOW - 5)], True),  # the only sibling is stopped: accept
        (load(0, 5), [load(1, 0, state=DRAINING)], True),  # ... or draining
        (load(0, 1), [], True),  # alone
    ],
)
def test_may_accept(me: Load, siblings: list[Load], accept: bool) -> None:
    assert may_accept(me, siblings, NOW) is accept


def test_the_least_loaded_worker_always_accepts() -> None:
    workers = [load(0, 3), load(1, 2, 40.0), load(2, 2, 8.0), load(3, 5)]
    accepting = [w for w in workers if may_accept(w, [o for o in workers if o != w], NOW)]
    assert [w.slot for w in accepting] == [2]


@pytest.mark.parametrize(
    ("me", "other", "shed"),
    [
        (load(0, 4), load(1, 4), False),
        (load(0, 5), load(1, 4), False),  # moving one would only swap the gap
        (load(0, 6), load(1, 4), True),
        (load(0, 8), load(1, 0), True),
        (load(0, 1), load(1, 0), False),  # one idle connection: nothing to gain
        (load(0, 1, 7.5), load(1, 0), True),  # one busy connection, an idle sibling: rotate
        (load(0, 2, 16.0), load(1, 1, 8.0), False),  # 3 connections on 2 workers: stays
    ],
)
def test_should_shed_only_when_moving_one_narrows_the_gap(me: Load, other: Load, shed: bool) -> None:
    target = should_shed(me, [other], NOW)
    assert (target is not None) is shed


def ready_sibling(table: LoadTable) -> int:
    """A live, ready sibling (this test's parent process) in ``table``: its slot."""
    sibling = table.claim(os.getppid())
    table.set_state(sibling, READY)
    table.beat(sibling)
    return sibling


def test_a_worker_publishes_its_load_and_sheds_at_most_once_per_interval(tmp_path: Path) -> None:
    table = LoadTable(tmp_path)
    sibling = ready_sibling(table)
    slot = WorkerSlot(table, os.getpid())
    me = WorkerConnections(slot)
    slot.tick(READY, 8)
    slot.add_load(8)
    slot.add_load(8)
    slot.add_load(-8)
    assert (table.read(slot.slot).items, table.read(slot.slot).connections) == (8, 8)
    assert not me.may_accept()
    assert me.should_shed()
    assert table.read(slot.slot).connections == 7
    assert not me.should_shed()  # within SHED_INTERVAL_S of the last one
    table.set_connections(sibling, 7)
    assert me.may_accept()  # as many connections as the sibling, not clearly busier


def test_a_worker_that_is_not_ready_always_accepts(tmp_path: Path) -> None:
    table = LoadTable(tmp_path)
    ready_sibling(table)
    slot = WorkerSlot(table, os.getpid())
    me = WorkerConnections(slot)
    slot.tick(DRAINING, 10)
    assert me.may_accept() and not me.should_shed()


def test_a_worker_that_does_not_balance_publishes_but_never_decides(tmp_path: Path) -> None:
    """SCORING_BALANCE=0: the load and state are still published (siblings coordinate boot and
    drain through them), but the worker accepts whatever comes, sheds nothing and routes
    nothing."""
    table = LoadTable(tmp_path)
    ready_sibling(table)
    slot = WorkerSlot(table, os.getpid())
    me = WorkerConnections(slot, balancing=False)
    slot.tick(READY, 10)
    slot.add_load(5)
    assert table.read(slot.slot).items == 5 and table.read(slot.slot).state == READY
    assert me.may_accept() and not me.should_shed() and WorkerSiblings(slot, None).others_serving()


class Peers:
    """What WorkerSiblings asks of app.server.peers.PeerClient: a model control change."""

    def __init__(self) -> None:
        self.sent: list[int] = []

    async def control(self, pid: int, action: str, name: str) -> str | None:
        self.sent.append(pid)
        return None if pid != 4 else "broken"


async def test_model_control_reaches_every_ticking_sibling_ready_or_not(tmp_path: Path) -> None:
    """A sibling whose only model was unloaded publishes "loading": balancing skips it, model
    control must not (else it keeps a state the others left); one draining, or stale, is left out."""
    table = LoadTable(tmp_path)
    slot = WorkerSlot(table, 1)
    peers = Peers()
    me = WorkerSiblings(slot, cast(PeerClient, peers))
    for pid, state in ((2, LOADING), (3, READY), (4, READY), (5, DRAINING), (6, BOOTING)):
        table.beat(table.claim(pid, state))
    loading = next(s for s in slot.others() if s.pid == 2)
    now = loading.heartbeat
    assert loading.reachable(now) and not loading.live(now)
    assert not loading.reachable(now + STALE_S + 0.1)  # stopped ticking
    assert await me.apply("load", "scale") == {4: "broken"}
    assert sorted(peers.sent) == [2, 3, 4]
    assert await WorkerSiblings(slot, None).apply("load", "scale") == {}  # no internal endpoints
