"""A real gunicorn server on 127.0.0.1 as a child process, and the helpers around it.

- :class:`Gunicorn` runs ``gunicorn -c gunicorn.conf.py`` (a free port, a run directory of its
  own), logs to a file, and tells readiness from the workers' states in the load table
  ``<run dir>/load`` (``ready`` = warm and listening; ``app.server.siblings``), not from log
  text.
- :func:`poll` is the one "wait until, bounded" helper; it fails with a diagnostic, and
  :func:`wait_for` is it with a server's log tail as the diagnostic.
- :func:`http` is one blocking request; :func:`free_port` picks a port; :func:`repository_env`
  is the environment of a server of a model repository.

The end-to-end tests use it, and so do the measurement harnesses of ``benchmarks/``. Traffic
goes to 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import ssl
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self, TypeVar

import psutil

from benchmarks.driver import free_port, http, poll
from gpu_stat.family import live_children

__all__ = [
    "ROOT",
    "Gunicorn",
    "free_port",
    "http",
    "poll",
    "repository_env",
    "wait_for",
    "worker_items",
    "worker_shares",
]

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
READY = "ready"
#: Environment a launched server does not inherit unless asked (``clean_env=False``).
_SERVER_ENV_PREFIXES = ("SCORING_", "GPU_STAT_", "PROMETHEUS_")

T = TypeVar("T")
_WORKER_ITEMS = re.compile(r'^scoring_worker_items_total\{pid="(\d+)"\} ([0-9.e+]+)$', re.M)


def wait_for(predicate: Callable[[], T | None], timeout_s: float, what: str, srv: Gunicorn) -> T:
    """:func:`poll` that fails with ``srv``'s log tail."""
    return poll(predicate, timeout_s, what, diagnostics=srv.log_tail)


def repository_env(repo: Path, workers: int = 1, **settings: str) -> dict[str, str]:
    """The environment of a server of ``workers`` workers that serves the model repository
    ``repo``; ``settings``: more ``SCORING_*`` settings (over those two)."""
    return {"SCORING_MODEL_REPOSITORY": str(repo), "SCORING_WORKERS": str(workers), **settings}


def worker_items(metrics_text: str) -> dict[int, float]:
    """Items computed per worker pid, from a ``/metrics`` scrape (``scoring_worker_items_total``)."""
    return {int(pid): float(n) for pid, n in _WORKER_ITEMS.findall(metrics_text)}


def worker_shares(before: Mapping[int, float], after: Mapping[int, float]) -> dict[int, float]:
    """Each worker's share (0-1, 3 decimals) of the items computed between two
    :func:`worker_items` scrapes, by pid in ascending order; a worker that computed none shows 0,
    and every share is 0 when none computed any."""
    done = {pid: after[pid] - before.get(pid, 0.0) for pid in after}
    total = sum(done.values()) or 1.0
    return {pid: round(n / total, 3) for pid, n in sorted(done.items())}


def published_states(run_dir: Path) -> dict[int, str]:
    """pid -> the state each claimed slot of ``run_dir``'s load table publishes
    (``app.server.balance``'s state names, lower case); empty while there is no table."""
    from app.server import balance
    from app.server.balance import LoadTable

    names = ("empty", "binding", "booting", "loading", "ready", "draining", "stopping")
    assert [getattr(balance, n.upper()) for n in names] == list(range(len(names)))
    try:
        table = LoadTable(run_dir, readonly=True)
    except OSError:
        return {}
    try:
        return {load.pid: names[load.state] for load in table.snapshot() if load.pid > 0}
    finally:
        table.close()


