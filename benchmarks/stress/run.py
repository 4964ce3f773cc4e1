"""The whole stress run: build the models, start Redis and gunicorn, take the references, run
locust through the phases while the schedule acts and the monitor samples, then judge.

Phases (``schedule.Plan``): **warm-up** (the users, no events), **baseline** (no users: the
workers' descriptors and threads once every connection closed), **main** (the users and the
schedule's events; none in its last ``tail_s``), **end** (no users: the same counts again).
``--duration`` sets the main phase and scales the schedule to it, or stops at once where it is
too short for the events' own times (``schedule.scale``).

Writes into ``--out``: ``summary.json`` (everything below), ``resources.csv`` (the monitor's
samples), ``locust_stats.csv`` / ``locust_failures.csv`` (locust's own tables), and the server's
log. Prints the requests by API and outcome, the schedule's events, the resource figures and
the verdict. Exit status 1 when a bound fails: a wrong answer, a request without an answer, an
unexpected status, an event the server did not answer as documented, RSS growth after warm-up
over ``--rss-growth-mb`` or no worker's growth judged at all, or descriptors or threads above
their baseline at the end.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from locust.stats import StatsCSVFileWriter

from benchmarks import report
from benchmarks.stress import apis, monitor, oracle, repository, schedule, target, wire
from benchmarks.stress.locustfile import USERS, PhaseShape, StressEnvironment
from benchmarks.stress.traffic import Traffic
from tests.support.gunicorn import ROOT, Gunicorn

SCHEDULES = {"30m": schedule.HERE / "schedule.toml", "ci": schedule.HERE / "schedule-ci.toml"}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--schedule", default="30m", help=f"a schedule file, or one of {sorted(SCHEDULES)}")
    parser.add_argument(
        "--duration",
        type=schedule.seconds,
        help="the main phase (e.g. 30m, 90s), the schedule scaled to it; default: the schedule's",
    )
    parser.add_argument("--users", type=int, help="users (default: the schedule's, 64)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--apis", type=lambda s: s.split(","), default=list(apis.APIS), help="comma-separated"
    )
    parser.add_argument("--rss-growth-mb", type=float, help="the bound (default: the schedule's, 50)")
    parser.add_argument("--out", type=Path, help="folder for the results (default: a new temporary one)")
    return parser.parse_args(argv)


def references(srv: Gunicorn, judge: oracle.Oracle, pools: dict[str, list[apis.Call]]) -> None:
    """Each call of each pool once on the idle server, one thread per API: the references."""
    errors: list[BaseException] = []

    def one(api: str) -> None:
        spec = judge.apis[api]
        try:
            if spec.protocol == "grpc":
                client = wire.GrpcClient(srv.grpc_port)
                for call in pools[api]:
                    judge.reference(api, call, client.request(call))
                client.close()
            else:
                conn = wire.Connection(srv.port)
                for call in pools[api]:
                    judge.reference(api, call, conn.request(call)[0])
                conn.close()
        except (RuntimeError, wire.WireError, ValueError) as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(api,)) for api in pools]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError(f"references failed: {errors[0]!r}")


def server_log(text: str) -> dict[str, Any]:
    """ERROR and CRITICAL lines and tracebacks of the server's log: counts and up to 12 distinct
    lines (numbers masked, so that the same line of another pid counts once)."""
    errors = [line for line in text.splitlines() if re.search(r"\b(ERROR|CRITICAL)\b", line)]
    distinct = Counter(re.sub(r"\d+", "N", line.split("]", 1)[-1])[:200] for line in errors)
    return {
        "error_lines": len(errors),
        "tracebacks": text.count("Traceback"),
        "distinct": dict(distinct.most_common(12)),
    }


class Run:
    """One stress run (see the module's docstring)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        path = SCHEDULES.get(args.schedule, Path(args.schedule))
        try:
            self.plan, self.events = schedule.read(path, args.duration)
        except ValueError as exc:
            raise SystemExit(f"stress run: {exc}") from None
        if args.users:
            self.plan = schedule.Plan(**{**self.plan.__dict__, "users": args.users})
        self.out: Path = args.out or Path(tempfile.mkdtemp(prefix="stress-"))
        self.out.mkdir(parents=True, exist_ok=True)
        self.folder = self.out / "server"
        unknown = sorted(set(args.apis) - set(apis.APIS))
        named = {e.params["api"] for e in self.events if "api" in e.params}
        named |= {api for e in self.events for api in e.params.get("apis", [])}
        if unknown or named - set(args.apis):
            raise SystemExit(f"--apis: unknown {unknown}; the schedule's events need {sorted(named)}")
        self.apis = [apis.APIS[name] for name in args.apis]
        self.oracle = oracle.Oracle(self.apis)
        self.summary: dict[str, Any] = {}

    def run(self) -> int:
        print(f"stress run: results in {self.out}", flush=True)
        last = schedule.clock(self.events[-1].at_s) if self.events else "-"
        main = schedule.clock(self.plan.main_s)
        print(f"{len(self.events)} events in a main phase of {main}, the last at {last}", flush=True)
        subprocess.run(
            [sys.executable, "-m", "benchmarks.stress.repository", str(self.folder)], cwd=ROOT, check=True
        )
        redis = target.RedisProcess(self.folder)
        redis.start()
        srv = target.start_server(
            self.folder, repository.repository_of(self.folder), self.args.workers, redis.url,
            {"SCORING_PEER_KEEPALIVE_S": str(self.plan.peer_keepalive_s)},
        )  # fmt: skip
        try:
            srv.wait_ready(600, count=self.args.workers)
            return self.drive(srv, redis)
        finally:
            srv.stop(120)
            redis.stop()

    def drive(self, srv: Gunicorn, redis: target.RedisProcess) -> int:
        words = apis.words_of(repository.tokenizer_file(self.folder).read_text())
        pools = {api.name: apis.pool(api, self.plan.pool, words) for api in self.apis}
        began = time.monotonic()
        references(srv, self.oracle, pools)
        print(f"references: {sum(map(len, pools.values()))} in {time.monotonic() - began:.1f} s", flush=True)

        shape = PhaseShape(self.plan)
        env = StressEnvironment(
            user_classes=[USERS[a.name] for a in self.apis], shape_class=shape, stop_timeout=120
        )
        env.traffic = Traffic(self.oracle, pools, srv.port, srv.grpc_port, _listener(env))
        runner = env.create_local_runner()
        writer = StatsCSVFileWriter(env, [0.5, 0.99], str(self.out / "locust"), full_history=False)
        stats_writer = threading.Thread(target=writer.stats_writer, daemon=True)
        stats_writer.start()
        watch = monitor.Monitor(
            srv.workers, srv.ready_workers, self.out / "resources.csv", self.plan.sample_s
        )
        watch.start()
        scenario = schedule.Scenario(srv, self.args.workers, self.folder, redis, env.traffic)

        watch.phase = "warmup"
        runner.start_shape()
        deadline = time.monotonic() + 120
        while runner.user_count < self.plan.users and time.monotonic() < deadline:
            time.sleep(0.2)  # the warm-up counts once every user runs
        time.sleep(self.plan.warmup_s)
        baseline = self._idle(shape, watch, runner, "baseline")
        shape.phase = watch.phase = "main"
        main_began = self.oracle.t0 = time.monotonic()
        events = threading.Thread(target=scenario.run, args=(self.events,))
        events.start()
        self._progress(main_began, events)
        events.join()
        watch.sample("main")
        end = self._idle(shape, watch, runner, "end", back_to=baseline)
        shape.phase = "done"
        runner.quit()
        watch.stop()
        self.oracle.settle()
        return self.judge(srv, watch, scenario, baseline, end, main_began)

    def _idle(
        self,
        shape: PhaseShape,
        watch: monitor.Monitor,
        runner: Any,
        phase: str,
        back_to: list[monitor.Sample] | None = None,
    ) -> list[monitor.Sample]:
        shape.phase = watch.phase = phase
        deadline = time.monotonic() + 180
        while runner.user_count and time.monotonic() < deadline:
            time.sleep(0.2)
        if back_to is None:
            return monitor.idle(watch, phase, at_least_s=self.plan.idle_s)
        # The end: idle connections close on their own timers (the workers' peer connections
        # after peer_keepalive_s, clients' after longer), so wait up to 90 s for the baseline's counts.
        return monitor.idle(watch, phase, at_least_s=self.plan.idle_s, timeout_s=90.0,
                            until=lambda look: not monitor.back_to_baseline(back_to, look))  # fmt: skip

    def _progress(self, began: float, events: threading.Thread) -> None:
        """Wait out the main phase, a line of outcomes every 30 s."""
        until = began + self.plan.main_s
        while time.monotonic() < until:
            time.sleep(min(30.0, max(0.0, until - time.monotonic())))
            counts: Counter[str] = Counter()
            for c in self.oracle.tally.counts.values():
                counts.update(c)
            print(f"{time.monotonic() - began:7.0f} s  {dict(counts)}", flush=True)

    def judge(
        self,
        srv: Gunicorn,
        watch: monitor.Monitor,
        scenario: schedule.Scenario,
        baseline: list[monitor.Sample],
        end: list[monitor.Sample],
        main_began: float,
    ) -> int:
        tally = self.oracle.tally
        failures = oracle.verdict(tally)
        events = [
            {"at_s": r.event.at_s, "action": r.event.action, **r.event.params, "began_s": round(r.began_s, 1),
             "ended_s": round(r.ended_s, 1), "note": r.note, "failure": r.failure}
            for r in scenario.records
        ]  # fmt: skip
        failures += [f"event {e['action']} at {e['at_s']} s: {e['failure']}" for e in events if e["failure"]]
        pids = {s.pid for s in baseline}
        growth, anon = (
            monitor.rss_growth(
                watch.samples, main_began, self.plan.warm_s, watch.first_ready, pids, field, self.plan.round_s
            )
            for field in ("rss", "anon")
        )
        bound = self.args.rss_growth_mb or self.plan.rss_growth_mb
        failures += monitor.growth_verdict(growth, bound, self.plan.round_s)
        failures += monitor.back_to_baseline(baseline, end)
        self.summary = report.record(
            command="python -m benchmarks.stress " + " ".join(sys.argv[1:]),
            plan=self.plan.__dict__,
            outcomes={api: dict(c) for api, c in tally.counts.items()},
            examples=tally.examples,
            retry_after_missing=tally.retry_after_missing,
            max_deviation=tally.max_deviation,
            events=events,
            rss_growth_mb=_rounded(growth),
            anon_growth_mb=_rounded(anon),
            baseline=[s.__dict__ for s in baseline],
            end=[s.__dict__ for s in end],
            server_log=server_log(srv.log()),
            failures=failures,
            passed=not failures,
        )
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=1, default=str))
        self._print(tally, events, growth, anon, baseline, end, failures)
        return 1 if failures else 0

    def _print(
        self,
        tally: oracle.Tally,
        events: list[dict[str, Any]],
        growth: dict[int, float],
        anon: dict[int, float],
        baseline: list[monitor.Sample],
        end: list[monitor.Sample],
        failures: list[str],
    ) -> None:
        print("\n".join(oracle.table(tally, [a.name for a in self.apis])))
        print(
            f"503 without Retry-After: {tally.retry_after_missing}; "
            f"largest deviation of an ok answer: {tally.max_deviation:.3g}"
        )
        for e in events:
            print(f"  {e['at_s']:7.0f} s  {e['action']:<13} {e['note'] or ''} {e['failure'] or ''}".rstrip())
        print("RSS growth after warm-up (MB):", _rounded(growth), "of which anonymous:", _rounded(anon))
        for label, samples in (("baseline", baseline), ("end", end)):
            rows = [f"{s.pid}: {s.rss / monitor.MB:.0f} MB {s.fds} fds {s.threads} threads" for s in samples]
            print(f"{label}:", ", ".join(rows))
        for name, examples in tally.examples.items():
            print(f"{name}:", *examples[:5], sep="\n  ")
        print("server log:", self.summary["server_log"])
        print("PASSED" if not failures else "FAILED:\n  " + "\n  ".join(failures), f"(results: {self.out})")


def _rounded(values: dict[int, float]) -> dict[int, float]:
    return {k: round(v, 1) for k, v in values.items()}


def _listener(env: StressEnvironment) -> Any:
    """Each judged request as a locust request event (its API's name; ``<api> (<outcome>)``
    unless ok; a failure for the outcomes that fail the run)."""

    def fire(api: str, outcome: str, ms: float, size: int) -> None:
        failed = outcome in oracle.FAILING
        env.events.request.fire(  # type: ignore[no-untyped-call]
            request_type="gRPC" if api.startswith("grpc") else "POST",
            name=api if outcome == "ok" else f"{api} ({outcome})",
            response_time=ms,
            response_length=size,
            exception=RuntimeError(outcome) if failed else None,
            context={},
        )

    return fire


def main(argv: Sequence[str] | None = None) -> int:
    return Run(parse_args(argv)).run()
