"""Which NVML backend answers, and the one query everything else is built on.

Environment variables (read on every call):

- ``GPU_STAT_FAKE_NVML=/path/gpus.json``: use the fake backend (gpu_stat.fake). Nothing else
  selects it; its name is ``fake:<path>`` and the first query in a process logs a warning.
- ``GPU_STAT_DISABLE_NVML=1`` (or true/yes/on): behave as if no NVML library were installed
  (every query raises NvmlUnavailable). Takes precedence over the fake.
- ``GPU_STAT_NVML_BACKEND=auto|nvidia-ml-py|py3nvml``: force one real binding (default auto:
  nvidia-ml-py, then py3nvml).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Protocol

from gpu_stat.fake import FakeBackend
from gpu_stat.nvml import BINDINGS, NvmlBackend, import_binding
from gpu_stat.snapshot import GpuInfo, NvmlUnavailable
from gpu_stat.visible import ENV_VISIBLE, apply_visible_devices

log = logging.getLogger(__name__)

ENV_FAKE = "GPU_STAT_FAKE_NVML"
ENV_DISABLE = "GPU_STAT_DISABLE_NVML"
ENV_BACKEND = "GPU_STAT_NVML_BACKEND"

_TRUE = frozenset({"1", "true", "yes", "on"})
_warned_fake: set[str] = set()


class Backend(Protocol):
    name: str

    def snapshot(self) -> list[GpuInfo]: ...


def _disabled() -> bool:
    return os.environ.get(ENV_DISABLE, "").strip().lower() in _TRUE


def _preferred_binding() -> str | None:
    value = os.environ.get(ENV_BACKEND, "auto").strip().lower() or "auto"
    if value == "auto":
        return None
    if value == "pynvml":
        return "nvidia-ml-py"
    names = [name for name, _ in BINDINGS]
    if value not in names:
        raise ValueError(f"{ENV_BACKEND}={value!r}: expected auto or one of {names}")
    return value


def select_backend() -> Backend:
    """The backend the environment selects. Raises NvmlUnavailable when NVML is disabled or no
    binding imports, ValueError for an invalid GPU_STAT_NVML_BACKEND."""
    if _disabled():
        raise NvmlUnavailable(f"disabled by {ENV_DISABLE}={os.environ[ENV_DISABLE]}")
    fake = os.environ.get(ENV_FAKE)
    if fake:
        if fake not in _warned_fake:
            _warned_fake.add(fake)
            log.warning("using the FAKE NVML backend from %s=%s", ENV_FAKE, fake)
        return FakeBackend(Path(fake))
    return NvmlBackend(*import_binding(_preferred_binding()))


def backend_name() -> str:
    """``"nvidia-ml-py"``, ``"py3nvml"`` or ``"fake:<path>"``: the backend the next query uses;
    ``"disabled"`` under GPU_STAT_DISABLE_NVML, ``"none"`` when no binding imports. Loads no
    library and never raises NvmlUnavailable (a driver may still be missing)."""
    try:
        return select_backend().name
    except NvmlUnavailable:
        return "disabled" if _disabled() else "none"


def query_gpus(*, respect_visible_devices: bool = True) -> list[GpuInfo]:
    """A fresh snapshot of the GPUs (memory in bytes).

    With ``respect_visible_devices`` (default) and CUDA_VISIBLE_DEVICES set, only the devices it
    selects, in its order, ``index`` renumbered as CUDA ordinals (see gpu_stat.visible); the
    empty string gives ``[]``. Otherwise every GPU, ``index == nvml_index``. MIG instances are
    listed under their GPU, or at top level when CUDA_VISIBLE_DEVICES names them.

    Raises NvmlUnavailable when there is no NVML (no binding, library or driver; disabled; fake
    marked unavailable), ValueError for a malformed fake file. Each call initialises and shuts
    down NVML (milliseconds), so callers that poll should cache.
    """
    gpus = select_backend().snapshot()
    if respect_visible_devices:
        return apply_visible_devices(gpus, os.environ.get(ENV_VISIBLE))
    return gpus
