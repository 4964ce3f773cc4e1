"""Steady load on a real server while a test does something else to it (a model swap, an
unload), and a look at which worker answers what on a new connection.

:class:`SteadyLoad` runs closed-loop HTTP clients (keep-alive, the stock aiohttp client) on a
thread of its own until stopped, and keeps every answer's status and ``model_version``;
:func:`on_new_connections` asks on fresh connections until every worker has answered, pairing
the worker's pid (``GET /v2``) with what the same connection then gets. Traffic goes to
127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp

from benchmarks.driver import poll

HOST = "127.0.0.1"


class SteadyLoad:
    """``connections`` clients sending ``body`` to ``path`` back to back, from now until
    :meth:`stop` (use it as a context manager).

    Attributes:
        statuses: how many answers got each HTTP status (0: no answer: reset, refused, timeout).
        versions: how many 200 answers came from each ``model_version``.
        errors: the first few bodies of answers that were not 200.
    """

    def __init__(self, port: int, path: str, body: dict[str, Any], connections: int = 16) -> None:
        self.url = f"http://{HOST}:{port}{path}"
        self.body = json.dumps(body).encode()
        self.connections = connections
        self.statuses: Counter[int] = Counter()
        self.versions: Counter[str] = Counter()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> SteadyLoad:
        self._thread.start()
        poll(lambda: sum(self.statuses.values()) >= self.connections, 30, "the load's first answers")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop the clients (each finishes the request it has in flight) and wait for them."""
        self._stop.set()
        self._thread.join(60)

    @property
    def answered(self) -> int:
        """Answers so far."""
        return sum(self.statuses.values())

    def wait_for_more(self, answers: int = 200) -> None:
        """Wait (bounded) until ``answers`` more answers came."""
        target = self.answered + answers
        poll(lambda: self.answered >= target, 60, f"{answers} more answers")

    async def _run(self) -> None:
        connector = aiohttp.TCPConnector(limit=self.connections)
        timeout = aiohttp.ClientTimeout(total=30)
        # A deadline of 30 s, not the model's (the feed-ranker's 1 s): these tests count the
        # answers a swap or a reload costs, and on a loaded machine 1 s is missed for no cause of theirs.
        headers = {"Content-Type": "application/json", "X-Request-Timeout-Ms": "30000"}
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

            async def client() -> None:
                while not self._stop.is_set():
                    try:
                        async with session.post(self.url, data=self.body, headers=headers) as resp:
                            raw = await resp.read()
                            status = resp.status
                    except (aiohttp.ClientError, TimeoutError) as exc:
                        status, raw = 0, repr(exc).encode()
                    self.statuses[status] += 1
                    if status == 200:
                        self.versions[json.loads(raw)["model_version"]] += 1
                    elif len(self.errors) < 5:
                        self.errors.append(raw[:300].decode(errors="replace"))

            await asyncio.gather(*(client() for _ in range(self.connections)))


def on_new_connections(
    port: int, ask: Callable[[http.client.HTTPConnection], Any], workers: int, timeout_s: float = 60
) -> dict[int, Any]:
    """pid -> ``ask(connection)`` of ``workers`` distinct workers: each try opens a new connection,
    asks ``GET /v2`` which worker it is, then ``ask`` on the same connection (the same worker)."""
    seen: dict[int, Any] = {}

    def one() -> bool:
        connection = http.client.HTTPConnection(HOST, port, timeout=30)
        try:
            connection.request("GET", "/v2")
            pid = json.loads(connection.getresponse().read())["worker"]["pid"]
            seen[pid] = ask(connection)
        finally:
            connection.close()
        return len(seen) >= workers

    poll(one, timeout_s, f"answers from {workers} workers", interval_s=0.01)
    return seen


def post_json(connection: http.client.HTTPConnection, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """POST ``body`` on ``connection``: (status, parsed JSON body)."""
    connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    return response.status, json.loads(response.read() or b"{}")
