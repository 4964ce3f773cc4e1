"""Bind a worker process to one (GPU, slot) before it initialises CUDA.

Each gunicorn worker binds itself, typically from the ``post_fork`` hook:

1. **Rank**: its position among the live children of its parent (the gunicorn master), ordered
   by (create_time, pid).
2. **Capacity**: a fresh NVML snapshot (CUDA_VISIBLE_DEVICES and the allow-list applied); per GPU
   the leases already held, the foreign processes, the free memory.
3. **Plan**: the free (GPU, slot) pairs in water-filling order: always the usable GPU with the
   fewest of our leases next (then the most free memory, in GiB, then the lowest index), so a
   fresh start gives gpu0 slot0, gpu1 slot0, ..., gpu0 slot1, ...
4. **Claim**: the worker takes the plan entry at its rank among the siblings that hold no lease
   yet, so siblings starting together aim at different entries, with a non-blocking exclusive
   ``flock`` on ``<run_dir>/gpu-leases/<uuid>.slot<k>.lock``. While a held lease names no
   process of ours (a sibling between its lock and writing its pid) the worker plans again:
   the plan already lacks that slot, but the sibling would still count as unbound and shift the
   entries (:func:`_settling`). The descriptor stays open for the life of the process; the
   kernel releases it when the process dies, however it dies. If the
   lock is taken (a sibling won the race) the worker plans again at once; if the plan is empty it
   waits with backoff, calling ``heartbeat`` at least every second, until ``bind_timeout_s``.
5. **Bind**: ``CUDA_VISIBLE_DEVICES=<uuid>``; the worker then uses ``cuda:0``.

Which GPU can take a worker (foreign processes, free memory) and why: ``gpu_stat.capacity``.

Lock files are never deleted: unlinking a lock file that another process has open lets a third
process lock a new file of the same name, and the lease would no longer be exclusive.

Rooms: this module holds the policy, the binding fact and the bind loop; steps 2-3 (capacity,
plan) are in ``gpu_stat.capacity``, their pure decisions (units, allow-list, foreign count,
plan order) in ``gpu_stat.planner``, the lock files in ``gpu_stat.leases``, the siblings in
``gpu_stat.family``, the after-load check in ``gpu_stat.verify``.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from gpu_stat.capacity import Assessment, assess, gib
from gpu_stat.family import Family, family
from gpu_stat.leases import LEASE_DIR, lock_path, try_lock
from gpu_stat.planner import Unit, allowed_units, units
from gpu_stat.query import backend_name, query_gpus
from gpu_stat.snapshot import NvmlUnavailable
from gpu_stat.visible import ENV_VISIBLE

__all__ = [
    "EXIT_BIND_TIMEOUT",
    "BindTimeout",
    "Binding",
    "BindingPolicy",
    "bind_worker",
    "current_binding",
    "release_binding",
    "usable_gpu_count",
]

log = logging.getLogger(__name__)

#: A worker exit code for BindTimeout that gunicorn does not treat as fatal (it halts the whole
#: server on 3 and 4): EX_TEMPFAIL from sysexits.h.
EXIT_BIND_TIMEOUT = 75

_HEARTBEAT_EVERY_S = 0.25
_MAX_BACKOFF_S = 1.0
_SETTLE_S = 0.5


@dataclass(frozen=True)
class BindingPolicy:
    """How workers claim GPUs.

    ``run_dir``: the server's run directory; leases live in ``run_dir/gpu-leases`` (local disk,
    one run directory per server). ``max_processes_per_gpu``: slots per GPU (or MIG instance).
    ``allowed_gpus``: indices (in the CUDA_VISIBLE_DEVICES view) or UUIDs (``GPU-``/``MIG-``, full
    or unique prefix); empty = all visible. ``min_free_memory_bytes``: a GPU with less free
    memory takes no new worker. ``foreign_process_policy``: "share" uses GPUs that run other
    programs' processes, "skip" does not. ``bind_timeout_s``: how long a worker waits for a slot
    (seconds) before BindTimeout; make it longer than gunicorn's ``graceful_timeout`` so that
    new workers outlast old ones during a HUP reload.
    """

    run_dir: Path
    max_processes_per_gpu: int = 1
    allowed_gpus: tuple[str, ...] = ()
    min_free_memory_bytes: int = 0
    foreign_process_policy: Literal["share", "skip"] = "share"
    bind_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "run_dir", Path(self.run_dir))
        if isinstance(self.allowed_gpus, str):
            example = tuple(self.allowed_gpus.split(","))
            raise ValueError(
                f"allowed_gpus must be a tuple of entries, e.g. {example!r}, "
                f"not the string {self.allowed_gpus!r}"
            )
        object.__setattr__(self, "allowed_gpus", tuple(str(e).strip() for e in self.allowed_gpus))
        if self.max_processes_per_gpu < 1:
            raise ValueError(
                f"max_processes_per_gpu must be >= 1, not {self.max_processes_per_gpu}"
            )
        if self.min_free_memory_bytes < 0:
            raise ValueError("min_free_memory_bytes must be >= 0")
        if self.foreign_process_policy not in ("share", "skip"):
            raise ValueError(
                "foreign_process_policy must be 'share' or 'skip', "
                f"not {self.foreign_process_policy!r}"
            )
        if not self.bind_timeout_s >= 0:
            raise ValueError(f"bind_timeout_s must be >= 0 seconds, not {self.bind_timeout_s}")


@dataclass(frozen=True)
class Binding:
    """Where a worker runs: the one fact about it, made once by :func:`bind_worker` and read
    from :func:`current_binding` by whoever needs it.

    ``device``: the torch device the binding names ("cuda:0" or "cpu"). ``gpu_index``: the GPU's
    index in the CUDA_VISIBLE_DEVICES view the worker started with (for a MIG instance: its
    GPU's); ``gpu_uuid``: what CUDA_VISIBLE_DEVICES now holds (a ``MIG-`` uuid for a MIG
    instance); ``slot``: the lease's slot on that GPU; all GPU fields are None on CPU. ``rank``:
    the worker's position among its siblings when it bound; ``reason``: "bound" or why CPU;
    ``pid``: the process it describes (the one that bound)."""

    device: str
    gpu_index: int | None
    gpu_uuid: str | None
    gpu_name: str | None
    slot: int | None
    rank: int
    reason: str
    pid: int = field(default_factory=os.getpid)

    def as_labels(self) -> dict[str, str]:
        """Labels for metrics and logs: gpu, gpu_uuid, slot ("" on CPU) and device."""
        return {
            "gpu": "" if self.gpu_index is None else str(self.gpu_index),
            "gpu_uuid": self.gpu_uuid or "",
            "slot": "" if self.slot is None else str(self.slot),
            "device": self.device,
        }


class BindTimeout(Exception):
    """No (GPU, slot) became free within ``bind_timeout_s``. Exit the worker with
    EXIT_BIND_TIMEOUT (not 3 or 4, which halt gunicorn); the master starts a new one."""


@dataclass
class _Held:
    pid: int
    binding: Binding
    fd: int | None


_held: _Held | None = None
_held_lock = threading.Lock()


def _forget_inherited_lease() -> None:
    # A process forked from a bound worker must not keep the worker's lease alive after the
    # worker dies: drop the child's reference to the locked file (the parent's stays).
    global _held
    if _held is not None and _held.pid != os.getpid():
        if _held.fd is not None:
            os.close(_held.fd)
        _held = None


os.register_at_fork(after_in_child=_forget_inherited_lease)


def current_binding() -> Binding | None:
    """This process's binding, or None before bind_worker (or after release_binding)."""
    held = _held
    return held.binding if held is not None and held.pid == os.getpid() else None


