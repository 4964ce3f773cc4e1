"""Test helpers: fake-NVML JSON files (GPU_STAT_FAKE_NVML) and a fake NVML binding module that
mimics nvidia-ml-py's ``pynvml`` or ``py3nvml.py3nvml`` closely enough to run the real adapter."""

from __future__ import annotations

import json
import os
import types
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

GIB = 2**30


def gpu_uuid(i: int) -> str:
    """A distinct, valid-looking GPU UUID; ``GPU-0000000<i>`` is a unique prefix for i < 10."""
    return f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}"


def mig_uuid(i: int, k: int) -> str:
    return f"MIG-{i:04x}{k:04x}-dddd-eeee-ffff-{i * 16 + k:012x}"


def gpu(
    i: int,
    *,
    memory_total: int = 80 * GIB,
    memory_used: int = 0,
    processes: Iterable[tuple[int, int | None]] | None = (),
    name: str = "Fake A100",
    utilization: int | None = 0,
    mig: Sequence[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One GPU entry of the fake-NVML JSON format; ``processes`` as (pid, used_memory) pairs."""
    entry: dict[str, Any] = {
        "uuid": gpu_uuid(i),
        "name": name,
        "memory_total": memory_total,
        "memory_used": memory_used,
        "utilization": utilization,
        "processes": None
        if processes is None
        else [{"pid": pid, "used_memory": used} for pid, used in processes],
    }
    if mig is not None:
        entry["mig"] = list(mig)
    return entry


def mig(i: int, k: int, *, memory_total: int = 10 * GIB, memory_used: int = 0) -> dict[str, Any]:
    return {
        "uuid": mig_uuid(i, k),
        "name": "Fake A100 MIG 1g.10gb",
        "memory_total": memory_total,
        "memory_used": memory_used,
        "processes": [],
    }


def write_fake(path: Path, gpus: Sequence[dict[str, Any]] | dict[str, Any]) -> Path:
    """Write a fake-NVML file atomically (a running server never reads half a file)."""
    data = gpus if isinstance(gpus, dict) else {"gpus": list(gpus)}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, path)
    return path


def write_unavailable(path: Path, reason: str = "simulated: no NVML library") -> Path:
    return write_fake(path, {"nvml": "unavailable", "reason": reason})


def unused_pids(n: int) -> list[int]:
    """PIDs no local process has (stand-ins for host PIDs seen from a container)."""
    live = set(psutil.pids())
    pids: list[int] = []
    pid = 3_999_999
    while len(pids) < n:
        if pid not in live:
            pids.append(pid)
        pid -= 1
    return pids


def unused_pid() -> int:
    return unused_pids(1)[0]


# --- a fake binding module ---------------------------------------------------------------------

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15


@dataclass
class FakeDevice:
    uuid: str
    name: str = "Fake H100"
    bus_id: bytes = b"00000000:17:00.0"
    total: int = 80 * GIB
    used: int = GIB
    utilization: int | None = 12  # None: "Not Supported"
    processes: list[tuple[int, int | None]] | None = field(default_factory=list)  # None: no perm
    mig: list[FakeDevice] | None = None  # None: MIG not supported
    lost: bool = False


class FakeNvmlModule(types.ModuleType):
    """Mimics ``pynvml`` (``flavour="nvidia-ml-py"``) or ``py3nvml.py3nvml`` (``"py3nvml"``):
    same function names, an ``NVMLError`` carrying ``.value``, ctypes-like result objects.
    ``process_calls`` lists the process-query functions the module has, ``missing_in_driver``
    those whose C symbol the "driver" lacks (they raise FunctionNotFound)."""

    def __init__(
        self,
        devices: list[FakeDevice],
        *,
        flavour: str = "nvidia-ml-py",
        strings_as_bytes: bool = False,
        init_error: int | None = None,
        missing_in_driver: tuple[str, ...] = (),
    ) -> None:
        super().__init__("pynvml" if flavour == "nvidia-ml-py" else "py3nvml.py3nvml")
        self.devices = devices
        self.strings_as_bytes = strings_as_bytes
        self.init_error = init_error
        self.missing_in_driver = missing_in_driver
        self.init_count = 0
        self.calls: list[str] = []

        class NVMLError(Exception):
            def __init__(self, value: int) -> None:
                super().__init__(value)
                self.value = value

            def __str__(self) -> str:
                return f"NVML error {self.value}"

        class NVMLLibraryMismatchError(Exception):
            pass

        self.NVMLError = NVMLError
        self.NVMLLibraryMismatchError = NVMLLibraryMismatchError
        self.NVML_DEVICE_MIG_ENABLE = 1
        if flavour == "nvidia-ml-py":
            self.nvmlDeviceGetComputeRunningProcesses_v3 = self._procs_call("_v3")
            self.nvmlDeviceGetComputeRunningProcesses_v2 = self._procs_call("_v2")
            self.nvmlDeviceGetMigMode = self._mig_mode
            self.nvmlDeviceGetMaxMigDeviceCount = self._max_mig
            self.nvmlDeviceGetMigDeviceHandleByIndex = self._mig_handle
        self.nvmlDeviceGetComputeRunningProcesses = self._procs_call("")

    # library
    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.NVMLError(self.init_error)
        self.init_count += 1

    def nvmlShutdown(self) -> None:
        self.init_count -= 1

    def _check(self) -> None:
        if self.init_count <= 0:
            raise self.NVMLError(1)  # Uninitialized

    def _str(self, text: str) -> str | bytes:
        return text.encode() if self.strings_as_bytes else text

    # devices
    def nvmlDeviceGetCount(self) -> int:
        self._check()
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:
        self._check()
        return self.devices[index]

    def nvmlDeviceGetUUID(self, handle: FakeDevice) -> str | bytes:
        if handle.lost:
            raise self.NVMLError(NVML_ERROR_GPU_IS_LOST)
        return self._str(handle.uuid)

    def nvmlDeviceGetName(self, handle: FakeDevice) -> str | bytes:
        return self._str(handle.name)

    def nvmlDeviceGetPciInfo(self, handle: FakeDevice) -> Any:
        return types.SimpleNamespace(busId=handle.bus_id)

    def nvmlDeviceGetMemoryInfo(self, handle: FakeDevice) -> Any:
        return types.SimpleNamespace(total=handle.total, used=handle.used,
                                     free=handle.total - handle.used)

    def nvmlDeviceGetUtilizationRates(self, handle: FakeDevice) -> Any:
        if handle.utilization is None:
            raise self.NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return types.SimpleNamespace(gpu=handle.utilization, memory=0)

    def _procs_call(self, suffix: str) -> Any:
        name = "nvmlDeviceGetComputeRunningProcesses" + suffix

        def call(handle: FakeDevice) -> list[Any]:
            self.calls.append(name)
            if name in self.missing_in_driver:
                if suffix:
                    raise self.NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
                raise self.NVMLLibraryMismatchError("unversioned call, old library")
            if handle.processes is None:
                raise self.NVMLError(NVML_ERROR_NOT_SUPPORTED)
            return [
                types.SimpleNamespace(pid=pid, usedGpuMemory=used)
                for pid, used in handle.processes
            ]

        return call

    # MIG (nvidia-ml-py only)
    def _mig_mode(self, handle: FakeDevice) -> list[int]:
        if handle.mig is None:
            raise self.NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return [1, 1]

    def _max_mig(self, handle: FakeDevice) -> int:
        return 7

    def _mig_handle(self, handle: FakeDevice, index: int) -> FakeDevice:
        assert handle.mig is not None
        if index >= len(handle.mig):
            raise self.NVMLError(NVML_ERROR_NOT_FOUND)
        return handle.mig[index]
