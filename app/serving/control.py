"""Model control: load, reload and unload a model while the server runs, on every worker
(Triton's model control modes and its model repository extension).

``SCORING_MODEL_CONTROL_MODE``:

- ``none``: the models loaded at start serve until the worker stops; load and unload answer
  400 with the reason (Triton's answer in that mode);
- ``explicit``: ``POST /v2/repository/models/{name}/load|unload`` (gRPC ``RepositoryModelLoad``,
  ``RepositoryModelUnload``) change one model while the others serve;
- ``poll``: each worker scans the repository every ``SCORING_REPOSITORY_POLL_S`` seconds and
  loads, reloads and unloads what changed; the API is refused.

Every mode first loads what ``SCORING_MODELS`` names (all by default).

**A load reads the model's folders again** (``app.models.repository.serving``): the versions its
``version_policy`` selects are loaded when new, reloaded when their files changed (a fingerprint of
names, sizes and times), loaded again when their last load failed; versions it no longer selects
are unloaded, but only once every selected version serves: a version that fails to load leaves
the ones serving in place, and the failure in the index and in the call's answer. Each load and
reload happens beside what serves (``app.serving.lifecycle``): nothing fails meanwhile.

**Every worker, one answer.** The worker that receives the call writes the new model set to
``<run dir>/models.json`` (a worker forked later, by a recycle, a crash or a HUP, starts from it,
and one that booted meanwhile reconciles with it once its boot loads are done), applies the change
and has every sibling apply it (``Siblings.apply``, over their internal endpoints: ready or not,
a worker whose models are all unloaded included; one still loading its boot models applies it
after them), and answers only once all of them have, or with an error naming each worker that
failed and why.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os

from app.errors import ModelControlFailed, ModelLoadError
from app.models.repository import ModelConfig, fingerprint, scan, scrub_paths, serving
from app.serving.lifecycle import Lifecycle
from app.serving.siblings import Siblings
from app.settings import Settings

log = logging.getLogger(__name__)

#: The model set of a server in explicit mode, in its run directory.
MODEL_SET_FILE = "models.json"
LOAD, UNLOAD = "load", "unload"


class ModelControl:
    """This worker's model control (module docstring).

    Args:
        lifecycle: what loads and unloads this worker's versions (its settings and registry).
        siblings: the server's other workers, which every change reaches.
    """

    def __init__(self, lifecycle: Lifecycle, siblings: Siblings) -> None:
        self.lifecycle = lifecycle
        self.registry = lifecycle.registry
        self.siblings = siblings
        self.settings: Settings = lifecycle.settings
        self.mode = self.settings.model_control_mode
        run_dir = self.settings.run_dir
        self.model_set_path = run_dir / MODEL_SET_FILE if run_dir else None
        self._lock = asyncio.Lock()
        self._seen: dict[str, dict[str, str]] = {}  # poll: name -> version -> fingerprint

    # --- what loads at start -----------------------------------------------------------------

    def boot_names(self) -> tuple[str, ...]:
        """The models this worker loads at start: ``SCORING_MODELS`` (empty: all), or in explicit
        mode the server's current model set when one was written."""
        current = self.model_set()
        return tuple(current) if current is not None else self.settings.model_names

    def register_boot_models(self) -> None:
        """Fill the registry with the versions :meth:`boot_names` selects (not yet loaded), the
        folders that cannot be served (unavailable, with why) and, in explicit mode, the models
        outside the server's model set (unloaded).

        Raises:
            ModelLoadError: the repository cannot be scanned.
        """
        registry = self.registry
        names = self.boot_names()
        found = scan(self.settings.model_repository, names if self.model_set() is None else ())
        for config in serving(found).configs:
            if not names or config.name in names:
                registry.add(config)
            else:  # explicit mode, not in the server's model set
                registry.set_unloaded(config.name, "not loaded")
        for broken in found.unavailable:
            if not names or broken.name in names:
                registry.set_unavailable(broken.name, broken.reason)

    async def load_registered(self) -> bool:
        """Load every registered version, one after the other (a failed one retried in the
        background); a change a sibling sends meanwhile applies after them. True when one
        serves."""
        loaded = False
        async with self._lock:
            for model in self.registry.entries():
                loaded = await self.lifecycle.try_load(model) or loaded
        return loaded

    def model_set(self) -> list[str] | None:
        """The model set ``models.json`` holds (explicit mode), or None when there is none."""
        if self.mode != "explicit" or self.model_set_path is None:
            return None
        try:
            names = json.loads(self.model_set_path.read_text())["models"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return [str(n) for n in names]

    def _write_model_set(self, names: list[str]) -> None:
        if self.model_set_path is None:
            return
        tmp = self.model_set_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"models": sorted(set(names))}))
        tmp.replace(self.model_set_path)

    # --- the API: this worker and its siblings ------------------------------------------------

    async def request(self, action: str, name: str) -> None:
        """Apply ``action`` (:data:`LOAD` or :data:`UNLOAD`) to model ``name`` here and on every
        ready sibling; return once all have.

        Raises:
            ModelControlFailed: the mode refuses it (``none``, ``poll``), an unknown model, or
                the change failed on some worker (each named, with why).
        """
        if self.mode != "explicit":
            why = "polls its repository" if self.mode == "poll" else "does not change models while it runs"
            raise ModelControlFailed(
                f"model control mode is {self.mode!r}: the server {why}; set "
                "SCORING_MODEL_CONTROL_MODE=explicit to load and unload models through the API"
            )
        registry = self.registry
        current = self.model_set() or sorted(set(registry.versions) | set(registry.unloaded))
        if action == LOAD:
            self._write_model_set([*current, name])
        else:
            self._write_model_set([n for n in current if n != name])
        here, there = await asyncio.gather(self.apply(action, name), self.siblings.apply(action, name))
        failures = {os.getpid(): here} if here else {}
        failures.update(there)
        if failures:
            detail = "; ".join(f"worker {pid}: {why}" for pid, why in sorted(failures.items()))
            raise ModelControlFailed(
                f"{action} of model {name!r} failed on {len(failures)} worker(s): {detail}"
            )

    async def apply(self, action: str, name: str) -> str | None:
        """Apply ``action`` to ``name`` in this worker only (what a sibling asks of it); the
        reason it failed, or None."""
        async with self._lock:
            try:
                if action == LOAD:
                    return await self._load(name)
                if action == UNLOAD:
                    return await self._unload(name, "unloaded")
                return f"unknown model control action {action!r}"
            except ModelLoadError as exc:
                return scrub_paths(str(exc), self.settings.model_repository)

    # --- the changes ------------------------------------------------------------------------

    def _selected(self, name: str) -> list[ModelConfig]:
        """The versions of ``name`` its ``version_policy`` selects, read from the repository now.

        Raises:
            ModelLoadError: no folder declares the model (or its ``model.toml`` cannot be read).
        """
        found = scan(self.settings.model_repository)
        registry = self.registry
        broken = {u.name: u.reason for u in found.unavailable}
        configs = [c for c in serving(found).configs if c.name == name]
        registry.set_unavailable(name, broken.get(name))
        if not configs:
            if name in broken:
                raise ModelLoadError(f"model {name}: {broken[name]}")
            raise ModelLoadError(f"model {name!r} is in no folder of the repository")
        return configs

    async def _load(self, name: str) -> str | None:
        registry = self.registry
        selected = self._selected(name)
        registry.set_unloaded(name, None)
        versions = registry.versions.get(name, {})
        failures = []
        for config in selected:
            model = versions.get(config.version)
            if model is not None and model.ready and model.fingerprint == fingerprint(config.path):
                continue  # unchanged: it keeps serving
            model = registry.to_load(config)
            if not await self.lifecycle.try_load(model, config, retry=False):
                failures.append(f"version {config.version}: {model.error}")
        if name in registry.unavailable:  # a folder of it that cannot be read: the call fails
            failures.append(registry.unavailable[name])
        if failures:
            return f"model {name}: " + "; ".join(failures)
        wanted = {c.version for c in selected}
        await asyncio.gather(
            *(
                self.lifecycle.unload(m)
                for v, m in list(versions.items())
                if v not in wanted and not m.unloading
            )
        )
        return None

    async def _unload(self, name: str, why: str) -> str | None:
        registry = self.registry
        models = [m for m in registry.versions.get(name, {}).values() if not m.unloading]
        if not models and name not in registry.unloaded and name not in registry.unavailable:
            return f"model {name!r} is not loaded"
        registry.set_unloaded(name, why)
        await asyncio.gather(*(self.lifecycle.unload(m) for m in models))
        return None

    # --- after boot, and polling ---------------------------------------------------------------

    async def reconcile(self) -> None:
        """Bring this worker to the server's model set (explicit mode), which may have changed
        while it booted."""
        wanted = self.model_set()
        if wanted is None:
            return
        registry = self.registry
        for name in wanted:
            if name not in registry.versions and name not in registry.unavailable:
                why = await self.apply(LOAD, name)
                if why:
                    log.warning("model %s (in the server's model set) did not load here: %s", name, why)
        for name in [n for n in registry.versions if n not in wanted]:
            await self.apply(UNLOAD, name)

    async def poll(self) -> None:
        """Until cancelled: every ``repository_poll_s`` seconds, load what is new or changed in
        the repository and unload what is gone (this worker only; every worker polls)."""
        names = set(self.settings.model_names)
        self._seen = self._snapshot(names)
        while True:
            await asyncio.sleep(self.settings.repository_poll_s)
            seen = await asyncio.get_running_loop().run_in_executor(None, self._snapshot, names)
            registry = self.registry
            for name in sorted(set(seen) | set(self._seen)):
                if name not in seen:
                    if name in registry.versions:
                        log.info("model %s left the repository: unloading it", name)
                        await self.apply(UNLOAD, name)
                elif seen[name] != self._seen.get(name):
                    log.info("model %s changed in the repository: loading it", name)
                    why = await self.apply(LOAD, name)
                    if why:
                        log.warning("poll: %s", why)
            self._seen = seen
            # A folder whose model.toml could not be read is in no snapshot: once it is gone
            # from the repository, it no longer keeps readiness (strict) at 503.
            broken = await asyncio.get_running_loop().run_in_executor(None, self._broken_names)
            for name in [n for n in registry.unavailable if n not in seen and n not in broken]:
                log.info("model %s left the repository: no longer unavailable", name)
                registry.set_unavailable(name, None)

    def _broken_names(self) -> set[str]:
        """Names (or folder names) of the repository's folders that cannot be read now; on a
        scan error, every name already unavailable (nothing is cleared)."""
        try:
            return {u.name for u in scan(self.settings.model_repository).unavailable}
        except ModelLoadError:
            return set(self.registry.unavailable)

    def _snapshot(self, names: set[str]) -> dict[str, dict[str, str]]:
        """name -> version -> fingerprint of every selected version in the repository (only
        ``names`` when given)."""
        try:
            found = serving(scan(self.settings.model_repository))
        except ModelLoadError as exc:
            log.warning("poll: %s", exc)
            return self._seen
        out: dict[str, dict[str, str]] = {}
        for config in found.configs:
            if not names or config.name in names:
                out.setdefault(config.name, {})[config.version] = fingerprint(config.path)
        return out
