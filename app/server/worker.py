"""The gunicorn workers of the scoring server: aiohttp's, with a graceful drain.

``gunicorn.conf.py`` selects :class:`ScoringWebWorker` (asyncio) or
:class:`ScoringUVLoopWebWorker`. Next to ``gunicorn.conf.py`` this is the only module that
knows gunicorn exists. What they add to aiohttp's ``GunicornWebWorker``:

**Drain** (SIGTERM from a HUP reload, a ``kill``, a full stop; a ``max_requests`` recycle;
the app's own request after a hung batch):

1. at once: readiness 503 and every response ``Connection: close``
   (:func:`app.serving.lifecycle.begin_drain`); requests that still arrive are served;
2. the listener stays open for ``SCORING_DRAIN_GRACE_S`` (default 1 s), and longer, up to
   half of gunicorn's graceful timeout, while no other worker is ready and one is still
   booting (a HUP reload starts the new workers and stops the old ones at the same
   moment: the old ones keep serving until a new one is warm);
3. then aiohttp's shutdown: the listener closes, idle keep-alive connections close,
   in-flight and queued requests finish (up to 95% of the graceful timeout), the models
   unload, the process exits and gunicorn forks a replacement (except on a full stop).

aiohttp's own worker stops at once at SIGTERM (checked once a second) and at
``max_requests`` (without a drain); here both go through the drain above.

**Drain-aware recycling**: a worker past ``max_requests`` (gunicorn's, jitter included)
recycles only while another worker is ready to take its traffic (or when it is the only
worker), so two workers that reach the limit together recycle one after the other.

**Boot heartbeat**: a thread notifies gunicorn from the fork until the event loop serves
(which then notifies once a second, as in aiohttp). Importing torch alone takes seconds; a
worker timeout shorter than the boot would otherwise kill every new worker, forever.

**Warm before listening**: a worker that boots while another one serves (a replacement, a
recycle, a HUP reload) starts listening only once its models are warm
(``WorkerLifecycle.defer_listening``), so no request waits for a model load while a warm
worker could take it. The first workers of a server listen at once (readiness 503 until warm).

**Worker states** for the above: one file per worker, ``<run dir>/workers/<pid>``, holding
``binding`` (waiting for a GPU slot, written by ``gunicorn.conf.py``'s ``post_fork``),
``booting`` (bound, importing), ``loading``, ``ready`` (warm and listening), ``draining``
(unready, still accepting) or ``stopping`` (listener closed, finishing requests). The master
removes it in ``child_exit``. A draining worker does not wait for a sibling that is still
``binding``: on a GPU whose slots are all taken, that sibling gets its slot only once the
draining worker has exited.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.worker import GunicornUVLoopWebWorker, GunicornWebWorker

from gpu_stat.family import live_children

# The master imports this module to find the worker class and must never import torch:
# the app's modules (app.serving.lifecycle, app.serving.state) are imported in the worker, lazily.

log = logging.getLogger(__name__)

STATES_DIR = "workers"
BINDING, BOOTING, LOADING = "binding", "booting", "loading"
READY, DRAINING, STOPPING = "ready", "draining", "stopping"
#: How often the worker looks at its app (readiness, request count) and at its siblings.
_TICK_S = 0.2
#: Between closing the listener and aiohttp's shutdown: time for the last accepted
#: connections to deliver their first request.
_LAST_ACCEPTS_S = 0.25


def states_dir(run_dir: str | os.PathLike[str]) -> Path:
    """Where the workers of the server with this run directory publish their state."""
    return Path(run_dir) / STATES_DIR


class SiblingStates:
    """This worker's state file, and a view of its siblings' (the master's other children).

    Args:
        directory: ``<run dir>/workers``; None disables the files (nothing to coordinate).
        pid: this worker's pid.
        ppid: the master's pid.
    """

    def __init__(self, directory: Path | None, pid: int, ppid: int) -> None:
        self.directory = directory
        self.pid = pid
        self.ppid = ppid
        self.state: str | None = None

    def publish(self, state: str) -> None:
        """Write this worker's state (best effort: a failure only weakens coordination)."""
        if state == self.state or self.directory is None:
            return
        self.state = state
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.directory / f".{self.pid}.tmp"
            tmp.write_text(state)
            tmp.replace(self.directory / str(self.pid))
        except OSError as exc:
            log.warning("cannot publish worker state %r in %s: %s", state, self.directory, exc)

    def siblings(self) -> dict[int, str]:
        """pid -> state of every other live worker (``binding`` when it has not said yet)."""
        states = {}
        for pid in live_children(self.ppid):  # gpu_stat.family: the one "my siblings" helper
            if pid == self.pid:
                continue
            state = BINDING
            if self.directory is not None:
                with contextlib.suppress(OSError):
                    state = (self.directory / str(pid)).read_text().strip() or BINDING
            states[pid] = state
        return states

    def replacement_booting(self) -> bool:
        """True while no other worker is ready and one is bound and still booting or loading."""
        states = set(self.siblings().values())
        return READY not in states and bool(states & {BOOTING, LOADING})

    def others_serving(self) -> bool:
        """True while another worker accepts requests (ready, or draining but still listening)."""
        return bool(set(self.siblings().values()) & {READY, DRAINING})

    def may_recycle(self) -> bool:
        """True when another worker is ready, or there is no other worker at all."""
        states = self.siblings()
        return not states or READY in states.values()


class ScoringWebWorker(GunicornWebWorker):
    """aiohttp's gunicorn worker with a graceful drain, drain-aware ``max_requests``
    recycling and a boot heartbeat (module docstring)."""

    # Set by gunicorn's Worker (untyped).
    max_requests: int
    wsgi: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._app: web.Application | None = None
        self._runner: web.AppRunner | None = None
        self._draining = False
        self._serving = threading.Event()
        self._states: SiblingStates | None = None
        self._recycle_after = 0
        self._tasks: set[asyncio.Task[None]] = set()

    # --- boot ---------------------------------------------------------------------

    def init_process(self) -> None:
        run_dir = os.environ.get("SCORING_RUN_DIR")
        self._states = SiblingStates(states_dir(run_dir) if run_dir else None, os.getpid(), self.ppid)
        # gunicorn's max_requests (jitter included) recycles through the drain; 0 turns
        # off aiohttp's own check, which would stop the worker without one.
        if 0 < self.max_requests < sys.maxsize:
            self._recycle_after = self.max_requests
        self.max_requests = 0
        threading.Thread(target=self._boot_heartbeat, name="boot-heartbeat", daemon=True).start()
        super().init_process()

    def _boot_heartbeat(self) -> None:
        interval = max(0.1, min(1.0, self.cfg.timeout / 4))
        while not self._serving.wait(interval):
            self.notify()

    def load_wsgi(self) -> None:
        super().load_wsgi()
        wsgi = self.wsgi  # an Application or an async factory of one (app.main:create_app)

        async def runner_factory() -> web.AppRunner:
            # aiohttp's worker runs an AppRunner the factory returns as it is; built here
            # with the worker's own arguments, so that the drain can stop the sites itself.
            app = wsgi if isinstance(wsgi, web.Application) else await wsgi()
            self._attach(app)
            access_log = self.log.access_log if self.cfg.accesslog else None
            self._runner = web.AppRunner(
                app,
                logger=self.log,
                keepalive_timeout=self.cfg.keepalive,
                access_log=access_log,
                access_log_format=self._get_valid_log_format(self.cfg.access_log_format),
                shutdown_timeout=self.cfg.graceful_timeout / 100 * 95,
            )
            return self._runner

        self.wsgi = runner_factory

    def _attach(self, app: web.Application) -> None:
        from app.serving.state import LIFECYCLE

        assert self._states is not None
        self._app = app
        app[LIFECYCLE].stop = self.stop_gracefully
        app[LIFECYCLE].defer_listening = self._states.others_serving
        app.on_shutdown.append(self._cancel_tasks)
        self._states.publish(LOADING)
        self._spawn(self._supervise())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _cancel_tasks(self, app: web.Application) -> None:
        for task in list(self._tasks):
            task.cancel()

    async def _supervise(self) -> None:
        """Every tick: end the boot heartbeat once serving, publish readiness, recycle."""
        from app.serving.state import LIFECYCLE, REGISTRY

        assert self._app is not None and self._states is not None
        app, states = self._app, self._states
        while not self._draining and self.alive:
            registry = app.get(REGISTRY)
            if self.booted:  # listening: the event loop notifies gunicorn from now on
                self._serving.set()
                if registry is not None and registry.ready:
                    states.publish(READY)
            served = app[LIFECYCLE].responses
            if self._recycle_after and served >= self._recycle_after and await _off_loop(states.may_recycle):
                self.log.info(
                    "worker %s: %d responses (max_requests %d), recycling",
                    self.pid, served, self._recycle_after,
                )  # fmt: skip
                self.stop_gracefully("max_requests")
                return
            await asyncio.sleep(_TICK_S)

    # --- drain --------------------------------------------------------------------

    def handle_exit(self, sig: int, frame: Any) -> None:
        """SIGTERM: drain instead of aiohttp's immediate stop."""
        self.stop_gracefully("SIGTERM")

    def stop_gracefully(self, reason: str) -> None:
        """Drain and exit (module docstring); idempotent. Installed as the app's
        ``WorkerLifecycle.stop``."""
        if self._draining:
            return
        self._draining = True
        self._serving.set()
        if reason == "hung inference":
            self.exit_code = 1  # gunicorn logs the exit status
        if self._app is None:  # still booting: nothing to drain
            self._stop()
            return
        from app.serving.lifecycle import begin_drain

        begin_drain(self._app, reason)
        assert self._states is not None
        self._states.publish(DRAINING)
        self._spawn(self._hold_then_stop(reason))

    async def _hold_then_stop(self, reason: str) -> None:
        from app.serving.state import SETTINGS

        assert self._app is not None and self._states is not None
        loop = asyncio.get_running_loop()
        started = loop.time()
        max_hold = self.cfg.graceful_timeout / 2
        await asyncio.sleep(min(self._app[SETTINGS].drain_grace_s, max_hold))
        waited = False
        while loop.time() - started < max_hold and await _off_loop(self._states.replacement_booting):
            waited = True
            await asyncio.sleep(_TICK_S / 2)
        held = loop.time() - started
        self.log.info(
            "worker %s (%s): stops accepting after %.1f s%s; finishing in-flight requests",
            self.pid, reason, held, " (waited for a new worker to be ready)" if waited else "",
        )  # fmt: skip
        # Close the listener first and give the connections it accepted last a moment to
        # read their request: aiohttp's shutdown (next) closes every connection that has no
        # request in progress, and one whose request has not been read yet would otherwise
        # hang until the shutdown timeout and then close without an answer.
        if self._runner is not None:
            for site in list(self._runner.sites):
                await site.stop()
            await asyncio.sleep(_LAST_ACCEPTS_S)
        self._stop()

    def _stop(self) -> None:
        if self._states is not None:
            self._states.publish(STOPPING)
        self.alive = False
        self._notify_waiter_done()


async def _off_loop(check: Callable[[], bool]) -> bool:
    """Run a sibling check (psutil, small file reads) on a helper thread."""
    return await asyncio.get_running_loop().run_in_executor(None, check)


class ScoringUVLoopWebWorker(ScoringWebWorker, GunicornUVLoopWebWorker):
    """:class:`ScoringWebWorker` on uvloop (``SCORING_UVLOOP=1``)."""
