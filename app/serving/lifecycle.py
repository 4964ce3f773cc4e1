"""Model load, warmup and unload, run from the app's ``cleanup_ctx``.

Startup creates one inference thread per model (so one model's long batch never holds
another model's requests; docs/reliability.md "Isolation between models") and starts
loading the repository's models in the background, so the worker answers health probes
(readiness 503) and keeps notifying gunicorn while a slow model loads; each
model loads and warms up on its inference thread, and its measured warmup seeds the
batcher's service rate (admission by time judges the very first requests); readiness turns 200 only
when every model is warm. Requests that arrive before then wait for it, within
their deadline. When another worker of the server is serving (a replacement
after a crash, a recycle, a HUP reload), startup instead waits for the models
before the worker listens, so no request waits for a load while a warm worker
could answer it. Cleanup stops the batchers and frees the models.

A model that fails to load (or whose ``model.toml`` cannot be read) is *unavailable*: its
requests get 503 with the reason, readiness and the repository index name it with its
reason (no absolute paths), and the other models serve (Triton's behaviour). The worker does
not exit (no restart loop): it retries the load after 2 s, then twice as long each time, up
to ``SCORING_MODEL_LOAD_RETRY_MAX_S`` apart, so a cause that goes away (device memory held by
another process, a weights file still being copied) heals by itself.

Draining (:func:`begin_drain`, called by the gunicorn worker at SIGTERM and by
``on_shutdown`` otherwise) turns readiness 503 at once; requests that still reach the
worker are served, each answered with ``Connection: close`` (``app.http.connections``).

The hung-inference watchdog is a task that wakes a few times per
``hung_inference_s`` and looks at each batcher's running batch (the hot path only
stores a tuple per batch), on whichever inference thread it runs. A batch past the
limit is logged and counted (``scoring_hung_batches_total``); liveness turns 503 and
the worker asks its process to stop (drain, exit, be replaced). Inference threads are
daemons (:class:`app.serving.executor.InferenceThread`), so a stuck call does not keep
the process alive; a call stuck while holding the GIL freezes the event loop too, and then
gunicorn's worker timeout kills the process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from functools import partial

import torch
from aiohttp import web

from app.binding import BINDING
from app.errors import ModelLoadError
from app.models.repository import scan, scrub_paths
from app.models.runner import ModelRunner, describe, synthetic_inputs
from app.observability.metrics import METRICS
from app.serving.batcher import DynamicBatcher, Threads
from app.serving.executor import InferenceThread
from app.serving.observer import BatchObserver, RunningBatch
from app.serving.state import LIFECYCLE, REGISTRY, SETTINGS, ModelEntry
from app.serving.stats import FanOut
from gpu_stat.verify import verify_binding

log = logging.getLogger(__name__)

#: One inference thread per model name (its versions share it), created at startup.
EXECUTORS = web.AppKey("inference_executors", dict[str, InferenceThread])
#: Per model name, its prepare pool and finish thread (staged pipeline, item pricing).
STAGE_POOLS = web.AppKey("stage_pools", dict[str, tuple[InferenceThread, InferenceThread]])
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


def _executor(app: web.Application, model: str) -> InferenceThread:
    executors = app[EXECUTORS]
    if model not in executors:
        threads = app[SETTINGS].effective_torch_threads(app[SETTINGS].workers)
        # torch.set_num_threads sets OpenMP's thread count for the calling thread only (an
        # OpenMP ICV is per thread): set it on the inference thread too, or MKL's sgemm there
        # forks an OpenMP team of one thread per core in every worker, whose barrier
        # spin-waits burned more CPU than the model itself (docs/benchmarks.md).
        executors[model] = InferenceThread(
            name=f"inference:{model}", initializer=partial(torch.set_num_threads, threads)
        )
    return executors[model]


def _threads(
    app: web.Application, runner: ModelRunner, inference: InferenceThread, pipelined: bool
) -> Threads:
    """The model's threads: its inference thread and, when it prices its items or runs the
    staged pipeline, a prepare pool (``prepare_threads``: 1 on the CPU, else 2) and a finish
    thread, torch-threaded like the inference thread. Made once per model name (its versions
    share them) and shut down with the inference threads."""
    config = runner.config
    if not pipelined and not runner.prices_items:
        return Threads(inference)
    pools = app[STAGE_POOLS]
    if config.name not in pools:
        torch_threads = app[SETTINGS].effective_torch_threads(app[SETTINGS].workers)
        count = config.prepare_threads or (1 if runner.device.type == "cpu" else 2)
        init = partial(torch.set_num_threads, torch_threads)
        pools[config.name] = (
            InferenceThread(name=f"prepare:{config.name}", initializer=init, threads=count),
            InferenceThread(name=f"finish:{config.name}", initializer=init),
        )
    prepare, finish = pools[config.name]
    return Threads(inference, prepare, finish if pipelined else None)


def pipelined(config_value: str, device: torch.device) -> bool:
    """Whether a model runs the staged pipeline: ``pipeline`` "on"/"off", or "auto" = on a CUDA
    device only (on the CPU the three stages would share the same cores and only add hand-offs)."""
    if config_value == "auto":
        return device.type == "cuda"
    return config_value == "on"


def _timed_batch(runner: ModelRunner) -> tuple[float, float]:
    """One batch of the largest warmup size, timed (after warmup, so no first-call costs):
    (its cost: items, or padded tokens for a priced model; seconds), the seed of the batcher's
    service rate."""
    items = max(runner.config.warmup_batch_sizes)
    inputs = synthetic_inputs(runner.config.inputs, items)
    costs = runner.item_costs(inputs)
    start = time.perf_counter()
    runner.run_batch(inputs)
    seconds = time.perf_counter() - start
    return (runner.batch_cost(costs) if costs is not None else float(items)), seconds


#: The first wait before a failed model load is retried, seconds (then doubled each time).
FIRST_RETRY_S = 2.0
#: The retry tasks of models that failed to load.
RETRIES = web.AppKey("model_load_retries", set[asyncio.Task[None]])


async def _load_all(app: web.Application, device: torch.device) -> None:
    registry = app[REGISTRY]
    for name, reason in registry.unavailable.items():
        log.error("model %s unavailable: %s", name, reason, extra={"event": "model_unavailable"})
    loaded = False
    for entry in registry.entries():
        loaded = await _try_load(app, entry, device) or loaded
    # Now that the models hold their CUDA context, check through NVML that it is on the
    # GPU this worker claimed (logs the outcome; None where PIDs are not visible).
    worker = app[BINDING]
    if loaded and worker.binding.gpu_uuid is not None:
        await asyncio.get_running_loop().run_in_executor(None, verify_binding, worker.binding)
    binding = worker.describe()["binding"]
    models = [describe(e.runner) for e in registry.entries() if e.runner is not None]
    log.info(
        "worker %d %s: binding %s, models %s%s",
        worker.pid, "ready" if registry.ready else "not ready", binding, models,
        f", unavailable {sorted(registry.failures())}" if registry.failures() else "",
        extra={"event": "worker_ready", "binding": binding, "models": models},
    )  # fmt: skip


async def _try_load(app: web.Application, entry: ModelEntry, device: torch.device) -> bool:
    """Load, warm up and start batching one model; on failure mark it unavailable (its reason,
    scrubbed of absolute paths), wake its waiters and schedule a retry. True when it serves."""
    try:
        await _load(app, entry, device)
        return True
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        config = entry.config
        message = str(exc) if isinstance(exc, ModelLoadError) else f"{type(exc).__name__}: {exc}"
        entry.error = scrub_paths(message, app[SETTINGS].model_repository)
        entry.settled.set()  # requests waiting for it get 503 with the reason now
        retry_max_s = app[SETTINGS].model_load_retry_max_s
        log.error(
            "model %s v%s unavailable, the other models serve: %s%s",
            config.name, config.version, message,
            "" if retry_max_s else " (not retried: SCORING_MODEL_LOAD_RETRY_MAX_S=0)",
            exc_info=None if isinstance(exc, ModelLoadError) else exc,
            extra={"event": "model_unavailable", "model": config.name, "version": config.version},
        )  # fmt: skip
        if retry_max_s and not any(t.get_name() == _retry_name(entry) for t in app[RETRIES]):
            task = asyncio.get_running_loop().create_task(
                _retry(app, entry, device, retry_max_s), name=_retry_name(entry)
            )
            app[RETRIES].add(task)
            task.add_done_callback(app[RETRIES].discard)
        return False


def _retry_name(entry: ModelEntry) -> str:
    return f"retry-load:{entry.config.name}/{entry.config.version}"


async def _retry(app: web.Application, entry: ModelEntry, device: torch.device, max_s: float) -> None:
    """Retry a failed load after FIRST_RETRY_S, then twice as long each time, up to ``max_s``."""
    wait_s = min(FIRST_RETRY_S, max_s)
    while entry.error is not None and not app[REGISTRY].draining:
        await asyncio.sleep(wait_s)
        try:
            await _load(app, entry, device)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            message = str(exc) if isinstance(exc, ModelLoadError) else f"{type(exc).__name__}: {exc}"
            entry.error = scrub_paths(message, app[SETTINGS].model_repository)
            wait_s = min(wait_s * 2, max_s)
            log.warning(
                "model %s v%s still unavailable (next try in %.0f s): %s",
                entry.config.name, entry.config.version, wait_s, message,
            )  # fmt: skip
            continue
        log.info("model %s v%s loaded on retry", entry.config.name, entry.config.version)


async def _load(app: web.Application, entry: ModelEntry, device: torch.device) -> None:
    """Load, warm up and time one model on its inference thread, then start its batcher.

    Raises:
        Exception: whatever the load or warmup raised (the half-loaded model is freed first).
    """
    settings = app[SETTINGS]
    loop = asyncio.get_running_loop()
    metrics = app.get(METRICS)
    executor = _executor(app, entry.config.name)
    runner = ModelRunner(entry.config)
    try:
        await loop.run_in_executor(executor, runner.load, device)
        await loop.run_in_executor(executor, runner.warmup)
        seed = await loop.run_in_executor(executor, _timed_batch, runner)
    except BaseException:
        await loop.run_in_executor(executor, runner.close)
        raise
    observer: BatchObserver = entry.stats
    if metrics is not None:
        config = entry.config
        metrics.model_ready(config.name, config.version, runner.load_seconds, runner.warmup_seconds)
        observer = FanOut(entry.stats, metrics.observer(config.name, config.version))
    entry.error = None
    batcher = _start_batching(app, entry, runner, executor, observer, settings.max_batch_bytes)
    batcher.rate.observe(*seed)
    figures = describe(runner)
    log.info("model ready %s", figures, extra={"event": "model_ready", **figures})


def _start_batching(
    app: web.Application,
    entry: ModelEntry,
    runner: ModelRunner,
    executor: InferenceThread,
    observer: BatchObserver | None,
    max_batch_bytes: int,
) -> DynamicBatcher:
    config = entry.config
    entry.runner = runner
    staged = pipelined(config.pipeline, runner.device)
    batcher = DynamicBatcher(
        config.name,
        runner,
        _threads(app, runner, executor, staged),
        max_batch_size=config.max_batch_size,
        max_queue_delay_ms=config.max_queue_delay_ms,
        gather_turns=config.gather_turns,
        queue_capacity=config.queue_capacity,
        max_batch_bytes=config.max_batch_bytes or max_batch_bytes,
        max_batch_tokens=config.max_batch_tokens,
        item_costs=runner.item_costs if runner.prices_items else None,
        batch_cost=runner.batch_cost,
        pipelined=staged,
        observer=observer,
    )
    batcher.start()
    entry.batcher = batcher
    entry.settled.set()
    return batcher


async def models_ctx(app: web.Application) -> AsyncIterator[None]:
    """``cleanup_ctx``: inference threads, background model loading, hung-inference watchdog;
    unload on cleanup (skipped when an inference thread is stuck or still loading)."""
    settings = app[SETTINGS]
    registry = app[REGISTRY]
    found = scan(settings.model_repository, settings.model_names)
    for config in found.configs:
        registry.add(config)
    registry.unavailable.update({u.name: u.reason for u in found.unavailable})
    registry.strict = settings.strict_readiness
    device = resolve_device(settings.device)
    torch.set_num_threads(settings.effective_torch_threads(settings.workers))
    app[EXECUTORS] = {}
    app[STAGE_POOLS] = {}
    app[RETRIES] = set()
    loop = asyncio.get_running_loop()
    task = loop.create_task(_load_all(app, device))
    app[LOAD_TASK] = task
    watchdog = None
    if settings.hung_inference_s > 0:
        watchdog = loop.create_task(_watch_inference(app, settings.hung_inference_s), name="watchdog")
    try:
        await _defer_listening(app, task)
        yield
    finally:
        registry.draining = True
        loaded = task.done() and not task.cancelled() and not any(
            e.error is None and not e.ready for e in registry.entries()
        )
        pending = [t for t in (task, watchdog, *app[RETRIES]) if t is not None]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await _release(app, loaded)


async def _defer_listening(app: web.Application, load: asyncio.Task[None]) -> None:
    """While another worker serves, keep this one off the listener until it is ready (every
    model that can load is warm), or it is asked to stop. A replacement whose models cannot load
    so stays off the listener, retrying, while its siblings serve. The gunicorn worker's boot
    heartbeat keeps gunicorn informed meanwhile."""
    defer = app[LIFECYCLE].defer_listening
    if defer is None:
        return
    loop = asyncio.get_running_loop()
    registry = app[REGISTRY]
    waited = False
    while not registry.ready and not registry.draining and await loop.run_in_executor(None, defer):
        waited = True
        await asyncio.sleep(0.1)
    if waited:
        log.info("worker %d: models warm, listening (another worker served meanwhile)", os.getpid())


async def _release(app: web.Application, loaded: bool) -> None:
    """Stop the batchers; unload the models on their inference threads unless one is stuck."""
    registry = app[REGISTRY]
    executors = app[EXECUTORS]
    for entry in registry.entries():
        if entry.batcher is not None:
            await entry.batcher.stop()
            entry.batcher = None
    hung = app[LIFECYCLE].hung
    if hung is not None or not loaded:
        # Anything queued now would wait behind the stuck (or still loading) call; the
        # daemon threads die with the process, and so does the device memory they hold.
        why = f"an inference thread is stuck ({hung})" if hung else "models were still loading"
        log.warning("exiting without unloading models: %s", why)
        for executor in (*executors.values(), *(t for pools in app[STAGE_POOLS].values() for t in pools)):
            executor.shutdown(wait=False, cancel_futures=True)
        return
    loop = asyncio.get_running_loop()
    for entry in registry.entries():
        if entry.runner is not None:
            await loop.run_in_executor(executors[entry.config.name], entry.runner.close)
            entry.runner = None
    for executor in (*executors.values(), *(t for pools in app[STAGE_POOLS].values() for t in pools)):
        await loop.run_in_executor(None, executor.shutdown)


def begin_drain(app: web.Application, reason: str) -> None:
    """Start draining: readiness 503 from now on; every response closes its connection.

    Requests that still reach the worker are served. Idempotent.
    """
    registry = app[REGISTRY]
    if registry.draining:
        return
    registry.draining = True
    log.info(
        "worker %d draining (%s): readiness 503, responses close their connections",
        os.getpid(), reason, extra={"event": "drain", "reason": reason},
    )  # fmt: skip


async def on_shutdown(app: web.Application) -> None:
    """Turn readiness 503 when the app shuts down (under gunicorn the worker did it earlier,
    at SIGTERM, before its listener closed)."""
    begin_drain(app, "shutdown")


async def _watch_inference(app: web.Application, hung_s: float) -> None:
    """Report batches that run longer than ``hung_s`` seconds, once each."""
    registry = app[REGISTRY]
    loop = asyncio.get_running_loop()
    interval = min(max(hung_s / 4, 0.05), 5.0)
    reported: set[tuple[str, str, float]] = set()
    lifecycle = app[LIFECYCLE]
    while True:
        await asyncio.sleep(interval)
        lifecycle.watchdog_passes += 1
        now = loop.time()
        for entry in registry.entries():
            batch = entry.batcher.running_batch if entry.batcher is not None else None
            if batch is None or now - batch.started < hung_s:
                continue
            key = (entry.config.name, entry.config.version, batch.started)
            if key not in reported:
                reported.add(key)
                _report_hung(app, entry, batch, now - batch.started, hung_s)


def _report_hung(
    app: web.Application, entry: ModelEntry, batch: RunningBatch, running_s: float, hung_s: float
) -> None:
    config = entry.config
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
    metrics = app.get(METRICS)
    if metrics is not None:
        metrics.hung_batches.labels(config.name, config.version).inc()
    lifecycle = app[LIFECYCLE]
    first = lifecycle.hung is None
    lifecycle.hung = message
    begin_drain(app, "hung inference")
    if first and not lifecycle.request_stop("hung inference"):
        log.warning("not under gunicorn: nothing restarts this process; liveness stays 503")
