"""Closed-loop load from clients that are not the bound: wrk, or several client processes, each
figure with the client's own CPU beside it.

A host-path figure (worker CPU per item) or a GPU figure (items/s) means little when the load
client runs out of CPU first: one Python process with 64 connections spends 100-200 us of CPU a
request, about what the server spends. Two clients here:

- :func:`run_wrk`: wrk (Debian's ``wrk`` package, a C client driven by a Lua script,
  ``benchmarks/wrk_requests.lua``) for HTTP/1.1: ``concurrency`` keep-alive connections over
  ``threads`` threads, each connection sending its next request when the previous is answered;
  the requests are formatted once. Latency percentiles are wrk's; it cannot tell requests apart.
- :func:`run_processes`: ``processes`` Python processes (spawned, each with an event loop) that
  share the ``concurrency`` closed-loop clients out, over HTTP (aiohttp, a keep-alive connection
  per client) or gRPC (one channel per process, the request sent as the serialized message it
  is: no protobuf work in the client). Every answer is kept with its request's ``tag``, so
  percentiles come per kind of request (:attr:`LoadResult.by_tag`).

Either way the client's CPU (user + system seconds of wrk, or of every client process over the
measured window) comes back in :attr:`LoadResult.client_cpu_s`. Traffic goes to the URL or
target given (the harnesses give 127.0.0.1), and every run stops by itself after ``seconds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import queue
import resource
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

from benchmarks.driver import JSON_HEADERS, percentiles

LUA = Path(__file__).with_name("wrk_requests.lua")
#: gRPC's ModelInfer method, as :func:`run_processes` calls it.
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"


@dataclass(frozen=True)
class Request:
    """One request a client sends: an HTTP ``path`` (or, over gRPC, the method, e.g.
    :data:`MODEL_INFER`, and ``body`` the serialized message), its ``headers`` and a ``tag`` that
    groups answers (e.g. ``"long"``/``"short"``)."""

    path: str
    body: bytes
    headers: Mapping[str, str] = field(default_factory=lambda: dict(JSON_HEADERS))
    tag: str = ""


@dataclass
class LoadResult:
    """What one closed-loop run saw.

    Attributes:
        client: ``"wrk"`` or ``"processes"``.
        concurrency: requests in flight.
        elapsed_s: the measured window, seconds.
        ok: requests answered 200 (gRPC: OK).
        statuses: the other answers, counted per status (``"503"``; ``"0"`` or a gRPC code name
            for a failed call, ``"socket"`` for wrk's connection errors).
        p50_ms, p99_ms: latency of the answered requests (wrk: of every request it timed).
        client_cpu_s: user + system CPU seconds the client spent in the window.
        by_tag: per tag: ``ok``, ``p50_ms``, ``p99_ms`` (:func:`run_processes` only).
        said: per status of :attr:`statuses`, the start of the first such answer's body (or the
            gRPC status details; :func:`run_processes` only).
    """

    client: str
    concurrency: int
    elapsed_s: float
    ok: int
    statuses: dict[str, int]
    p50_ms: float
    p99_ms: float
    client_cpu_s: float
    by_tag: dict[str, dict[str, float]] = field(default_factory=dict)
    said: dict[str, str] = field(default_factory=dict)

    def figures(self, items: int) -> dict[str, Any]:
        """A row: requests and ``items`` per request answered per second, latencies, errors and
        the client's CPU (seconds, and microseconds per item answered)."""
        answered = self.ok * items
        return {
            "client": self.client,
            "concurrency": self.concurrency,
            "requests": self.ok,
            "errors": sum(self.statuses.values()),
            "statuses": dict(sorted(self.statuses.items())),
            "items_per_s": answered / self.elapsed_s if self.elapsed_s else 0.0,
            "p50_ms": self.p50_ms,
            "p99_ms": self.p99_ms,
            "client_cpu_s": self.client_cpu_s,
            "client_cpu_us_per_item": self.client_cpu_s * 1e6 / answered if answered else float("nan"),
            "said": self.said,
        }


