"""Reliability soak: steady load on a real gunicorn server while it reloads, recycles,
drains and loses a worker; counts every failed request.

Starts ``gunicorn -c gunicorn.conf.py`` on 127.0.0.1 (loopback only, a free port, a
temporary run directory) with ``--workers`` workers serving ``--model`` from
``--repository``, drives it with ``--concurrency`` clients, and performs in turn:

1. ``hup``: SIGHUP to the master (new workers start, the old ones drain);
2. ``max_requests``: a reload that sets ``max_requests`` (sized from the measured rate so
   each worker recycles within the phase, but lives at least twice as long as a worker takes
   to boot; jitter 20%), until every worker has recycled,
   then a reload that turns it off again;
3. ``sigterm``: SIGTERM to one worker (it drains; gunicorn forks a replacement);
4. ``sigkill``: SIGKILL to one worker. The worker is first stopped (SIGSTOP) so that the
   connections it holds can be listed (psutil) while nothing moves; the requests in flight
   on them are counted, then it is killed. Every request that fails in this phase must
   be one on those connections.

Each phase runs steady load before and after its event, and waits until all workers are
ready again. Phases 1-3 must have zero failed requests; phase 4 exactly the requests the
killed worker held. Exit status 0 when both hold, 1 otherwise.

The clients are :class:`benchmarks.driver.Connection`, a minimal HTTP/1.1 keep-alive client,
one connection each, behaving like a pooling client library (urllib3, aiohttp, httpx): it reuses its
connection, opens a new one after a ``Connection: close`` response, discards a connection
the server has closed (EOF seen) before sending on it, and never retries a request. A failed
request is any error on the wire (reset, EOF before a complete response, a 30 s timeout) or
a status other than 200. Knowing each connection's local port is what makes the SIGKILL
accounting exact.

    python -m benchmarks.soak                                 # feed-ranker, 2 workers, 10 s phases
    python -m benchmarks.soak --repository /tmp/repo --model scale --phase-s 3 --json soak.json

The feed-ranker's ``model.pt2`` is made by ``scripts/export_ranking_model.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from benchmarks import driver, payloads, report, server
from benchmarks.driver import Connection
from tests.support.gunicorn import HOST, ROOT, Gunicorn

REQUEST_TIMEOUT_S = 30.0
PHASES = ("hup", "max_requests", "sigterm", "sigkill")
#: What a failed request looks like on the wire (OSError covers resets and refused connections).
_WIRE_ERRORS = (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError, IndexError)

CONFIG = """\
# Written by benchmarks/soak.py: gunicorn.conf.py plus knobs the soak changes between reloads.
import runpy as _runpy
from pathlib import Path as _Path

