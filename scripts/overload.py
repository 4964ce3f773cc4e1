#!/usr/bin/env python
"""Overload: goodput, rejection latency and worker memory of a real gunicorn server driven
far past its capacity (issue 12; the figures go in docs/reliability.md).

Starts ``gunicorn -c gunicorn.conf.py`` on 127.0.0.1 (a free port, a temporary run
directory) with ``--workers`` workers serving the repository's models, then for each
scenario:

1. measures the unloaded capacity: the scenario's capacity connections (8 for minilm-64,
   64 for one-item-512, or ``--capacity-connections``) as closed-loop clients for
   ``--capacity-s`` seconds, successful requests/s;
2. overloads it: ``connections`` closed-loop clients for ``--duration-s`` seconds. The
   clients are adversarial: they resend at once after any answer, ignoring Retry-After;
3. reports goodput (200s/s) against the capacity, the count of every status (503
   admission/queue refusals, 504 deadlines), the p50/p99 latency of the 200s and the p99 of
   the 503s, and the workers' RSS before and after (psutil).

Scenarios (``--scenarios``, comma-separated):

- ``minilm-64``: all-MiniLM-L6-v2, 64 texts per request, 96 connections;
- ``one-item-512``: one item per request, 512 connections, half on each model
  (feed-ranker and all-MiniLM-L6-v2).

    python scripts/overload.py --json overload.json                 # the figures (quiet machine)
    python scripts/overload.py --duration-s 3 --capacity-s 2        # a smoke run
    python scripts/overload.py --honour-retry-after                 # clients that back off

The clients are scripts/soak.py's HTTP/1.1 keep-alive client (one connection each). The
issue's targets: goodput >= 70 % of capacity, every rejection a 503 in under 50 ms p99,
worker RSS within 10 % from start to end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import HOST, ROOT, Connection, _free_port

MINILM = "all-MiniLM-L6-v2"
RANKER = "feed-ranker"
WORDS = ["an", "overload", "test", "sentence", "about", "scoring", "servers", "and", "the", "requests"]


@dataclass(frozen=True)
class Scenario:
    """Which models the clients call, with how many items per request, on how many connections
    (and on how many to measure the capacity: enough to fill batches, few enough to meet the
    deadlines)."""

    name: str
    models: tuple[str, ...]
    items: int
    connections: int
    capacity_connections: int


SCENARIOS = {
    "minilm-64": Scenario("minilm-64", (MINILM,), 64, 96, 8),
    "one-item-512": Scenario("one-item-512", (RANKER, MINILM), 1, 512, 64),
}


@dataclass
class Tally:
    """Outcomes of one load run: latency (s) per status; wire errors."""

    latencies: dict[int, list[float]] = field(default_factory=dict)
    errors: Counter[str] = field(default_factory=Counter)

    def add(self, status: int, seconds: float) -> None:
        self.latencies.setdefault(status, []).append(seconds)

    def count(self, status: int) -> int:
        return len(self.latencies.get(status, []))

    def p(self, status: int, q: float) -> float | None:
        values = self.latencies.get(status)
        return round(float(np.percentile(values, q)) * 1000, 1) if values else None


def text(chars: int) -> str:
    """An English-like text of about ``chars`` characters."""
    words = (WORDS * (chars // 60 + 1))[: max(1, chars // 6)]
    return " ".join(words)[:chars]


def body(items: int, model: str, text_chars: int) -> bytes:
    """A V2 inference request of ``items`` items for one of the demo models (MiniLM texts of
    ``text_chars`` characters)."""
    if model == MINILM:
        inputs = [
            {"name": "text", "shape": [items, 1], "datatype": "BYTES", "data": [text(text_chars)] * items}
        ]
    else:
        rng = np.random.default_rng(0)
        features = rng.random(items * 32).round(4).tolist()
        inputs = [{"name": "features", "shape": [items, 32], "datatype": "FP32", "data": features}]
    return json.dumps({"inputs": inputs}).encode()


class Server:
    """gunicorn on a free loopback port; the workers' RSS through psutil."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="overload-"))
        self.port = _free_port()
        self.log_path = self.tmp / "gunicorn.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SCORING_", "PROMETHEUS_"))}
        env.update(
            SCORING_HOST=HOST,
            SCORING_PORT=str(self.port),
            SCORING_WORKERS=str(args.workers),
            SCORING_MODEL_REPOSITORY=str(args.repository),
            SCORING_RUN_DIR=str(self.tmp / "run"),
            SCORING_ACCESS_LOG="",
            SCORING_TORCH_THREADS=str(args.torch_threads),
            PYTHONPATH=str(ROOT),
            HF_HUB_OFFLINE="1",
        )
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py"],
            cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.workers = args.workers

    def rss_mib(self) -> dict[int, float]:
        """Each worker's resident memory, MiB."""
        out = {}
        for child in psutil.Process(self.proc.pid).children():
            try:
                out[child.pid] = round(child.memory_info().rss / 2**20, 1)
            except psutil.Error:
                continue
        return out

    async def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        states = self.tmp / "run" / "workers"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gunicorn exited {self.proc.returncode}: see {self.log_path}")
            ready = 0
            for path in states.glob("*") if states.is_dir() else []:
                with contextlib.suppress(OSError):  # a worker's file comes and goes
                    ready += path.read_text().strip() == "ready"
            if ready >= self.workers:
                return
            await asyncio.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout_s} s: see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


