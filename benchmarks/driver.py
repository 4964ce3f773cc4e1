"""The load driver every benchmark uses: closed-loop clients, one timed request, the figures of
a run, and a raw HTTP/1.1 keep-alive connection.

- :func:`closed_loop` runs N clients that each send the next request when the previous one is
  answered (Triton perf_analyzer's "concurrency" mode); :class:`Answer` is what a client saw.
- :func:`post` is one timed HTTP request on an aiohttp session; :func:`drive` and
  :func:`drive_grpc` are a whole closed-loop run over HTTP (one aiohttp session holding
  ``concurrency`` keep-alive connections) or over one gRPC channel, summed up by
  :func:`figures`.
- :func:`percentiles` is ``numpy.percentile`` (linear interpolation), NaN when empty.
- :class:`Connection` is one raw HTTP/1.1 keep-alive connection that knows its local port (the
  soak and overload clients: exact accounting of what a killed worker held, headers such as
  Retry-After).
- :func:`free_port`, :func:`http` (one blocking request) and :func:`poll` (the one "wait until,
  bounded" helper) for whatever talks to a server on loopback: the harnesses, the end-to-end
  tests' launcher (``tests.support.gunicorn``) and ``scripts/container_check.py``.

It imports nothing of the tests, and of the server only the gRPC stubs (in :func:`drive_grpc`),
so ``scripts/loadtest.py`` and ``scripts/container_check.py`` use it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import ssl
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import numpy as np

HOST = "127.0.0.1"
#: The lowest port :func:`free_port` picks (below it: well-known and commonly configured ports).
_FIRST_PORT = 10000
JSON_HEADERS = {"Content-Type": "application/json"}

R = TypeVar("R")
T = TypeVar("T")


def free_port(host: str = HOST) -> int:
    """A TCP port free on ``host`` right now, for a server about to listen on it.

    Picked at random below the kernel's ephemeral range (``ip_local_port_range``, where the
    kernel also takes the local ports of outgoing connections): a port the OS hands out for
    ``bind(0)`` can be given to a client's connection before the server binds it (gunicorn then
    fails with "Address already in use"; seen with four test processes on loopback). Another
    process picking the same port in the same moment is still possible (1 in about 22,000).
    Falls back to the OS's pick where that range leaves no room.
    """
    low = _ephemeral_low()
    if low > _FIRST_PORT + 1000:  # room for a random pick below the ephemeral range
        for port in random.SystemRandom().sample(range(_FIRST_PORT, low), 64):
            with socket.socket() as s, contextlib.suppress(OSError):  # in use: the next pick
                s.bind((host, port))
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    """The first port of Linux's ephemeral range (32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


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
        with exc:  # the error is the response: close it like one
            status, rh, raw = exc.code, dict(exc.headers), exc.read()
    try:
        return status, rh, json.loads(raw)
    except ValueError:
        return status, rh, raw.decode(errors="replace")


@dataclass(frozen=True)
class Answer:
    """One request as a client saw it: HTTP ``status`` (0 = no answer), ``latency_s``,
    ``error`` ("" when the status is 200) and, for a 503, its ``Retry-After`` in seconds (0.0
    when none)."""

    status: int
    latency_s: float
    error: str = ""
    retry_after_s: float = 0.0


def timed(call: Callable[[], object], seconds: float) -> list[float]:
    """Seconds each ``call()`` took, called back to back for ``seconds`` (at least 5 calls)."""
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 5:
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def percentiles(values: Iterable[float], qs: Sequence[float] = (50, 90, 95, 99)) -> list[float]:
    """``numpy.percentile`` of ``values`` at each of ``qs`` (0-100, linear interpolation);
    NaN for every q when ``values`` is empty."""
    array = np.fromiter(values, dtype=np.float64)
    if array.size == 0:
        return [float("nan")] * len(qs)
    return [float(v) for v in np.percentile(array, qs)]


