"""The model versions this worker serves and their states.

:class:`ModelRegistry` holds one :class:`ModelVersion` per (name, version): its config, its
state (a :class:`ModelState`: Triton's ``LOADING``, ``READY``, ``UNLOADING``, ``UNAVAILABLE``,
with a reason) and, once loaded and warm, its serving unit (``app.serving.unit``).
``app.serving.lifecycle`` and ``app.serving.control`` change it only through
:class:`ModelVersion`'s transition methods and the registry's own methods (readiness's
strictness is fixed at construction, draining starts once and for good); the data plane reads
it on every request as plain dictionaries (``versions``, ``latest``), so a lookup is two dict
lookups and no call.

Which version a request that names none gets (``latest``): the highest version that serves,
else the highest version (its requests then wait for it to load). A version that replaces
another therefore takes its requests only once it is warm.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from app.errors import ModelNotFound, ModelNotReady, ModelUnloaded
from app.models.repository import ModelConfig, version_key
from app.observability.metrics import ModelStats

if TYPE_CHECKING:  # the runner imports torch; the request path needs none of it
    from app.serving.executor import Threads
    from app.serving.runner import ModelRunner
    from app.serving.unit import ServingUnit

log = logging.getLogger(__name__)


class ModelState(enum.StrEnum):
    """Triton's model states, its names as values (the repository index shows them as they are)."""

    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"


class IllegalTransition(RuntimeError):
    """A model version was asked to change state in a way its lifecycle does not allow (a bug
    in the caller: the message names the model, its state and the transition)."""


