"""The gunicorn worker of the scoring server: our own serve loop on gunicorn's public contract.

``gunicorn.conf.py`` selects :class:`ScoringWebWorker` (asyncio) or
:class:`ScoringUVLoopWebWorker`. Next to ``gunicorn.conf.py`` this package is the only code that
knows gunicorn exists. The worker subclasses ``gunicorn.workers.base.Worker`` and implements its
documented contract (``init_process`` -> ``init_signals``, ``load_wsgi``, ``run``; ``notify``
at least every ``timeout``; ``handle_exit``/``handle_quit``/``handle_abort``) with public
aiohttp and asyncio names only. ``run()`` builds the app with the app factory, an
``aiohttp.web.AppRunner``, its own accept loop (:mod:`app.server.listener`, gunicorn's
``backlog`` stays as the master set it) and the balancing among siblings
(:mod:`app.server.siblings`).

**Drain** (SIGTERM from a HUP reload, a ``kill``, a full stop; a ``max_requests`` recycle;
the app's own request after a hung batch):

1. at once: readiness 503 and every response ``Connection: close``
   (``app.serving.registry.ModelRegistry.begin_drain``); requests that still arrive are served;
2. the listener stays open for ``SCORING_DRAIN_GRACE_S`` (default 1 s), and longer, up to
   ``SCORING_DRAIN_MAX_HOLD_S``, while no other worker is ready and one is still booting or
   loading (a HUP reload starts the new workers and stops the old ones at the same moment:
   the old ones keep serving until a new one is warm, however long its boot takes);
3. then the listener stops, idle keep-alive connections close, in-flight and queued requests
   finish (up to 95% of the graceful timeout), the models unload, the process exits and
   gunicorn forks a replacement (except on a full stop).

**Stopped before ready**: a SIGTERM while the app is imported kills the worker (the default
action, until the event loop runs); one while its models load or it waits for them off the
listener stops it at once, without a drain and without waiting for a load under way (the master
forwards a stop to every worker at once: ``app.server.gunicorn_config.when_ready``); it opens
none of its listeners (HTTP, gRPC, the internal endpoint) after the stop.

**Drain-aware recycling**: a worker past ``max_requests`` (gunicorn's, jitter included)
recycles only while another worker is ready to take its traffic (or when it is the only
worker), so two workers that reach the limit together recycle one after the other.

**Boot heartbeat**: a thread notifies gunicorn from the fork until the event loop serves
(which then notifies every tick). Importing torch alone takes seconds; a worker timeout
shorter than the boot would otherwise kill every new worker, forever.

**Warm before listening**: a worker that boots while another one serves (a replacement, a
recycle, a HUP reload) starts listening only once its models are warm
(``Siblings.others_serving``). The first workers of a server listen at once (readiness 503
until warm).

**Worker states and load** for the above and for balancing: one record, the load table
(:mod:`app.server.balance`), through the worker's :class:`app.server.siblings.Membership`, made
whole in ``init_process`` with the worker's metrics. The app factory gets its balancer and
siblings (without a load table none, and the app stands alone), its connections' shedding, the
metrics, and the worker itself as its ``supervisor`` (``app.serving.siblings``); none is replaced
or completed afterwards. Once the app has started, the internal endpoint serves its core to the
siblings (``Membership.serve_endpoint``).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from aiohttp import web
from gunicorn.workers.base import Worker

from app.server.balance import DRAINING, LOADING, READY, STOPPING
from app.server.listener import Listener, new_event_loop, ssl_context
from app.server.siblings import Membership
from app.settings import Settings

# The master imports this module to find the worker class and must never import torch:
# the app's modules (app.serving.*) are imported in the worker, lazily.

__all__ = ["ScoringUVLoopWebWorker", "ScoringWebWorker"]

log = logging.getLogger(__name__)

#: How often the worker notifies gunicorn, publishes its load and looks at its siblings.
_TICK_S = 0.05
#: A gap between two ticks longer than this is logged as a stall, seconds.
_STALL_S = 2.0
#: How often it looks at its siblings' states for recycling (psutil reads /proc: off the loop).
_STATES_EVERY = 4
#: Between stopping the listener and the shutdown: time for the last accepted connections
#: to deliver their first request.
_LAST_ACCEPTS_S = 0.25


class ScoringWebWorker(Worker):  # type: ignore[misc]  # gunicorn is untyped
    """gunicorn worker serving the aiohttp app with a drain, drain-aware ``max_requests``
    recycling, a boot heartbeat and load balancing among siblings (module docstring)."""

    # Set by gunicorn's Worker (untyped).
    max_requests: int
    wsgi: Any
    alive: bool
    pid: int
    ppid: int
    cfg: Any
    sockets: list[Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.exit_code = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self._app: web.Application | None = None
        self._core: Any = None  # the serving core (app.serving.core.ServingCore), once built
        self._runner: web.AppRunner | None = None
        self._listener: Listener | None = None
        self._membership = Membership(None, os.getpid())  # alone until init_process
        self._metrics: Any = None
        self._draining = False
        self._was_ready = False
        self._finished = False
        self._aborted = False
        self._serving = threading.Event()
        self._stopped: asyncio.Event | None = None
        self._recycle_after = 0
        self._tasks: set[asyncio.Task[None]] = set()

    # --- gunicorn's contract ------------------------------------------------------

    def new_loop(self) -> asyncio.AbstractEventLoop:
        """The worker's event loop: asyncio's, on a selector that looks at the sockets again
        after the process was stopped (:func:`app.server.listener.new_event_loop`); uvloop's in the
        subclass."""
        return new_event_loop()

    def init_process(self) -> None:
        atexit.register(self._exit_without_teardown)  # first: it runs after the app's own
        # Before any import of the app (the membership's imports the serving layer, torch).
        threading.Thread(target=self._boot_heartbeat, name="boot-heartbeat", daemon=True).start()
        self.loop = self.new_loop()
        asyncio.set_event_loop(self.loop)
        self.settings = settings = Settings().for_workers(self.cfg.workers)
        if settings.metrics_enabled:
            from app.observability.metrics import create_metrics

            self._metrics = create_metrics()
        self._membership = Membership(
            settings.run_dir, os.getpid(), settings.balance, self._metrics, settings.peer_keepalive_s
        )
        # gunicorn's max_requests (jitter included) recycles through the drain.
        if 0 < self.max_requests < sys.maxsize:
            self._recycle_after = self.max_requests
        super().init_process()  # init_signals, load_wsgi, then run()

    def init_signals(self) -> None:
        """Signals through the event loop (so a handler runs between callbacks, not inside one).

        SIGTERM has its default action until the event loop runs (:meth:`_serve`): the app's
        import (torch: seconds) is not a loop callback, and a booting worker has nothing to
        drain, so a stop that arrives meanwhile ends it at once. (``post_fork`` already set it
        so; set here too, as a worker started without this project's hooks would still have the
        master's handler, which only queues the signal for the master's loop.)
        """
        assert self.loop is not None
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        handlers: dict[int, Callable[[int, Any], None]] = {
            signal.SIGQUIT: self.handle_quit,
            signal.SIGINT: self.handle_quit,
            signal.SIGWINCH: self.handle_winch,
            signal.SIGUSR1: self.handle_usr1,
            signal.SIGABRT: self.handle_abort,
        }
        for sig, handler in handlers.items():
            self.loop.add_signal_handler(sig, handler, sig, None)
        signal.siginterrupt(signal.SIGUSR1, False)
        # Inherited from the master: would swallow the exit status of the app's subprocesses.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)

    def run(self) -> None:
        assert self.loop is not None
        try:
            self.loop.run_until_complete(self._serve())
        finally:
            self._membership.release()
            if not self._aborted:  # an abort leaves generators mid-await: nothing to finish
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()
        self._finished = True
        sys.exit(self.exit_code)

    def _exit_without_teardown(self) -> None:
        """The worker's last exit handler, after a finished :meth:`run`: gunicorn's exit steps
        (its log line, ``worker_exit``) and every exit handler the app registered have run, the
        non-daemon threads are joined; the logs are flushed here and the process ends without
        the interpreter's teardown (freeing torch's and the app's objects one by one: seconds a
        worker, docs/benchmarks.md, *Figures behind the code's choices*), which only delayed the
        moment the kernel frees the worker's GPU lease for its replacement."""
        if not self._finished:  # a failed boot, an abort: the interpreter's own exit
            return
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(self.exit_code)

    def handle_exit(self, sig: int, frame: Any) -> None:
        """SIGTERM: drain (module docstring)."""
        self.stop_gracefully("SIGTERM")

    def handle_quit(self, sig: int, frame: Any) -> None:
        """SIGINT/SIGQUIT: stop now (in-flight requests get the shutdown timeout)."""
        self.alive = False
        self.cfg.worker_int(self)
        self._wake()

    def handle_abort(self, sig: int, frame: Any) -> None:
        """SIGABRT (gunicorn's timeout): exit with status 1 at once."""
        self.alive = False
        self.exit_code = 1
        self._aborted = True
        self.cfg.worker_abort(self)
        self._membership.release()
        sys.exit(1)

    # --- boot ---------------------------------------------------------------------

    def _boot_heartbeat(self) -> None:
        interval = max(0.1, min(1.0, self.cfg.timeout / 4))
        while not self._serving.wait(interval):
            self.notify()

    async def _serve(self) -> None:
        """Build the serving core and the HTTP app over it (``app.main``); run the core, gRPC
        and the HTTP app side by side, the internal endpoint and the listener once the core may
        listen; tick until stopped; stop them in the reverse order."""
        from app.grpc.server import serving_grpc  # imports grpc, and the core torch: not in the master
        from app.main import build_core

        self._stopped = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.handle_exit, signal.SIGTERM, None)
        signal.siginterrupt(signal.SIGTERM, False)
        factory = self.wsgi  # an async factory of the HTTP app over a core (app.main:create_app)
        if isinstance(factory, web.Application):
            raise TypeError("the worker serves an app factory (app.main:create_app), not an Application")
        member = self._membership
        core = build_core(self.settings, siblings=member.siblings, balancer=member.balancer, supervisor=self,
                          metrics=self._metrics, owns_process=True)  # fmt: skip
        app = await factory(self.settings, core=core, shedding=member.connections)
        if self._draining:  # stopped while the app was being made: nothing loaded, nothing to drain
            return
        self._attach(app, core)
        access_log = self.log.access_log if self.cfg.accesslog else None
        kwargs: dict[str, Any] = {}
        if "%(" not in self.cfg.access_log_format:  # gunicorn's own format: aiohttp's default
            kwargs["access_log_format"] = self.cfg.access_log_format
        runner = web.AppRunner(
            app,
            logger=self.log,
            keepalive_timeout=self.cfg.keepalive,
            access_log=access_log,
            shutdown_timeout=self.cfg.graceful_timeout / 100 * 95,
            **kwargs,
        )
        self._runner = runner
        # the core enters once this worker may listen (its models load; it defers while a
        # sibling serves); gRPC after it, the HTTP app last; they stop in the reverse order
        async with core.running(), serving_grpc(core):
            await runner.setup()
            try:
                await self._listen(core, runner)
            finally:
                await runner.cleanup()
        await member.close()

    async def _listen(self, core: Any, runner: web.AppRunner) -> None:
        """The internal endpoint and the listener (not for a worker stopped before it was ready),
        then the ticks until stopped."""
        from app.main import http_protocol

        server = runner.server
        assert server is not None
        if not self._draining:  # a worker stopped before it was ready starts no listener
            await self._membership.serve_endpoint(core)
        connections = self._membership.connections
        self._listener = Listener(
            asyncio.get_running_loop(),
            self.sockets,
            functools.partial(http_protocol, server),
            ssl_context(self.cfg) if self.cfg.is_ssl else None,
            may_accept=connections.may_accept if connections is not None else (lambda: True),
            accepted=connections.accepted if connections is not None else (lambda: None),
        )
        if not self._draining:
            self._listener.start()
        self._serving.set()  # the tick notifies gunicorn from now on
        await self._tick_until_stopped()
        self._listener.stop(close=True)

    def _attach(self, app: web.Application, core: Any) -> None:
        self._app, self._core = app, core
        app.on_shutdown.append(self._cancel_tasks)
        self._membership.publish(LOADING)

    def request_stop(self, reason: str) -> bool:
        """``app.serving.siblings.Supervisor``: drain and exit (:meth:`stop_gracefully`)."""
        self.stop_gracefully(reason)
        return True

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        assert self.loop is not None
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _cancel_tasks(self, app: web.Application) -> None:
        for task in list(self._tasks):
            task.cancel()

    # --- the serve loop -----------------------------------------------------------

    async def _tick_until_stopped(self) -> None:
        """Every tick: notify gunicorn, publish state and load, resume/pause the listener,
        recycle at max_requests, stop when the master is gone."""
        assert self._core is not None and self._stopped is not None
        core, member, stopped = self._core, self._membership, self._stopped
        pid = os.getpid()
        ticks = 0
        loop = asyncio.get_running_loop()
        last = loop.time()
        while self.alive and not stopped.is_set():
            self.notify()
            ticks += 1
            now = loop.time()
            if now - last > _STALL_S:  # SIGSTOP, or a call that held the GIL
                self.log.warning("worker %s: event loop stalled for %.1f s", pid, now - last)
            last = now
            ready = core.registry.ready and not self._draining
            state = READY if ready else DRAINING if self._draining else LOADING
            self._was_ready = self._was_ready or ready
            self._publish_load(state)
            if self.ppid != os.getppid():
                self.log.info("worker %s: parent changed, shutting down", pid)
                self.alive = False
                break
            served = core.health.responses
            if (
                not self._draining
                and self._recycle_after
                and served >= self._recycle_after
                and ticks % _STATES_EVERY == 0
                and await _off_loop(member.may_recycle)
            ):
                self.log.info(
                    "worker %s: %d responses (max_requests %d), recycling", pid, served, self._recycle_after
                )
                self.stop_gracefully("max_requests")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stopped.wait(), _TICK_S)

    def _publish_load(self, state: int) -> None:
        server = self._runner.server if self._runner is not None else None
        self._membership.tick(state, len(server.connections) if server is not None else 0)
        connections, listener = self._membership.connections, self._listener
        if (
            listener is not None
            and listener.listening
            and listener.paused
            and (connections is not None and connections.may_accept())
        ):
            listener.resume()

    def _wake(self) -> None:
        if self._stopped is not None:
            self._stopped.set()

    # --- drain --------------------------------------------------------------------

    def stop_gracefully(self, reason: str) -> None:
        """Drain and exit (module docstring); idempotent."""
        if self._draining:
            return
        self._draining = True
        self._serving.set()
        if reason == "hung inference":
            self.exit_code = 1  # gunicorn logs the exit status
        if self._core is None:  # still booting: nothing to drain
            self._stop()
            return
        registry = self._core.registry
        was_ready = self._was_ready or registry.ready
        registry.begin_drain(reason)
        if not was_ready:
            # Not ready yet (its models still load, or it waits for them off the listener): it
            # has served nothing worth a drain, and a sibling that drains waits for it (a HUP
            # reload): stop now; a load under way is left to its thread.
            self.log.info("worker %s (%s): stopped before it was ready", os.getpid(), reason)
            self._stop()
            return
        self._membership.publish(DRAINING)
        if self._listener is not None:
            self._listener.resume()  # accept while draining, whatever the balance said
        self._spawn(self._hold_then_stop(reason))

    async def _hold_then_stop(self, reason: str) -> None:
        settings = self.settings
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.sleep(settings.drain_grace_s)
        waited = False
        while loop.time() - started < settings.drain_max_hold_s and await _off_loop(
            self._membership.replacement_booting
        ):
            waited = True
            await asyncio.sleep(_TICK_S * 2)
        held = loop.time() - started
        self.log.info(
            "worker %s (%s): stops accepting after %.1f s%s; finishing in-flight requests",
            os.getpid(), reason, held, " (waited for a new worker to be ready)" if waited else "",
        )  # fmt: skip
        # Stop accepting first and give the connections accepted last a moment to deliver
        # their request: the shutdown (next) closes every connection that has no request in
        # progress, and one whose request has not been read yet would close unanswered.
        if self._listener is not None:
            self._listener.stop(close=True)
            await asyncio.sleep(_LAST_ACCEPTS_S)
        self._stop()

    def _stop(self) -> None:
        self._membership.publish(STOPPING)
        self.alive = False
        self._wake()


async def _off_loop(check: Callable[[], bool]) -> bool:
    """Run a sibling check (psutil reads /proc) on a helper thread."""
    return await asyncio.get_running_loop().run_in_executor(None, check)


class ScoringUVLoopWebWorker(ScoringWebWorker):
    """:class:`ScoringWebWorker` on uvloop (``SCORING_UVLOOP=1``)."""

    def new_loop(self) -> asyncio.AbstractEventLoop:
        import uvloop

        return uvloop.new_event_loop()
