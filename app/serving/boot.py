"""A worker's models from start to stop (:func:`serve_models`, run by the HTTP layer as the
app's ``cleanup_ctx``): the boot loads in the background, the hung-inference watchdog,
repository polling, the wait before listening while a sibling serves, and, at the stop, the units
stopped and the models freed.

What loads is model control's (:class:`app.serving.control.ModelControl`); how a version loads,
swaps and frees is the lifecycle's (:class:`app.serving.lifecycle.Lifecycle`); this module runs
them in the order a worker's life needs.

**The collector, while the worker serves** (:func:`collect_less`). What the boot loaded (the
libraries, the models) lives as long as the worker; CPython's collector scanned it all in each
full collection (a stall of the event loop every few seconds under load) and ran its young
generation every 700 objects that requests left behind (docs/benchmarks.md, *Figures behind the
code's choices*). Once the boot's models are loaded, they are moved out
of the collector's reach (``gc.freeze``: CPython's documentation recommends it for what a
process keeps, as Instagram's servers do), and the young generation collects every
:data:`GC_YOUNG_OBJECTS`; a version freed returns them to it
(``app.serving.runner.ModelRunner.close``), and the stop restores both. Only a worker that owns
its process does this (``ServingCore.owns_process``: the gunicorn worker); a core run in another
program's process (tests, ``python -m aiohttp.web``) leaves that program's collector as it is,
and its stop drops the models to it uncollected.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
from collections.abc import AsyncIterator

import torch

from app.serving.core import ServingCore
from app.serving.runner import describe
from app.serving.watchdog import watch_inference
from gpu_stat.verify import verify_binding

log = logging.getLogger(__name__)

#: How often a replacement waiting off the listener looks again whether it is ready, seconds.
DEFER_RECHECK_S = 0.1
#: Objects a worker's young generation holds before the collector runs (CPython's default:
#: 700, which ran it every few requests under load: module docstring).
GC_YOUNG_OBJECTS = 7000


@contextlib.asynccontextmanager
async def serve_models(core: ServingCore) -> AsyncIterator[None]:
    """The worker's models from start to stop (module docstring): the models of
    ``ModelControl.boot_names`` load in the background, the hung-inference watchdog runs,
    the repository is polled (``poll`` mode); it enters once this worker may listen
    (:func:`_defer_listening`); on exit the units stop and the models are freed (not when an
    inference thread is stuck or a load is still under way).

    Raises:
        ModelLoadError: the repository cannot be scanned.
    """
    settings, registry, control = core.settings, core.registry, core.control
    control.register_boot_models()
    torch.set_num_threads(settings.effective_torch_threads(settings.workers))
    thresholds = gc.get_threshold()
    if core.owns_process:
        gc.set_threshold(GC_YOUNG_OBJECTS, *thresholds[1:])
    loop = asyncio.get_running_loop()
    task = loop.create_task(_load_all(core), name="boot-models")
    background = []
    if settings.hung_inference_s > 0:
        background.append(loop.create_task(watch_inference(core, settings.hung_inference_s), name="watchdog"))
    try:
        await _defer_listening(core)
        yield
    finally:
        registry.begin_drain("its models stop")
        loaded = (
            task.done()
            and not task.cancelled()
            and not any(m.error is None and not m.ready for m in registry.entries())
        )
        pending = [task, *background, *core.lifecycle.tasks]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await core.lifecycle.release_all(loaded, core.health.hung, collect=core.owns_process)
        if core.owns_process:
            gc.unfreeze()
            gc.set_threshold(*thresholds)


async def _load_all(core: ServingCore) -> None:
    """The boot loads, the check of the binding, the ready line; then model control's
    reconciling and, in ``poll`` mode, polling."""
    registry, control = core.registry, core.control
    for name, reason in registry.unavailable.items():
        log.error("model %s unavailable: %s", name, reason, extra={"event": "model_unavailable"})
    loaded = await control.load_registered()
    if core.owns_process:
        collect_less()
    # Now that the models hold their CUDA context, check through NVML that it is on the
    # GPU this worker claimed (logs the outcome; None where PIDs are not visible).
    worker = core.binding
    if loaded and worker.binding.gpu_uuid is not None:
        await asyncio.get_running_loop().run_in_executor(None, verify_binding, worker.binding)
    binding = worker.describe()["binding"]
    models = [describe(m.runner) for m in registry.entries() if m.runner is not None]
    log.info(
        "worker %d %s: binding %s, models %s%s",
        worker.pid, "ready" if registry.ready else "not ready", binding, models,
        f", unavailable {sorted(registry.failures())}" if registry.failures() else "",
        extra={"event": "worker_ready", "binding": binding, "models": models},
    )  # fmt: skip
    await control.reconcile()
    if control.mode == "poll":
        await control.poll()


def collect_less() -> None:
    """What the worker holds now (its libraries, the boot's models) out of the collector's
    reach (module docstring): one full collection first (0.2 s with a few hundred thousand
    objects, before the worker is ready), so that only live objects are frozen."""
    gc.collect()
    gc.freeze()


async def _defer_listening(core: ServingCore) -> None:
    """While another worker serves, keep this one off the listener until it is ready (every
    model that can load is warm), or it is asked to stop. A replacement whose models cannot load
    so stays off the listener, retrying, while its siblings serve. The gunicorn worker's boot
    heartbeat keeps gunicorn informed meanwhile."""
    loop = asyncio.get_running_loop()
    registry = core.registry
    others_serving = core.siblings.others_serving
    waited = False
    while not registry.ready and not registry.draining and await loop.run_in_executor(None, others_serving):
        waited = True
        await asyncio.sleep(DEFER_RECHECK_S)
    if waited and not registry.draining:
        log.info("worker %d: models warm, listening (another worker served meanwhile)", os.getpid())