class Gunicorn:
    """``gunicorn -c <config>`` on 127.0.0.1 as a child process, its output in ``log_path``.

    Args:
        tmp: a folder for the log, the pid file and the run directory.
        env: extra environment (``SCORING_*`` settings) over everything else.
        args: extra gunicorn command-line arguments.
        config: the gunicorn config file (default: the repository's ``gunicorn.conf.py``).
        context: serve over TLS (``SCORING_CERTFILE``/``SCORING_KEYFILE`` in ``env``) and trust it.
        headers: sent with every :meth:`get` / :meth:`post`.
        clean_env: drop inherited ``SCORING_*``, ``GPU_STAT_*``, ``PROMETHEUS_*`` and
            ``CUDA_VISIBLE_DEVICES`` first (tests); False lets them through (benchmarks).
        torch_threads: ``SCORING_TORCH_THREADS`` of every worker unless ``env`` names it (one
            per worker by default, so that tests on a shared machine do not oversubscribe it);
            None leaves it to the environment or the server's default (cores / workers).
        drain_grace_s: ``SCORING_DRAIN_GRACE_S`` (seconds) of every worker unless ``env`` names it:
            0 by default, so that each stop (and any drain the test does not look at) closes
            the listener at once instead of after the server's 1 s; a test of the drain or of a
            reload sets its own. None leaves it to the environment or the server's default
            (the benchmarks, which measure drains and reloads as deployed).
        root: the checkout to run (working directory and ``PYTHONPATH``; default this one;
            another commit's checkout for ``benchmarks/regression.py``).
    """

    def __init__(
        self,
        tmp: Path,
        env: Mapping[str, str] | None = None,
        args: Sequence[str] | None = None,
        *,
        config: str | os.PathLike[str] = "gunicorn.conf.py",
        context: ssl.SSLContext | None = None,
        headers: dict[str, str] | None = None,
        clean_env: bool = True,
        torch_threads: int | None = 1,
        drain_grace_s: float | None = 0.0,
        root: Path = ROOT,
    ) -> None:
        self.port = free_port()
        self.grpc_port = free_port()
        self.context = context
        self.headers = headers or {}
        self.url = f"{'https' if context else 'http'}://{HOST}:{self.port}"
        self.log_path = tmp / f"gunicorn-{self.port}.log"
        self.pidfile = tmp / f"gunicorn-{self.port}.pid"
        self.run_dir = tmp / f"run-{self.port}"
        inherited = {
            k: v
            for k, v in os.environ.items()
            if not clean_env or (not k.startswith(_SERVER_ENV_PREFIXES) and k != "CUDA_VISIBLE_DEVICES")
        }
        threads = {} if torch_threads is None else {"SCORING_TORCH_THREADS": str(torch_threads)}
        grace = {} if drain_grace_s is None else {"SCORING_DRAIN_GRACE_S": str(drain_grace_s)}
        full_env = {
            **inherited,
            **threads,
            **grace,
            "SCORING_HOST": HOST,
            "SCORING_PORT": str(self.port),
            "SCORING_GRPC_PORT": str(self.grpc_port),
            "SCORING_RUN_DIR": str(self.run_dir),
            "PYTHONPATH": str(root),
            "HF_HUB_OFFLINE": "1",
            **(env or {}),
        }
        self.run_dir = Path(full_env["SCORING_RUN_DIR"])  # env may name another
        self.grpc_port = int(full_env["SCORING_GRPC_PORT"])
        self.grpc_url = f"{HOST}:{self.grpc_port}"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        command = [sys.executable, "-m", "gunicorn", "-c", str(config), "--pid", str(self.pidfile)]
        self.proc = subprocess.Popen(
            [*command, *(args or [])], cwd=root, env=full_env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def log(self) -> str:
        """Everything the server has written so far."""
        return self.log_path.read_text(errors="replace")

    def log_tail(self, chars: int = 6000) -> str:
        return self.log()[-chars:]

    def get(
        self, path: str, headers: dict[str, str] | None = None, **kw: Any
    ) -> tuple[int, dict[str, str], Any]:
        """``http("GET", ...)`` on this server with its headers and TLS context."""
        return http(
            "GET", self.url + path, headers={**self.headers, **(headers or {})}, context=self.context, **kw
        )

    def scrape(self) -> str:
        """This server's ``/metrics`` text (every worker's figures); AssertionError unless 200."""
        status, _, text = self.get("/metrics", timeout=10)
        assert status == 200, f"/metrics: HTTP {status}"
        return str(text)

    def post(
        self, path: str, body: Any, headers: dict[str, str] | None = None, **kw: Any
    ) -> tuple[int, dict[str, str], Any]:
        """``http("POST", ...)`` on this server with its headers and TLS context."""
        headers = {**self.headers, **(headers or {})}
        return http("POST", self.url + path, body, headers=headers, context=self.context, **kw)

    def workers(self) -> list[psutil.Process]:
        """The master's live workers, oldest first (``gpu_stat.family``: zombies left out);
        empty once the master is gone."""
        workers = []
        for pid in live_children(self.proc.pid):
            with contextlib.suppress(psutil.Error):
                workers.append(psutil.Process(pid))
        return workers

    def worker_states(self) -> dict[int, str]:
        """pid -> published state of every live worker (``app.server.siblings``' state names;
        "" where it has no slot yet)."""
        published = published_states(self.run_dir)
        return {worker.pid: published.get(worker.pid, "") for worker in self.workers()}

    def ready_workers(self) -> set[int]:
        """Pids of the live workers whose published state is ``ready``."""
        return {pid for pid, state in self.worker_states().items() if state == READY}

    def all_workers_ready(self) -> bool:
        """At least one worker, and every live worker's published state is ``ready``."""
        states = self.worker_states()
        return bool(states) and all(state == READY for state in states.values())

    def answering_workers(self, count: int, timeout_s: float = 60.0) -> dict[int, dict[str, Any]]:
        """pid -> ``GET /v2``'s ``worker`` document of ``count`` distinct live workers: asks
        until that many answered (bounded; answers of workers that died meanwhile are dropped)."""
        seen: dict[int, dict[str, Any]] = {}

        def all_answered() -> bool:
            worker = self.get("/v2")[2]["worker"]
            seen[worker["pid"]] = worker
            live = {w.pid for w in self.workers()}
            for pid in [p for p in seen if p not in live]:
                del seen[pid]
            return len(seen) >= count

        poll(all_answered, timeout_s, f"GET /v2 from {count} workers", diagnostics=self.log_tail)
        return seen

    def _alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"gunicorn exited {self.proc.returncode}:\n{self.log_tail()}")

    def wait_ready(self, timeout_s: float = 120.0, *, all_workers: bool = True, count: int = 1) -> None:
        """Wait (bounded) until at least ``count`` workers are live and every live worker is
        ready (the load table), or with ``all_workers=False`` until ``count`` are ready; fail with
        the log, or at once if gunicorn exits."""

        def ready() -> bool:
            self._alive()
            if all_workers:
                return self.all_workers_ready() and len(self.workers()) >= count
            return len(self.ready_workers()) >= count

        poll(ready, timeout_s, "ready workers", interval_s=0.1, diagnostics=self.log_tail)

    def wait_workers(self, count: int, timeout_s: float = 60.0) -> list[psutil.Process]:
        """Wait (bounded) until the master has exactly ``count`` live workers; return them."""

        def exactly() -> list[psutil.Process]:
            self._alive()
            workers = self.workers()
            return workers if len(workers) == count else []

        return poll(exactly, timeout_s, f"{count} workers", diagnostics=self.log_tail)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout_s``; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
