"""Typed, immutable snapshots of GPUs as NVML reports them, and the one error NVML raises to us.

Memory is always in bytes, utilisation in percent (0-100).
"""

from __future__ import annotations

from dataclasses import dataclass


class NvmlUnavailable(Exception):
    """No usable NVML: no binding installed, no driver/library, NVML disabled, or a fake that
    says so. Callers treat it as "no GPU information", never as "zero GPUs"."""


@dataclass(frozen=True)
class GpuProcess:
    """A process with a compute context on a GPU.

    ``pid`` is in the PID namespace of the *driver* (the host), which inside a container is not
    ours; ``used_memory`` is in bytes, None where NVML cannot tell (e.g. MIG without privileges).
    """

    pid: int
    used_memory: int | None


@dataclass(frozen=True)
class GpuInfo:
    """One GPU, or one MIG instance, at the moment of the query.

    ``index`` is the position in the view that was asked for: with CUDA_VISIBLE_DEVICES applied it
    is the CUDA ordinal (what ``cuda:<index>`` means to a process started with that environment).
    ``nvml_index`` is NVML's own index of the physical GPU (for a MIG instance: of its parent).
    ``processes`` is None when NVML would not list them (not supported / no permission); an empty
    tuple means NVML listed none. ``mig_enabled`` GPUs are usable by CUDA only through their
    ``mig_instances`` (each a GpuInfo with ``parent_uuid`` set and a ``MIG-`` uuid).
    """

    index: int
    nvml_index: int
    uuid: str
    name: str
    pci_bus_id: str
    memory_total: int
    memory_used: int
    memory_free: int
    utilization_percent: int | None
    processes: tuple[GpuProcess, ...] | None
    mig_enabled: bool = False
    mig_instances: tuple[GpuInfo, ...] = ()
    parent_uuid: str | None = None
