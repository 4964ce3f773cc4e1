"""Typed application state: the ``web.AppKey``s and the model registry they hold."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from aiohttp import web

from app.errors import ModelNotFound, ModelNotReady
from app.models.repository import ModelConfig
from app.protocols.limits import RequestLimits
from app.serving.batcher import DynamicBatcher
from app.serving.stats import ModelStats
from app.settings import Settings

if TYPE_CHECKING:  # the runner imports torch; the request path needs none of it
    from app.models.runner import ModelRunner


@dataclass(eq=False)
class ModelEntry:
    """One model version in this worker: config, and once loaded, its runner and batcher."""

    config: ModelConfig
    runner: ModelRunner | None = None
    batcher: DynamicBatcher | None = None
    #: Set once the model is warm, or once loading has failed (waiters then see the error).
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    #: This worker's Triton-style statistics of the model (fed by its batcher).
    stats: ModelStats = field(default_factory=ModelStats)
    #: Why the model could not be loaded (no absolute paths), while it is unavailable; None
    #: while it loads or once it is ready. Loading is retried (``app.serving.lifecycle``).
    error: str | None = None

    @property
    def ready(self) -> bool:
        """True once loaded, warmed up and batching."""
        return self.batcher is not None

    @property
    def state(self) -> str:
        """Triton's model state: ``READY``, ``LOADING`` or ``UNAVAILABLE``."""
        if self.ready:
            return "READY"
        return "UNAVAILABLE" if self.error is not None else "LOADING"


class Spread(Protocol):
    """Balancing of one request over sibling workers (``app.server.scatter.Scatter``)."""

    def considers(self, entry: ModelEntry, items: int, pinned: bool) -> bool:
        """Whether a request of ``items`` items may leave this worker (split or forwarded);
        False: run it here whole without awaiting the hook (the common, cheap case)."""
        ...

    def __call__(
        self,
        entry: ModelEntry,
        inputs: dict[str, np.ndarray],
        timeout_s: float,
        request_id: str,
        local: Callable[[dict[str, np.ndarray], float], Coroutine[Any, Any, dict[str, np.ndarray]]],
        *,
        pinned: bool = False,
    ) -> Awaitable[dict[str, np.ndarray] | None]:
        """The request's outputs, or None when it should run here whole."""
        ...


