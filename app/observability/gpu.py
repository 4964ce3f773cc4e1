"""GPU figures of the bound GPU through NVML (``gpu_stat.query_gpus``), never through CUDA:
a small task per worker samples memory and utilisation every ``gpu_metrics_interval_s``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping

import gpu_stat
from app.observability.metrics import ServerMetrics

log = logging.getLogger(__name__)


def bound_gpus(uuid: str) -> list[gpu_stat.GpuInfo]:
    """The GPU (or MIG instance) with this uuid, from a fresh NVML snapshot."""
    found: list[gpu_stat.GpuInfo] = []
    for gpu in gpu_stat.query_gpus():
        found.extend(g for g in (gpu, *gpu.mig_instances) if g.uuid == uuid)
    return found


async def poll_gpus(metrics: ServerMetrics, uuid: str, index: str, interval_s: float) -> None:
    """Until cancelled: every ``interval_s`` seconds record the GPU ``uuid``'s figures with
    label ``gpu=index``; a failing NVML is logged once (and its recovery), never raised."""
    loop = asyncio.get_running_loop()
    failing = False
    while True:
        try:
            # NVML calls take milliseconds: off the event loop and off the inference thread.
            gpus = await loop.run_in_executor(None, bound_gpus, uuid)
            metrics.set_gpus(gpus, index)
        except Exception as exc:  # best effort: GPU figures must never take the worker down
            if not failing:
                expected = isinstance(exc, (gpu_stat.NvmlUnavailable, OSError, ValueError))
                log.warning("GPU metrics unavailable for %s: %s", uuid, exc, exc_info=not expected)
            failing = True
        else:
            if failing:
                log.info("GPU metrics for %s available again", uuid)
            failing = False
        await asyncio.sleep(interval_s)


def gpu_metrics_ctx(
    metrics: ServerMetrics, labels: Mapping[str, str], interval_s: float
) -> Callable[[object], AsyncIterator[None]]:
    """A ``cleanup_ctx`` of the worker's app (which it does not read): publish this worker's
    binding (``labels``: ``gpu_stat.binding.Binding.as_labels`` keys) and, in GPU mode, poll its
    GPU through NVML every ``interval_s`` seconds."""

    async def ctx(_app: object) -> AsyncIterator[None]:
        metrics.set_binding(labels)
        task: asyncio.Task[None] | None = None
        if labels["gpu_uuid"]:
            task = asyncio.get_running_loop().create_task(
                poll_gpus(metrics, labels["gpu_uuid"], labels["gpu"], interval_s), name="gpu-metrics"
            )
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    return ctx
