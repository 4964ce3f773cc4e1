"""Steps 2 and 3 of a bind attempt (``gpu_stat.binding``): what each GPU can take now, and the
plan. Reads the lease files (``gpu_stat.leases``) and an NVML snapshot's processes and memory;
the arithmetic is in ``gpu_stat.planner``.

Foreign processes: NVML lists every process with a context on a GPU, by PIDs of the driver's
namespace. Those equal to a live process of our server (the parent and its descendants) are ours
("matched"). In a container the rest cannot be told apart from strangers, but each of our leases
on the GPU accounts for at most one process, and ``leases - matched`` of them have not been
matched, so that many unmatched PIDs may be ours::

    foreign = max(0, unmatched - max(0, leases - matched))

This errs towards "not foreign" only while one of our lease holders has not created its context
yet, and never counts one of our own workers as foreign.

Memory: a GPU whose free memory is below ``min_free_memory_bytes`` takes no new worker, even if
it holds our leases: our workers' memory is as real as anyone's. Lease holders that have no
process on the GPU yet (``leases - matched - unmatched``; still loading) are reserved
``min_free_memory_bytes`` each, so workers starting together do not all count the same free
memory. A GPU short of memory is retried until the timeout, which picks up memory released by an
exiting old worker after a HUP reload.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from gpu_stat.leases import probe_leases, safe_name
from gpu_stat.planner import (
    GIB,
    SlotState,
    Unit,
    count_foreign_processes,
    pending_leases,
    plan_slots,
)

__all__ = ["Assessment", "assess", "gib"]


def gib(n: int) -> str:
    """``n`` bytes as GiB for a log line, e.g. "15.8 GiB"."""
    return f"{n / GIB:.1f} GiB"


@dataclass(frozen=True)
class Assessment:
    """One look at the candidate GPUs.

    ``plan``: free (uuid, slot) pairs in the order workers take them (``planner.plan_slots``);
    ``units``: uuid -> unit; ``skipped``: GPUs the policy kept from taking a worker, and why;
    ``full``: GPUs whose slots are all leased; ``holders``: the pid on record in each held
    lease (``leases.probe_leases``): None, or the slot's previous holder, while the process that
    has just locked it has not written its own pid yet."""

    plan: list[tuple[str, int]]
    units: dict[str, Unit]
    skipped: list[str]
    full: list[str]
    holders: tuple[int | None, ...]


def assess(
    candidates: list[Unit],
    our_pids: Collection[int],
    lease_dir: Path,
    *,
    slots_per_gpu: int,
    min_free_memory_bytes: int,
    skip_foreign: bool,
) -> Assessment:
    """Capacity and plan of ``candidates`` (the allowed units of a fresh NVML snapshot).

    ``our_pids``: live pids of our server (``Family.ours``); ``lease_dir``: the lease files;
    ``slots_per_gpu``: ``max_processes_per_gpu``; ``min_free_memory_bytes``: bytes a new worker
    needs free (0: no check); ``skip_foreign``: a GPU with a foreign process takes no worker.
    Raises nothing for a missing lease directory (no leases)."""
    probes = probe_leases(lease_dir)
    states: list[SlotState] = []
    skipped: list[str] = []
    full: list[str] = []
    holders: list[int | None] = []
    for unit in candidates:
        held = probes.get(safe_name(unit.gpu.uuid), {})
        holders.extend(held.values())
        leases = len(held)
        free_slots = tuple(k for k in range(slots_per_gpu) if k not in held)
        foreign = count_foreign_processes(unit.gpu.processes, our_pids, leases)
        pending = pending_leases(unit.gpu.processes, our_pids, leases)
        free_memory = unit.gpu.memory_free - pending * min_free_memory_bytes
        capacity = len(free_slots)
        if foreign and skip_foreign:
            capacity = 0
            skipped.append(f"{unit.label()}: {foreign} foreign process(es), policy skip")
        elif min_free_memory_bytes:
            fits = max(0, free_memory) // min_free_memory_bytes
            if fits < capacity:
                capacity = fits
                if fits == 0:
                    reserved = f" after reserving {pending} loading worker(s)" if pending else ""
                    skipped.append(
                        f"{unit.label()}: {gib(unit.gpu.memory_free)} free{reserved}, "
                        f"below min_free_memory {gib(min_free_memory_bytes)}"
                    )
        if not free_slots:
            full.append(f"{unit.label()}: all {slots_per_gpu} slot(s) leased")
        states.append(
            SlotState(unit.gpu.uuid, unit.order, leases, free_slots, capacity, free_memory)
        )
    return Assessment(
        plan_slots(states), {u.gpu.uuid: u for u in candidates}, skipped, full, tuple(holders)
    )