@dataclass(eq=False)
class ModelRegistry:
    """The models of the repository this worker serves, by name and version."""

    models: dict[str, dict[str, ModelEntry]] = field(default_factory=dict)
    #: Models of the repository that cannot be served at all (a ``model.toml`` that could not be
    #: read, a version declared twice): name -> reason (no absolute paths).
    unavailable: dict[str, str] = field(default_factory=dict)
    #: Readiness needs every model of the repository warm (Triton's ``--strict-readiness``);
    #: False: every model that can load has, and at least one is warm.
    strict: bool = False
    draining: bool = False
    #: Called with +items at admission and -items at completion of every inference request
    #: (the gunicorn worker publishes its load with it; app.server.balance).
    on_load: Callable[[int], None] | None = None
    #: Scatter/gather of large requests over sibling workers (app.server.scatter.Scatter):
    #: ``(entry, inputs, timeout_s, request_id, local, *, pinned) -> outputs``, or None to run
    #: here whole (``pinned``: may be forwarded whole, app.server.forward).
    spread: Spread | None = None
    #: The highest version of each name (what a request naming no version gets).
    latest: dict[str, ModelEntry] = field(default_factory=dict)

    def add(self, config: ModelConfig) -> ModelEntry:
        """Register ``config`` (not yet loaded)."""
        entry = ModelEntry(config)
        versions = self.models.setdefault(config.name, {})
        versions[config.version] = entry
        self.latest[config.name] = versions[max(versions, key=_version_key)]
        return entry

    def entries(self) -> list[ModelEntry]:
        """Every model version, in name then version order."""
        return [e for name in sorted(self.models) for _, e in sorted(self.models[name].items())]

    def get(self, name: str, version: str | None = None) -> ModelEntry:
        """The entry for ``name`` (and ``version``; default: the highest version).

        Raises:
            ModelNotFound: unknown name or version (the message lists what exists).
            ModelNotReady: a model of the repository that cannot be served (its reason; 503).
        """
        if version is None:
            latest = self.latest.get(name)
            if latest is None:
                raise self._missing(name)
            return latest
        versions = self.models.get(name)
        if versions is None:
            raise self._missing(name)
        entry = versions.get(version)
        if entry is None:
            raise ModelNotFound(f"model {name!r} has no version {version!r}; available: {sorted(versions)}")
        return entry

    def _missing(self, name: str) -> ModelNotFound | ModelNotReady:
        reason = self.unavailable.get(name)
        if reason is not None:
            return ModelNotReady(f"model {name!r} is unavailable: {reason}")
        return ModelNotFound(f"model {name!r} not found; available: {sorted(self.models)}")

    def index(self, only_ready: bool = False) -> list[tuple[str, str, str, str]]:
        """The repository index (Triton's): ``(name, version, state, reason)`` of every model,
        state ``READY``, ``LOADING`` or ``UNAVAILABLE`` (reason: why); only the ready ones when
        ``only_ready``. A folder whose ``model.toml`` could not be read has version ""."""
        rows = [(e.config.name, e.config.version, e.state, e.error or "") for e in self.entries()]
        rows += [(name, "", "UNAVAILABLE", reason) for name, reason in sorted(self.unavailable.items())]
        return [row for row in rows if row[2] == "READY" or not only_ready]

    def failures(self) -> dict[str, str]:
        """Every model that cannot be served now, ``name`` or ``name/version`` -> reason."""
        failed = dict(self.unavailable)
        for entry in self.entries():
            if entry.error is not None:
                failed[f"{entry.config.name}/{entry.config.version}"] = entry.error
        return failed

    async def wait_ready(self, entry: ModelEntry, timeout_s: float) -> ModelEntry:
        """``entry`` once it is warm; a request that reaches a worker still loading waits.

        Waiting (bounded by the request's own deadline) rather than refusing keeps a HUP
        reload or a worker restart free of failed requests: the kernel may hand a
        connection to a new worker before its model is warm. A draining worker still
        serves the requests that reach it (readiness is what turns traffic away).

        Raises:
            ModelNotReady: the model is unavailable (its load failed: the reason, no
                Retry-After), not warm within ``timeout_s`` seconds, or the worker is draining
                before it ever got warm (503 + Retry-After).
        """
        if not entry.ready and not self.draining and entry.error is None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(entry.settled.wait(), timeout_s)
        if not entry.ready:
            if entry.error is not None:
                raise ModelNotReady(f"model {entry.config.name!r} is unavailable: {entry.error}")
            reason = "draining" if self.draining else "loading"
            raise ModelNotReady(f"model {entry.config.name!r} is not ready ({reason})", retry_after_s=1)
        return entry

    @property
    def ready(self) -> bool:
        """Server readiness: not draining, and every model warm (:attr:`strict`), or else every
        model that can load warm and at least one of them."""
        if self.draining:
            return False
        entries = self.entries()
        if self.strict:
            return bool(entries) and not self.unavailable and all(e.ready for e in entries)
        return any(e.ready for e in entries) and all(e.ready or e.error is not None for e in entries)


@dataclass(eq=False)
class WorkerLifecycle:
    """This worker's process-level state: how many responses it gave, whether its inference
    thread is stuck, and its hooks into the process that runs it.

    The hooks are installed by the gunicorn worker (``app.server.worker``); in-process (tests, a bare
    ``aiohttp.web`` run) they stay None: nothing restarts the process, and it listens at once.
    """

    responses: int = 0
    #: Why an inference thread is considered stuck (liveness turns 503), or None.
    hung: str | None = None
    #: Passes the hung-inference watchdog has made over the batchers.
    watchdog_passes: int = 0
    #: Asks the process to drain and exit (reason).
    stop: Callable[[str], None] | None = None
    #: True while another worker of the server serves: this one then starts listening only
    #: once its models are warm. Blocking (reads sibling state files): call it off the loop.
    defer_listening: Callable[[], bool] | None = None
    #: True when the response being prepared should close its connection so that a less-loaded
    #: sibling worker takes it (app.server.balance); asked by app.http.connections.
    shed: Callable[[], bool] | None = None

    def request_stop(self, reason: str) -> bool:
        """Ask the worker process to drain and exit; False when nothing can stop it."""
        if self.stop is None:
            return False
        self.stop(reason)
        return True


def _version_key(version: str) -> tuple[int, Any]:
    return (0, int(version)) if version.isdigit() else (1, version)


SETTINGS = web.AppKey("settings", Settings)
REGISTRY = web.AppKey("registry", ModelRegistry)
LIFECYCLE = web.AppKey("lifecycle", WorkerLifecycle)
LIMITS = web.AppKey("request_limits", RequestLimits)
