"""The server a stress run drives, and what the schedule does to it from outside: gunicorn on
127.0.0.1 (:class:`tests.support.gunicorn.Gunicorn`) with explicit model control and the response
cache over a Redis tier, the redis-server beside it, model control calls, and waiting for the
workers to settle after a HUP or a kill.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.support.gunicorn import Gunicorn

#: The response cache's store: small, so that it evicts within minutes of traffic.
CACHE_BYTES = 32 << 20


class RedisProcess:
    """A redis-server (or valkey-server) on a Unix socket in ``folder``, nothing persisted, that
    can be stopped and started again at the same address (the schedule's Redis outage). A socket
    file and not a loopback port: while Redis is down for the outage, a port it released can be
    taken by any other process of the machine (another server's listener, an outgoing
    connection), and Redis could not come back at its address."""

    def __init__(self, folder: Path) -> None:
        binary = shutil.which("redis-server") or shutil.which("valkey-server")
        if binary is None:
            raise FileNotFoundError("no redis-server or valkey-server (apt-get install redis-server)")
        self.binary, self.folder = binary, folder
        self.socket = folder / "redis.sock"
        if len(str(self.socket)) > 100:  # a Unix socket's path holds at most 107 bytes
            self.socket = Path(tempfile.mkdtemp(prefix="stress-redis-")) / "redis.sock"
        self.pid: int | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}?db=0"

    def start(self) -> None:
        """Start it and wait for its first PONG (10 s at most). ``os.posix_spawn``, not a fork:
        the driver runs locust under gevent with gRPC clients, and a forked child of such a
        process can abort in gRPC's fork handlers before it reaches ``exec``.

        Raises:
            redis.ConnectionError: no PONG within 10 s, or the server exited.
        """
        command = [self.binary, "--port", "0", "--unixsocket", str(self.socket), "--unixsocketperm", "700",
                   "--save", "", "--appendonly", "no", "--dir", str(self.folder)]  # fmt: skip
        quiet = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_WRONLY, 0) for fd in (1, 2)]
        self.pid = os.posix_spawn(self.binary, command, dict(os.environ), file_actions=quiet)
        deadline = time.monotonic() + 10
        import redis

        client = redis.Redis(unix_socket_path=str(self.socket))
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    if time.monotonic() > deadline or not self._running():
                        raise
                    time.sleep(0.05)
        finally:
            client.close()

    def _running(self) -> bool:
        if self.pid is None:
            return False
        if os.waitpid(self.pid, os.WNOHANG)[0] == 0:
            return True
        self.pid = None  # reaped
        return False

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s; reaped either way."""
        if not self._running():
            return
        assert self.pid is not None
        os.kill(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while self._running() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.pid is not None:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        self.pid = None


def start_server(
    folder: Path, repository: Path, workers: int, redis_url: str, env: Mapping[str, str] | None = None
) -> Gunicorn:
    """gunicorn serving ``repository`` with ``workers`` workers (1 torch thread each), explicit
    model control, the response cache (:data:`CACHE_BYTES`) with ``redis_url`` as its second tier,
    the server's own drain grace; not ready yet (``wait_ready``)."""
    settings = {
        "SCORING_MODEL_REPOSITORY": str(repository),
        "SCORING_WORKERS": str(workers),
        "SCORING_MODEL_CONTROL_MODE": "explicit",
        "SCORING_RESPONSE_CACHE_BYTES": str(CACHE_BYTES),
        "SCORING_RESPONSE_CACHE_REDIS_URL": redis_url,
        "SCORING_ACCESS_LOG": "",
        **(env or {}),
    }
    return Gunicorn(folder, settings, drain_grace_s=None)


def control(srv: Gunicorn, action: str, model: str, timeout_s: float = 300.0) -> tuple[int, Any]:
    """``POST /v2/repository/models/{model}/{action}`` (load, unload): (status, answer)."""
    status, _, answer = srv.post(f"/v2/repository/models/{model}/{action}", {}, timeout=timeout_s)
    return status, answer


def settle(srv: Gunicorn, workers: int, gone: set[int], timeout_s: float = 300.0) -> float:
    """Wait until none of ``gone`` lives and ``workers`` workers are ready; seconds taken.

    Raises:
        RuntimeError: not settled within ``timeout_s``, or gunicorn exited.
    """
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        if srv.proc.poll() is not None:
            raise RuntimeError(f"gunicorn exited {srv.proc.returncode}")
        live = {w.pid for w in srv.workers()}
        if not live & gone and len(live) == workers and len(srv.ready_workers()) == workers:
            return time.monotonic() - began
        time.sleep(0.1)
    raise RuntimeError(f"the workers did not settle in {timeout_s} s")
