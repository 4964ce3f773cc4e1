"""Gunicorn configuration of the scoring server: settings and hooks, read by the gunicorn master.

    scoring-server                                        # the console command (app.server.cli)
    gunicorn -c python:app.server.gunicorn_config         # the same, installed package
    gunicorn -c gunicorn.conf.py                          # the same, in a checkout (a thin file)
    gunicorn -c gunicorn.conf.py -w 4 -b 127.0.0.1:9000 app.main:create_app

Each serves ``app.main:create_app`` unless another app is named.

Every value comes from ``app.settings.Settings`` (``SCORING_*`` environment
variables); gunicorn's own flags and ``GUNICORN_CMD_ARGS`` override it.

Processes: this module runs in the gunicorn master, which counts usable GPUs
through NVML (``gpu_stat``) and never imports torch, so it never creates a CUDA
context. Workers = usable GPUs x ``SCORING_MAX_PROCESSES_PER_GPU``, or
``SCORING_WORKERS`` in CPU mode; in GPU mode no more than fit each GPU beside their models'
weights and activations (``app.models.placement``: planned from the model.toml files before
any worker forks, each GPU's shortfall logged, none at all a refusal to start), and a worker
binds only to a GPU with its planned bytes free (docs/gpu-binding.md, "Memory plan"). Each
forked worker binds itself to one GPU slot in ``post_fork`` (before the app, and so torch, is
imported).

Workers: ``app.server.worker.ScoringWebWorker`` (our own gunicorn worker serving the aiohttp
app: graceful drain at SIGTERM and ``max_requests``, boot heartbeat, load balancing among
siblings through ``<run dir>/load``); see docs/architecture.md and docs/reliability.md. The
listen ``backlog`` is gunicorn's (the workers never call ``listen`` again). TLS: set
``SCORING_CERTFILE`` and ``SCORING_KEYFILE``. Binding a non-loopback address without API
keys is logged as a warning at start. A worker that keeps exiting before it is ready is forked
more and more slowly (``app.server.restarts``).

Observability: Prometheus multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, by
default ``<run dir>/prometheus``, set here before anything imports
prometheus_client, wiped in ``on_starting``, dead workers' live gauges removed
in ``child_exit``); logs as text or JSON lines through ``logconfig_dict``
(``SCORING_LOG_FORMAT``). See docs/observability.md.

Read afresh every time: gunicorn reads its configuration at start and again at each HUP reload
(the usable GPUs are counted again, the settings read again). A config *file* is executed anew
each time, but ``-c python:<module>`` imports the module, and an import runs a module's body only
once per process: so this module forgets itself (``sys.modules``) once gunicorn has read it, in
``on_starting`` and in ``on_reload``, and ``gunicorn.conf.py`` does the same before importing it.
``__all__`` names exactly the gunicorn settings and hooks defined here: what
``from app.server.gunicorn_config import *`` gives the thin file is what gunicorn reads from the
module itself. This module runs in the master: no torch, no CUDA, no aiohttp app.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import ipaddress
import logging
import os
import shutil
import signal
import ssl
import sys
import time
from pathlib import Path
from typing import Any

from gunicorn.config import KNOWN_SETTINGS

from app.observability.logconfig import log_config
from app.server import balance, rundir
from app.server.restarts import RestartBackoff, wait_before_booting
from app.serving.auth import read_key_file
from app.settings import Settings
from gpu_stat import NvmlUnavailable, backend_name, query_gpus
from gpu_stat.binding import (
    EXIT_BIND_TIMEOUT,
    BindingPolicy,
    BindTimeout,
    bind_worker,
    usable_gpu_count,
)
from gpu_stat.planner import allowed_units, units

_settings = Settings()
_log = logging.getLogger("gunicorn.error")

#: Exit status of a worker that found no GPU slot in time (75, EX_TEMPFAIL). Not 3 or 4:
#: gunicorn halts the whole server on those; on 75 it logs the exit and forks a new worker.
BIND_FAILED_EXIT = EXIT_BIND_TIMEOUT

try:
    # Private to this user: a fresh mkdtemp folder, or the one named, checked (app.server.rundir).
    _run_dir = rundir.prepare(_settings.run_dir)
except (OSError, rundir.RunDirError) as _exc:
    raise SystemExit(f"SCORING_RUN_DIR: {_exc}") from None
# A HUP reload runs this module again in the same master, which now finds SCORING_RUN_DIR set
# (below): remember that the directory is the default one, so that on_exit still removes it.
_DEFAULT_RUN_DIR_ENV = "SCORING_SERVER_DEFAULT_RUN_DIR"
_default_run_dir = _settings.run_dir is None or os.environ.get(_DEFAULT_RUN_DIR_ENV) == str(_run_dir)
if _default_run_dir:
    os.environ[_DEFAULT_RUN_DIR_ENV] = str(_run_dir)
os.environ["SCORING_RUN_DIR"] = str(_run_dir)
# prometheus_client picks file-backed values at import time, so this must come before any
# import of it (the workers import app.observability.metrics; child_exit below imports it in the master).
os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", str(_run_dir / "prometheus"))
# The Rust tokenizer's batch calls run on the calling prepare thread, not on a rayon pool of
# one thread per core in every worker: the workers and their prepare threads are the
# parallelism, and idle pool threads spin (docs/benchmarks.md, "Host path"). Set it to "true"
# to get the pool back.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
_metrics_dir = Path(os.environ["PROMETHEUS_MULTIPROC_DIR"])

_policy = BindingPolicy(
    run_dir=_run_dir,
    max_processes_per_gpu=_settings.max_processes_per_gpu,
    allowed_gpus=_settings.gpu_allow_list,
    min_free_memory_bytes=_settings.min_free_memory_mib * 1024 * 1024,
    foreign_process_policy=_settings.foreign_process_policy,
    bind_timeout_s=_settings.bind_timeout_s,
)
_gpus = usable_gpu_count(_policy)
if _settings.gpu_allow_list and not _gpus:
    # An operator who names GPUs wants them: refuse to start rather than serve on the CPU.
    raise SystemExit(
        f"SCORING_GPUS={_settings.gpus!r} but none of those GPUs is usable "
        f"(NVML backend {backend_name()}); see `python -m gpu_stat`"
    )


def _gpu_rooms(policy: BindingPolicy) -> list[tuple[str, int, int]]:
    """Each usable GPU's ``(label, total bytes, bytes free for this server)``, NVML's: free now at
    the first start; the total at a HUP reload, where the old workers, this master's children,
    hold memory they give back as they exit (the binding's free-memory floor waits for it)."""
    import psutil

    reload = bool(psutil.Process().children())
    allowed, _ = allowed_units(units(query_gpus()), policy.allowed_gpus)
    return [
        (
            f"{u.label()} ({u.gpu.name})",
            u.gpu.memory_total,
            u.gpu.memory_total if reload else u.gpu.memory_free,
        )
        for u in allowed
    ]


def _plan(policy: BindingPolicy) -> tuple[int, BindingPolicy, list[tuple[int, str]]]:
    """GPU mode: how many workers fit the usable GPUs beside their models' weights and activations
    (``app.models.placement.plan_server``, in the dtype each model.toml names), the binding policy
    with the worker's bytes as its free-memory floor, and the lines to log (a warning per GPU
    that takes fewer than asked); every worker asked where the plan cannot be made (a
    repository it cannot read: the workers will say why).

    Raises:
        SystemExit: no GPU can hold one worker (a clear refusal, not workers that run out of
            memory while loading and are forked again).
    """
    from app.errors import ModelLoadError
    from app.models.placement import plan_server

    asked = _settings.max_processes_per_gpu
    try:
        plan = plan_server(_settings.model_repository, _settings.model_names, asked, _gpu_rooms(policy))
    except (ModelLoadError, NvmlUnavailable, OSError, ValueError) as exc:
        return (
            _gpus * asked,
            policy,
            [(logging.WARNING, f"memory plan not made ({exc}): {asked} worker(s) per GPU")],
        )
    if not plan.workers:
        raise SystemExit("memory plan: " + " ".join(plan.messages))
    floor = max(policy.min_free_memory_bytes, plan.worker.total_bytes)
    lines = [(logging.INFO, f"memory plan: {plan.worker.describe()}; {plan.workers} worker(s)")]
    lines += [(logging.WARNING, message) for message in plan.messages]
    return plan.workers, dataclasses.replace(policy, min_free_memory_bytes=floor), lines


wsgi_app = "app.main:create_app"
_host = f"[{_settings.host}]" if ":" in _settings.host else _settings.host  # IPv6 literal
bind = [f"{_host}:{_settings.port}"]
workers, _policy, _plan_lines = _plan(_policy) if _gpus else (_settings.workers, _policy, [])
worker_class = (
    "app.server.worker.ScoringUVLoopWebWorker"
    if _settings.uvloop and importlib.util.find_spec("uvloop") is not None
    else "app.server.worker.ScoringWebWorker"
)
timeout = _settings.timeout_s
graceful_timeout = _settings.graceful_timeout_s
keepalive = _settings.keepalive_s
max_requests = _settings.max_requests
max_requests_jitter = _settings.max_requests_jitter
if _settings.certfile is not None and _settings.keyfile is not None:
    certfile = str(_settings.certfile)
    keyfile = str(_settings.keyfile)
if _settings.client_ca_file is not None:  # mutual TLS; gRPC reads the same setting
    ca_certs = str(_settings.client_ca_file)
    cert_reqs = ssl.CERT_REQUIRED
if _settings.api_keys_file is not None:
    try:
        read_key_file(_settings.api_keys_file)
    except OSError as exc:
        raise SystemExit(f"SCORING_API_KEYS_FILE={_settings.api_keys_file}: {exc}") from None
accesslog = _settings.access_log or None
# aiohttp's format: remote address, request line, status, bytes, latency in seconds (1 ms steps
# under uvloop), request id, the app's time in ms (Server-Timing: app;dur=...). In JSON mode
# each atom is also a key of the line (app.observability.logconfig.JsonFormatter).
access_log_format = '%a "%r" %s %b %Tf rid=%{X-Request-Id}o %{Server-Timing}o'
loglevel = _settings.log_level
logconfig_dict = log_config(_settings.log_format, _settings.log_level, accesslog)
proc_name = "scoring-server"
# gunicorn >= 24 opens a control socket; keep it per server so servers never collide.
control_socket = str(_run_dir / "gunicorn.ctl")


def _read_afresh_next_time() -> None:
    """Forget this module, so that gunicorn's next read of the configuration (a HUP reload)
    runs it again instead of finding it imported (module docstring). The running hooks keep
    their own module's state."""
    sys.modules.pop(__name__, None)


def on_starting(server: Any) -> None:
    """Master, once: make the metrics folder (private) and empty it, say how the worker count
    was chosen."""
    _read_afresh_next_time()
    if _metrics_dir.parent == _run_dir:
        rundir.private_subdir(_run_dir, _metrics_dir.name)
    else:
        _metrics_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    for stale in _metrics_dir.glob("*.db"):  # a previous server's samples would add up with ours
        stale.unlink()
    # A previous server's load table and shard sockets (app.server.balance, app.server.peers).
    (_run_dir / "load").unlink(missing_ok=True)
    shutil.rmtree(_run_dir / "peers", ignore_errors=True)
    mode = f"{_gpus} usable GPU(s) x {_settings.max_processes_per_gpu}" if _gpus else "CPU mode"
    for level, line in _plan_lines:
        server.log.log(level, line)
    server.log.info(
        "scoring-server: %d worker(s) (%s; NVML backend %s); run dir %s",
        server.cfg.workers,
        mode,
        _backend(),
        _run_dir,
    )
    exposed = [a for a in server.cfg.address if isinstance(a, tuple) and not _is_loopback(a[0])]
    if exposed and not _settings.auth_enabled:
        server.log.warning(
            "listening on %s without API keys: anyone who can reach it can use it "
            "(set SCORING_API_KEYS or SCORING_API_KEYS_FILE; docs/reliability.md)",
            ", ".join(f"{h}:{p}" for h, p in exposed),
        )


def on_reload(server: Any) -> None:
    """Master, after a HUP reload read the configuration again (this very module, run afresh)."""
    _read_afresh_next_time()


def when_ready(server: Any) -> None:
    """Master, once it listens: a stop signal reaches the workers at once, not when gunicorn's
    main loop gets to it.

    gunicorn queues signals for its main loop, and a HUP reload holds that loop for up to the
    graceful timeout while the old workers exit, which they do only once a new worker is warm
    (``app.server.worker``, *Drain*). A stop during a reload with slow model loads then reached
    no worker for that long, and took the graceful timeout again after: past systemd's
    ``TimeoutStopSec``, which SIGKILLed the lot. So the master's handlers for SIGTERM (graceful:
    forwarded as SIGTERM) and SIGINT/SIGQUIT (quick: forwarded as SIGQUIT, what gunicorn sends
    for them) first pass the signal on to every worker: a booting one stops at once, a draining
    one stops waiting for its replacement; then gunicorn's own handler queues it as before (its
    stop signals the workers again, which changes nothing)."""
    master = os.getpid()
    for sig, forward in (
        (signal.SIGTERM, signal.SIGTERM),
        (signal.SIGINT, signal.SIGQUIT),
        (signal.SIGQUIT, signal.SIGQUIT),
    ):
        signal.signal(sig, _forwarding(server, master, forward, signal.getsignal(sig)))


def _forwarding(server: Any, master: int, forward: int, queued: Any) -> Any:
    def handler(signum: int, frame: Any) -> None:
        if os.getpid() == master:  # not in a worker forked a moment ago that still has it
            for pid in list(server.WORKERS):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, forward)
        if callable(queued):
            queued(signum, frame)

    return handler


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def _backend() -> str:
    try:
        return backend_name()
    except Exception as exc:  # NVML missing: CPU mode
        return f"unavailable ({exc})"


