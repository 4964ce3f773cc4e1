"""Model load, warmup and unload, run from the app's ``cleanup_ctx``.

Startup creates the worker's single inference thread and starts loading the
repository's models in the background, so the worker answers health probes
(readiness 503) and keeps notifying gunicorn while a slow model loads; each
model loads and warms up on the inference thread, and readiness turns 200 only
when every model is warm. Requests that arrive before then get 503 with
Retry-After. Cleanup stops the batchers and frees the models.

A model that fails to load leaves readiness at 503 with the error in its body;
under gunicorn (``exit_on_load_failure``) the worker then exits with status 1,
which gunicorn logs and answers with a new worker, without halting the others.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import torch
from aiohttp import web

from app.batcher import BatchObserver, DynamicBatcher
from app.errors import ModelLoadError
from app.metrics import METRICS
from app.models.runner import ModelRunner, describe
from app.repository import scan
from app.state import REGISTRY, SETTINGS, WORKER_INFO, ModelEntry, ModelRegistry
from gpu_stat.binding import current_binding, verify_binding

log = logging.getLogger(__name__)

EXECUTOR = web.AppKey("inference_executor", ThreadPoolExecutor)
LOAD_TASK = web.AppKey("model_load_task", asyncio.Task)


def resolve_device(setting: str) -> torch.device:
    """``auto`` -> ``cuda:0`` when CUDA is available (after binding, the bound GPU), else cpu.

    Raises:
        ModelLoadError: a CUDA device was asked for but torch sees no CUDA.
    """
    if setting == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    device = torch.device(setting)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {setting!r} requested but torch has no CUDA device")
    return device


async def _load_all(app: web.Application, device: torch.device) -> None:
    registry = app[REGISTRY]
    executor = app[EXECUTOR]
    loop = asyncio.get_running_loop()
    metrics = app.get(METRICS)
    models = []
    for entry in registry.entries():
        runner = ModelRunner(entry.config)
        await loop.run_in_executor(executor, runner.load, device)
        await loop.run_in_executor(executor, runner.warmup)
        observer: BatchObserver | None = None
        if metrics is not None:
            config = entry.config
            metrics.model_ready(config.name, config.version, runner.load_seconds, runner.warmup_seconds)
            observer = metrics.observer(config.name, config.version)
        _start_batching(entry, runner, executor, observer)
        figures = describe(runner)
        models.append(figures)
        log.info("model ready %s", figures, extra={"event": "model_ready", **figures})
    # Now that the models hold their CUDA context, check through NVML that it is on the
    # GPU this worker claimed (logs the outcome; None where PIDs are not visible).
    current = current_binding()
    if current is not None and current.device != "cpu":
        await loop.run_in_executor(None, verify_binding, current)
    info = app[WORKER_INFO]
    binding = info.get("binding", {"device": info["device"]})
    log.info(
        "worker %d ready: binding %s, models %s",
        info["pid"], binding, models,
        extra={"event": "worker_ready", "binding": binding, "models": models},
    )  # fmt: skip


def _start_batching(
    entry: ModelEntry, runner: ModelRunner, executor: ThreadPoolExecutor, observer: BatchObserver | None
) -> None:
    config = entry.config
    entry.runner = runner
    batcher = DynamicBatcher(
        config.name,
        runner.run_batch,
        executor,
        max_batch_size=config.max_batch_size,
        max_queue_delay_ms=config.max_queue_delay_ms,
        queue_capacity=config.queue_capacity,
        observer=observer,
    )
    batcher.start()
    entry.batcher = batcher
    entry.settled.set()


async def _load_in_background(app: web.Application, device: torch.device) -> None:
    try:
        await _load_all(app, device)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        message = str(exc) if isinstance(exc, ModelLoadError) else repr(exc)
        app[REGISTRY].fail(message)
        log.error("model load failed, worker cannot become ready: %s", message, exc_info=exc)
        if app[SETTINGS].exit_on_load_failure:
            # SIGABRT makes gunicorn's aiohttp worker exit with status 1: the
            # arbiter replaces this worker and keeps the healthy ones (3 and 4 halt it).
            os.kill(os.getpid(), signal.SIGABRT)


async def models_ctx(app: web.Application) -> AsyncIterator[None]:
    """``cleanup_ctx``: inference thread + background model loading; unload on cleanup."""
    settings = app[SETTINGS]
    registry = ModelRegistry()
    for config in scan(settings.model_repository, settings.model_names):
        registry.add(config)
    app[REGISTRY] = registry
    device = resolve_device(settings.device)
    torch.set_num_threads(settings.effective_torch_threads(settings.workers))
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference")
    app[EXECUTOR] = executor
    task = asyncio.get_running_loop().create_task(_load_in_background(app, device))
    app[LOAD_TASK] = task
    try:
        yield
    finally:
        registry.draining = True
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for entry in registry.entries():
            if entry.batcher is not None:
                await entry.batcher.stop()
                entry.batcher = None
            if entry.runner is not None:
                await asyncio.get_running_loop().run_in_executor(executor, entry.runner.close)
                entry.runner = None
        executor.shutdown(wait=True)


async def on_shutdown(app: web.Application) -> None:
    """Turn readiness 503 as soon as the worker starts to stop (drain)."""
    app[REGISTRY].draining = True