def release_binding() -> None:
    """Give the lease back (close the lock file) and forget the binding. For tests and tools; a
    worker keeps its lease until it exits. CUDA_VISIBLE_DEVICES is left as it is."""
    global _held
    with _held_lock:
        if _held is not None and _held.pid == os.getpid() and _held.fd is not None:
            os.close(_held.fd)
        _held = None


def usable_gpu_count(policy: BindingPolicy) -> int:
    """For the master: how many GPUs workers can bind to, after CUDA_VISIBLE_DEVICES and the
    allow-list (a MIG-enabled GPU counts its MIG instances). 0 when NVML is unavailable. Does not
    look at leases, memory or foreign processes, which change; never imports torch or creates a
    CUDA context, so it is safe before fork(). Raises ValueError for a malformed fake file."""
    try:
        view = query_gpus()
    except NvmlUnavailable as exc:
        log.info("usable GPUs: 0 (NVML unavailable: %s)", exc)
        return 0
    allowed, unmatched = allowed_units(units(view), policy.allowed_gpus)
    if unmatched:
        log.warning("allowed_gpus entries match no visible GPU: %s", unmatched)
    return len(allowed)


def _cpu(reason: str, rank: int, *, warn: bool) -> Binding:
    # CPU mode means CPU: no library in this worker may create a context on some default GPU.
    os.environ[ENV_VISIBLE] = ""
    binding = Binding("cpu", None, None, None, None, rank, reason)
    log.log(
        logging.WARNING if warn else logging.INFO,
        "gpu binding: pid=%d rank=%d -> CPU (%s)", os.getpid(), rank, reason.removeprefix("cpu: "),
    )
    return binding


