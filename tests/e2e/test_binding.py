"""Worker -> GPU binding under real gunicorn, against the fake NVML backend.

Each worker's lease is ``<run dir>/gpu-leases/<uuid>.slot<k>.lock`` holding its pid; a lease
counts when that pid is one of the server's live workers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support.fake_gpus import gpu, gpu_uuid, unused_pids, write_fake, write_unavailable
from tests.support.gunicorn import Gunicorn, wait_for
from tests.support.toy_models import write_scale_model

pytestmark = pytest.mark.e2e


def leases(srv: Gunicorn) -> dict[int, tuple[str, int]]:
    """Live worker pid -> (GPU uuid, slot) from the lease files."""
    live = {w.pid for w in srv.workers()}
    held = {}
    for f in (srv.run_dir / "gpu-leases").glob("*.lock"):
        text = f.read_text().strip()
        if text.isdigit() and int(text) in live:
            uuid, _, slot = f.name.removesuffix(".lock").rpartition(".slot")
            held[int(text)] = (uuid, int(slot))
    return held


def start(
    tmp: Path,
    gpus: list[dict[str, Any]] | None,
    env: dict[str, str] | None = None,
    args: list[str] | None = None,
    *,
    load_delay_s: float = 0.0,
) -> Gunicorn:
    repo = tmp / "repo"
    if not repo.exists():
        write_scale_model(repo, "scale", load_delay_s=load_delay_s)
    fake = tmp / "gpus.json"
    if gpus is not None:
        write_fake(fake, gpus)
    full = {
        "SCORING_MODEL_REPOSITORY": str(repo),
        "GPU_STAT_FAKE_NVML": str(fake),
        "SCORING_BIND_TIMEOUT_S": "20",
        "SCORING_ACCESS_LOG": "",
        **(env or {}),
    }
    return Gunicorn(tmp, full, args)


def replaced(srv: Gunicorn, victim: int, workers: int) -> dict[int, tuple[str, int]]:
    """The leases once ``workers`` live workers hold one and ``victim`` (SIGKILLed) none, judged
    on one read of them: a killed process lives on until the kernel tears it down, so a count
    read before that and a "victim gone" read after it may both hold while its replacement has
    not bound yet."""

    def settled() -> dict[int, tuple[str, int]] | None:
        now = leases(srv)
        return now if len(now) == workers and victim not in now else None

    return wait_for(settled, 60, "replacement", srv)


def balanced(srv: Gunicorn, workers: int, per_gpu: int) -> dict[int, tuple[str, int]]:
    wait_for(lambda: len(leases(srv)) == workers == len(srv.workers()), 90, f"{workers} leases", srv)
    held = leases(srv)
    assert set(Counter(uuid for uuid, _ in held.values()).values()) == {per_gpu}, held
    assert len(set(held.values())) == workers  # no two workers on one slot
    return held


def test_four_gpus_two_each_bound_in_parallel(tmp_path: Path) -> None:
    gpus = [gpu(i) for i in range(4)]
    with start(tmp_path, gpus, {"SCORING_MAX_PROCESSES_PER_GPU": "2"}, load_delay_s=3.0) as srv:
        held = balanced(srv, 8, 2)
        # every worker holds its slot while none has loaded its model (3 s each): binding
        # does not wait for a sibling's loading
        assert srv.ready_workers() == set(), srv.worker_states()
        assert {u for u, _ in held.values()} == {gpu_uuid(i) for i in range(4)}
        srv.wait_ready()
        worker = next(iter(srv.answering_workers(1).values()))
        pid = worker["pid"]
        assert (worker["binding"]["gpu_uuid"], int(worker["binding"]["slot"])) == held[pid]
        # the binding names the GPU; the fake GPUs do not exist for torch, so models run on the CPU
        assert worker["binding"]["device"] == "cuda:0" and worker["device"] == "cpu"
        master_maps = Path(f"/proc/{srv.proc.pid}/maps").read_text()
        assert "libtorch" not in master_maps and "libcuda" not in master_maps
        assert srv.log().count("gpu binding: pid=") == 8


def test_killed_worker_is_replaced_on_the_same_slot_under_load(tmp_path: Path) -> None:
    gpus = [gpu(i) for i in range(2)]
    with start(tmp_path, gpus, {"SCORING_MAX_PROCESSES_PER_GPU": "2"}) as srv:
        before = balanced(srv, 4, 2)
        srv.wait_ready()
        stop = threading.Event()
        statuses: list[int] = []

        def load() -> None:
            body = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}
            while not stop.is_set():
                try:
                    statuses.append(srv.post("/v2/models/scale/infer", body, timeout=10)[0])
                except OSError:
                    statuses.append(-1)

        threads = [threading.Thread(target=load) for _ in range(4)]
        for t in threads:
            t.start()
        victim = sorted(before)[1]
        os.kill(victim, signal.SIGKILL)
        after = replaced(srv, victim, 4)
        stop.set()
        for t in threads:
            t.join(30)
        (newcomer,) = set(after) - set(before)
        assert after[newcomer] == before[victim]  # the freed slot, same GPU
        assert {p: after[p] for p in before if p != victim} == {p: before[p] for p in before if p != victim}
        assert statuses.count(200) > 0


@pytest.mark.parametrize("recycle", ["hup", "max_requests"])
def test_reload_and_recycling_keep_every_gpu_at_capacity(tmp_path: Path, recycle: str) -> None:
    gpus = [gpu(i) for i in range(2)]
    env = {"SCORING_MAX_PROCESSES_PER_GPU": "2"}
    if recycle == "max_requests":
        env["SCORING_MAX_REQUESTS"] = "10"
    with start(tmp_path, gpus, env) as srv:
        first = balanced(srv, 4, 2)
        srv.wait_ready()
        if recycle == "hup":
            os.kill(srv.proc.pid, signal.SIGHUP)

        def all_replaced() -> bool:
            if recycle == "max_requests":  # keep traffic flowing until every worker recycled
                for _ in range(10):
                    with contextlib.suppress(OSError):
                        srv.get("/v2/health/live", timeout=5)
            return not (set(leases(srv)) & set(first)) and len(leases(srv)) == 4

        wait_for(all_replaced, 90, "new workers", srv)
        held = balanced(srv, 4, 2)  # every live worker holds a lease: none fell back to the CPU
        srv.wait_ready()
        if recycle == "hup":  # (with max_requests=10 these requests would recycle them again)
            for pid, worker in srv.answering_workers(4).items():  # each serves from the slot it leased
                assert (worker["binding"]["gpu_uuid"], int(worker["binding"]["slot"])) == held[pid]


def test_container_pids_that_match_no_local_process(tmp_path: Path) -> None:
    fake = [gpu(i) for i in range(2)]
    env = {"SCORING_FOREIGN_PROCESS_POLICY": "skip"}
    with start(tmp_path, fake, env) as srv:
        held = balanced(srv, 2, 1)
        srv.wait_ready()
        # NVML in a container lists our workers under host PIDs that match nothing here.
        host = dict(zip(sorted(held), unused_pids(2), strict=True))
        by_gpu = {uuid: pid for pid, (uuid, _) in held.items()}
        write_fake(tmp_path / "gpus.json", [gpu(i, processes=[(host[by_gpu[gpu_uuid(i)]], 2**30)]) for i in range(2)])
        victim = sorted(held)[0]
        victim_gpu = held[victim][0]
        os.kill(victim, signal.SIGKILL)
        psutil.Process(srv.proc.pid)  # master alive
        # the dead worker's context goes with it; the survivor's host PID stays listed
        write_fake(
            tmp_path / "gpus.json",
            [gpu(i, processes=[] if gpu_uuid(i) == victim_gpu else [(host[by_gpu[gpu_uuid(i)]], 2**30)]) for i in range(2)],
        )
        after = replaced(srv, victim, 2)
        (newcomer,) = set(after) - set(held)
        # the survivor's host PID is counted as ours on its GPU, and the victim's GPU, empty
        # again, takes the replacement even under the "skip" policy
        assert after[newcomer] == held[victim]
        assert {p: after[p] for p in held if p != victim} == {p: held[p] for p in held if p != victim}


@pytest.mark.parametrize("style", ["indices", "uuids"])
def test_operator_cuda_visible_devices(tmp_path: Path, style: str) -> None:
    visible = "1,3" if style == "indices" else f"{gpu_uuid(1)},{gpu_uuid(3)}"
    env = {"CUDA_VISIBLE_DEVICES": visible, "SCORING_MAX_PROCESSES_PER_GPU": "2"}
    with start(tmp_path, [gpu(i) for i in range(4)], env) as srv:
        held = balanced(srv, 4, 2)
        assert {u for u, _ in held.values()} == {gpu_uuid(1), gpu_uuid(3)}


@pytest.mark.parametrize("policy", ["skip", "share"])
def test_foreign_process_and_low_memory_follow_the_policy(tmp_path: Path, policy: str) -> None:
    (stranger,) = unused_pids(1)
    gpus = [
        gpu(0, processes=[(stranger, 4 * 2**30)]),
        gpu(1, memory_total=80 * 2**30, memory_used=79 * 2**30 + 2**29),
        gpu(2),
    ]
    env = {"SCORING_FOREIGN_PROCESS_POLICY": policy, "SCORING_MIN_FREE_MEMORY_MIB": "1024"}
    with start(tmp_path, gpus, env, ["-w", "1"]) as srv:
        wait_for(lambda: len(leases(srv)) == 1, 60, "one lease", srv)
        ((uuid, _),) = leases(srv).values()
        log = srv.log()
        if policy == "skip":
            assert uuid == gpu_uuid(2)
            assert "foreign" in log and "policy skip" in log
        else:
            assert uuid in {gpu_uuid(0), gpu_uuid(2)}
        assert uuid != gpu_uuid(1)


def test_more_workers_than_slots_wait_then_exit_without_halting(tmp_path: Path) -> None:
    env = {"SCORING_BIND_TIMEOUT_S": "1"}
    with start(tmp_path, [gpu(0)], env, ["-w", "2"]) as srv:
        wait_for(lambda: "found no free GPU slot" in srv.log(), 60, "bind timeout", srv)
        srv.wait_ready(all_workers=False)  # the extra worker keeps waiting for a slot
        assert srv.proc.poll() is None  # the master did not halt
        assert len(leases(srv)) == 1
        assert "exit code 75" in srv.log() or "exited with code 75" in srv.log() or "status 75" in srv.log()
        assert srv.get("/v2/models/scale/ready")[0] == 200


def test_no_nvml_means_cpu_mode_and_the_server_serves(tmp_path: Path) -> None:
    write_unavailable(tmp_path / "gpus.json")
    with start(tmp_path, None, {"SCORING_WORKERS": "1"}) as srv:
        srv.wait_ready()
        _, _, meta = srv.get("/v2")
        assert meta["worker"]["device"] == "cpu" and meta["worker"]["binding"]["device"] == "cpu"
        assert "CPU" in srv.log() and "NVML unavailable" in srv.log()