#: Workers that keep dying before they are ready are forked more and more slowly.
_restarts = RestartBackoff()
#: How long the worker forked next waits before it boots, seconds (set in the master by
#: pre_fork; the child reads its copy in post_fork).
_boot_delay_s = 0.0


def pre_fork(server: Any, worker: Any) -> None:
    """Master, before each fork: how long the new worker waits before it boots (a worker that
    keeps crashing while it boots is not forked again a few times a second)."""
    global _boot_delay_s
    _boot_delay_s = _restarts.delay_s(time.monotonic())
    if _boot_delay_s:
        server.log.warning(
            "workers keep exiting before they are ready: the next one boots in %.0f s", _boot_delay_s
        )


def post_fork(server: Any, worker: Any) -> None:
    """Worker, before the app is imported: wait out a restart backoff, then bind to a GPU slot.
    The app, in this process, reads the binding from ``gpu_stat.binding.current_binding()``;
    torch picks the device ("auto")."""
    # Until the worker installs its own handlers (init_process, after this hook) it still has
    # the master's, which only queue the signal for the master's loop: a SIGTERM sent now, say
    # by a HUP reload while this worker waits for a GPU slot, would be lost and the worker
    # would live on holding its slot. A booting worker has nothing to drain: let it die.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    wait_before_booting(_boot_delay_s, worker.notify)
    # The worker's slot in the load table, its one state record (app.server.balance):
    # draining siblings wait for a booting worker, not for one still waiting for a GPU slot.
    table = balance.LoadTable(_run_dir)
    slot = table.claim(os.getpid(), balance.BINDING)
    try:
        bind_worker(_policy, heartbeat=worker.notify)
    except BindTimeout as exc:
        worker.log.error("worker %d: %s; exiting with status %d", os.getpid(), exc, BIND_FAILED_EXIT)
        sys.exit(BIND_FAILED_EXIT)
    table.set_state(slot, balance.BOOTING)
    table.close()


def child_exit(server: Any, worker: Any) -> None:
    """Master, after a worker exited (however it died): drop its live gauges from /metrics and
    free its load table slot. Its counters and histograms stay in the folder, so totals never
    go backwards.
    """
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid, str(_metrics_dir))  # type: ignore[no-untyped-call]
    try:
        table = balance.LoadTable(_run_dir)
    except OSError as exc:
        server.log.warning("cannot free the load table slot of worker %d: %s", worker.pid, exc)
        return
    slot = table.slot_of(worker.pid)
    if slot is not None and table.read(slot).state < balance.READY:
        _restarts.exited_early(time.monotonic())  # it exited before it ever served
    table.release_pid(worker.pid)
    table.close()


def on_exit(server: Any) -> None:
    """Master, at the very end: remove the run directory it made (never one the user named).

    Every worker is gone, so no lease is held; a HUP reload does not come here.
    """
    if _default_run_dir:
        shutil.rmtree(_run_dir, ignore_errors=True)


#: The gunicorn settings and hooks above: what ``gunicorn.conf.py`` takes with ``import *``.
__all__ = sorted({setting.name for setting in KNOWN_SETTINGS} & set(globals()))
