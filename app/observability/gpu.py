"""This worker's binding and the figures of its bound GPU through NVML (``gpu_stat.query_gpus``),
never through CUDA: a small task per worker samples memory and utilisation every
``gpu_metrics_interval_s`` into the gauges of :class:`GpuMetrics`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Gauge

import gpu_stat
from app.observability.metrics import ServerMetrics

log = logging.getLogger(__name__)


class GpuMetrics:
    """The binding and GPU gauges of one worker process (multiprocess mode: ``registry`` None)
    or one app (in-process: its metrics' registry), made when its ``cleanup_ctx`` starts."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        r = registry
        self.binding = Gauge(
            "scoring_worker_binding_info", "1 per live worker, labelled with its GPU binding.",
            ["pid", "device", "gpu", "gpu_uuid", "slot"], multiprocess_mode="liveall", registry=r,
        )  # fmt: skip
        gpu = ["gpu", "gpu_uuid"]
        self.memory_used = Gauge(
            "scoring_gpu_memory_used_bytes", "Memory in use on a bound GPU (all processes), per NVML.",
            gpu, multiprocess_mode="livemostrecent", registry=r,
        )  # fmt: skip
        self.memory_total = Gauge(
            "scoring_gpu_memory_total_bytes", "Memory of a bound GPU, per NVML.",
            gpu, multiprocess_mode="livemostrecent", registry=r,
        )  # fmt: skip
        self.utilization = Gauge(
            "scoring_gpu_utilization_percent",
            "Percent of the last sample period a kernel ran on a bound GPU, per NVML.",
            gpu, multiprocess_mode="livemostrecent", registry=r,
        )  # fmt: skip

    def set_binding(self, labels: Mapping[str, str]) -> None:
        """Publish this worker's binding (``gpu_stat.binding.Binding.as_labels()`` keys)."""
        self.binding.labels(
            str(os.getpid()),
            labels.get("device", ""),
            labels.get("gpu", ""),
            labels.get("gpu_uuid", ""),
            labels.get("slot", ""),
        ).set(1)

    def set_gpus(self, gpus: Sequence[gpu_stat.GpuInfo], index: str) -> None:
        """Record memory and utilisation of the bound GPU(s), labelled ``gpu=index`` (the
        binding's index, in the master's view: the worker's own view numbers its GPU 0)."""
        for gpu in gpus:
            labels = (index, gpu.uuid)
            self.memory_used.labels(*labels).set(gpu.memory_used)
            self.memory_total.labels(*labels).set(gpu.memory_total)
            if gpu.utilization_percent is not None:
                self.utilization.labels(*labels).set(gpu.utilization_percent)


def bound_gpus(uuid: str) -> list[gpu_stat.GpuInfo]:
    """The GPU (or MIG instance) with this uuid, from a fresh NVML snapshot."""
    found: list[gpu_stat.GpuInfo] = []
    for gpu in gpu_stat.query_gpus():
        found.extend(g for g in (gpu, *gpu.mig_instances) if g.uuid == uuid)
    return found


async def poll_gpus(metrics: GpuMetrics, uuid: str, index: str, interval_s: float) -> None:
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
        gauges = GpuMetrics(metrics.registry)
        gauges.set_binding(labels)
        task: asyncio.Task[None] | None = None
        if labels["gpu_uuid"]:
            task = asyncio.get_running_loop().create_task(
                poll_gpus(gauges, labels["gpu_uuid"], labels["gpu"], interval_s), name="gpu-metrics"
            )
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    return ctx
