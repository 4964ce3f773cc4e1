"""What the scripts and the end-to-end tests share: a gunicorn launcher, a port picker, one
bounded poll, a closed-loop load driver and latency percentiles (numpy).

- :class:`Gunicorn` runs ``gunicorn -c gunicorn.conf.py`` on 127.0.0.1 (a free port, a run
  directory of its own) as a child process, logs to a file, and tells readiness from the
  workers' states in the load table ``<run dir>/load`` (``ready`` = warm and listening;
  ``app.server.loadtable``), not from log text.
- :func:`poll` is the one "wait until, bounded" helper; it fails with a diagnostic.
- :func:`closed_loop` runs N clients that each send the next request when the previous one
  is answered (Triton perf_analyzer's "concurrency" mode); :func:`post` is one timed request.
- :func:`percentiles` is ``numpy.percentile`` (linear interpolation) in ms, NaN when empty.
- :class:`Connection` is one raw HTTP/1.1 keep-alive connection that knows its local port
  (the soak and overload clients: exact accounting of what a killed worker held, headers
  such as Retry-After).

Used by ``tests/server.py`` and every script in ``scripts/`` that starts a server. Traffic
goes to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self, TypeVar

import aiohttp
import numpy as np
import psutil

from gpu_stat.family import live_children

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
READY = "ready"
#: Environment a launched server does not inherit unless asked (``clean_env=False``).
_SERVER_ENV_PREFIXES = ("SCORING_", "GPU_STAT_", "PROMETHEUS_")
JSON_HEADERS = {"Content-Type": "application/json"}

T = TypeVar("T")
R = TypeVar("R")


def free_port(host: str = HOST) -> int:
    """A TCP port free on ``host`` right now (the OS picks it; a race with others is possible)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def poll(
    predicate: Callable[[], T | None],
    timeout_s: float,
    what: str,
    *,
    interval_s: float = 0.05,
    diagnostics: Callable[[], str] = lambda: "",
) -> T:
    """Call ``predicate`` every ``interval_s`` until it returns a truthy value, and return it.

    Raises:
        AssertionError: still falsy after ``timeout_s`` seconds; the message names ``what``
            and carries ``diagnostics()`` (e.g. a server log's tail).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n{diagnostics()}")
        time.sleep(interval_s)


def percentiles(values: Iterable[float], qs: Sequence[float] = (50, 90, 95, 99)) -> list[float]:
    """``numpy.percentile`` of ``values`` at each of ``qs`` (0-100, linear interpolation);
    NaN for every q when ``values`` is empty."""
    array = np.fromiter(values, dtype=np.float64)
    if array.size == 0:
        return [float("nan")] * len(qs)
    return [float(v) for v in np.percentile(array, qs)]


def http(
    method: str,
    url: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30,
    context: ssl.SSLContext | None = None,
) -> tuple[int, dict[str, str], Any]:
    """One blocking HTTP(S) request; returns (status, headers, parsed JSON or text).

    ``body``: bytes as they are, anything else as JSON. An HTTP error status is returned,
    not raised; connection errors raise ``OSError``.
    """
    data = None
    hdrs = dict(headers or {})
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        hdrs.setdefault("Content-Type", "application/json")
    req = urllib.request.Request(url, data=data, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
            status, rh, raw = resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        status, rh, raw = exc.code, dict(exc.headers), exc.read()
    try:
        return status, rh, json.loads(raw)
    except ValueError:
        return status, rh, raw.decode(errors="replace")


class Gunicorn:
    """``gunicorn -c <config>`` on 127.0.0.1 as a child process, its output in ``log_path``.

    Args:
        tmp: a folder for the log, the pid file and the run directory.
        env: extra environment (``SCORING_*`` settings) over the defaults below.
        args: extra gunicorn command-line arguments.
        config: the gunicorn config file (default: the repository's ``gunicorn.conf.py``).
        context: serve over TLS (``SCORING_CERTFILE``/``SCORING_KEYFILE`` in ``env``) and trust it.
        headers: sent with every :meth:`get` / :meth:`post`.
        clean_env: drop inherited ``SCORING_*``, ``GPU_STAT_*``, ``PROMETHEUS_*`` and
            ``CUDA_VISIBLE_DEVICES`` first (tests); False lets them through (benchmarks).
        root: the checkout to run (working directory and ``PYTHONPATH``; default this one;
            another commit's worktree for ``scripts/bench_ab.py``).
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
        full_env = {
            **inherited,
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
        """pid -> published state of every live worker (``app.server.loadtable``'s state names;
        "" where it has no slot yet)."""
        from app.server.loadtable import STATE_NAMES, LoadTable

        try:
            table = LoadTable(self.run_dir, readonly=True)
        except OSError:
            return {worker.pid: "" for worker in self.workers()}
        try:
            published = {load.pid: STATE_NAMES[load.state] for load in table.snapshot() if load.pid > 0}
        finally:
            table.close()
        return {worker.pid: published.get(worker.pid, "") for worker in self.workers()}

    def ready_workers(self) -> set[int]:
        """Pids of the live workers whose state file says ``ready``."""
        return {pid for pid, state in self.worker_states().items() if state == READY}

    def all_workers_ready(self) -> bool:
        """At least one worker, and every live worker's state file says ``ready``."""
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
        ready (state files), or with ``all_workers=False`` until ``count`` are ready; fail with
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


@dataclass(frozen=True)
class Answer:
    """One request as a client saw it: HTTP ``status`` (0 = no answer), ``latency_s``, and
    ``error`` ("" when the status is 200)."""

    status: int
    latency_s: float
    error: str = ""


async def post(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: Mapping[str, str] = JSON_HEADERS
) -> Answer:
    """POST ``body`` and read the whole answer; a connection error or timeout is status 0."""
    start = time.perf_counter()
    status, error = 0, ""
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            await resp.read()
            status = resp.status
            if status != 200:
                error = f"HTTP {status}"
    except (aiohttp.ClientError, TimeoutError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    return Answer(status, time.perf_counter() - start, error)


async def closed_loop(request: Callable[[int], Awaitable[R]], concurrency: int, until: float) -> list[R]:
    """``concurrency`` clients; client ``i`` awaits ``request(i)`` back to back until
    ``time.perf_counter()`` passes ``until`` (no request starts after it). Every result, in
    completion order."""
    results: list[R] = []

    async def client(i: int) -> None:
        while time.perf_counter() < until:
            results.append(await request(i))

    await asyncio.gather(*(client(i) for i in range(concurrency)))
    return results


class Connection:
    """One HTTP/1.1 keep-alive connection to ``host:port``, behaving like a pooling client
    library (urllib3, aiohttp, httpx): reuse it while :meth:`usable`, :meth:`open` a new one
    after a ``Connection: close`` answer or an EOF, never retry. ``local_port`` is the client
    end's port (0 before :meth:`open`), so a server-side connection list can be matched.
    Errors on the wire raise ``OSError``, ``asyncio.IncompleteReadError`` or ``ValueError``."""

    def __init__(self, port: int, host: str = HOST) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.local_port = 0

    def usable(self) -> bool:
        """Open, and the server has not closed it (no EOF seen)."""
        return (
            self.writer is not None
            and self.reader is not None
            and not self.reader.at_eof()
            and not self.writer.is_closing()
        )

    async def open(self) -> None:
        """Close any current connection and open a new one."""
        self.close()
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.local_port = self.writer.get_extra_info("sockname")[1]

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
        """Send one request (a JSON ``body``) and read the whole answer: (status, headers with
        lower-case names, body bytes). Closes the connection after ``Connection: close``."""
        assert self.reader is not None and self.writer is not None, "open() first"
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        await self.writer.drain()
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        payload = await self.reader.readexactly(int(headers.get("content-length", "0")))
        if headers.get("connection", "").lower() == "close":
            self.close()
        return status, headers, payload


_WORKER_ITEMS = re.compile(r'^scoring_worker_items_total\{pid="(\d+)"\} ([0-9.e+]+)$', re.M)


def worker_items(metrics_text: str) -> dict[str, float]:
    """Items answered per worker pid, from a ``/metrics`` scrape (``scoring_worker_items_total``)."""
    return {pid: float(n) for pid, n in _WORKER_ITEMS.findall(metrics_text)}


def worker_shares(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Each worker's share (0-1, 3 decimals) of the items answered between two
    :func:`worker_items` scrapes, by pid; a worker that answered none shows 0."""
    done = {pid: after[pid] - before.get(pid, 0.0) for pid in after}
    total = sum(done.values()) or 1.0
    return {pid: round(n / total, 3) for pid, n in sorted(done.items())}


def machine() -> dict[str, Any]:
    """Where a benchmark ran: CPU count, platform and Python version, for its JSON record."""
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


def benchmark_parser(
    doc: str | None,
    *,
    model: str | None = None,
    models: str | None = None,
    torch_threads: int | None = None,
) -> argparse.ArgumentParser:
    """The argument parser of a script that starts the server: ``doc`` (the script's docstring)
    as its help, and the options such scripts share: ``--repository`` (the model repository;
    default: the demo one), ``--workers`` (default 2), and, where a default is given,
    ``--model`` (one model), ``--models`` (comma-separated) and ``--torch-threads``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    if model is not None:
        parser.add_argument("--model", default=model)
    if models is not None:
        parser.add_argument("--models", default=models)
    parser.add_argument("--workers", type=int, default=2)
    if torch_threads is not None:
        parser.add_argument("--torch-threads", type=int, default=torch_threads)
    return parser


def comma_list(known: Iterable[str]) -> Callable[[str], list[str]]:
    """An argparse ``type``: a comma-separated list of values, each one of ``known`` (argparse
    reports any other as a usage error)."""
    allowed = list(known)

    def parse(text: str) -> list[str]:
        values = [v for v in text.split(",") if v]
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {allowed}")
        return values

    return parse
