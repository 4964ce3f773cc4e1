"""Model versions in and out of service in this worker: load, warm up, swap, drain, free
(:class:`Lifecycle`).

**A load** (:meth:`Lifecycle.load`) runs on an inference thread of the version's own: the model
loads and warms up, a small and a large batch are timed to seed its admission's service rate
(``ModelRunner.calibrate``: the very first requests are judged at a measured rate), and only
then does its serving unit start and take requests. What loads when is
:mod:`app.serving.control`'s (start, model control).

**A swap fails nothing.** Loading a version that already serves (a reload) builds the new unit
beside the old one while the old serves; once warm, new requests go to the new unit; requests
already queued on the old finish there (``ServingUnit.drain``); then the old unit stops and its
model is freed on its own thread (on a GPU its cached blocks are given back,
``torch.cuda.empty_cache``, with the freed bytes in the log). A load that fails, out of device
memory included, leaves what serves in place, and the reason in the repository index.

**A model that fails to load** is *unavailable*: its requests get 503 with the reason (no absolute
paths), readiness and the index name it, and the other models serve (Triton's behaviour). A load
at start that failed on something that may pass (out of memory, an I/O error, a device) is
retried after :data:`FIRST_RETRY_S`, then twice as long each time, up to
``SCORING_MODEL_LOAD_RETRY_MAX_S`` apart, so a cause that goes away heals by itself. One that
failed on the model's own files (:data:`DETERMINISTIC`: a value its ``model.toml`` or its handler
refuses, labels that do not fit its outputs, a tokenizer without a pad token, a handler that does
not import) would fail the same way every time: it is loaded again only once a file of its folder
changes (its fingerprint, the one the response cache keys on, looked at every
:data:`FIRST_RETRY_S`), its ``model.toml`` read again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from app.errors import ModelLoadError
from app.models.repository import ModelConfig, fingerprint, read_config, scrub_paths
from app.observability.metrics import ModelObserver
from app.observability.tracing import Tracing
from app.serving.executor import InferenceThread, Threads
from app.serving.registry import ModelRegistry, ModelVersion
from app.serving.runner import ModelRunner, collect_freed, describe
from app.serving.unit import ServingUnit
from app.settings import Settings

if TYPE_CHECKING:
    from app.observability.metrics import ServerMetrics

log = logging.getLogger(__name__)

#: The first wait before a failed model load is retried, seconds (then doubled each time); how
#: often the files of a model that failed deterministically are looked at.
FIRST_RETRY_S = 2.0
#: What a load raises when the model's own files are wrong (module docstring): the same files
#: fail the same way. Anything else (OSError, out of memory, a CUDA error) may pass by itself;
#: of a ``ModelLoadError`` that wraps another exception, the wrapped one decides.
DETERMINISTIC: tuple[type[Exception], ...] = (
    ModelLoadError, ValueError, TypeError, LookupError, AttributeError, ImportError, SyntaxError,
)  # fmt: skip


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


def staged(config_value: str, device: torch.device) -> bool:
    """Whether a model runs the staged pipeline: ``pipeline`` "on"/"off", or "auto" = on a CUDA
    device only (on the CPU the three stages would share the same cores and only add hand-offs)."""
    if config_value == "auto":
        return device.type == "cuda"
    return config_value == "on"


def unit_for(config: ModelConfig, runner: ModelRunner, threads: Threads, observer: ModelObserver,
             max_batch_bytes: int, tracing: Tracing | None = None) -> ServingUnit:  # fmt: skip
    """The serving unit of a loaded model version, as its ``model.toml`` says."""
    return ServingUnit(
        config,
        runner,
        threads,
        max_batch_bytes=max_batch_bytes,
        item_costs=runner.item_costs if runner.prices_items else None,
        batch_cost=runner.batch_cost,
        staged=staged(config.pipeline, runner.device),
        observer=observer,
        tracing=tracing,
    )


@dataclass(eq=False)
class Lifecycle:
    """What puts this worker's model versions in and out of service (module docstring).

    Attributes:
        settings: the worker's settings (batch bytes, the longest deadline, torch threads,
            the repository, the retry bound).
        registry: the versions whose states it moves (``app.serving.registry``).
        device: the torch device models load onto (:func:`resolve_device`).
        metrics: the Prometheus metrics, or None when off.
        tracing: the OpenTelemetry tracing of the units' requests, or None when off.
        tasks: its background tasks (load retries, old units draining), cancelled when the
            models stop.
    """

    settings: Settings
    registry: ModelRegistry
    device: torch.device
    metrics: ServerMetrics | None = None
    tracing: Tracing | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def _torch_threads(self) -> int:
        return self.settings.effective_torch_threads(self.settings.workers)

    def _threads(self, config: ModelConfig, inference: InferenceThread, runner: ModelRunner) -> Threads:
        """The version's threads: its inference thread and, when it prices its items or runs the
        staged pipeline, a prepare pool (``prepare_threads``: 1 on the CPU, else 2) and a finish
        thread, torch-threaded like the inference thread."""
        pipelined = staged(config.pipeline, runner.device)
        if not pipelined and not runner.prices_items:
            return Threads(inference)
        init = partial(torch.set_num_threads, self._torch_threads())
        count = config.prepare_threads or (1 if runner.device.type == "cpu" else 2)
        tag = f"{config.name}/{config.version}"
        prepare = InferenceThread(name=f"prepare:{tag}", initializer=init, threads=count)
        finish = InferenceThread(name=f"finish:{tag}", initializer=init) if pipelined else None
        return Threads(inference, prepare, finish)

    async def load(
        self, model: ModelVersion, config: ModelConfig | None = None, files: str | None = None
    ) -> None:
        """Load, warm up and time ``model`` (as ``config`` says: its folder read again; default its
        own) on a new inference thread, start its serving unit and put it in service; a unit it
        replaces drains and is freed in the background. ``files``: the fingerprint of its folder
        taken just before (default: taken now).

        torch.set_num_threads sets OpenMP's thread count for the calling thread only: it is set on
        each of the model's threads, or MKL's sgemm there forks a team of one thread per core in
        every worker, whose barrier spin-waits burned more CPU than the model (docs/benchmarks.md).

        Raises:
            Exception: whatever the load or warmup raised (the half-loaded model is freed first).
        """
        config = config or model.config
        loop = asyncio.get_running_loop()
        inference = InferenceThread(
            name=f"inference:{config.name}/{config.version}",
            initializer=partial(torch.set_num_threads, self._torch_threads()),
        )
        runner = ModelRunner(config)
        metrics = self.metrics
        # Before the load: files replaced while it runs then differ from this and are loaded again
        # (model control), and no result of the new files is cached under the old ones' identity.
        files = files or fingerprint(config.path)
        try:
            await loop.run_in_executor(inference, runner.load, self.device)
            await loop.run_in_executor(inference, runner.warmup)
            seed = await loop.run_in_executor(inference, runner.calibrate)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                # A stop or an unload while the load runs: the inference thread is still inside
                # the load, and awaiting the close behind it would hold the worker's exit for the
                # whole load (a SIGTERM during a reload with slow loads outlived systemd's
                # TimeoutStopSec). Queued after the load: the thread frees the model and ends, or
                # dies with the process (a daemon thread).
                inference.submit(runner.close)
            else:
                await loop.run_in_executor(inference, runner.close)
            inference.shutdown(wait=False)
            if metrics is not None:
                metrics.model_loads.labels(config.name, config.version, "failure").inc()
            raise
        if metrics is not None:
            metrics.model_loads.labels(config.name, config.version, "success").inc()
            metrics.model_ready(config.name, config.version, runner.load_seconds, runner.warmup_seconds)
        if runner.prefix_cache() is not None:
            runner.open_prefix_cache(metrics.prefix_cache(config.name, config.version) if metrics else None)
        observer = ModelObserver(
            model.stats, metrics, config.name, config.version, cached=config.response_cache.enable
        )
        threads = self._threads(config, inference, runner)
        unit = unit_for(config, runner, threads, observer, self.settings.max_batch_bytes, self.tracing)
        unit.admission.seed(seed)
        unit.start()
        what = f"{config.name} v{config.version}"
        if model.unloading or model.retired:  # unloaded while a retry loaded it: free the new copy
            await self.retire(unit, runner, threads, what=what)
            raise ModelLoadError(f"model {config.name} v{config.version} was unloaded while it loaded")
        old = model.serve(config, files, unit, runner, threads)
        self.registry.refresh(config.name)
        figures = describe(runner)
        state = "reloaded" if old[0] else "ready"
        log.info("model %s v%s %s %s", config.name, config.version, state, figures,
                 extra={"event": "model_ready", **figures})  # fmt: skip
        if old[0] is not None:
            self._spawn(self.retire(*old, what=what), f"retire:{config.name}")

    async def unload(self, model: ModelVersion) -> None:
        """Take ``model`` out of service: new requests go to another version (or get 404), those
        already routed to it finish (its unit drains), then it stops, its model is freed and it
        leaves the registry."""
        registry = self.registry
        model.begin_unload()
        registry.refresh(model.config.name)
        config = model.config
        await self.retire(model.unit, model.runner, model.threads, what=f"{config.name} v{config.version}")
        registry.remove(model)
        log.info(
            "model %s v%s unloaded", config.name, config.version,
            extra={"event": "model_unloaded", "model": config.name, "version": config.version},
        )  # fmt: skip

    async def retire(
        self, unit: ServingUnit | None, runner: ModelRunner | None, threads: Threads | None, *, what: str
    ) -> None:
        """Let ``unit`` finish what was routed to it (up to the longest deadline a request may
        have), stop it, free its model on its own thread and give the memory back."""
        if unit is not None:
            await unit.drain(self.settings.max_request_timeout_ms / 1000.0)
            await unit.stop()
        if runner is not None and threads is not None:
            loop = asyncio.get_running_loop()
            freed = await loop.run_in_executor(threads.inference, runner.close)
            threads.shutdown(wait=False)
            shown = f" ({freed} bytes of device memory)" if freed else ""
            log.info("%s: old copy drained and freed%s", what, shown,
                     extra={"event": "model_freed", "freed_bytes": freed})  # fmt: skip

    def _reason(self, exc: BaseException) -> str:
        message = str(exc) if isinstance(exc, ModelLoadError) else f"{type(exc).__name__}: {exc}"
        return scrub_paths(message, self.settings.model_repository)

    async def try_load(
        self, model: ModelVersion, config: ModelConfig | None = None, *, retry: bool = True
    ) -> bool:
        """:meth:`load`; on failure record the reason (the version stays unavailable, or an older
        copy keeps serving), wake its waiters and, with ``retry``, schedule retries (module
        docstring; loads that model control asked for are not retried: the operator asks
        again). True when it serves."""
        config = config or model.config
        files = fingerprint(config.path)
        try:
            await self.load(model, config, files)
            return True
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if model.unloading or model.retired:  # unloaded meanwhile: nothing to record
                return False
            model.fail(self._reason(exc))  # requests waiting for it get 503 with the reason now
            retry_max_s = self.settings.model_load_retry_max_s if retry else 0
            same_files = files if deterministic(exc) else None
            if not retry:
                when = ""
            elif not retry_max_s:
                when = " (not retried: SCORING_MODEL_LOAD_RETRY_MAX_S=0)"
            else:
                when = " (loaded again once its files change)" if same_files else " (retried)"
            log.error(
                "model %s v%s %s: %s%s",
                config.name, config.version,
                "failed to load; the old copy keeps serving" if model.unit is not None else
                "unavailable, the other models serve", model.error, when,
                exc_info=None if isinstance(exc, ModelLoadError) else exc,
                extra={"event": "model_unavailable", "model": config.name, "version": config.version},
            )  # fmt: skip
            name = f"retry-load:{config.name}/{config.version}"
            if retry_max_s and model.unit is None and not any(t.get_name() == name for t in self.tasks):
                self._spawn(self._retry(model, retry_max_s, same_files), name)
            return False

    async def _retry(self, model: ModelVersion, max_s: float, same_files: str | None) -> None:
        """Retry a failed load (module docstring): after FIRST_RETRY_S, then twice as long each
        time, up to ``max_s``; while ``same_files`` (the fingerprint of the files a load failed
        on deterministically) still describes the model's folder, only look again."""
        wait_s = min(FIRST_RETRY_S, max_s)
        loop = asyncio.get_running_loop()
        while model.error is not None and not model.retired and not self.registry.draining:
            await asyncio.sleep(wait_s if same_files is None else min(FIRST_RETRY_S, max_s))
            config = model.config
            files = await loop.run_in_executor(None, fingerprint, config.path)
            if files == same_files:
                continue
            try:
                if same_files is not None:  # its files changed: its model.toml may have too
                    config = await loop.run_in_executor(None, _read_again, config)
                await self.load(model, config, files)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if model.unloading or model.retired:  # unloaded meanwhile: no more tries
                    return
                model.fail(self._reason(exc))
                same_files = files if deterministic(exc) else None
                wait_s = min(wait_s * 2, max_s)
                log.warning(
                    "model %s v%s still unavailable (%s): %s",
                    config.name, config.version,
                    "loaded again once its files change" if same_files else f"next try in {wait_s:.0f} s",
                    model.error,
                )  # fmt: skip
                continue
            log.info("model %s v%s loaded on retry", config.name, config.version)

    async def release_all(self, loaded: bool, hung: str | None, *, collect: bool = True) -> None:
        """Stop every unit; free the models on their inference threads unless one is stuck
        (``hung``: why) or, ``loaded`` False, a load is still under way; then, with ``collect``,
        run the collector once for all of them (``app.serving.runner.collect_freed``)."""
        models = self.registry.entries()
        for model in models:
            if model.unit is not None:
                await model.unit.stop()
        if hung is not None or not loaded:
            # Anything queued now would wait behind the stuck (or still loading) call; the
            # daemon threads die with the process, and so does the device memory they hold.
            why = f"an inference thread is stuck ({hung})" if hung else "models were still loading"
            log.warning("exiting without unloading models: %s", why)
            for model in models:
                if model.threads is not None:
                    model.threads.shutdown(wait=False)
            return
        loop = asyncio.get_running_loop()
        for model in models:
            if model.runner is not None and model.threads is not None:
                await loop.run_in_executor(model.threads.inference, model.runner.close, False)
                await loop.run_in_executor(None, model.threads.shutdown, True)
            model.release()
        if collect:  # once for all: each is a full collection
            await loop.run_in_executor(None, collect_freed)


def deterministic(exc: BaseException) -> bool:
    """Whether a load that raised ``exc`` failed on the model's own files (:data:`DETERMINISTIC`;
    the cause of a wrapping ``ModelLoadError``)."""
    while isinstance(exc, ModelLoadError) and exc.__cause__ is not None:
        exc = exc.__cause__
    return isinstance(exc, DETERMINISTIC)


def _read_again(config: ModelConfig) -> ModelConfig:
    """The ``model.toml`` of ``config``'s folder as it is now, which must still declare the same
    model version.

    Raises:
        ModelLoadError: it cannot be read, is refused, or declares another name or version
            (model control loads that one).
    """
    again = read_config(config.path)
    if (again.name, again.version) != (config.name, config.version):
        raise ModelLoadError(
            f"{config.where}: now declares model {again.name} v{again.version}, not {config.name} "
            f"v{config.version}: load it through model control"
        )
    return again
