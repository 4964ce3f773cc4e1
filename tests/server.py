"""Run a real gunicorn server on 127.0.0.1 for end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(
    method: str,
    url: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30,
    context: ssl.SSLContext | None = None,
) -> tuple[int, dict[str, str], Any]:
    """One HTTP(S) request; returns (status, headers, parsed JSON or raw text)."""
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


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str, srv: Gunicorn) -> None:
    """Poll ``predicate`` every 50 ms until true (bounded); fail with the server log's tail."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}:\n{srv.log()[-6000:]}")


class Gunicorn:
    """``gunicorn -c gunicorn.conf.py`` as a child process, logs in ``log_path``."""

    def __init__(
        self,
        tmp: Path,
        env: dict[str, str] | None = None,
        args: list[str] | None = None,
        *,
        context: ssl.SSLContext | None = None,
        headers: dict[str, str] | None = None,
    ):
        """``context``: serve over TLS and trust it; ``headers`` go on every request."""
        self.port = free_port()
        self.grpc_port = free_port()
        self.grpc_url = f"127.0.0.1:{self.grpc_port}"
        self.context = context
        self.headers = headers or {}
        self.url = f"{'https' if context else 'http'}://127.0.0.1:{self.port}"
        self.log_path = tmp / f"gunicorn-{self.port}.log"
        self.pidfile = tmp / f"gunicorn-{self.port}.pid"
        full_env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("SCORING_", "GPU_STAT_", "PROMETHEUS_")) and k != "CUDA_VISIBLE_DEVICES"
        }
        full_env.update(
            {
                "SCORING_HOST": "127.0.0.1",
                "SCORING_PORT": str(self.port),
                "SCORING_GRPC_PORT": str(self.grpc_port),
                "SCORING_RUN_DIR": str(tmp / f"run-{self.port}"),
                "SCORING_TORCH_THREADS": "1",
                "PYTHONPATH": str(ROOT),
                "HF_HUB_OFFLINE": "1",
            }
        )
        full_env.update(env or {})
        self._log = open(self.log_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "--pid", str(self.pidfile), *(args or [])],
            cwd=ROOT,
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str, headers: dict[str, str] | None = None, **kw: Any) -> tuple[int, dict[str, str], Any]:
        return http("GET", self.url + path, headers={**self.headers, **(headers or {})}, context=self.context, **kw)

    def post(
        self, path: str, body: Any, headers: dict[str, str] | None = None, **kw: Any
    ) -> tuple[int, dict[str, str], Any]:
        headers = {**self.headers, **(headers or {})}
        return http("POST", self.url + path, body, headers=headers, context=self.context, **kw)

    def all_workers_ready(self) -> bool:
        """Every live worker has logged its "worker <pid> ready" line (app.serving.lifecycle)."""
        log = self.log()
        workers = self.workers()
        return bool(workers) and all(f"worker {w.pid} ready" in log for w in workers)

    def wait_ready(self, timeout_s: float = 120.0, *, all_workers: bool = True) -> None:
        """Poll until readiness answers 200 and every worker is warm (bounded); fail with the log.

        Readiness is per worker: while some workers still load, a probe may reach one of them.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"gunicorn exited {self.proc.returncode}:\n{self.log()}")
            try:
                ready = self.get("/v2/health/ready", timeout=5)[0] == 200
                if ready and (not all_workers or self.all_workers_ready()):
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"server not ready after {timeout_s}s:\n{self.log()}")

    def workers(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children()

    def wait_workers(self, count: int, timeout_s: float = 60.0) -> list[psutil.Process]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            workers = self.workers()
            if len(workers) == count:
                return workers
            time.sleep(0.05)
        raise AssertionError(f"expected {count} workers, have {len(self.workers())}:\n{self.log()}")

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> Gunicorn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
