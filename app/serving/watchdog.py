"""The hung-inference watchdog: a task that wakes a few times per ``hung_inference_s`` and looks
at the batch each serving unit is running (the hot path only appends a record per batch).

A batch running longer than the limit is logged and counted (``scoring_hung_batches_total``);
liveness turns 503 and the worker asks its supervisor (the gunicorn worker) to drain and exit,
so that it is replaced. Inference threads are daemons (``app.serving.executor.InferenceThread``),
so a stuck call does not keep the process alive; a call stuck while holding the GIL freezes the
event loop too, and then gunicorn's worker timeout kills the process.
"""

from __future__ import annotations

import asyncio
import logging

from app.serving.core import ServingCore
from app.serving.executor import RunningBatch
from app.serving.registry import ModelVersion

log = logging.getLogger(__name__)


async def watch_inference(core: ServingCore, hung_s: float) -> None:
    """Report batches of ``core``'s units that run longer than ``hung_s`` seconds, once each
    (until cancelled)."""
    registry = core.registry
    loop = asyncio.get_running_loop()
    interval = min(max(hung_s / 4, 0.05), 5.0)
    reported: set[tuple[str, str, float]] = set()
    health = core.health
    while True:
        await asyncio.sleep(interval)
        health.watchdog_passes += 1
        now = loop.time()
        for model in registry.entries():
            batch = model.unit.running_batch if model.unit is not None else None
            if batch is None or now - batch.started < hung_s:
                continue
            key = (model.config.name, model.config.version, batch.started)
            if key not in reported:
                reported.add(key)
                _report(core, model, batch, now - batch.started, hung_s)


def _report(
    core: ServingCore, model: ModelVersion, batch: RunningBatch, running_s: float, hung_s: float
) -> None:
    config = model.config
    message = (
        f"model {config.name} v{config.version}: a batch of {batch.items} items has been on the "
        f"inference thread for {running_s:.1f} s (SCORING_HUNG_INFERENCE_S={hung_s:g})"
    )
    log.error(
        "%s; requests %s; liveness 503, the worker restarts itself",
        message, ", ".join(batch.request_ids),
        extra={"event": "hung_inference", "model": config.name, "version": config.version,
               "items": batch.items, "running_s": round(running_s, 3)},
    )  # fmt: skip
    if core.metrics is not None:
        core.metrics.hung_batches.labels(config.name, config.version).inc()
    health = core.health
    first = health.hung is None
    health.hung = message
    core.registry.begin_drain("hung inference")
    if first and not core.supervisor.request_stop("hung inference"):
        log.warning("not under gunicorn: nothing restarts this process; liveness stays 503")
