"""Overload: goodput, rejection latency and worker memory of a real gunicorn server driven
far past its capacity (docs/reliability.md, *Overload figures*).

Starts ``gunicorn -c gunicorn.conf.py`` on 127.0.0.1 (a free port, a temporary run
directory) with ``--workers`` workers serving the repository's models, then for each
scenario:

1. measures the unloaded capacity: the scenario's capacity connections (8 for minilm-64,
   64 for one-item-512, or ``--capacity-connections``) as closed-loop clients for
   ``--capacity-s`` seconds, successful requests/s;
2. overloads it: ``connections`` closed-loop clients for ``--duration-s`` seconds. The
   clients are adversarial: they resend at once after any answer, ignoring Retry-After;
3. reports goodput (200s/s) against the capacity, the count of every status (503
   admission/queue refusals, 504 deadlines), the p50/p99 latency of the 200s and of the 503s
   (from the request's send: a reconnect after the server closed the connection is timed
   apart, with the count of reconnects), and the workers' RSS before and after (psutil).

Scenarios (``--scenarios``, comma-separated):

- ``minilm-64``: all-MiniLM-L6-v2, 64 texts per request, 96 connections;
- ``mixed-8``: all-MiniLM-L6-v2, 8 feed texts per request of mixed length (titles of 5-15
  words, descriptions of 40-200: :func:`benchmarks.payloads.feed_texts`), the feed's query,
  only ``score`` asked for, 64 connections (capacity at 4): items that differ in cost;
- ``one-item-512``: one item per request, 512 connections, half on each model
  (feed-ranker and all-MiniLM-L6-v2).

After the overload, the capacity connections again for ``--recovery-s`` seconds: the
statuses of each second (admission must not stay poisoned by the burst).

    python -m benchmarks.overload --json overload.json            # the figures (quiet machine)
    python -m benchmarks.overload --duration-s 3 --capacity-s 2   # a smoke run
    python -m benchmarks.overload --honour-retry-after            # clients that back off

The clients are :class:`benchmarks.driver.Connection` (HTTP/1.1 keep-alive, one connection
each) in :func:`benchmarks.driver.closed_loop`. Targets: goodput >= 70 % of capacity, every
rejection a 503 in under 50 ms p99, worker RSS within 10 % from start to end.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from benchmarks import driver, payloads, report, server
from benchmarks.server import MINILM, RANKER
from tests.support.gunicorn import Gunicorn


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
    #: Feed texts of mixed length (``payloads.feed_texts``) instead of ``--text-chars`` each.
    mixed: bool = False


SCENARIOS = {
    "minilm-64": Scenario("minilm-64", (MINILM,), 64, 96, 8),
    "mixed-8": Scenario("mixed-8", (MINILM,), 8, 64, 4, mixed=True),
    "one-item-512": Scenario("one-item-512", (RANKER, MINILM), 1, 512, 64),
}


@dataclass
class Tally:
    """Outcomes of one load run: latency (s) per HTTP status; wire errors by exception name."""

    latencies: dict[int, list[float]] = field(default_factory=dict)
    errors: Counter[str] = field(default_factory=Counter)
    #: Seconds each (re)connect took (after the server closed a connection), not in latencies.
    connects: list[float] = field(default_factory=list)
    #: Per HTTP status, the server's own time for each answer (its ``Server-Timing: app;dur``).
    server_s: dict[int, list[float]] = field(default_factory=dict)

    @classmethod
    def of(cls, answers: list[driver.Answer]) -> Tally:
        """Group answers (status 0 = a wire error named by ``Answer.error``)."""
        tally = cls()
        for answer in answers:
            if answer.status:
                tally.latencies.setdefault(answer.status, []).append(answer.latency_s)
            else:
                tally.errors[answer.error] += 1
        return tally

    def count(self, status: int) -> int:
        return len(self.latencies.get(status, []))

    def p(self, status: int, q: float) -> float | None:
        return ms_p(self.latencies.get(status, []), q)


def ms_p(seconds: list[float], q: float) -> float | None:
    """The ``q``-th percentile (:func:`benchmarks.driver.percentiles`) of ``seconds`` in ms,
    1 decimal; None (JSON null) when empty."""
    return round(driver.percentiles(seconds, (q,))[0] * 1000, 1) if seconds else None


def bodies_of(repository: Path, scenario: Scenario, model: str, text_chars: int) -> list[bytes]:
    """The V2 inference requests the clients of ``scenario`` send to ``model`` (in turn):
    ``items`` items each, MiniLM texts of ``text_chars`` characters and no query, or for a
    mixed scenario 250 requests of mixed-length feed texts with the feed's query."""
    if scenario.mixed:
        texts = payloads.feed_texts(payloads.model_words(repository), 250 * scenario.items)
        return payloads.feed_bodies(texts, scenario.items)
    inputs = payloads.inputs_of(repository, model, query=False)
    tensors = payloads.tensors(inputs, scenario.items, random.Random(0), payloads.text_of(text_chars))
    return [payloads.v2_json(tensors)]


def start(args: argparse.Namespace, tmp: Path) -> Gunicorn:
    """gunicorn on a free loopback port with ``--workers`` workers serving every model of the
    repository; ``SCORING_*`` settings of this environment pass through (e.g.
    ``SCORING_IMPATIENT_HOLD_MS``)."""
    env = {"SCORING_TORCH_THREADS": str(args.torch_threads), "SCORING_LOG_LEVEL": "info"}
    return server.start(tmp, args.repository, "", args.workers, env)


