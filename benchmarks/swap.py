"""A model swapped while it serves: the feed-ranker rolled out from version 1 to version 2 and
back, under steady load, with model control (``SCORING_MODEL_CONTROL_MODE=explicit``).

The server (``--workers`` workers) serves a repository of its own holding the demo feed-ranker
as version 1. ``--connections`` closed-loop clients send V2 JSON requests of ``--items`` items
back to back, and keep each answer's send time, latency, status and ``model_version``. After
``--settle`` seconds, version 2 (the same archive in a second folder whose ``model.toml`` says
``version = "2"``) is copied in and ``POST /v2/repository/models/feed-ranker/load`` is timed:
the default version policy (latest 1) loads version 2 on every worker beside version 1 and
unloads version 1 once version 2 serves everywhere. After ``--settle`` more seconds, the rollback:
version 2's folder is removed and the same call is timed again. Printed: per phase (before, the
rollout call, between, the rollback call, after) the answers by status and version and the
p50/p99 of the 200s; the calls' durations; the workers' resident memory before and after.

    python -m benchmarks.swap --out docs/benchmarks/swap-cpu.json

Traffic goes only to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp

from benchmarks import driver, payloads, report, server
from benchmarks.server import RANKER

PHASES = ("before", "rollout", "between", "rollback", "after")


class Sent(NamedTuple):
    """One request as a client saw it."""

    at: float
    latency_s: float
    status: int
    version: str


def repository(tmp: Path) -> Path:
    """A repository with the demo feed-ranker as version 1, in folder ``feed-ranker-1``."""
    folder = tmp / "repo" / f"{RANKER}-1"
    shutil.copytree(server.DEMO_REPOSITORY / RANKER, folder)
    return folder.parent


def add_version(repo: Path, version: str) -> Path:
    """Copy version 1's folder as ``version`` (its ``model.toml``'s ``version`` replaced)."""
    folder = repo / f"{RANKER}-{version}"
    shutil.copytree(repo / f"{RANKER}-1", folder)
    toml = folder / "model.toml"
    lines = toml.read_text().splitlines()
    lines = [f'version = "{version}"' if line.split("=")[0].strip() == "version" else line for line in lines]
    toml.write_text("\n".join(lines) + "\n")
    return folder


class Load:
    """``connections`` clients on a thread of their own until :meth:`stop`."""

    def __init__(self, url: str, bodies: list[bytes], connections: int) -> None:
        self.url, self.bodies, self.connections = url, bodies, connections
        self.sent: list[Sent] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    async def _run(self) -> None:
        connector = aiohttp.TCPConnector(limit=self.connections)
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

            async def client(i: int) -> None:
                n = i
                while not self._stop.is_set():
                    body = self.bodies[n % len(self.bodies)]
                    n += self.connections
                    at = time.perf_counter()
                    status, version = 0, ""
                    try:
                        async with session.post(self.url, data=body, headers=driver.JSON_HEADERS) as resp:
                            raw = await resp.read()
                            status = resp.status
                            if status == 200:
                                version = json.loads(raw)["model_version"]
                    except (aiohttp.ClientError, TimeoutError):
                        pass
                    self.sent.append(Sent(at, time.perf_counter() - at, status, version))

            await asyncio.gather(*(client(i) for i in range(self.connections)))


def phase_figures(sent: list[Sent]) -> dict[str, Any]:
    """Answers by status and by version, p50/p99 of the 200s (ms)."""
    ok = [s.latency_s * 1000 for s in sent if s.status == 200]
    p50, p99 = driver.percentiles(ok, (50, 99))
    return {
        "answers": len(sent),
        "statuses": dict(Counter(s.status for s in sent)),
        "versions": dict(Counter(s.version for s in sent if s.status == 200)),
        "p50_ms": round(p50, 2),
        "p99_ms": round(p99, 2),
    }


def rss_mib(srv: Any) -> dict[int, float]:
    """Resident memory of each worker, MiB."""
    return {w.pid: round(w.memory_info().rss / 2**20, 1) for w in srv.workers()}


def control(srv: Any) -> tuple[float, int, Any]:
    """Time ``POST …/load`` of the feed-ranker: (seconds, status, body)."""
    begin = time.perf_counter()
    status, _, body = driver.http("POST", f"{srv.url}/v2/repository/models/{RANKER}/load", {}, timeout=600)
    return time.perf_counter() - begin, status, body


def markdown(result: dict[str, Any]) -> str:
    rows = [
        (name, p["answers"], p["statuses"], p["versions"], p["p50_ms"], p["p99_ms"])
        for name, p in result["phases"].items()
    ]
    header = ("phase", "answers", "by status", "200s by version", "p50 ms", "p99 ms")
    calls = result["calls"]
    return (
        report.table(header, rows, "lrllrr")
        + f"\n\nrollout call {calls['rollout']['seconds']} s, rollback call {calls['rollback']['seconds']} s;"
        + f" worker RSS MiB before {result['rss_mib']['before']}, after {result['rss_mib']['after']}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = server.parser(__doc__)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--items", type=int, default=1)
    parser.add_argument("--settle", type=float, default=5.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    bodies = payloads.v2_bodies(server.DEMO_REPOSITORY, RANKER, args.items, 64)
    marks: list[float] = []
    calls: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        repo = repository(Path(tmp))
        env = {"SCORING_MODEL_CONTROL_MODE": "explicit"}
        with server.start(Path(tmp), repo, "", args.workers, env) as srv:
            srv.wait_ready(300, count=args.workers)
            load = Load(srv.url + f"/v2/models/{RANKER}/infer", bodies, args.connections)
            load.start()
            time.sleep(args.settle)  # the load runs meanwhile: the "before" phase
            rss_before = rss_mib(srv)
            for name, change in (("rollout", lambda: add_version(repo, "2")),
                                 ("rollback", lambda: shutil.rmtree(repo / f"{RANKER}-2"))):  # fmt: skip
                change()
                marks.append(time.perf_counter())
                seconds, status, body = control(srv)
                marks.append(time.perf_counter())
                calls[name] = {"seconds": round(seconds, 2), "status": status, "body": body}
                time.sleep(args.settle)
            load.stop()
            rss_after = rss_mib(srv)
    bounds = [float("-inf"), *marks, float("inf")]
    phases = {
        name: phase_figures([s for s in load.sent if bounds[i] <= s.at < bounds[i + 1]])
        for i, name in enumerate(PHASES)
    }
    result = report.record(
        command="python -m benchmarks.swap " + " ".join(sys.argv[1:] if argv is None else argv),
        workers=args.workers, connections=args.connections, items=args.items, phases=phases,
        calls=calls, rss_mib={"before": rss_before, "after": rss_after},
    )  # fmt: skip
    print(markdown(result))
    report.write_json(args.out, result)


if __name__ == "__main__":
    main()
