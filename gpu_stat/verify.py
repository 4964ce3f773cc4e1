"""After the model is loaded: check through NVML that this worker's CUDA context is on the GPU
it claimed (``gpu_stat.binding``). Never imports torch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Sequence

from gpu_stat.binding import Binding
from gpu_stat.family import family
from gpu_stat.query import backend_name, query_gpus
from gpu_stat.snapshot import GpuInfo, NvmlUnavailable
from gpu_stat.visible import ENV_VISIBLE

__all__ = ["check_binding", "verify_binding"]

log = logging.getLogger(__name__)


def verify_binding(binding: Binding) -> bool | None:
    """After the model is loaded: is this process's CUDA context on the claimed GPU?

    True when NVML lists our pid on it; False when it does not although PIDs are comparable (it
    lists a sibling of ours somewhere, or CUDA_VISIBLE_DEVICES no longer names the GPU, or the GPU
    is gone); None when it cannot tell: CPU binding, fake backend, NVML unavailable, processes not
    listed, or PIDs from another namespace (containers). Logs the result; never raises."""
    if binding.gpu_uuid is None:
        return None
    if backend_name().startswith("fake:"):
        log.info("gpu binding: not verified (fake NVML backend)")
        return None
    if os.environ.get(ENV_VISIBLE) != binding.gpu_uuid:
        log.error(
            "gpu binding: %s=%r no longer names the bound GPU %s",
            ENV_VISIBLE,
            os.environ.get(ENV_VISIBLE),
            binding.gpu_uuid,
        )
        return False
    try:
        gpus = query_gpus(respect_visible_devices=False)
    except (NvmlUnavailable, ValueError) as exc:
        log.info("gpu binding: not verified (%s)", exc)
        return None
    return check_binding(binding, gpus, os.getpid(), family().ours)


def check_binding(binding: Binding, gpus: Sequence[GpuInfo], me: int, ours: Collection[int]) -> bool | None:
    units = {u.uuid: u for g in gpus for u in (g, *g.mig_instances)}
    unit = units.get(binding.gpu_uuid or "")
    if unit is None:
        log.error("gpu binding: bound GPU %s is no longer reported by NVML", binding.gpu_uuid)
        return False
    if unit.processes is None:
        log.info("gpu binding: not verified (NVML does not list processes on %s)", unit.uuid)
        return None
    if me in {p.pid for p in unit.processes}:
        log.info("gpu binding verified: pid %d has a context on %s", me, unit.uuid)
        return True
    listed = {p.pid for u in units.values() for p in u.processes or ()}
    if listed & (set(ours) - {me}):
        log.warning(
            "gpu binding NOT verified: pid %d has no context on %s although NVML shows PIDs of "
            "this server; did something initialise CUDA before binding?",
            me,
            unit.uuid,
        )
        return False
    log.info("gpu binding: not verified (NVML PIDs are not this namespace's) on %s", unit.uuid)
    return None