@dataclass(eq=False)
class ModelVersion:
    """One model version in this worker: its config, its state and, once loaded and warm, its
    runner and serving unit.

    Its state changes only through the transition methods (:meth:`begin_load`, :meth:`serve`,
    :meth:`fail`, :meth:`begin_unload`, :meth:`retire`, :meth:`release`)::

        LOADING --serve--> READY --begin_unload--> UNLOADING --retire--> (retired)
           |                 |  ^  (a reload: begin_load, then serve or fail, stays READY)
          fail              fail (a failed reload: READY, the reason in ``error``)
           v
        UNAVAILABLE --begin_load--> LOADING;  UNAVAILABLE --serve--> READY (a retry)

    Any other change raises :class:`IllegalTransition`.
    """

    config: ModelConfig
    #: Triton's model state: ``LOADING``, ``READY``, ``UNLOADING`` or ``UNAVAILABLE``.
    state: ModelState = ModelState.LOADING
    runner: ModelRunner | None = None
    unit: ServingUnit | None = None
    #: The threads its runner and unit run on (its own: a swap loads beside the old copy).
    threads: Threads | None = None
    #: Set once the version serves, once loading has failed, or when the worker drains.
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    #: This worker's Triton statistics of the version (fed by its unit's observer).
    stats: ModelStats = field(default_factory=ModelStats)
    #: Why the version cannot serve, or why its last load failed while an older copy serves
    #: (no absolute paths); None when its last load succeeded or is under way.
    error: str | None = None
    #: True once removed from the registry: a request that holds it looks its model up again.
    retired: bool = False
    #: What identifies the files it was loaded from (model control compares it).
    fingerprint: str = ""

    @property
    def ready(self) -> bool:
        """True while a serving unit takes its requests: state ``READY`` and its serving loop
        running (not waiting to start again after a failure: ``ServingUnit.serving``)."""
        return self.state == ModelState.READY and (self.unit is None or self.unit.serving)

    @property
    def unloading(self) -> bool:
        """True while its unit drains and its model is freed (unload, or replaced by a newer
        version), and once retired."""
        return self.state == ModelState.UNLOADING

    def _require(self, transition: str, *allowed: str) -> None:
        """Raises IllegalTransition: the version is retired or its state not in ``allowed``."""
        if self.retired or self.state not in allowed:
            state = f"{self.state}, retired" if self.retired else self.state
            raise IllegalTransition(
                f"model {self.config.name} v{self.config.version}: cannot {transition} in state {state}"
                f" (allowed from {', '.join(allowed)})"
            )

    def begin_load(self, config: ModelConfig) -> None:
        """A (re)load of ``config`` starts: its error is cleared and its waiters wait again; a
        version that does not serve (LOADING, UNAVAILABLE) takes ``config`` and is LOADING, one
        that serves stays READY (the new copy loads beside it).

        Raises:
            IllegalTransition: the version is UNLOADING or retired.
        """
        self._require("begin a load", ModelState.LOADING, ModelState.READY, ModelState.UNAVAILABLE)
        if self.state != ModelState.READY:
            self.config = config
            self.state = ModelState.LOADING
        self.settled.clear()
        self.error = None

    def serve(
        self, config: ModelConfig, fingerprint: str, unit: ServingUnit, runner: ModelRunner, threads: Threads
    ) -> tuple[ServingUnit | None, ModelRunner | None, Threads | None]:
        """The loaded, warm copy (``unit`` on ``runner`` and ``threads``, loaded from ``config``
        whose files had ``fingerprint``) takes the version's requests: READY, error cleared,
        waiters woken.

        Returns:
            The copy it replaces (unit, runner, threads; all None when none served), for the
            caller to drain and free.

        Raises:
            IllegalTransition: the version is UNLOADING or retired.
        """
        self._require("serve", ModelState.LOADING, ModelState.READY, ModelState.UNAVAILABLE)
        old = (self.unit, self.runner, self.threads)
        self.config, self.fingerprint = config, fingerprint
        self.unit, self.runner, self.threads = unit, runner, threads
        self.state = ModelState.READY
        self.error = None
        self.settled.set()
        return old

    def fail(self, reason: str) -> None:
        """A load failed (``reason``: no absolute paths): UNAVAILABLE, or, when an older copy
        serves, still READY with ``reason`` in :attr:`error`; its waiters are woken (they get
        503 with the reason, or the older copy).

        Raises:
            IllegalTransition: the version is UNLOADING or retired.
        """
        self._require("fail a load", ModelState.LOADING, ModelState.READY, ModelState.UNAVAILABLE)
        self.error = reason
        if self.unit is None:
            self.state = ModelState.UNAVAILABLE
        self.settled.set()

    def begin_unload(self) -> None:
        """UNLOADING: it takes no new requests by name; its unit (if any) drains.

        Raises:
            IllegalTransition: already UNLOADING, or retired.
        """
        self._require("begin an unload", ModelState.LOADING, ModelState.READY, ModelState.UNAVAILABLE)
        self.state = ModelState.UNLOADING

    def retire(self) -> None:
        """Its unit drained and its model freed: it leaves the registry (``retired``; requests
        still holding it look their model up again). Stays UNLOADING.

        Raises:
            IllegalTransition: not UNLOADING, or already retired.
        """
        self._require("retire", ModelState.UNLOADING)
        self.unit = self.runner = self.threads = None
        self.retired = True

    def release(self) -> None:
        """The worker stops: its unit stopped and its model freed (or left to the process's
        exit); UNLOADING, from any state."""
        self.unit = self.runner = self.threads = None
        self.state = ModelState.UNLOADING