async def post(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: Mapping[str, str] = JSON_HEADERS
) -> Answer:
    """POST ``body`` and read the whole answer; a connection error or timeout is status 0."""
    start = time.perf_counter()
    status, error, retry_after = 0, "", 0.0
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            await resp.read()
            status = resp.status
            if status != 200:
                error = f"HTTP {status}"
            if status == 503 and (value := resp.headers.get("Retry-After", "")).isdigit():
                retry_after = float(value)
    except (aiohttp.ClientError, TimeoutError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    return Answer(status, time.perf_counter() - start, error, retry_after)


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


def cycling(messages: Sequence[R], concurrency: int) -> Callable[[int], R]:
    """Client ``i``'s next message, each client walking ``messages`` from its own offset, so
    that concurrent clients send different ones."""
    sent = list(range(concurrency))

    def next_for(i: int) -> R:
        message = messages[sent[i] % len(messages)]
        sent[i] += concurrency
        return message

    return next_for


def figures(answers: Sequence[Answer], items: int, concurrency: int, elapsed_s: float) -> dict[str, Any]:
    """A run's row: ``concurrency``, ``requests`` (answered 200), ``errors`` (every other
    answer), ``statuses`` (their count per HTTP status, as strings: ``{"503": 4}``; a status of 0
    is a connection error), ``items_per_s`` (``items`` per successful request over
    ``elapsed_s``), ``p50_ms`` and ``p99_ms`` of the successful requests (NaN when none
    succeeded)."""
    ok = [a.latency_s * 1000 for a in answers if a.status == 200]
    p50, p99 = percentiles(ok, (50, 99))
    statuses = Counter(str(a.status) for a in answers if a.status != 200)
    return {
        "concurrency": concurrency,
        "requests": len(ok),
        "errors": len(answers) - len(ok),
        "statuses": dict(sorted(statuses.items())),
        "items_per_s": len(ok) * items / elapsed_s,
        "p50_ms": p50,
        "p99_ms": p99,
    }


async def timed_run(
    request: Callable[[int], Awaitable[Answer]], items: int, concurrency: int, seconds: float
) -> dict[str, Any]:
    """:func:`closed_loop` for ``seconds``, summed up by :func:`figures`."""
    begin = time.perf_counter()
    answers = await closed_loop(request, concurrency, begin + seconds)
    return figures(answers, items, concurrency, time.perf_counter() - begin)


async def drive(
    url: str, bodies: Sequence[bytes], items: int, concurrency: int, seconds: float
) -> dict[str, Any]:
    """Closed loop over HTTP: ``concurrency`` clients POST ``bodies`` (``items`` each, cycled)
    to ``url`` back to back for ``seconds`` on one aiohttp session whose connector holds
    ``concurrency`` keep-alive connections, opened once and reused; :func:`figures`."""
    body_for = cycling(bodies, concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        return await timed_run(lambda i: post(session, url, body_for(i)), items, concurrency, seconds)


async def drive_grpc(
    target: str, messages: Sequence[Any], items: int, concurrency: int, seconds: float
) -> dict[str, Any]:
    """Closed loop over ONE gRPC channel (one HTTP/2 connection) to ``target`` (host:port):
    ``concurrency`` ModelInfer calls in flight back to back for ``seconds``, ``messages``
    (``ModelInferRequest``\\ s of ``items`` each) cycled; :func:`figures` (a failed call is
    status 0, named by its gRPC status code)."""
    import grpc

    from app.grpc.generated import grpc_service_pb2_grpc as pb_grpc

    message_for = cycling(messages, concurrency)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]

        async def call(i: int) -> Answer:
            start = time.perf_counter()
            try:
                await stub.ModelInfer(message_for(i), timeout=30)
            except grpc.aio.AioRpcError as exc:
                return Answer(0, time.perf_counter() - start, str(exc.code()))
            return Answer(200, time.perf_counter() - start)

        return await timed_run(call, items, concurrency, seconds)


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
        """Close the transport (at once; nothing is flushed or awaited)."""
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
