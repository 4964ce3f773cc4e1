"""A real redis-server (or valkey-server) on a free loopback port for the tests of the response
cache's Redis tier; nothing persisted. Skips the test, saying why, where neither is installed."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.gunicorn import free_port, poll


@contextlib.contextmanager
def redis_server(tmp: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``(url, process)`` of a redis-server of this test, stopped on exit (the test may stop
    it earlier: ``process.terminate()``)."""
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        pytest.skip("no redis-server or valkey-server on this machine (apt-get install redis-server)")
    import redis

    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    client = redis.Redis(port=port)
    try:
        poll(lambda: _pings(client), 10, "redis-server answering")
        yield f"redis://127.0.0.1:{port}/0", proc
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)


def _pings(client: Any) -> bool:
    import redis

    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False
