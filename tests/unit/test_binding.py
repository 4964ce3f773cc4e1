"""gpu_stat.binding: the pure decisions, and real worker processes binding through real flocks.

Process tests run a small "master" (a Python process, like the gunicorn master) that forks
workers on command; each worker calls bind_worker and reports back through a pipe, then holds its
lease until the master releases or kills it. Synchronisation is by those reports only.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import queue
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpu_stat import GpuInfo, GpuProcess
from gpu_stat import binding as binding_module
from gpu_stat.binding import (
    Binding,
    BindingPolicy,
    BindTimeout,
    bind_worker,
    current_binding,
    release_binding,
    usable_gpu_count,
)
from gpu_stat.family import Family
from gpu_stat.leases import LEASE_DIR
from gpu_stat.planner import SlotState, count_foreign_processes, plan_slots
from gpu_stat.verify import check_binding, verify_binding
from tests.support.fake_gpus import (
    GIB,
    gpu,
    gpu_uuid,
    mig,
    mig_uuid,
    unused_pid,
    unused_pids,
    write_fake,
    write_unavailable,
)
from tests.support.gunicorn import ROOT


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("CUDA_VISIBLE_DEVICES", "GPU_STAT_FAKE_NVML", "GPU_STAT_DISABLE_NVML",
                 "GPU_STAT_NVML_BACKEND"):
        # setenv first so teardown restores the original state even when bind_worker wrote it
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    yield
    release_binding()


@pytest.fixture
def fake_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = write_fake(tmp_path / "gpus.json", [gpu(0), gpu(1)])
    monkeypatch.setenv("GPU_STAT_FAKE_NVML", str(path))
    return path


# --- pure decisions -------------------------------------------------------------------------------


def procs(*pids: int) -> tuple[GpuProcess, ...]:
    return tuple(GpuProcess(pid, GIB) for pid in pids)


@pytest.mark.parametrize(
    ("processes", "ours", "leases", "foreign"),
    [
        (None, set(), 0, 0),  # NVML does not list processes: nothing to go on
        (procs(), set(), 3, 0),
        (procs(10, 11), {10, 11}, 2, 0),  # all matched
        (procs(900), set(), 0, 1),  # a stranger
        (procs(900), set(), 1, 0),  # container: the unmatched PID is our lease holder
        (procs(900, 901), set(), 1, 1),  # one lease explains one unmatched PID, not two
        (procs(10, 900), {10}, 1, 1),  # the lease is explained by the matched PID
        (procs(10, 900), {10}, 2, 0),
        (procs(10, 10), {10}, 1, 0),  # one PID listed twice is one process
        (procs(10), {10}, 0, 0),  # ours without a lease (the master, a helper) is not foreign
    ],
)
def test_count_foreign_processes(
    processes: tuple[GpuProcess, ...] | None, ours: set[int], leases: int, foreign: int
) -> None:
    assert count_foreign_processes(processes, ours, leases) == foreign


def state(key: str, order: int, *, leases: int = 0, slots: int = 2, capacity: int | None = None,
          free_gib: float = 80) -> SlotState:
    free = tuple(range(leases, slots))
    return SlotState(key, order, leases, free, len(free) if capacity is None else capacity,
                     int(free_gib * GIB))


def test_plan_round_robin_on_a_fresh_start() -> None:
    plan = plan_slots([state("a", 0), state("b", 1), state("c", 2)])

    assert plan == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("b", 1), ("c", 1)]


def test_plan_prefers_fewest_leases_then_most_free_memory_then_order() -> None:
    plan = plan_slots(
        [
            state("a", 0, leases=1, slots=3),
            state("b", 1, slots=3, free_gib=40),
            state("c", 2, slots=3, free_gib=70.4),
            state("d", 3, slots=3, free_gib=70.9),  # same whole GiB as c: order decides
        ]
    )

    assert plan[:3] == [("c", 0), ("d", 0), ("b", 0)]
    assert plan[3:7] == [("a", 1), ("c", 1), ("d", 1), ("b", 1)]
    assert len(plan) == 2 + 3 * 3


def test_plan_respects_capacity_and_full_gpus() -> None:
    plan = plan_slots(
        [state("a", 0, capacity=1), state("b", 1, leases=2), state("c", 2, capacity=0)]
    )

    assert plan == [("a", 0)]


def test_policy_validation(tmp_path: Path) -> None:
    assert BindingPolicy(run_dir=str(tmp_path)).run_dir == tmp_path  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"e.g. \('0', '1'\)"):
        BindingPolicy(tmp_path, allowed_gpus="0,1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_processes_per_gpu"):
        BindingPolicy(tmp_path, max_processes_per_gpu=0)
    with pytest.raises(ValueError, match="foreign_process_policy"):
        BindingPolicy(tmp_path, foreign_process_policy="evict")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bind_timeout_s"):
        BindingPolicy(tmp_path, bind_timeout_s=-1)
    with pytest.raises(ValueError, match="min_free_memory_bytes"):
        BindingPolicy(tmp_path, min_free_memory_bytes=-1)


def test_labels() -> None:
    gpu_binding = Binding("cuda:0", 1, gpu_uuid(1), "Fake", 0, 3, "bound")
    cpu_binding = Binding("cpu", None, None, None, None, 0, "cpu: no GPU visible")

    assert gpu_binding.as_labels() == {
        "gpu": "1", "gpu_uuid": gpu_uuid(1), "slot": "0", "device": "cuda:0"
    }
    assert cpu_binding.as_labels() == {"gpu": "", "gpu_uuid": "", "slot": "", "device": "cpu"}


# --- in this process: CPU mode, counting, idempotence ---------------------------------------------


def test_nvml_unavailable_binds_cpu_with_one_log_line(
    tmp_path: Path, fake_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_unavailable(fake_file, "simulated: no libnvidia-ml")
    caplog.set_level(logging.INFO, logger="gpu_stat.binding")

    binding = bind_worker(BindingPolicy(tmp_path / "run"))

    assert binding.device == "cpu" and binding.gpu_uuid is None
    assert binding.reason == "cpu: NVML unavailable (simulated: no libnvidia-ml)"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    records = [r for r in caplog.records if r.name == "gpu_stat.binding"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert "-> CPU (NVML unavailable (simulated: no libnvidia-ml))" in records[0].getMessage()
    assert not (tmp_path / "run").exists()  # nothing to lease
    assert usable_gpu_count(BindingPolicy(tmp_path)) == 0


def test_disabled_nvml_binds_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPU_STAT_DISABLE_NVML", "1")

    binding = bind_worker(BindingPolicy(tmp_path))

    assert binding.reason == "cpu: NVML unavailable (disabled by GPU_STAT_DISABLE_NVML=1)"


def test_no_visible_gpu_binds_cpu(
    tmp_path: Path, fake_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")

    binding = bind_worker(BindingPolicy(tmp_path))

    assert binding.device == "cpu"
    assert binding.reason == "cpu: no GPU visible, CUDA_VISIBLE_DEVICES=''"
    assert usable_gpu_count(BindingPolicy(tmp_path)) == 0


def test_mig_enabled_without_instances_binds_cpu(tmp_path: Path, fake_file: Path) -> None:
    write_fake(fake_file, [gpu(0, mig=[])])

    binding = bind_worker(BindingPolicy(tmp_path))

    assert binding.reason == "cpu: no GPU usable by CUDA is visible (MIG enabled, no MIG instances)"


def test_allow_list_matching_nothing_binds_cpu_with_a_warning(
    tmp_path: Path, fake_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    policy = BindingPolicy(tmp_path, allowed_gpus=("7", "GPU-ffff"))

    binding = bind_worker(policy)

    assert binding.reason == "cpu: no visible GPU matches allowed_gpus=['7', 'GPU-ffff']"
    assert "allowed_gpus entries match no visible GPU: ['7', 'GPU-ffff']" in caplog.text
    assert usable_gpu_count(policy) == 0


def test_usable_gpu_count(tmp_path: Path, fake_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_fake(fake_file, [gpu(0), gpu(1), gpu(2, mig=[mig(2, 0), mig(2, 1)]), gpu(3, mig=[])])

    def count(*allowed: str) -> int:
        return usable_gpu_count(BindingPolicy(tmp_path, allowed_gpus=allowed))

    assert count() == 4  # GPU 0, GPU 1, two MIG instances; MIG enabled without instances: none
    assert count("2") == 2
    assert count(gpu_uuid(2)[:12], "0") == 3
    assert count(mig_uuid(2, 1)) == 1
    assert count("GPU-0000000") == 0  # ambiguous prefix
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert count() == 2
    assert count("0") == 1  # indices are in the CUDA_VISIBLE_DEVICES view


def lock_is_free(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def test_bind_in_process_holds_a_lease_until_released(tmp_path: Path, fake_file: Path) -> None:
    write_fake(fake_file, [gpu(0)])
    policy = BindingPolicy(tmp_path)

    binding = bind_worker(policy)

    lock = tmp_path / LEASE_DIR / f"{gpu_uuid(0)}.slot0.lock"
    assert (binding.device, binding.gpu_uuid, binding.gpu_index, binding.slot) == (
        "cuda:0", gpu_uuid(0), 0, 0
    )
    assert os.environ["CUDA_VISIBLE_DEVICES"] == gpu_uuid(0)
    assert bind_worker(policy) is binding  # idempotent
    assert current_binding() is binding
    assert lock.read_text() == f"{os.getpid()}\n"
    assert not lock_is_free(lock)
    release_binding()
    assert current_binding() is None
    assert lock_is_free(lock)


def hold_unrecorded_lease(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recorded: bytes) -> tuple[int, int]:
    """Three siblings on 3 GPUs x 3 slots, this process the youngest; the oldest has locked gpu0's
    slot 0, and the file holds ``recorded`` (its own pid not written yet). The lock's descriptor
    (close it) and the oldest sibling's pid (the two older ones are past pid_max: no process has
    them)."""
    oldest, middle, me = 2**22 + 1, 2**22 + 2, os.getpid()
    ours = Family((oldest, middle, me), frozenset({oldest, middle, me}))
    monkeypatch.setattr(binding_module, "family", lambda: ours)
    (tmp_path / LEASE_DIR).mkdir(mode=0o700)
    fd = os.open(tmp_path / LEASE_DIR / f"{gpu_uuid(0)}.slot0.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.pwrite(fd, recorded, 0)
    return fd, oldest


@pytest.mark.parametrize("recorded", [b"", b"1\n"], ids=["empty", "previous-holder"])
def test_a_lease_not_yet_on_record_is_planned_around_once_its_holder_is_known(
    tmp_path: Path, fake_file: Path, monkeypatch: pytest.MonkeyPatch, recorded: bytes
) -> None:
    """Counted as unbound, the oldest sibling would shift the youngest's plan entry onto gpu0's
    slot 1 (two workers on gpu0, none on gpu1): it plans again until the pid is on record, then
    takes its own entry, gpu2's slot 0 (the middle sibling's is gpu1's)."""
    write_fake(fake_file, [gpu(0), gpu(1), gpu(2)])
    fd, oldest = hold_unrecorded_lease(tmp_path, monkeypatch, recorded)
    rounds: list[int] = []

    def heartbeat() -> None:  # called as each attempt begins
        rounds.append(1)
        if len(rounds) == 3:
            os.pwrite(fd, f"{oldest}\n".encode(), 0)
            os.ftruncate(fd, len(f"{oldest}\n"))

    try:
        binding = bind_worker(BindingPolicy(tmp_path, max_processes_per_gpu=3), heartbeat=heartbeat)
    finally:
        os.close(fd)
    assert (binding.gpu_uuid, binding.slot) == (gpu_uuid(2), 0)
    assert len(rounds) >= 3


