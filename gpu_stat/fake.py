"""A fake NVML described by a JSON file, for tests and demos without a GPU.

Selected only by the environment variable ``GPU_STAT_FAKE_NVML=/path/to/gpus.json``; the file is
read again on every query, so a test can change the GPUs under a running server (replace the
file atomically: write a temporary file, then ``os.replace``). Format (bytes for memory)::

    {"gpus": [
        {"uuid": "GPU-...", "name": "Fake A100", "memory_total": 85899345920,
         "memory_used": 0, "utilization": 0,
         "processes": [{"pid": 1234, "used_memory": 1073741824}],
         "mig": [{"uuid": "MIG-...", "memory_total": 10737418240, "processes": []}]}
    ]}

A top-level list is the same as ``{"gpus": [...]}``. ``{"nvml": "unavailable"}`` (optionally
with ``"reason"``) makes every query raise NvmlUnavailable, as if no NVML library were installed.
Optional per GPU: ``name`` ("Fake GPU"), ``pci_bus_id`` (derived from the position),
``memory_used`` (0), ``memory_free`` (total - used), ``utilization`` (0; null = not supported),
``processes`` ([]; null = NVML does not list processes), ``mig`` (absent = MIG disabled; a list =
MIG enabled with these instances, which take the same keys except ``mig``). Unknown keys are
errors, so a typo cannot pass silently; a malformed file raises ValueError naming the path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpu_stat.snapshot import GpuInfo, GpuProcess, NvmlUnavailable

_GPU_KEYS = frozenset(
    {"uuid", "name", "pci_bus_id", "memory_total", "memory_used", "memory_free", "utilization",
     "processes", "mig"}
)
_PROCESS_KEYS = frozenset({"pid", "used_memory"})


class FakeBackend:
    """Snapshots read from a fake-NVML JSON file (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.name = f"fake:{path}"

    def snapshot(self) -> list[GpuInfo]:
        """All GPUs of the file, ``index == nvml_index == position``. Raises NvmlUnavailable for
        ``{"nvml": "unavailable"}``, ValueError when the file is missing or malformed."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"fake NVML file {self.path}: {exc}") from exc
        try:
            return _parse(data)
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(f"fake NVML file {self.path}: {exc}") from exc


def _parse(data: Any) -> list[GpuInfo]:
    if isinstance(data, dict):
        if "nvml" in data:
            if data["nvml"] != "unavailable":
                raise ValueError(f'"nvml" must be "unavailable", not {data["nvml"]!r}')
            raise NvmlUnavailable(str(data.get("reason", "fake NVML marked unavailable")))
        _check_keys(data, frozenset({"gpus"}), "top level")
        data = data.get("gpus", [])
    if not isinstance(data, list):
        raise TypeError("expected a list of GPUs or {\"gpus\": [...]}")
    gpus = [_gpu(raw, i) for i, raw in enumerate(data)]
    uuids = [g.uuid for g in gpus] + [m.uuid for g in gpus for m in g.mig_instances]
    duplicates = sorted({u for u in uuids if uuids.count(u) > 1})
    if duplicates:
        raise ValueError(f"duplicate uuids: {duplicates}")
    return gpus


def _check_keys(raw: dict[str, Any], allowed: frozenset[str], where: str) -> None:
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown} (allowed: {sorted(allowed)})")


def _int(raw: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if value is None:
        raise ValueError(f"{where}: {key!r} is required")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}: {key!r} must be a non-negative integer, not {value!r}")
    return value


def _processes(raw: dict[str, Any], where: str) -> tuple[GpuProcess, ...] | None:
    value = raw.get("processes", [])
    if value is None:
        return None
    if not isinstance(value, list):
        raise TypeError(f"{where}: 'processes' must be a list or null")
    result = []
    for k, proc in enumerate(value):
        pwhere = f"{where} process {k}"
        if not isinstance(proc, dict):
            raise TypeError(f"{pwhere}: expected an object")
        _check_keys(proc, _PROCESS_KEYS, pwhere)
        used = proc.get("used_memory")
        result.append(
            GpuProcess(
                pid=_int(proc, "pid", pwhere),
                used_memory=None if used is None else _int(proc, "used_memory", pwhere),
            )
        )
    return tuple(result)


def _memory(raw: dict[str, Any], where: str) -> tuple[int, int, int]:
    total = _int(raw, "memory_total", where)
    used = _int(raw, "memory_used", where, 0)
    free = _int(raw, "memory_free", where, max(0, total - used))
    if used > total or free > total:
        raise ValueError(f"{where}: memory_used/memory_free exceed memory_total")
    return total, used, free


def _utilization(raw: dict[str, Any], where: str) -> int | None:
    if "utilization" in raw and raw["utilization"] is None:
        return None
    value = _int(raw, "utilization", where, 0)
    if value > 100:
        raise ValueError(f"{where}: 'utilization' is a percentage, not {value}")
    return value


def _uuid(raw: dict[str, Any], prefix: str, default: str, where: str) -> str:
    value = raw.get("uuid", default)
    if not isinstance(value, str) or not value.startswith(prefix):
        raise ValueError(f"{where}: 'uuid' must be a string starting with {prefix!r}")
    return value


def _name(raw: dict[str, Any], default: str, where: str) -> str:
    value = raw.get("name", default)
    if not isinstance(value, str):
        raise TypeError(f"{where}: 'name' must be a string")
    return value


def _gpu(raw: Any, index: int) -> GpuInfo:
    where = f"GPU {index}"
    if not isinstance(raw, dict):
        raise TypeError(f"{where}: expected an object")
    _check_keys(raw, _GPU_KEYS, where)
    uuid = _uuid(raw, "GPU-", f"GPU-00000000-0000-0000-0000-{index:012d}", where)
    name = _name(raw, "Fake GPU", where)
    pci_bus_id = raw.get("pci_bus_id", f"00000000:{index + 1:02X}:00.0")
    if not isinstance(pci_bus_id, str):
        raise TypeError(f"{where}: 'pci_bus_id' must be a string")
    total, used, free = _memory(raw, where)
    mig_raw = raw.get("mig")
    if mig_raw is not None and not isinstance(mig_raw, list):
        raise TypeError(f"{where}: 'mig' must be a list of MIG instances")
    instances = []
    for k, mig in enumerate(mig_raw or []):
        mwhere = f"{where} MIG {k}"
        if not isinstance(mig, dict):
            raise TypeError(f"{mwhere}: expected an object")
        _check_keys(mig, _GPU_KEYS - {"mig", "pci_bus_id"}, mwhere)
        mtotal, mused, mfree = _memory(mig, mwhere)
        instances.append(
            GpuInfo(
                index=k,
                nvml_index=index,
                uuid=_uuid(mig, "MIG-", f"MIG-00000000-0000-0000-{index:04d}-{k:012d}", mwhere),
                name=_name(mig, f"{name} MIG", mwhere),
                pci_bus_id=pci_bus_id,
                memory_total=mtotal,
                memory_used=mused,
                memory_free=mfree,
                utilization_percent=None if "utilization" not in mig else _utilization(mig, mwhere),
                processes=_processes(mig, mwhere),
                parent_uuid=uuid,
            )
        )
    return GpuInfo(
        index=index,
        nvml_index=index,
        uuid=uuid,
        name=name,
        pci_bus_id=pci_bus_id,
        memory_total=total,
        memory_used=used,
        memory_free=free,
        utilization_percent=_utilization(raw, where),
        processes=_processes(raw, where),
        mig_enabled=mig_raw is not None,
        mig_instances=tuple(instances),
    )