class ModelRegistry:
    """The model versions this worker serves, by name and version (module docstring). Changed
    only through its methods and its versions' transitions; the data plane reads ``versions``
    and ``latest`` directly (two dict lookups per request).

    Args:
        strict: readiness needs every model of the repository serving (Triton's
            ``--strict-readiness``, ``SCORING_STRICT_READINESS``); False: every model that can
            load has, and at least one is warm.
    """

    def __init__(self, *, strict: bool = False) -> None:
        self.versions: dict[str, dict[str, ModelVersion]] = {}
        #: Per name, the version a request that names none gets.
        self.latest: dict[str, ModelVersion] = {}
        self.strict = strict
        #: True once :meth:`begin_drain` was called (its only writer): readiness 503 for good.
        #: An attribute, not a property: the keep-alive policy reads it for every response.
        self.draining = False
        self._unavailable: dict[str, str] = {}
        self._unloaded: dict[str, str] = {}

    @property
    def unavailable(self) -> Mapping[str, str]:
        """Model folders of the repository that cannot be served at all (a ``model.toml`` that
        could not be read, a version declared twice): name -> reason (no absolute paths)."""
        return self._unavailable

    @property
    def unloaded(self) -> Mapping[str, str]:
        """Models of the repository that model control unloaded, or has not loaded (explicit
        mode): name -> why (their requests get 404; the index lists them UNAVAILABLE)."""
        return self._unloaded

    def add(self, config: ModelConfig) -> ModelVersion:
        """Register ``config`` (not yet loaded); a version of that name and number is replaced."""
        model = ModelVersion(config)
        self.versions.setdefault(config.name, {})[config.version] = model
        self.refresh(config.name)
        return model

    def remove(self, model: ModelVersion) -> None:
        """Take ``model`` out once it has unloaded (:meth:`ModelVersion.retire`): requests no
        longer reach it (those holding it look again).

        Raises:
            IllegalTransition: ``model`` is not UNLOADING, or already retired.
        """
        name = model.config.name
        versions = self.versions.get(name, {})
        if versions.get(model.config.version) is model:
            del versions[model.config.version]
        if not versions:
            self.versions.pop(name, None)
        model.retire()
        self.refresh(name)

    def refresh(self, name: str) -> None:
        """Recompute which version of ``name`` requests without a version get."""
        ordered = sorted(self.versions.get(name, {}).values(), key=lambda m: version_key(m.config.version))
        candidates = [m for m in ordered if not m.unloading]
        if not candidates:
            self.latest.pop(name, None)
            return
        self.latest[name] = ([m for m in candidates if m.ready] or candidates)[-1]

    # --- model control's changes (app.serving.control) -----------------------------------------

    def set_unavailable(self, name: str, reason: str | None) -> None:
        """Model ``name``'s folder cannot be served (``reason``: why, no absolute paths), or,
        with None, can again."""
        if reason is None:
            self._unavailable.pop(name, None)
        else:
            self._unavailable[name] = reason

    def set_unloaded(self, name: str, why: str | None) -> None:
        """Model ``name`` is not loaded on purpose (``why``: its requests get 404 saying so; its
        folder's own error, if any, no longer counts), or, with None, is wanted again."""
        if why is None:
            self._unloaded.pop(name, None)
        else:
            self._unloaded[name] = why
            self._unavailable.pop(name, None)

    def to_load(self, config: ModelConfig) -> ModelVersion:
        """The version of ``config`` about to be (re)loaded: a new entry when there is none or
        the one there is unloading; else the one there, its error cleared and, when it does not
        serve (a failed or unloaded load), its config taken from the folder as it is now. Its
        waiters wait again (:meth:`ModelVersion.begin_load`)."""
        model = self.versions.get(config.name, {}).get(config.version)
        if model is None or model.unloading:
            model = self.add(config)
        model.begin_load(config)
        return model

    def entries(self) -> list[ModelVersion]:
        """Every model version, in name then version order."""
        return [
            m
            for name in sorted(self.versions)
            for m in sorted(self.versions[name].values(), key=lambda m: version_key(m.config.version))
        ]

    def get(self, name: str, version: str | None = None) -> ModelVersion:
        """The version addressed (version None: :attr:`latest`).

        Raises:
            ModelNotFound, ModelNotReady: see :meth:`missing`.
        """
        found = self.latest.get(name) if version is None else self.versions.get(name, {}).get(version)
        if found is None:
            raise self.missing(name, version)
        return found

    def labels(self, name: str, version: str | None) -> tuple[str, str] | None:
        """The request metrics' (model, version) of a request for ``name`` ``version``: those of
        the version addressed in any state (a failed load too), ``(name, "")`` for a folder that
        cannot be served or a model unloaded, None (labelled "") for a name or version unknown
        here, so that no client adds label values."""
        found = self.latest.get(name) if version is None else self.versions.get(name, {}).get(version)
        if found is not None:
            return found.config.name, found.config.version
        if name in self._unavailable or name in self._unloaded:
            return name, ""
        return None

    def missing(self, name: str, version: str | None) -> ModelNotFound | ModelNotReady:
        """The error for a name or version not served: 404 listing what exists (or saying it was
        unloaded), or 503 with the reason for a model folder that cannot be served."""
        versions = self.versions.get(name)
        if versions is not None and version is not None:
            return ModelNotFound(f"model {name!r} has no version {version!r}; available: {sorted(versions)}")
        unloaded = self.unloaded.get(name)
        if unloaded is not None:
            return ModelUnloaded(f"model {name!r} is not loaded ({unloaded})")
        reason = self.unavailable.get(name)
        if reason is not None:
            return ModelNotReady(f"model {name!r} is unavailable: {reason}")
        return ModelNotFound(f"model {name!r} not found; available: {sorted(self.versions)}")

    def index(self, only_ready: bool = False) -> list[tuple[str, str, str, str]]:
        """Triton's repository index: ``(name, version, state, reason)`` of every version (reason:
        why it is not READY, or why its last load failed); only the READY ones when
        ``only_ready``. A folder whose ``model.toml`` could not be read has version ""."""
        rows = [(m.config.name, m.config.version, m.state.value, m.error or "") for m in self.entries()]
        unavailable = ModelState.UNAVAILABLE.value
        rows += [(name, "", unavailable, reason) for name, reason in sorted(self._unavailable.items())]
        rows += [(name, "", unavailable, reason) for name, reason in sorted(self._unloaded.items())]
        return [row for row in rows if row[2] == ModelState.READY or not only_ready]

    def failures(self) -> dict[str, str]:
        """Every model that cannot be served now, ``name`` or ``name/version`` -> reason."""
        failed = dict(self._unavailable)
        for m in self.entries():
            if m.error is not None and not m.ready:
                failed[f"{m.config.name}/{m.config.version}"] = m.error
        return failed

    async def serving_unit(self, model: ModelVersion, deadline: float) -> ServingUnit:
        """``model``'s serving unit once it serves: a request that reaches a worker still loading
        waits, within its deadline (``loop.time()``), rather than being refused, which keeps a
        HUP reload or a worker restart free of failed requests.

        Raises:
            ModelNotReady: unavailable (its load failed: the reason, no Retry-After), unloaded,
                not warm before ``deadline``, or the worker drains before it got warm (503 +
                Retry-After).
        """
        if model.unit is None and not self.draining and model.error is None and not model.retired:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await model.settled.wait()
        unit = model.unit
        if unit is not None:
            return unit
        name = model.config.name
        if model.error is not None:
            raise ModelNotReady(f"model {name!r} is unavailable: {model.error}")
        reason = "unloaded" if model.retired else "draining" if self.draining else "loading"
        raise ModelNotReady(f"model {name!r} is not ready ({reason})", retry_after_s=1)

    def begin_drain(self, reason: str) -> None:
        """Start draining: readiness 503 from now on; every response closes its connection
        (``app.http.edge``). Requests that still reach the worker are served. Idempotent."""
        if self.draining:
            return
        self.draining = True
        for model in (m for versions in self.versions.values() for m in versions.values()):
            model.settled.set()  # a request waiting for a load gets its 503 now (serving_unit)
        log.info(
            "worker %d draining (%s): readiness 503, responses close their connections",
            os.getpid(), reason, extra={"event": "drain", "reason": reason},
        )  # fmt: skip

    @property
    def ready(self) -> bool:
        """Server readiness: not draining, and every model serving (:attr:`strict`: no folder
        unavailable and every model with a warm version; a new version still loading, or one
        whose load failed, beside a warm one does not count against it), or else every model
        that can load warm and at least one of them."""
        if self.draining:
            return False
        entries = self.entries()
        if self.strict:
            return (
                bool(entries)
                and not self.unavailable
                and all(any(m.ready for m in versions.values()) for versions in self.versions.values())
            )
        return any(m.ready for m in entries) and all(m.ready or m.error is not None for m in entries)