async def drive(
    port: int, scenario: Scenario, connections: int, seconds: float, text_chars: int, polite: bool = False
) -> tuple[Tally, float]:
    """``connections`` closed-loop clients for ``seconds``; (outcomes, seconds elapsed).
    ``polite`` clients wait ``Retry-After`` seconds after a 503; the others resend at once."""
    tally = Tally()
    bodies = {m: body(scenario.items, m, text_chars) for m in scenario.models}
    stop_at = time.monotonic() + seconds

    async def client(cid: int) -> None:
        model = scenario.models[cid % len(scenario.models)]
        path, payload = f"/v2/models/{model}/infer", bodies[model]
        conn = Connection(port)
        while time.monotonic() < stop_at:
            start = time.perf_counter()
            try:
                if not conn.usable():
                    await conn.open()
                status, headers, _ = await asyncio.wait_for(conn.request("POST", path, payload), 60)
            except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
                tally.errors[type(exc).__name__] += 1
                conn.close()
                continue
            tally.add(status, time.perf_counter() - start)
            if polite and status == 503:
                wait = float(headers.get("retry-after", "1"))
                await asyncio.sleep(min(wait, max(0.0, stop_at - time.monotonic())))
        conn.close()

    start = time.monotonic()
    await asyncio.gather(*(client(i) for i in range(connections)))
    return tally, time.monotonic() - start


async def run_scenario(server: Server, scenario: Scenario, args: argparse.Namespace) -> dict[str, Any]:
    clients = args.capacity_connections or scenario.capacity_connections
    base, base_s = await drive(server.port, scenario, clients, args.capacity_s, args.text_chars)
    capacity = base.count(200) / base_s
    rss_start = server.rss_mib()
    connections = args.connections or scenario.connections
    load, load_s = await drive(
        server.port, scenario, connections, args.duration_s, args.text_chars, args.honour_retry_after
    )
    rss_end = server.rss_mib()
    goodput = load.count(200) / load_s
    growth = [rss_end[p] / rss_start[p] - 1 for p in rss_start if p in rss_end]
    return {
        "scenario": scenario.name,
        "models": list(scenario.models),
        "items_per_request": scenario.items,
        "connections": connections,
        "honour_retry_after": args.honour_retry_after,
        "text_chars": args.text_chars if MINILM in scenario.models else None,
        "capacity_connections": clients,
        "capacity_rps": round(capacity, 1),
        "goodput_rps": round(goodput, 1),
        "goodput_of_capacity": round(goodput / capacity, 3) if capacity else None,
        "statuses": {str(s): load.count(s) for s in sorted(load.latencies)},
        "wire_errors": dict(load.errors),
        "ok_p50_ms": load.p(200, 50),
        "ok_p99_ms": load.p(200, 99),
        "rejected_p99_ms": load.p(503, 99),
        "rss_start_mib": rss_start,
        "rss_end_mib": rss_end,
        "rss_max_growth": round(max(growth), 3) if growth else None,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--scenarios", type=lambda s: s.split(","), default=list(SCENARIOS))
    parser.add_argument("--duration-s", type=float, default=20.0, help="overload per scenario")
    parser.add_argument("--capacity-s", type=float, default=10.0, help="unloaded measurement per scenario")
    parser.add_argument("--capacity-connections", type=int, default=0, help="clients for the capacity")
    parser.add_argument(
        "--connections", type=int, default=0, help="overload clients (default: the scenario's)"
    )
    parser.add_argument(
        "--text-chars",
        type=int,
        default=1500,
        help="characters per MiniLM text (1500: about 256 tokens, the model's max_seq_length)",
    )
    parser.add_argument(
        "--honour-retry-after",
        action="store_true",
        help="clients wait Retry-After after a 503 (default: adversarial, they resend at once)",
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; choose from {sorted(SCENARIOS)}")
    return args


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    server = Server(args)
    try:
        await server.wait_ready()
        return [await run_scenario(server, SCENARIOS[name], args) for name in args.scenarios]
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = asyncio.run(run(args))
    for r in results:
        print(
            f"{r['scenario']}: capacity {r['capacity_rps']} req/s, goodput {r['goodput_rps']} req/s "
            f"({r['goodput_of_capacity']}), statuses {r['statuses']}, wire errors {r['wire_errors']}, "
            f"200 p50/p99 {r['ok_p50_ms']}/{r['ok_p99_ms']} ms, 503 p99 {r['rejected_p99_ms']} ms, "
            f"RSS {r['rss_start_mib']} -> {r['rss_end_mib']} MiB"
        )
    if args.json:
        command = " ".join(["python", "scripts/overload.py", *(argv if argv is not None else sys.argv[1:])])
        args.json.write_text(json.dumps({"command": command, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
