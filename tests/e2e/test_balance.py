"""End to end on real gunicorn: persistent client connections spread over the workers
(app.server.siblings), a stopped worker does not hold up its siblings, and a HUP reload with a
model load longer than half the graceful timeout fails no request, and a stop during a reload
whose load never ends is prompt."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import pytest

from app.server.balance import LoadTable
from tests.support.balance import both_live, items_per_worker, shares
from tests.support.gunicorn import (
    ROOT,
    Gunicorn,
    free_port,
    http,
    poll,
    published_states,
    wait_for,
)
from tests.support.toy_models import write_scale_model

pytestmark = pytest.mark.e2e

V2 = "/v2/models/scale/infer"
ITEMS = 8
BODY = {"inputs": [{"name": "x", "shape": [ITEMS, 2], "datatype": "FP32", "data": [1.0] * (2 * ITEMS)}]}


async def closed_loop(
    url: str, connections: int, requests_per_connection: int, timeout_ms: int = 10000
) -> list[int]:
    """``connections`` persistent connections (opened once, reused), each sending its requests
    one after the other; returns the status codes."""
    connector = aiohttp.TCPConnector(limit=connections)
    timeout = aiohttp.ClientTimeout(total=timeout_ms / 1000 + 5)
    statuses: list[int] = []
    headers = {"X-Request-Timeout-Ms": str(timeout_ms)}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def client() -> None:
            for _ in range(requests_per_connection):
                async with session.post(url + V2, json=BODY, headers=headers) as resp:
                    await resp.read()
                    statuses.append(resp.status)

        await asyncio.gather(*(client() for _ in range(connections)))
    return statuses


def env(repo: Path, workers: int, **extra: str) -> dict[str, str]:
    return {"SCORING_MODEL_REPOSITORY": str(repo), "SCORING_WORKERS": str(workers), **extra}


@pytest.mark.parametrize(("workers", "low", "high"), [(2, 0.35, 0.65), (4, 0.15, 0.35)])
def test_persistent_connections_spread_over_the_workers(
    tmp_path: Path, workers: int, low: float, high: float
) -> None:
    repo = tmp_path / "repo"
    write_scale_model(repo, "scale", max_batch_size=64, queue_capacity=1024, delay_ms=4)
    with Gunicorn(tmp_path, env(repo, workers)) as srv:
        pids = [w.pid for w in srv.wait_workers(workers)]
        srv.wait_ready(120)
        for connections in (2, 4, 8):
            before = items_per_worker(srv)
            statuses = asyncio.run(closed_loop(srv.url, connections, 600 // connections))
            assert set(statuses) == {200}, statuses
            after = items_per_worker(srv)
            share = shares(before, after, pids)
            assert all(low <= s <= high for s in share.values()), (connections, share, srv.log()[-3000:])
            assert sorted(w.pid for w in srv.workers()) == sorted(pids)


def test_a_stopped_worker_does_not_hold_up_new_connections(tmp_path: Path) -> None:
    """SIGSTOP one of two workers: its heartbeat goes stale, the other accepts every new
    connection (none waits past its deadline); after SIGCONT both serve again."""
    repo = tmp_path / "repo"
    write_scale_model(repo, "scale", max_batch_size=64, queue_capacity=1024, delay_ms=2)
    with Gunicorn(tmp_path, env(repo, 2, SCORING_TIMEOUT_S="60")) as srv:
        stopped, _ = srv.wait_workers(2)
        srv.wait_ready(120)
        asyncio.run(closed_loop(srv.url, 4, 20))
        stopped.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            for _ in range(20):  # a fresh connection per request: the kernel places each one
                statuses = asyncio.run(closed_loop(srv.url, 1, 1, timeout_ms=3000))
                assert statuses == [200]
            assert time.monotonic() - t0 < 60  # bounded by the deadlines above, not a hang
        finally:
            stopped.send_signal(signal.SIGCONT)
        before = items_per_worker(srv)
        wait_for(lambda: asyncio.run(closed_loop(srv.url, 4, 25)) and stopped.pid in _grew(srv, before),
                 60, "the resumed worker serving again", srv)  # fmt: skip


def _grew(srv: Gunicorn, before: dict[int, float]) -> set[int]:
    after = items_per_worker(srv)
    return {pid for pid, n in after.items() if n > before.get(pid, 0.0)}


def test_hup_reload_with_a_slow_model_load_fails_no_request(tmp_path: Path) -> None:
    """A model load (4 s, plus the import) longer than half the graceful timeout (4 s): the old
    worker keeps serving until its replacement is warm; every request gets a 200."""
    repo = tmp_path / "repo"
    write_scale_model(repo, "scale", load_delay_s=4.0)
    grace = {"SCORING_GRACEFUL_TIMEOUT_S": "4", "SCORING_DRAIN_GRACE_S": "1"}  # the server's default grace
    with Gunicorn(tmp_path, env(repo, 1, **grace)) as srv:
        (old,) = srv.wait_workers(1)
        srv.wait_ready(120)
        statuses: list[int] = []
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                statuses.extend(asyncio.run(closed_loop(srv.url, 2, 10, timeout_ms=5000)))

        thread = threading.Thread(target=load)
        thread.start()
        try:
            srv.proc.send_signal(signal.SIGHUP)
            old.wait(120)
            wait_for(lambda: srv.all_workers_ready(), 60, "the new worker ready", srv)
            count = len(statuses)
            wait_for(lambda: len(statuses) > count + 20, 60, "requests served by the new worker", srv)
        finally:
            stop.set()
            thread.join(60)
        assert statuses and set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
        assert "waited for a new worker to be ready" in srv.log()


def test_backlog_a_stop_during_a_slow_reload_and_the_default_run_dir_removed(tmp_path: Path) -> None:
    """``--backlog 77`` is the listen backlog the kernel reports (aiohttp's 128 before). Then a
    HUP reload whose model load never ends (600 s) and a SIGTERM while it loads: the master
    passes the signal on at once (the workers hear it before gunicorn's main loop, which the
    reload holds, does), the loading worker stops without waiting for its load, the draining
    one stops waiting for it, the master exits 0 with no worker SIGKILLed and, HUP-reloaded,
    still removes its default run directory (under TMPDIR)."""
    repo = tmp_path / "repo"
    write_scale_model(repo, "scale")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    port = free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SCORING_", "PROMETHEUS_")) and k != "XDG_RUNTIME_DIR"
    }
    env.update(
        TMPDIR=str(scratch), PYTHONPATH=str(ROOT), SCORING_HOST="127.0.0.1", SCORING_PORT=str(port),
        SCORING_MODEL_REPOSITORY=str(repo), SCORING_WORKERS="1", SCORING_TORCH_THREADS="1",
        # Longer than any boot on a busy machine: the reload still waits when the SIGTERM comes.
        SCORING_GRACEFUL_TIMEOUT_S="120",
    )  # fmt: skip
    log = tmp_path / "gunicorn.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "--backlog", "77"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:

        def ready() -> bool:
            try:
                return http("GET", f"http://127.0.0.1:{port}/v2/health/ready", timeout=5)[0] == 200
            except OSError:
                return False

        def tail() -> str:
            return log.read_text(errors="replace")[-4000:]

        poll(ready, 120, "the server ready", diagnostics=tail)
        (run_dir,) = scratch.glob("scoring-server-*")  # mkdtemp's: a name no one could guess
        assert run_dir.stat().st_mode & 0o777 == 0o700
        listening = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout
        assert listening.split()[2] == "77", listening  # LISTEN Recv-Q Send-Q(backlog) ...
        write_scale_model(repo, "scale", load_delay_s=600.0)
        proc.send_signal(signal.SIGHUP)

        def loading() -> int | None:
            states = published_states(run_dir)
            if sorted(states.values()) != ["draining", "loading"]:
                return None
            return next(pid for pid, state in states.items() if state == "loading")

        booting = poll(loading, 120, "a new worker loading, the old one draining", diagnostics=tail)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, tail()
        text = log.read_text(errors="replace")
        assert "SIGKILL" not in text, text
        stopped = text.index(f"worker {booting} (SIGTERM): stopped before it was ready")
        assert stopped < text.index("Handling signal: term"), text
        assert not run_dir.exists(), list(run_dir.rglob("*"))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_large_request_is_scattered_over_both_workers_and_gathered_in_order(tmp_path: Path) -> None:
    """64 items, max_batch_size 8, 2 workers: shards run on both (per-worker item counters),
    FP32 and BYTES inputs travel, and the outputs come back in the request's item order."""
    repo = tmp_path / "repo"
    write_scale_model(repo, "scale", max_batch_size=8, queue_capacity=1024)
    items = 64
    body = {
        "inputs": [
            {
                "name": "x",
                "shape": [items, 2],
                "datatype": "FP32",
                "data": [float(i) for i in range(2 * items)],
            },
            {
                "name": "tag",
                "shape": [items, 1],
                "datatype": "BYTES",
                "data": ["t" * (i % 5) for i in range(items)],
            },
        ]
    }
    with Gunicorn(tmp_path, env(repo, 2)) as srv:
        pids = [w.pid for w in srv.wait_workers(2)]
        srv.wait_ready(120)
        wait_for(lambda: both_live(srv), 30, "both workers in the load table", srv)
        before = items_per_worker(srv)
        status, _, out = srv.post(V2, body)
        assert status == 200, out
        outputs = {o["name"]: o for o in out["outputs"]}
        assert outputs["y"]["data"] == [2.0 * i for i in range(2 * items)]
        assert outputs["tag_length"]["data"] == [i % 5 for i in range(items)]
        after = items_per_worker(srv)
        assert all(after.get(pid, 0) - before.get(pid, 0) == items / 2 for pid in pids), (before, after)
        metrics = srv.get("/metrics")[2]
        assert 'scoring_scattered_requests_total{model="scale",version="1"} 1.0' in metrics
        assert 'scoring_forwarded_shards_total{model="scale",version="1"} 1.0' in metrics


def test_a_sibling_stalled_mid_scatter_costs_a_504_at_the_deadline_not_a_hang(tmp_path: Path) -> None:
    """A sibling stalls (SIGSTOP) after its last tick and before a large request arrives, so the
    running worker still sees it live and sends it a shard: the request gets a 504 when its
    deadline passes, not a hang. To take that one path every time, the test keeps the stopped
    worker's load-table slot as a stall just after a tick would leave it: heartbeat fresh (an
    hour ahead: ``live`` all through the request), and many connections, so that the running
    worker keeps accepting (it is never the busier one) while the scatter still picks the
    sibling (no items queued)."""
    repo = tmp_path / "repo"
    write_scale_model(repo, "scale", max_batch_size=8, queue_capacity=1024)
    body = {"inputs": [{"name": "x", "shape": [32, 2], "datatype": "FP32", "data": [1.0] * 64}]}
    with Gunicorn(tmp_path, env(repo, 2, SCORING_TIMEOUT_S="60")) as srv:
        stopped, _ = srv.wait_workers(2)
        srv.wait_ready(120)
        wait_for(lambda: both_live(srv), 30, "both workers in the load table", srv)
        stopped.send_signal(signal.SIGSTOP)
        table = LoadTable(srv.run_dir)
        try:
            (slot,) = [load.slot for load in table.snapshot() if load.pid == stopped.pid]
            table.set_connections(slot, 1000)
            table.beat(slot, time.monotonic() + 3600)
            t0 = time.monotonic()
            status, _, out = srv.post(V2, body, headers={"X-Request-Timeout-Ms": "2000"}, timeout=30)
            elapsed = time.monotonic() - t0
        finally:
            table.close()
            stopped.send_signal(signal.SIGCONT)
        assert status == 504, (status, out)
        assert "did not answer its shard in time" in out["error"]
        assert 'scoring_scattered_requests_total{model="scale",version="1"} 1.0' in srv.scrape()
        assert elapsed < 2.0 + 3.0, elapsed