def rss_mib(srv: Gunicorn) -> dict[int, float]:
    """Each live worker's resident memory, MiB."""
    out = {}
    for worker in srv.workers():
        try:
            out[worker.pid] = round(worker.memory_info().rss / 2**20, 1)
        except psutil.Error:
            continue
    return out


async def drive(
    srv: Gunicorn,
    bodies: dict[str, list[bytes]],
    scenario: Scenario,
    connections: int,
    seconds: float,
    polite: bool = False,
) -> tuple[Tally, float]:
    """``connections`` closed-loop clients (one :class:`benchmarks.driver.Connection` each) for
    ``seconds``, sending the ``bodies[model]`` in turn; (outcomes, seconds elapsed). ``polite``
    clients wait ``Retry-After`` seconds after a 503; the others resend at once."""
    conns = [driver.Connection(srv.port) for _ in range(connections)]
    connects: list[float] = []
    server_s: dict[int, list[float]] = {}
    start = time.perf_counter()
    stop_at = start + seconds
    next_body = {m: driver.cycling(bodies[m], connections) for m in scenario.models}

    async def request(cid: int) -> driver.Answer:
        model = scenario.models[cid % len(scenario.models)]
        conn = conns[cid]
        body = next_body[model](cid)
        began = time.perf_counter()
        try:
            if not conn.usable():
                await conn.open()
                connects.append(time.perf_counter() - began)
                began = time.perf_counter()  # an answer's latency runs from its request
            status, headers, _ = await asyncio.wait_for(
                conn.request("POST", f"/v2/models/{model}/infer", body), 60
            )
        except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
            conn.close()
            return driver.Answer(0, time.perf_counter() - began, type(exc).__name__)
        error = "" if status == 200 else f"HTTP {status}"
        timing = headers.get("server-timing", "")
        if timing.startswith("app;dur="):
            server_s.setdefault(status, []).append(float(timing[8:]) / 1000)
        answer = driver.Answer(status, time.perf_counter() - began, error)
        if polite and status == 503:
            wait = float(headers.get("retry-after", "1"))
            await asyncio.sleep(min(wait, max(0.0, stop_at - time.perf_counter())))
        return answer

    answers = await driver.closed_loop(request, connections, stop_at)
    for conn in conns:
        conn.close()
    tally = Tally.of(answers)
    tally.connects = connects[connections:]  # the first connect of each client is no reconnect
    tally.server_s = server_s
    return tally, time.perf_counter() - start


async def run_scenario(srv: Gunicorn, scenario: Scenario, args: argparse.Namespace) -> dict[str, Any]:
    """Capacity, then overload, of one scenario: every figure of its row."""
    bodies = {m: bodies_of(args.repository, scenario, m, args.text_chars) for m in scenario.models}
    clients = args.capacity_connections or scenario.capacity_connections
    base, base_s = await drive(srv, bodies, scenario, clients, args.capacity_s)
    capacity = base.count(200) / base_s
    rss_start = rss_mib(srv)
    connections = args.connections or scenario.connections
    load, load_s = await drive(srv, bodies, scenario, connections, args.duration_s, args.honour_retry_after)
    rss_end = rss_mib(srv)
    recovery = []
    for _ in range(round(args.recovery_s)):
        after, _ = await drive(srv, bodies, scenario, clients, 1.0)
        recovery.append({str(s): after.count(s) for s in sorted(after.latencies)} | dict(after.errors))
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
        "rejected_p50_ms": load.p(503, 50),
        "rejected_p99_ms": load.p(503, 99),
        "rejected_server_p99_ms": ms_p(load.server_s.get(503, []), 99),
        "reconnects": len(load.connects),
        "reconnect_p99_ms": ms_p(load.connects, 99),
        "rss_start_mib": rss_start,
        "rss_end_mib": rss_end,
        "rss_max_growth": round(max(growth), 3) if growth else None,
        "recovery_statuses_per_s": recovery,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = server.parser(__doc__, torch_threads=1)
    parser.add_argument("--scenarios", type=server.comma_list(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--duration-s", type=float, default=20.0, help="overload per scenario")
    parser.add_argument("--capacity-s", type=float, default=10.0, help="unloaded measurement per scenario")
    parser.add_argument("--capacity-connections", type=int, default=0, help="clients for the capacity")
    parser.add_argument(
        "--recovery-s", type=float, default=4.0, help="capacity clients after the overload, in 1 s windows"
    )
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
    return parser.parse_args(argv)


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="overload-") as tmp, start(args, Path(tmp)) as srv:
        srv.wait_ready(300, count=args.workers)
        return [await run_scenario(srv, SCENARIOS[name], args) for name in args.scenarios]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = asyncio.run(run(args))
    for r in results:
        print(
            f"{r['scenario']}: capacity {r['capacity_rps']} req/s, goodput {r['goodput_rps']} req/s "
            f"({r['goodput_of_capacity']}), statuses {r['statuses']}, wire errors {r['wire_errors']}, "
            f"200 p50/p99 {r['ok_p50_ms']}/{r['ok_p99_ms']} ms, 503 p50/p99 {r['rejected_p50_ms']}/"
            f"{r['rejected_p99_ms']} ms (server's own p99 {r['rejected_server_p99_ms']} ms), "
            f"{r['reconnects']} reconnects (p99 {r['reconnect_p99_ms']} ms), "
            f"RSS {r['rss_start_mib']} -> {r['rss_end_mib']} MiB, "
            f"then each second {r['recovery_statuses_per_s']}"
        )
    command = " ".join(["python -m benchmarks.overload", *(argv if argv is not None else sys.argv[1:])])
    report.write_json(args.json, report.record(command=command, results=results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