def wrk_available() -> bool:
    """Whether ``wrk`` is on the PATH (``apt-get install wrk``)."""
    return shutil.which("wrk") is not None


def write_requests(folder: Path, requests: Sequence[Request]) -> None:
    """``requests.bin`` and ``requests.tsv`` in ``folder``, as ``wrk_requests.lua`` reads them.

    Raises:
        ValueError: a path or header has a tab or a line break (the index's separators).
    """
    lines = []
    for r in requests:
        fields = [r.path, str(len(r.body)), *(f"{name}: {value}" for name, value in r.headers.items())]
        if any(c in f for f in fields for c in "\t\r\n"):
            raise ValueError(f"a tab or line break in {fields}")
        lines.append("\t".join(fields))
    (folder / "requests.bin").write_bytes(b"".join(r.body for r in requests))
    (folder / "requests.tsv").write_text("\n".join(lines) + "\n")


def wrk_result(said: str, concurrency: int, cpu_s: float) -> LoadResult:
    """The :class:`LoadResult` of the JSON line ``wrk_requests.lua``'s ``done()`` printed in
    ``said`` (wrk's whole output).

    Raises:
        ValueError: no such line (wrk failed: its output is in the message).
    """
    line = next((ln for ln in said.splitlines() if ln.startswith('{"requests"')), None)
    if line is None:
        raise ValueError(f"wrk printed no figures:\n{said[-2000:]}")
    w = json.loads(line)
    socket_errors = w["connect"] + w["read"] + w["write"] + w["timeout"]
    statuses = {k: v for k, v in (("non-2xx", w["status"]), ("socket", socket_errors)) if v}
    return LoadResult(
        client="wrk",
        concurrency=concurrency,
        elapsed_s=w["duration_us"] / 1e6,
        ok=w["requests"] - w["status"],
        statuses=statuses,
        p50_ms=w["p50_us"] / 1000,
        p99_ms=w["p99_us"] / 1000,
        client_cpu_s=cpu_s,
    )


def run_wrk(
    base_url: str, requests: Sequence[Request], concurrency: int, seconds: float, threads: int = 2
) -> LoadResult:
    """wrk against ``base_url`` (``http://host:port``) for ``seconds``: ``concurrency``
    connections over ``threads`` threads cycling through ``requests`` (HTTP POSTs).

    Raises:
        FileNotFoundError: no ``wrk`` on the PATH.
        ValueError: wrk printed no figures.
    """
    wrk = shutil.which("wrk")
    if wrk is None:
        raise FileNotFoundError("wrk is not installed (apt-get install wrk)")
    with tempfile.TemporaryDirectory() as tmp:
        write_requests(Path(tmp), requests)
        command = [
            wrk, "-t", str(min(threads, concurrency)), "-c", str(concurrency),
            "-d", f"{max(1, round(seconds))}s", "--timeout", "30s", "-s", str(LUA), base_url,
        ]  # fmt: skip
        with tempfile.TemporaryFile() as out:
            child = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "WRK_REQUESTS": tmp}
            )
            _, _, usage = os.wait4(child.pid, 0)
            child.returncode = 0  # reaped by wait4
            out.seek(0)
            said = out.read().decode(errors="replace")
    return wrk_result(said, concurrency, usage.ru_utime + usage.ru_stime)


#: Runs one closed loop: ``run(requests, seconds)``.
Run = Callable[[Sequence[Request], float], LoadResult]


