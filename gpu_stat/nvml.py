"""Adapter over the real NVML through a Python binding: NVIDIA's ``nvidia-ml-py`` (module
``pynvml``, preferred) or ``py3nvml`` (fallback). Both wrap the same C library with the same
function names; they differ in what they return (bytes or str), in which versioned process calls
exist, and py3nvml has no MIG calls. Everything binding-specific stays in this module.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import replace
from types import ModuleType
from typing import Any, TypeVar

from gpu_stat.snapshot import GpuInfo, GpuProcess, NvmlUnavailable

log = logging.getLogger(__name__)

#: (backend name, module) in order of preference.
BINDINGS: tuple[tuple[str, str], ...] = (
    ("nvidia-ml-py", "pynvml"),
    ("py3nvml", "py3nvml.py3nvml"),
)

_T = TypeVar("_T")
# NVML's "value not available" for unsigned long long fields.
_NOT_AVAILABLE_ULL = 2**64 - 1
_NVML_ERROR_FUNCTION_NOT_FOUND = 13
_NVML_DEVICE_MIG_ENABLE = 1
# Newest first: v3 and v2 exist only in newer bindings/drivers; a missing C symbol raises
# NVMLError_FunctionNotFound (or pynvml's NVMLLibraryMismatchError for the unversioned name).
_PROCESS_CALLS = (
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetComputeRunningProcesses",
)


def import_binding(preferred: str | None = None) -> tuple[str, ModuleType]:
    """Import an NVML binding: ``preferred`` (a backend name from :data:`BINDINGS`) or the first
    that imports. Importing loads no C library. Raises NvmlUnavailable when none imports."""
    candidates = [b for b in BINDINGS if preferred in (None, b[0])]
    errors = []
    for name, module in candidates:
        try:
            return name, importlib.import_module(module)
        except ImportError as exc:
            errors.append(f"{module}: {exc}")
    raise NvmlUnavailable("no NVML binding importable (" + "; ".join(errors) + ")")


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _memory(value: object) -> int | None:
    if value is None:
        return None
    number = int(value)  # type: ignore[call-overload]
    return None if number == _NOT_AVAILABLE_ULL else number


class NvmlBackend:
    """Snapshots of the physical GPUs through one binding module. Initialises NVML for each
    snapshot and shuts it down afterwards, so nothing NVML-related survives into a fork()."""

    def __init__(self, name: str, module: ModuleType) -> None:
        self.name = name
        self._nvml: Any = module
        classes = [getattr(module, n, None) for n in ("NVMLError", "NVMLLibraryMismatchError")]
        self._errors: tuple[type[BaseException], ...] = tuple(
            c for c in classes if isinstance(c, type) and issubclass(c, BaseException)
        )
        # A library that cannot be loaded surfaces as OSError in some binding versions.
        self._init_errors: tuple[type[BaseException], ...] = (*self._errors, OSError)

    def snapshot(self) -> list[GpuInfo]:
        """All GPUs NVML sees, ``index == nvml_index``. Raises NvmlUnavailable when NVML cannot
        be initialised (no library, no driver) or cannot count devices. A single GPU that fails
        its essential queries (uuid, name, memory; e.g. "GPU is lost") is left out and logged."""
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except self._init_errors as exc:
            raise NvmlUnavailable(f"{self.name}: nvmlInit failed: {exc}") from exc
        try:
            try:
                count = int(nvml.nvmlDeviceGetCount())
            except self._errors as exc:
                raise NvmlUnavailable(f"{self.name}: nvmlDeviceGetCount failed: {exc}") from exc
            gpus = [self._device(i) for i in range(count)]
            return [g for g in gpus if g is not None]
        finally:
            try:
                nvml.nvmlShutdown()
            except self._errors as exc:
                log.debug("nvmlShutdown failed: %s", exc)

    def _optional(self, call: Callable[[], _T], default: _T) -> _T:
        try:
            return call()
        except self._errors:
            return default

    def _device(self, index: int) -> GpuInfo | None:
        nvml = self._nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            pci_bus_id = self._optional(lambda: _text(nvml.nvmlDeviceGetPciInfo(handle).busId), "")
            gpu = self._describe(handle, index, index, pci_bus_id)
        except self._errors as exc:
            log.warning("GPU %d left out of the snapshot: %s", index, exc)
            return None
        mig_enabled, instances = self._mig(handle, index, pci_bus_id)
        return replace(gpu, mig_enabled=mig_enabled, mig_instances=instances)

    def _describe(
        self, handle: object, index: int, nvml_index: int, pci_bus_id: str, parent_uuid: str | None = None
    ) -> GpuInfo:
        """One device handle (a GPU, or a MIG instance of ``parent_uuid``) as a GpuInfo; the
        NVML errors of its uuid, name and memory calls propagate."""
        nvml = self._nvml
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        return GpuInfo(
            index=index,
            nvml_index=nvml_index,
            uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
            name=_text(nvml.nvmlDeviceGetName(handle)),
            pci_bus_id=pci_bus_id,
            memory_total=int(memory.total),
            memory_used=int(memory.used),
            memory_free=int(memory.free),
            utilization_percent=self._utilization(handle),
            processes=self._processes(handle),
            parent_uuid=parent_uuid,
        )

    def _utilization(self, handle: object) -> int | None:
        nvml = self._nvml
        return self._optional(lambda: int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu), None)

    def _processes(self, handle: object) -> tuple[GpuProcess, ...] | None:
        for call_name in _PROCESS_CALLS:
            call = getattr(self._nvml, call_name, None)
            if call is None:
                continue
            try:
                raw = call(handle)
            except self._errors as exc:
                code = getattr(exc, "value", None)
                if code is None or code == _NVML_ERROR_FUNCTION_NOT_FOUND:
                    continue  # the driver lacks this version: try the next older call
                return None  # not supported / no permission: unknown, which is not "none"
            return tuple(GpuProcess(int(p.pid), _memory(p.usedGpuMemory)) for p in raw)
        return None

    def _mig(
        self, handle: object, nvml_index: int, pci_bus_id: str
    ) -> tuple[bool, tuple[GpuInfo, ...]]:
        nvml = self._nvml
        get_mode = getattr(nvml, "nvmlDeviceGetMigMode", None)
        if get_mode is None:  # py3nvml: no MIG calls
            return False, ()
        try:
            current, _pending = get_mode(handle)
        except self._errors:  # "Not Supported" on GPUs without MIG
            return False, ()
        if int(current) != getattr(nvml, "NVML_DEVICE_MIG_ENABLE", _NVML_DEVICE_MIG_ENABLE):
            return False, ()
        parent_uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        count = self._optional(lambda: int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)), 0)
        instances: list[GpuInfo] = []
        for k in range(count):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, k)
                instances.append(self._describe(mig, len(instances), nvml_index, pci_bus_id, parent_uuid))
            except self._errors:
                continue  # "Not Found": no instance at this index
        return True, tuple(instances)