def _sleep(seconds: float, deadline: float, heartbeat: Callable[[], None] | None) -> None:
    end = min(time.monotonic() + seconds, deadline)
    while True:
        if heartbeat is not None:
            heartbeat()
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, _HEARTBEAT_EVERY_S))


def bind_worker(policy: BindingPolicy, *, heartbeat: Callable[[], None] | None = None) -> Binding:
    """Claim a (GPU, slot) for this process and set CUDA_VISIBLE_DEVICES to the GPU's UUID; call
    it before anything initialises CUDA, then use ``binding.device`` ("cuda:0" or "cpu").

    Idempotent within a process. Returns a CPU binding, logged in one line, when NVML is
    unavailable, when no GPU is visible, or when no visible GPU matches ``allowed_gpus``;
    CUDA_VISIBLE_DEVICES is then set to "". Otherwise waits, calling ``heartbeat`` at least every
    second, until a slot is free. Raises BindTimeout after ``policy.bind_timeout_s`` seconds
    without one; OSError if the lease directory cannot be created or written; ValueError for a
    malformed fake-NVML file.
    """
    global _held
    with _held_lock:
        existing = current_binding()
        if existing is not None:
            return existing
        binding, fd = _bind(policy, heartbeat)
        _held = _Held(os.getpid(), binding, fd)
        return binding