def client(
    base_url: str,
    grpc_target: str,
    protocol: str,
    concurrency: int,
    kind: str = "auto",
    processes: int = 2,
    wrk_threads: int = 2,
) -> Run:
    """The client of one protocol: over gRPC (``protocol == "grpc"``: to ``grpc_target``,
    ``host:port``) always client processes; over HTTP (to ``base_url``) wrk where ``kind`` is
    ``"auto"`` or ``"wrk"`` and wrk is installed, else ``processes`` client processes.

    Raises:
        FileNotFoundError: ``kind`` is ``"wrk"`` for HTTP and wrk is not installed.
    """
    if protocol == "grpc":
        return lambda requests, seconds: run_processes(
            grpc_target, requests, concurrency, seconds, processes, True
        )
    if kind == "wrk" or (kind == "auto" and wrk_available()):
        if not wrk_available():
            raise FileNotFoundError("wrk is not installed (apt-get install wrk)")
        return lambda requests, seconds: run_wrk(base_url, requests, concurrency, seconds, wrk_threads)
    return lambda requests, seconds: run_processes(base_url, requests, concurrency, seconds, processes)


def shares(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` whole numbers differing by at most one (zeros dropped)."""
    return [n for n in (total // parts + (i < total % parts) for i in range(parts)) if n]


def run_processes(
    target: str,
    requests: Sequence[Request],
    concurrency: int,
    seconds: float,
    processes: int = 2,
    grpc: bool = False,
) -> LoadResult:
    """``processes`` spawned client processes sharing ``concurrency`` closed-loop clients out,
    cycling through ``requests`` for ``seconds`` after all of them are ready (a barrier):
    over HTTP to ``target`` (``http://host:port``), or with ``grpc`` to ``target`` (``host:port``,
    each request's ``path`` the method and ``body`` the serialized message).

    Raises:
        RuntimeError: a client process failed or gave no report in time.
    """
    counts = shares(concurrency, processes)
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(len(counts))
    reports: multiprocessing.Queue[dict[str, Any]] = context.Queue()
    children = [
        context.Process(
            target=client_process,
            args=(ClientJob(target, requests, n, sum(counts[:i]), seconds, grpc), barrier, reports),
            daemon=True,
        )
        for i, n in enumerate(counts)
    ]
    for child in children:
        child.start()
    try:
        parts = [reports.get(timeout=seconds + 180) for _ in children]
    except queue.Empty:
        raise RuntimeError(
            f"a client process gave no report; exit codes {[c.exitcode for c in children]}"
        ) from None
    finally:
        for child in children:
            child.join(10)
            if child.is_alive():
                child.kill()
    failed = [p["error"] for p in parts if "error" in p]
    if failed:
        raise RuntimeError(f"client process failed: {failed[0]}")
    return combine(parts, concurrency)


def combine(parts: Sequence[dict[str, Any]], concurrency: int) -> LoadResult:
    """One :class:`LoadResult` of the client processes' own reports (:func:`client_process`)."""
    statuses: Counter[str] = Counter()
    said: dict[str, str] = {}
    by_tag: dict[str, list[float]] = {}
    for part in parts:
        statuses.update(part["statuses"])
        for status, detail in part["said"].items():
            said.setdefault(status, detail)
        for tag, latencies in part["latencies_ms"].items():
            by_tag.setdefault(tag, []).extend(latencies)
    everything = [ms for latencies in by_tag.values() for ms in latencies]
    p50, p99 = percentiles(everything, (50, 99))
    return LoadResult(
        client="processes",
        concurrency=concurrency,
        elapsed_s=max(p["elapsed_s"] for p in parts),
        ok=len(everything),
        statuses=dict(statuses),
        p50_ms=p50,
        p99_ms=p99,
        client_cpu_s=sum(p["cpu_s"] for p in parts),
        said=said,
        by_tag={
            tag: dict(zip(("ok", "p50_ms", "p99_ms"), (len(ms), *percentiles(ms, (50, 99))), strict=True))
            for tag, ms in sorted(by_tag.items())
        },
    )


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True)
class ClientJob:
    """What one client process of :func:`run_processes` does: ``clients`` closed-loop clients
    to ``target`` (over gRPC where ``grpc``), client ``i`` starting at request ``first + i`` of
    ``requests`` and going on for ``seconds``."""

    target: str
    requests: Sequence[Request]
    clients: int
    first: int
    seconds: float
    grpc: bool


def client_process(job: ClientJob, barrier: Barrier, reports: multiprocessing.Queue[dict[str, Any]]) -> None:
    """One client process of :func:`run_processes`, running ``job`` once every process passed
    ``barrier``. Puts on ``reports`` its ``latencies_ms`` per tag (answered requests),
    ``statuses`` (the others) and ``said`` (the first answer of each), ``elapsed_s`` and
    ``cpu_s`` (this process's CPU from the barrier on: imports and connection set-up left out);
    or ``error``."""
    try:
        reports.put(asyncio.run(_clients(job, barrier)))
    except Exception as exc:  # reported to the parent, which raises it
        barrier.abort()
        reports.put({"error": f"{type(exc).__name__}: {exc}"})


async def _clients(job: ClientJob, barrier: Barrier) -> dict[str, Any]:
    requests, clients = job.requests, job.clients
    latencies: dict[str, list[float]] = {}
    statuses: Counter[str] = Counter()
    said: dict[str, str] = {}  # per status other than 200: the first answer's start
    async with sender(job.target, clients, job.grpc) as send:
        barrier.wait(timeout=120)
        cpu0, start = _cpu_s(), time.perf_counter()
        until = start + job.seconds

        async def client(i: int) -> None:
            sent = job.first + i
            while time.perf_counter() < until:
                request = requests[sent % len(requests)]
                sent += clients
                began = time.perf_counter()
                status, detail = await send(request)
                if status == "200":
                    latencies.setdefault(request.tag, []).append((time.perf_counter() - began) * 1000)
                else:
                    statuses[status] += 1
                    said.setdefault(status, detail[:300])

        await asyncio.gather(*(client(i) for i in range(clients)))
        elapsed = time.perf_counter() - start
        cpu = _cpu_s() - cpu0
    return {
        "latencies_ms": latencies,
        "statuses": dict(statuses),
        "said": said,
        "elapsed_s": elapsed,
        "cpu_s": cpu,
    }


#: ``send(request) -> (status, detail)``: "200", another HTTP status, "0" for a connection error,
#: or a gRPC status code's name; and, for any but "200", what the answer said.
Send = Callable[[Request], Awaitable[tuple[str, str]]]


@contextlib.asynccontextmanager
async def sender(target: str, clients: int, grpc: bool) -> AsyncIterator[Send]:
    """A :data:`Send` over HTTP to ``target`` (an aiohttp session of ``clients`` keep-alive
    connections) or over one gRPC channel, closed after the block."""
    if grpc:
        async with grpc_sender(target) as send:
            yield send
        return
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as session:

        async def send_http(request: Request) -> tuple[str, str]:
            try:
                async with session.post(
                    target + request.path, data=request.body, headers=request.headers
                ) as r:
                    body = await r.read()
                    return str(r.status), "" if r.status == 200 else body[:300].decode(errors="replace")
            except (aiohttp.ClientError, TimeoutError) as exc:
                return "0", f"{type(exc).__name__}: {exc}"

        yield send_http


@contextlib.asynccontextmanager
async def grpc_sender(target: str) -> AsyncIterator[Send]:
    """A :data:`Send` over one gRPC channel to ``target``: each request's ``path`` is the
    method, its ``body`` the serialized message, sent as it is."""
    import grpc

    async with grpc.aio.insecure_channel(target) as channel:
        calls: dict[str, Any] = {}

        async def send_grpc(request: Request) -> tuple[str, str]:
            if request.path not in calls:
                calls[request.path] = channel.unary_unary(request.path)
            try:
                await calls[request.path](request.body, timeout=30)
            except grpc.aio.AioRpcError as exc:
                return str(exc.code().name), str(exc.details())
            return "200", ""

        yield send_grpc