def test_a_lease_that_never_names_one_of_ours_delays_binding_only_a_moment(
    tmp_path: Path, fake_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another server's lease in the same run directory: planned as it stands after ``_SETTLE_S``."""
    write_fake(fake_file, [gpu(0), gpu(1), gpu(2)])
    monkeypatch.setattr(binding_module, "_SETTLE_S", 0.05)
    fd, _ = hold_unrecorded_lease(tmp_path, monkeypatch, b"1\n")
    rounds: list[int] = []
    try:
        binding = bind_worker(
            BindingPolicy(tmp_path, max_processes_per_gpu=3, bind_timeout_s=5),
            heartbeat=lambda: rounds.append(1),
        )
    finally:
        os.close(fd)
    assert binding.device == "cuda:0" and (binding.gpu_uuid, binding.slot) != (gpu_uuid(0), 0)
    assert len(rounds) >= 2


def test_forked_child_does_not_keep_the_lease(tmp_path: Path, fake_file: Path) -> None:
    write_fake(fake_file, [gpu(0)])
    bind_worker(BindingPolicy(tmp_path))
    lock = tmp_path / LEASE_DIR / f"{gpu_uuid(0)}.slot0.lock"
    hold_r, hold_w = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child inherited the lease descriptor, and must have dropped it
        os.close(hold_w)
        os.write(ready_w, b"1")  # at-fork hooks have run by the time fork() returns here
        os.read(hold_r, 1)
        os._exit(0 if current_binding() is None else 1)
    os.close(hold_r)
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"1"
        release_binding()
        assert lock_is_free(lock)  # although the forked child is still alive
    finally:
        os.close(hold_w)
        os.close(ready_r)
        assert os.waitpid(pid, 0)[1] == 0


def test_timeout_in_process(tmp_path: Path, fake_file: Path) -> None:
    write_fake(fake_file, [gpu(0, processes=[(unused_pid(), GIB)])])
    beats: list[int] = []

    with pytest.raises(BindTimeout, match="1 foreign process\\(es\\), policy skip"):
        bind_worker(
            BindingPolicy(tmp_path, foreign_process_policy="skip", bind_timeout_s=0),
            heartbeat=lambda: beats.append(1),
        )
    assert current_binding() is None
    assert beats  # called even when giving up at once


# --- verify ---------------------------------------------------------------------------------------


def snapshot(*processes: int, listed: bool = True) -> list[GpuInfo]:
    return [
        GpuInfo(0, 0, gpu_uuid(0), "Fake", "", 80 * GIB, 0, 80 * GIB, 0,
                procs(*processes) if listed else None),
        GpuInfo(1, 1, gpu_uuid(1), "Fake", "", 80 * GIB, 0, 80 * GIB, 0, procs(20)),
    ]


BOUND = Binding("cuda:0", 0, gpu_uuid(0), "Fake", 0, 0, "bound")


@pytest.mark.parametrize(
    ("gpus", "binding", "expected"),
    [
        (snapshot(10), BOUND, True),
        (snapshot(30), BOUND, None),  # PIDs of another namespace: cannot tell
        (snapshot(listed=False), BOUND, None),
        (snapshot(11), BOUND, False),  # a sibling is visible, we are not
        (snapshot(), Binding("cuda:0", 0, gpu_uuid(9), "Fake", 0, 0, "bound"), False),
    ],
)
def test_verify(gpus: list[GpuInfo], binding: Binding, expected: bool | None) -> None:
    assert check_binding(binding, gpus, me=10, ours={10, 11}) is expected


def test_verify_binding_is_none_on_cpu_and_with_the_fake(
    fake_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert verify_binding(Binding("cpu", None, None, None, None, 0, "cpu: x")) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", gpu_uuid(0))
    assert verify_binding(BOUND) is None
    monkeypatch.delenv("GPU_STAT_FAKE_NVML")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", gpu_uuid(1))
    assert verify_binding(BOUND) is False  # CUDA_VISIBLE_DEVICES no longer names it


# --- real worker processes ------------------------------------------------------------------------

MASTER = r"""
import dataclasses, json, logging, os, selectors, signal, sys, time
from gpu_stat.binding import BindingPolicy, BindTimeout, bind_worker

logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                    format="%(process)d %(name)s %(levelname)s %(message)s")
policy = BindingPolicy(**json.loads(sys.argv[1]))
events_r, events_w = os.pipe()
stay = {}  # worker pid -> write end of the pipe whose EOF lets the worker exit


def emit(event):
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def report(event):  # one write under PIPE_BUF: atomic among workers
    os.write(events_w, (json.dumps(event) + "\n").encode())


def worker(stay_r):
    beats = []

    def heartbeat():
        beats.append(time.monotonic())
        if len(beats) == 2:  # a second call means the first attempt did not bind
            report({"event": "waiting", "pid": os.getpid()})

    started = time.monotonic()
    try:
        binding = bind_worker(policy, heartbeat=heartbeat)
    except BindTimeout as exc:
        gaps = [b - a for a, b in zip(beats, beats[1:])]
        report({"event": "timeout", "pid": os.getpid(), "message": str(exc)[:3000],
                "elapsed": time.monotonic() - started, "max_gap": max(gaps, default=0.0)})
        return 75
    report({"event": "bound", "pid": os.getpid(), "env": os.environ["CUDA_VISIBLE_DEVICES"],
            **dataclasses.asdict(binding)})
    os.read(stay_r, 1)
    return 0


def reap(*_):
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def wait_dead(pid):
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass  # reaped by the SIGCHLD handler already


def spawn(n):
    pids = []
    for _ in range(n):
        stay_r, stay_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in [stay_w, events_r, *stay.values()]:
                    os.close(fd)
                code = worker(stay_r)
            finally:
                os._exit(code)
        os.close(stay_r)
        stay[pid] = stay_w
        pids.append(pid)
    emit({"event": "spawned", "pids": pids})


signal.signal(signal.SIGCHLD, reap)
selector = selectors.DefaultSelector()
selector.register(0, selectors.EVENT_READ)
selector.register(events_r, selectors.EVENT_READ)
buffers = {0: b"", events_r: b""}
while True:
    for key, _ in selector.select():
        data = os.read(key.fd, 65536)
        if key.fd == 0 and not data:
            sys.exit(0)
        buffers[key.fd] += data
        *lines, buffers[key.fd] = buffers[key.fd].split(b"\n")
        for line in lines:
            if key.fd == events_r:
                emit(json.loads(line))
                continue
            command, _, arg = line.decode().partition(" ")
            if command == "spawn":
                spawn(int(arg))
            elif command in ("kill", "release"):
                pid = int(arg)
                if command == "kill":
                    os.kill(pid, signal.SIGKILL)
                os.close(stay.pop(pid))
                wait_dead(pid)
                emit({"event": "gone", "pid": pid})
            elif command == "quit":
                for pid in list(stay):
                    os.kill(pid, signal.SIGKILL)
                    wait_dead(pid)
                sys.exit(0)
"""

EVENT_TIMEOUT_S = 30.0


class Master:
    """A parent process whose forked children bind, like gunicorn workers."""

    def __init__(self, workdir: Path, env: dict[str, str], policy: dict[str, Any]) -> None:
        self.log_path = workdir / "master.log"
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", MASTER, json.dumps(policy)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
            )
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.waiting: set[int] = set()
        self._pending: list[dict[str, Any]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.put(json.loads(line))
        self.events.put(None)

    def _send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def _receive(self) -> None:
        """Move the master's next event into ``waiting`` or ``_pending``."""
        event = self.events.get(timeout=EVENT_TIMEOUT_S)
        if event is None:
            raise AssertionError("master exited:\n" + self.log_path.read_text())
        if event["event"] == "waiting":
            self.waiting.add(event["pid"])
        else:
            self._pending.append(event)

    def _next(self, match: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        while True:
            for i, event in enumerate(self._pending):
                if match(event):
                    return self._pending.pop(i)
            self._receive()

    def spawn(self, n: int) -> list[int]:
        self._send(f"spawn {n}")
        pids: list[int] = self._next(lambda e: e["event"] == "spawned")["pids"]
        return pids

    def result(self, pid: int) -> dict[str, Any]:
        """The worker's bound/timeout report."""
        return self._next(lambda e: e.get("pid") == pid and e["event"] in ("bound", "timeout"))

    def start(self, n: int) -> list[dict[str, Any]]:
        """Start n workers together; their reports, in spawn order."""
        return [self.result(pid) for pid in self.spawn(n)]

    def wait_until_waiting(self, pid: int) -> None:
        """Until the worker reports that its first attempt found no slot."""
        while pid not in self.waiting:
            self._receive()

    def kill(self, pid: int) -> None:
        """SIGKILL a worker and wait until it is reaped (its lease is gone)."""
        self._send(f"kill {pid}")
        self._next(lambda e: e == {"event": "gone", "pid": pid})

    def close(self) -> str:
        """Stop the master (its workers with it), close its pipes; its log."""
        if self.proc.poll() is None:
            try:
                self._send("quit")
                self.proc.wait(timeout=EVENT_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._reader.join(EVENT_TIMEOUT_S)  # it stops at the end of the master's output
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        return self.log_path.read_text()


@pytest.fixture
def start_master(tmp_path: Path, fake_file: Path) -> Iterator[Callable[..., Master]]:
    masters: list[Master] = []

    def start(*, env: dict[str, str] | None = None, **policy: Any) -> Master:
        workdir = tmp_path / f"master{len(masters)}"
        workdir.mkdir()
        policy.setdefault("run_dir", str(tmp_path / "run"))
        policy.setdefault("bind_timeout_s", 20.0)
        full_env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        full_env.update(PYTHONPATH=str(ROOT), GPU_STAT_FAKE_NVML=str(fake_file), **(env or {}))
        masters.append(Master(workdir, full_env, policy))
        return masters[-1]

    yield start
    for master in masters:
        master.close()


def placement(results: list[dict[str, Any]]) -> Counter[str]:
    return Counter(r["gpu_uuid"] for r in results if r["event"] == "bound")


def test_simultaneous_workers_fill_every_slot_once(
    fake_file: Path, start_master: Callable[..., Master]
) -> None:
    write_fake(fake_file, [gpu(0), gpu(1), gpu(2)])
    master = start_master(max_processes_per_gpu=2)

    results = master.start(6)

    assert all(r["event"] == "bound" for r in results)
    assert len({(r["gpu_uuid"], r["slot"]) for r in results}) == 6
    assert placement(results) == {gpu_uuid(0): 2, gpu_uuid(1): 2, gpu_uuid(2): 2}
    assert sorted(r["rank"] for r in results) == list(range(6))
    assert all(r["env"] == r["gpu_uuid"] and r["device"] == "cuda:0" for r in results)
    assert all(r["gpu_index"] == int(r["gpu_uuid"][4:12], 16) for r in results)


def test_fewer_workers_than_slots_spread_over_all_gpus(
    fake_file: Path, start_master: Callable[..., Master]
) -> None:
    write_fake(fake_file, [gpu(0), gpu(1), gpu(2)])
    master = start_master(max_processes_per_gpu=3)

    results = master.start(3)

    assert placement(results) == {gpu_uuid(0): 1, gpu_uuid(1): 1, gpu_uuid(2): 1}
    assert {r["slot"] for r in results} == {0}


def test_workers_started_one_by_one_alternate_gpus(
    fake_file: Path, start_master: Callable[..., Master]
) -> None:
    write_fake(fake_file, [gpu(0), gpu(1)])
    master = start_master(max_processes_per_gpu=2)

    results = [master.start(1)[0] for _ in range(4)]

    assert [(r["gpu_index"], r["slot"]) for r in results] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_binding_is_parallel_not_one_at_a_time(
    tmp_path: Path, fake_file: Path, start_master: Callable[..., Master]
) -> None:
    # The 2018 design waited for older siblings to show up in NVML's process list; these
    # workers never do (they hold their leases but never create a CUDA context).
    write_fake(fake_file, [gpu(i) for i in range(4)])
    master = start_master()

    results = master.start(4)

    assert len(placement(results)) == 4
    locks = sorted((tmp_path / "run" / LEASE_DIR).iterdir())
    assert len(locks) == 4
    assert not any(lock_is_free(lock) for lock in locks)  # all four hold a lease at once
    assert {int(lock.read_text()) for lock in locks} == {r["pid"] for r in results}


def test_killed_worker_frees_its_slot_for_a_new_one(
    fake_file: Path, start_master: Callable[..., Master]
) -> None:
    write_fake(fake_file, [gpu(0), gpu(1)])
    master = start_master()
    first = master.start(2)
    victim = next(r for r in first if r["gpu_uuid"] == gpu_uuid(1))

    master.kill(victim["pid"])
    (replacement,) = master.start(1)

    assert (replacement["event"], replacement["gpu_uuid"], replacement["slot"]) == (
        "bound", gpu_uuid(1), 0
    )


def test_new_worker_waits_for_an_old_one_to_leave(
    fake_file: Path, start_master: Callable[..., Master]
) -> None:
    # A HUP reload starts new workers before the old ones stop.
    write_fake(fake_file, [gpu(0)])
    master = start_master(bind_timeout_s=30.0)
    (old,) = master.start(1)
    (new_pid,) = master.spawn(1)

    master.wait_until_waiting(new_pid)
    master.kill(old["pid"])
    new = master.result(new_pid)

    assert (new["event"], new["gpu_uuid"], new["slot"]) == ("bound", gpu_uuid(0), 0)


def test_more_workers_than_slots_time_out_with_heartbeats(
    fake_file: Path, start_master: Callable[..., Master]
) -> None:
    write_fake(fake_file, [gpu(0)])
    master = start_master(bind_timeout_s=2.5)

    results = master.start(2)

    bound = [r for r in results if r["event"] == "bound"]
    (timed_out,) = [r for r in results if r["event"] == "timeout"]
    assert len(bound) == 1
    assert timed_out["elapsed"] >= 2.5
    assert timed_out["max_gap"] < 1.0  # gunicorn's heartbeat kept alive throughout
    assert "found no free GPU slot in 2.5 s: GPU 0: all 1 slot(s) leased" in timed_out["message"]


def test_foreign_processes_skip_or_share(
    tmp_path: Path, fake_file: Path, start_master: Callable[..., Master]
) -> None:
    stranger = unused_pid()
    # GPU 0 has more free memory, so only the policy keeps a worker off it.
    write_fake(fake_file, [gpu(0, processes=[(stranger, GIB)]), gpu(1, memory_used=20 * GIB)])

    skip = start_master(foreign_process_policy="skip", run_dir=str(tmp_path / "run-skip"))
    share = start_master(foreign_process_policy="share", run_dir=str(tmp_path / "run-share"))

    (skipping,) = skip.start(1)
    (sharing,) = share.start(1)

    assert skipping["gpu_uuid"] == gpu_uuid(1)
    assert sharing["gpu_uuid"] == gpu_uuid(0)


def test_unmatched_pids_count_against_our_leases_in_containers(
    fake_file: Path, start_master: Callable[..., Master]
) -> None:
    write_fake(fake_file, [gpu(0)])
    master = start_master(max_processes_per_gpu=3, foreign_process_policy="skip",
                          bind_timeout_s=0.5)
    (first,) = master.start(1)

    # NVML shows the first worker under a host PID we cannot match: it is ours, not foreign.
    host_pids = unused_pids(3)
    write_fake(fake_file, [gpu(0, processes=[(host_pids[0], GIB)])])
    (second,) = master.start(1)
    # Now two leases explain at most two unmatched PIDs; a third PID is a stranger.
    write_fake(fake_file, [gpu(0, processes=[(pid, GIB) for pid in host_pids])])
    (third,) = master.start(1)

    assert (first["slot"], second["slot"]) == (0, 1)
    assert third["event"] == "timeout"
    assert "GPU 0: 1 foreign process(es), policy skip" in third["message"]


def test_matched_pid_does_not_cover_a_stranger(
    fake_file: Path, start_master: Callable[..., Master]
) -> None:
    write_fake(fake_file, [gpu(0)])
    master = start_master(max_processes_per_gpu=2, foreign_process_policy="skip",
                          bind_timeout_s=0.5)
    (first,) = master.start(1)
    write_fake(fake_file, [gpu(0, processes=[(first["pid"], GIB), (unused_pid(), GIB)])])

    (second,) = master.start(1)

    assert second["event"] == "timeout"
    assert "1 foreign process(es)" in second["message"]


def test_min_free_memory_limits_workers_per_gpu(
    fake_file: Path, start_master: Callable[..., Master]
) -> None:
    write_fake(fake_file, [gpu(0, memory_used=40 * GIB), gpu(1, memory_used=10 * GIB)])
    master = start_master(max_processes_per_gpu=3, min_free_memory_bytes=30 * GIB,
                          bind_timeout_s=1.0)

    results = master.start(4)

    # 40 GiB free fits one 30 GiB worker, 70 GiB two; the loading ones are reserved for.
    assert placement(results) == {gpu_uuid(0): 1, gpu_uuid(1): 2}
    (timed_out,) = [r for r in results if r["event"] == "timeout"]
    assert "below min_free_memory 30.0 GiB" in timed_out["message"]


def test_allow_list_restricts_gpus(fake_file: Path, start_master: Callable[..., Master]) -> None:
    write_fake(fake_file, [gpu(0), gpu(1), gpu(2)])
    master = start_master(allowed_gpus=["2", gpu_uuid(0)[:12]], bind_timeout_s=0.5)

    results = master.start(3)

    assert placement(results) == {gpu_uuid(0): 1, gpu_uuid(2): 1}
    assert [r["event"] for r in results].count("timeout") == 1


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        ("2,0", [(0, gpu_uuid(2)), (1, gpu_uuid(0))]),
        (f"{gpu_uuid(1)[:12]},2", [(0, gpu_uuid(1)), (1, gpu_uuid(2))]),
    ],
)
def test_cuda_visible_devices_of_the_master_is_honoured(
    fake_file: Path, start_master: Callable[..., Master], visible: str,
    expected: list[tuple[int, str]]
) -> None:
    write_fake(fake_file, [gpu(0), gpu(1), gpu(2)])
    master = start_master(env={"CUDA_VISIBLE_DEVICES": visible}, max_processes_per_gpu=2)

    results = master.start(2)

    assert sorted((r["gpu_index"], r["gpu_uuid"]) for r in results) == expected
    assert all(r["env"] == r["gpu_uuid"] for r in results)  # the full UUID, not the prefix


def test_mig_instances_are_bound_individually(
    fake_file: Path, start_master: Callable[..., Master]
) -> None:
    write_fake(fake_file, [gpu(0, mig=[mig(0, 0), mig(0, 1)])])
    master = start_master()

    results = master.start(2)

    assert sorted(r["env"] for r in results) == [mig_uuid(0, 0), mig_uuid(0, 1)]
    assert {r["gpu_index"] for r in results} == {0}
    assert {r["gpu_name"] for r in results} == {"Fake A100 MIG 1g.10gb"}


def test_one_info_line_per_worker(fake_file: Path, start_master: Callable[..., Master]) -> None:
    write_fake(fake_file, [gpu(0), gpu(1, processes=[(unused_pid(), GIB)])])
    master = start_master(foreign_process_policy="skip", bind_timeout_s=0.5)
    results = master.start(2)

    lines = [line for line in master.close().splitlines() if "gpu_stat.binding" in line]

    bound = next(r for r in results if r["event"] == "bound")
    (info,) = [line for line in lines if " INFO " in line]
    assert info.startswith(f"{bound['pid']} gpu_stat.binding INFO gpu binding: pid={bound['pid']}")
    assert f"-> GPU 0 {gpu_uuid(0)} (Fake A100) slot 0, 80.0 GiB free" in info
    assert f"backend fake:{fake_file}" in info
    assert "skipped: GPU 1: 1 foreign process(es), policy skip" in info
