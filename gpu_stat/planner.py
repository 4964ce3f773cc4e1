"""The pure decisions of the GPU binding, unit-tested without processes: which GPUs (or MIG
instances) a worker may bind to, how many processes on a GPU are foreign, and the order in which
workers take the free (GPU, slot) pairs (water-filling). See ``gpu_stat.binding`` for the whole
procedure and ``gpu_stat.capacity`` for the reasoning behind the foreign-process count.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from gpu_stat.snapshot import GpuInfo, GpuProcess

__all__ = [
    "SlotState",
    "Unit",
    "allowed_units",
    "count_foreign_processes",
    "pending_leases",
    "plan_slots",
    "units",
]

GIB = 2**30


def count_foreign_processes(
    processes: Sequence[GpuProcess] | None, our_pids: Collection[int], our_leases: int
) -> int:
    """Processes on a GPU that are not ours (``gpu_stat.capacity`` gives the reasoning).

    ``processes``: NVML's list (None = NVML does not list them: 0 foreign, nothing to go on);
    ``our_pids``: live PIDs of our server; ``our_leases``: leases held on this GPU.
    """
    if processes is None:
        return 0
    pids = {p.pid for p in processes}
    matched = len(pids.intersection(our_pids))
    unmatched = len(pids) - matched
    return max(0, unmatched - max(0, our_leases - matched))


def pending_leases(processes: Sequence[GpuProcess] | None, our_pids: Collection[int], our_leases: int) -> int:
    """Leases whose holder has no process on the GPU yet (so has not allocated memory)."""
    if processes is None:
        return 0
    pids = {p.pid for p in processes}
    matched = len(pids.intersection(our_pids))
    return max(0, our_leases - matched - (len(pids) - matched))


@dataclass(frozen=True)
class SlotState:
    """One bindable GPU as the planner sees it: ``key`` identifies it (its uuid), ``order`` breaks
    ties (lower first), ``leases`` held by us, ``free_slots`` not leased, ``capacity`` how many
    new workers it may take now, ``free_memory`` in bytes."""

    key: str
    order: int
    leases: int
    free_slots: tuple[int, ...]
    capacity: int
    free_memory: int


def plan_slots(states: Iterable[SlotState]) -> list[tuple[str, int]]:
    """Free (key, slot) pairs in the order workers should take them: repeatedly the GPU with the
    fewest leases (counting those planned before), then the most free memory in whole GiB (so
    that megabytes of noise do not reorder identical GPUs), then the lowest ``order``; on that
    GPU its lowest free slot. A GPU appears at most ``capacity`` times."""
    candidates = [s for s in states if s.capacity > 0 and s.free_slots]
    taken = {s.key: 0 for s in candidates}
    plan: list[tuple[str, int]] = []
    while True:
        open_ = [s for s in candidates if taken[s.key] < min(s.capacity, len(s.free_slots))]
        if not open_:
            return plan
        best = min(open_, key=lambda s: (s.leases + taken[s.key], -(s.free_memory // GIB), s.order))
        plan.append((best.key, best.free_slots[taken[best.key]]))
        taken[best.key] += 1


@dataclass(frozen=True)
class Unit:
    """One thing CUDA_VISIBLE_DEVICES can name: a GPU, or a MIG instance of one."""

    gpu: GpuInfo  # the GPU, or the MIG instance, that CUDA_VISIBLE_DEVICES will name
    view_index: int  # index of the (parent) GPU in the CUDA_VISIBLE_DEVICES view
    parent_uuid: str | None
    order: int

    def label(self) -> str:
        mig = f" {self.gpu.uuid}" if self.parent_uuid is not None else ""
        return f"GPU {self.view_index}{mig}"


def units(view: Sequence[GpuInfo]) -> list[Unit]:
    """The bindable units of a view, in order: a MIG-enabled GPU gives its instances."""
    found: list[Unit] = []
    for gpu in view:
        # CUDA cannot use a MIG-enabled GPU as a whole, only its instances.
        for unit in gpu.mig_instances if gpu.mig_enabled else (gpu,):
            found.append(Unit(unit, gpu.index, unit.parent_uuid, len(found)))
    return found


def allowed_units(candidates: list[Unit], allowed: Sequence[str]) -> tuple[list[Unit], list[str]]:
    """Units matching the allow-list, and the entries that match nothing (or are ambiguous)."""
    if not allowed:
        return candidates, []
    keep: set[int] = set()
    unmatched: list[str] = []
    for entry in allowed:
        if entry.isdigit() and entry.isascii():
            hits = {u.order for u in candidates if u.view_index == int(entry)}
        elif entry.lower().startswith(("gpu-", "mig-")):
            prefix = entry.lower()
            named = {
                uuid
                for u in candidates
                for uuid in (u.gpu.uuid, u.parent_uuid)
                if uuid is not None and uuid.lower().startswith(prefix)
            }
            hits = (
                {u.order for u in candidates if named & {u.gpu.uuid, u.parent_uuid}}
                if len(named) == 1
                else set()
            )
        else:
            hits = set()
        if not hits:
            unmatched.append(entry)
        keep |= hits
    return [u for u in candidates if u.order in keep], unmatched