globals().update(
    {{k: v for k, v in _runpy.run_path({conf!r}).items() if not k.startswith("__")}}
)
max_requests, max_requests_jitter = map(int, _Path({knobs!r}).read_text().split())
"""


@dataclass
class PhaseStats:
    """What the clients saw while one phase ran (requests counted by their start time)."""

    name: str
    event: str = ""
    requests: int = 0
    failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list, repr=False)
    failed_ports: list[int] = field(default_factory=list, repr=False)
    seconds: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        p50, p99, top = driver.percentiles(self.latencies_ms or [0.0], (50, 99, 100))
        out = {k: v for k, v in asdict(self).items() if k not in ("latencies_ms", "failed_ports")}
        out.update(p50_ms=round(p50, 2), p99_ms=round(p99, 2), max_ms=round(top, 2))
        out["seconds"] = round(self.seconds, 1)
        return out


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="soak-"))
        self.knobs = self.tmp / "knobs"
        self.knobs.write_text("0 0")
        self.server: Gunicorn | None = None
        self.stats: PhaseStats = PhaseStats("start")
        self.phases: list[PhaseStats] = []
        self.in_flight: dict[int, int] = {}  # client id -> local port of its request
        self.stop = asyncio.Event()
        self.body = b""
        self.path = ""

    # --- server ------------------------------------------------------------------

    def start_server(self) -> Gunicorn:
        config = self.tmp / "soak.conf.py"
        config.write_text(CONFIG.format(conf=str(ROOT / "gunicorn.conf.py"), knobs=str(self.knobs)))
        env = {
            "SCORING_WORKERS": str(self.args.workers),
            "SCORING_MODEL_REPOSITORY": str(self.args.repository),
            "SCORING_MODELS": self.args.model,
            "SCORING_ACCESS_LOG": "",
            "SCORING_GRACEFUL_TIMEOUT_S": str(self.args.graceful_timeout_s),
        }
        self.server = Gunicorn(
            self.tmp, env, config=config, torch_threads=self.args.torch_threads or None, drain_grace_s=None
        )
        return self.server

    @property
    def srv(self) -> Gunicorn:
        assert self.server is not None, "start_server() first"
        return self.server

    @property
    def log_path(self) -> Path:
        return self.srv.log_path

    def workers(self) -> list[int]:
        return sorted(w.pid for w in self.srv.workers())

    async def wait_settled(self, gone: set[int], timeout_s: float = 120.0) -> float:
        """Until none of ``gone`` is alive and ``--workers`` workers are ready; seconds taken."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.srv.proc.poll() is not None:
                raise RuntimeError(f"gunicorn exited {self.srv.proc.returncode}:\n{self.srv.log_tail()}")
            workers = set(self.workers())
            settled = not (workers & gone) and len(workers) == self.args.workers
            if settled and len(self.srv.ready_workers()) == self.args.workers:
                return time.monotonic() - start
            await asyncio.sleep(0.05)
        raise RuntimeError(f"server did not settle in {timeout_s} s:\n{self.srv.log_tail()}")

    def recycles(self) -> int:
        return self.srv.log().count("recycling")

    def hup(self) -> None:
        os.kill(self.srv.proc.pid, signal.SIGHUP)

    # --- load --------------------------------------------------------------------

    def prepare_body(self) -> None:
        inputs = payloads.inputs_of(self.args.repository, self.args.model)
        self.body = payloads.v2_json(payloads.tensors(inputs, self.args.items, random.Random(0)))
        self.path = f"/v2/models/{self.args.model}/infer"

    async def client(self, cid: int) -> None:
        conn = Connection(self.srv.port)
        while not self.stop.is_set():
            stats = self.stats
            started = time.perf_counter()
            try:
                if not conn.usable():
                    await conn.open()
                self.in_flight[cid] = conn.local_port
                status, _, payload = await asyncio.wait_for(
                    conn.request("POST", self.path, self.body), REQUEST_TIMEOUT_S
                )
                error = None if status == 200 else f"HTTP {status}: {payload[:120].decode(errors='replace')}"
            except _WIRE_ERRORS as exc:
                error = type(exc).__name__
                conn.close()
            port = self.in_flight.pop(cid, conn.local_port)
            stats.requests += 1
            stats.latencies_ms.append((time.perf_counter() - started) * 1000)
            if error is not None:
                stats.failed += 1
                stats.errors[error] = stats.errors.get(error, 0) + 1
                stats.failed_ports.append(port)
        conn.close()

    # --- phases ------------------------------------------------------------------

    async def phase(self, name: str, event: Callable[[PhaseStats], Awaitable[None]]) -> PhaseStats:
        stats = PhaseStats(name)
        self.stats = stats
        began = time.monotonic()
        await asyncio.sleep(min(2.0, self.args.phase_s / 3))
        await event(stats)
        remaining = self.args.phase_s - (time.monotonic() - began)
        await asyncio.sleep(max(1.0, remaining))
        stats.seconds = time.monotonic() - began
        self.phases.append(stats)
        print(_row(stats.summary()), flush=True)
        return stats

    async def do_hup(self, stats: PhaseStats) -> None:
        old = set(self.workers())
        stats.event = "SIGHUP to the master: new workers, the old ones drain"
        self.hup()
        stats.notes["settled_s"] = round(await self.wait_settled(old), 2)

    async def do_max_requests(self, stats: PhaseStats) -> None:
        done = sum(p.requests for p in self.phases) + self.stats.requests
        elapsed = sum(p.seconds for p in self.phases) or 1.0
        per_worker_s = done / elapsed / self.args.workers
        # A worker that reaches max_requests keeps serving until its replacement is ready, so
        # it must live longer than a boot, or workers would recycle without end: at least twice
        # the time the SIGHUP's new workers took to be ready (the hup phase), a third of a phase.
        boot_s = max([float(p.notes.get("settled_s", 0.0)) for p in self.phases] + [1.0])
        limit = max(20, int(per_worker_s * max(self.args.phase_s / 3, 2 * boot_s)))
        jitter = max(1, limit // 5)
        stats.event = f"reload, max_requests={limit} (+jitter {jitter}); every worker recycles; reload back"
        before = self.recycles()
        self.knobs.write_text(f"{limit} {jitter}")
        old = set(self.workers())
        self.hup()
        await self.wait_settled(old)
        reloaded = set(self.workers())
        deadline = time.monotonic() + 120
        while self.recycles() - before < self.args.workers or set(self.workers()) & reloaded:
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers did not recycle:\n{self.srv.log_tail()}")
            await asyncio.sleep(0.1)
        await self.wait_settled(reloaded)
        stats.notes["recycles"] = self.recycles() - before
        self.knobs.write_text("0 0")
        old = set(self.workers())
        self.hup()
        await self.wait_settled(old)

    async def do_sigterm(self, stats: PhaseStats) -> None:
        victim = self.workers()[0]
        stats.event = f"SIGTERM to worker {victim}: it drains, gunicorn forks a replacement"
        os.kill(victim, signal.SIGTERM)
        stats.notes["settled_s"] = round(await self.wait_settled({victim}), 2)

    async def do_sigkill(self, stats: PhaseStats) -> None:
        victim = self.workers()[0]
        stats.event = f"SIGKILL to worker {victim} (stopped first to count what it holds)"
        os.kill(victim, signal.SIGSTOP)
        await asyncio.sleep(0.3)  # requests on the other workers complete; the victim's cannot
        loop = asyncio.get_running_loop()
        conns = await loop.run_in_executor(None, _tcp_connections, victim)
        ports = {c.raddr.port for c in conns if c.raddr and c.raddr.ip == HOST}
        held = sum(1 for port in self.in_flight.values() if port in ports)
        os.kill(victim, signal.SIGKILL)  # no await since counting: the count is exact
        stats.notes.update(victim_connections=len(ports), held_in_flight=held)
        stats.notes["settled_s"] = round(await self.wait_settled({victim}), 2)
        stats.notes["victim_ports"] = ports

    async def run(self) -> int:
        self.start_server()
        try:
            await self.wait_settled(set(), timeout_s=180)
            self.prepare_body()
            clients = [asyncio.create_task(self.client(i)) for i in range(self.args.concurrency)]
            print(_row(None), flush=True)
            self.stats = PhaseStats("warmup")
            await asyncio.sleep(self.args.warmup_s)
            self.stats.seconds = self.args.warmup_s
            self.phases.append(self.stats)
            print(_row(self.stats.summary()), flush=True)
            events = {
                "hup": self.do_hup,
                "max_requests": self.do_max_requests,
                "sigterm": self.do_sigterm,
                "sigkill": self.do_sigkill,
            }
            for name in self.args.phases:
                await self.phase(name, events[name])
            self.stop.set()
            await asyncio.gather(*clients)
        finally:
            self.stop.set()
            self.shutdown()
        return self.verdict()

    def verdict(self) -> int:
        ok = True
        for stats in self.phases:
            if stats.name == "sigkill":
                ports = stats.notes.pop("victim_ports", set())
                stray = [p for p in stats.failed_ports if p not in ports]
                stats.notes["failed_on_victim_connections"] = stats.failed - len(stray)
                exact = not stray and stats.failed == stats.notes["held_in_flight"]
                stats.notes["exact"] = exact
                ok = ok and not stray
            elif stats.failed:
                ok = False
        return 0 if ok else 1

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.stop(60)


def _row(summary: dict[str, Any] | None) -> str:
    if summary is None:
        return f"{'phase':<13}{'requests':>9}{'failed':>7}{'p50 ms':>8}{'p99 ms':>8}{'max ms':>8}  event"
    return (
        f"{summary['name']:<13}{summary['requests']:>9}{summary['failed']:>7}"
        f"{summary['p50_ms']:>8.1f}{summary['p99_ms']:>8.1f}{summary['max_ms']:>8.1f}  {summary['event']}"
    )


def _tcp_connections(pid: int) -> list[Any]:
    """The TCP connections of ``pid`` (psutil >= 6 names it ``net_connections``)."""
    process = psutil.Process(pid)
    lister = getattr(process, "net_connections", None) or process.connections
    return list(lister("tcp"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = server.parser(__doc__, model=server.RANKER, torch_threads=1)
    parser.add_argument("--concurrency", type=int, default=8, help="clients, one connection each")
    parser.add_argument("--items", type=int, default=1, help="items per request")
    parser.add_argument("--phase-s", type=float, default=10.0, help="length of each phase, at least")
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--graceful-timeout-s", type=int, default=30)
    parser.add_argument("--phases", type=server.comma_list(PHASES), default=list(PHASES))
    parser.add_argument("--json", type=Path, help="write the results here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    soak = Soak(args)
    status = asyncio.run(soak.run())
    results = report.record(
        command=" ".join(["python -m benchmarks.soak", *(argv if argv is not None else sys.argv[1:])]),
        workers=args.workers,
        concurrency=args.concurrency,
        model=args.model,
        phases=[p.summary() for p in soak.phases],
        passed=status == 0,
    )
    kill = next((p for p in soak.phases if p.name == "sigkill"), None)
    if kill is not None:
        print(
            f"sigkill: {kill.failed} failed; {kill.notes['held_in_flight']} were in flight on the killed "
            f"worker's {kill.notes['victim_connections']} connections; "
            f"{kill.notes['failed_on_victim_connections']} of the failures on those connections"
        )
    print("PASSED" if status == 0 else "FAILED", f"(server log: {soak.log_path})")
    report.write_json(args.json, results)
    return status


if __name__ == "__main__":
    sys.exit(main())