def _bind(
    policy: BindingPolicy, heartbeat: Callable[[], None] | None
) -> tuple[Binding, int | None]:
    me = os.getpid()
    started = time.monotonic()
    deadline = started + policy.bind_timeout_s
    first = True
    empty_rounds = 0
    settling: float | None = None
    notes: list[str] = ["no attempt completed"]
    while True:
        collided = False
        if heartbeat is not None:
            heartbeat()
        fam = family()
        rank = fam.siblings.index(me)
        chosen: list[Unit] | None = None
        try:
            view = query_gpus()
        except NvmlUnavailable as exc:
            if first:
                return _cpu(f"cpu: NVML unavailable ({exc})", rank, warn=True), None
            notes = [f"NVML unavailable ({exc})"]
        else:
            all_units = units(view)
            chosen, unmatched = allowed_units(all_units, policy.allowed_gpus)
            if first:
                if unmatched:
                    log.warning("allowed_gpus entries match no visible GPU: %s", unmatched)
                if not view:
                    visible = os.environ.get(ENV_VISIBLE)
                    why = "" if visible is None else f", {ENV_VISIBLE}={visible!r}"
                    return _cpu(f"cpu: no GPU visible{why}", rank, warn=False), None
                if not all_units:
                    return _cpu(
                        "cpu: no GPU usable by CUDA is visible (MIG enabled, no MIG instances)",
                        rank,
                        warn=True,
                    ), None
                if not chosen:
                    return _cpu(
                        f"cpu: no visible GPU matches allowed_gpus={list(policy.allowed_gpus)}",
                        rank,
                        warn=True,
                    ), None
                policy.run_dir.joinpath(LEASE_DIR).mkdir(mode=0o700, parents=True, exist_ok=True)
        first = False
        if chosen is not None:
            attempt = assess(
                chosen,
                fam.ours,
                policy.run_dir / LEASE_DIR,
                slots_per_gpu=policy.max_processes_per_gpu,
                min_free_memory_bytes=policy.min_free_memory_bytes,
                skip_foreign=policy.foreign_process_policy == "skip",
            )
            notes = attempt.skipped + attempt.full or ["no GPU has a free slot"]
            if attempt.plan:
                empty_rounds = 0
                settling = _settling(attempt, fam, settling)
                if settling is None or time.monotonic() - settling >= _SETTLE_S:
                    key, slot = attempt.plan[_offset(attempt, fam, me, rank) % len(attempt.plan)]
                    fd = try_lock(lock_path(policy.run_dir / LEASE_DIR, key, slot))
                    if fd is not None:
                        return _bound(attempt.units[key], slot, rank, attempt.skipped, started), fd
                collided = True
        if time.monotonic() >= deadline:
            raise BindTimeout(
                f"worker pid {me} (rank {rank}) found no free GPU slot in "
                f"{policy.bind_timeout_s:g} s: " + "; ".join(notes) + ". Start fewer workers, "
                "raise max_processes_per_gpu, relax min_free_memory_bytes/"
                "foreign_process_policy, or free the GPUs."
            )
        if collided:
            # A sibling took that slot (or probed it) an instant ago: plan again almost at once.
            _sleep(random.uniform(0.001, 0.02), deadline, heartbeat)
        else:
            empty_rounds += 1
            backoff = min(_MAX_BACKOFF_S, 0.05 * 2 ** min(empty_rounds, 8))
            _sleep(random.uniform(0.5, 1.0) * backoff, deadline, heartbeat)


def _settling(attempt: Assessment, fam: Family, since: float | None) -> float | None:
    """Since when (``time.monotonic()``, s) some held lease has named no live process of ours, or
    None when every one does.

    A worker writes its pid into the lock file just after locking it, so for an instant the
    file is empty, or still names the slot's previous (dead) holder. A sibling that plans in that
    instant finds the slot taken but cannot tell who took it, so it counts the new holder among
    the unbound siblings and its own entry shifts by one: of three workers starting together on
    three GPUs, two took one GPU and the third GPU got none. It plans again instead, for at most
    ``_SETTLE_S`` (a lease another server holds in the same run directory never settles)."""
    if all(pid in fam.ours for pid in attempt.holders):
        return None
    return time.monotonic() if since is None else since


def _offset(attempt: Assessment, fam: Family, me: int, rank: int) -> int:
    """This worker's index among the siblings that hold no lease (its rank if it holds one)."""
    unbound = [pid for pid in fam.siblings if pid not in attempt.holders]
    return unbound.index(me) if me in unbound else rank


def _bound(unit: Unit, slot: int, rank: int, skipped: list[str], started: float) -> Binding:
    gpu = unit.gpu
    os.environ[ENV_VISIBLE] = gpu.uuid
    binding = Binding("cuda:0", unit.view_index, gpu.uuid, gpu.name, slot, rank, "bound")
    waited = time.monotonic() - started
    log.info(
        "gpu binding: pid=%d rank=%d -> %s %s (%s) slot %d, %s free, backend %s%s%s",
        os.getpid(),
        rank,
        f"GPU {unit.view_index}",
        gpu.uuid,
        gpu.name,
        slot,
        gib(gpu.memory_free),
        backend_name(),
        f", waited {waited:.1f} s" if waited >= 1 else "",
        "; skipped: " + "; ".join(skipped) if skipped else "",
    )
    return binding
