"""Start to ready: seconds from ``gunicorn`` exec to the first 200 on ``/v2/health/ready``, and
what the processes import on the way.

    python -m benchmarks.startup --out out/startup.json          # both cases, 5 starts each
    python -m benchmarks.startup --cases minilm-1 --repeat 3 --no-imports

Cases (:data:`CASES`): ``minilm-1``, one worker serving only all-MiniLM-L6-v2; ``demo-2``, the
demo repository (every model) with two workers. Each start runs gunicorn as the other harnesses
do (:func:`benchmarks.server.start`, a warm install: the files are in the page cache after the
first start) and polls every ``--poll-ms`` ms, from just before the exec:

- ``ready_s``: the first 200 on ``GET /v2/health/ready`` (a worker with every model ready);
- ``models_s``: per model, the first 200 on ``GET /v2/models/<name>/ready``;
- ``all_workers_s``: every worker ready (the load table, as the tests' launcher reads it);
- ``worker_cpu_s`` / ``master_cpu_s``: user + system CPU of each worker and of the master when
  all were ready.

Each figure's min, median and max over ``--repeat`` starts are reported. Then, unless
``--no-imports``, one more start per case with one worker and ``PYTHONPROFILEIMPORTTIME=1``
(``python -X importtime``): the master's imports (before the fork) and the worker's own
(after it: what the master imported is inherited), each module's self time summed per
top-level package (:func:`by_package`). ``-X importtime`` measures wall time: on an idle
machine that is the import's CPU (imports run on one thread); on a loaded one it is more.

Targets (issue 51): ``minilm-1`` ready within 3 s, ``demo-2`` within 6 s. Traffic goes to
127.0.0.1 only; every start is stopped (SIGTERM) before the next.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import psutil

from benchmarks import report, server
from benchmarks.driver import http
from tests.support.gunicorn import Gunicorn

#: Case -> (models, "" = every model of the repository; workers).
CASES: dict[str, tuple[str, int]] = {"minilm-1": (server.MINILM, 1), "demo-2": ("", 2)}
#: The targets of issue 51, seconds to ready.
TARGETS_S = {"minilm-1": 3.0, "demo-2": 6.0}
_IMPORT = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)\s*$")
#: gunicorn logs this in the worker after the fork, before the worker imports anything.
BOOTING = "Booting worker with pid"


def models_of(repository: Path, models: str) -> list[str]:
    """The model names a case serves: ``models`` (comma-separated), or every folder of
    ``repository`` with a ``model.toml`` when empty."""
    if models:
        return models.split(",")
    return sorted(p.parent.name for p in repository.glob("*/model.toml"))


def answered(srv: Gunicorn, path: str) -> bool:
    """Whether ``GET path`` answers 200 now (a refused connection or a timeout is no)."""
    try:
        return http("GET", srv.url + path, timeout=2)[0] == 200
    except OSError:
        return False


def one_start(repository: Path, models: str, workers: int, poll_s: float, timeout_s: float) -> dict[str, Any]:
    """One start (module docstring): seconds to ready, per model, to every worker ready, and the
    processes' CPU then.

    Raises:
        AssertionError: not ready within ``timeout_s`` (with the server's log), or gunicorn exited.
    """
    names = models_of(repository, models)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        with server.start(Path(tmp), repository, models, workers) as srv:
            ready: float | None = None
            model_ready: dict[str, float] = {}
            while True:
                now = time.perf_counter() - start
                if srv.proc.poll() is not None or now > timeout_s:
                    raise AssertionError(f"not ready after {now:.1f} s:\n{srv.log_tail()}")
                if ready is None and answered(srv, "/v2/health/ready"):
                    ready = now
                for name in (n for n in names if n not in model_ready):
                    if answered(srv, f"/v2/models/{name}/ready"):
                        model_ready[name] = now
                everything = ready is not None and len(model_ready) == len(names)
                if everything and srv.all_workers_ready() and len(srv.workers()) >= workers:
                    break
                time.sleep(poll_s)
            all_workers = time.perf_counter() - start
            cpu = {w.pid: sum(w.cpu_times()[:2]) for w in srv.workers()}
            master = sum(psutil.Process(srv.proc.pid).cpu_times()[:2])
    return {
        "ready_s": ready,
        "models_s": model_ready,
        "all_workers_s": all_workers,
        "worker_cpu_s": sorted(cpu.values()),
        "master_cpu_s": master,
    }


def spread(values: Iterable[float]) -> dict[str, float]:
    """min, median and max of ``values``.

    >>> spread([3.0, 1.0, 2.0])
    {'min': 1.0, 'median': 2.0, 'max': 3.0}
    """
    ordered = sorted(values)
    return {"min": ordered[0], "median": statistics.median(ordered), "max": ordered[-1]}


def summary(starts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each figure of :func:`one_start` as its :func:`spread` over ``starts`` (per model for
    ``models_s``; the per-worker CPU pooled over the workers)."""
    models = starts[0]["models_s"]
    return {
        "ready_s": spread(s["ready_s"] for s in starts),
        "all_workers_s": spread(s["all_workers_s"] for s in starts),
        "models_s": {m: spread(s["models_s"][m] for s in starts) for m in models},
        "worker_cpu_s": spread(cpu for s in starts for cpu in s["worker_cpu_s"]),
        "master_cpu_s": spread(s["master_cpu_s"] for s in starts),
    }


class Import(NamedTuple):
    """One ``-X importtime`` line: the module, its self and cumulative time (microseconds) and
    its nesting depth (0: imported by no other import, at top level or by a function at run
    time)."""

    module: str
    self_us: int
    cumulative_us: int
    depth: int


def parse_importtime(lines: Iterable[str]) -> list[Import]:
    """The ``-X importtime`` lines among ``lines``, in order (others, and the header, skipped)."""
    found = [(m[4], int(m[1]), int(m[2]), len(m[3])) for m in map(_IMPORT.match, lines) if m]
    top = min((indent for *_, indent in found), default=0)
    return [Import(module, own, total, (indent - top) // 2) for module, own, total, indent in found]


def entry_points(imports: Sequence[Import], count: int = 10) -> dict[str, float]:
    """The ``count`` costliest imports of depth 0 (what the process itself, or a function at run
    time, imported: each with everything it pulled in that was not imported yet), cumulative
    seconds, largest first.

    >>> entry_points([Import("a.b", 5, 5, 1), Import("a", 10, 15, 0), Import("c", 2, 2, 0)])
    {'a': 1.5e-05, 'c': 2e-06}
    """
    roots = sorted((i for i in imports if i.depth == 0), key=lambda i: -i.cumulative_us)
    return {i.module: i.cumulative_us / 1e6 for i in roots[:count]}


def split_at_fork(log: str) -> tuple[list[str], list[str]]:
    """The lines of a one-worker server's log before the worker's ``Booting worker`` line (the
    master's) and after it (the worker's)."""
    lines = log.splitlines()
    at = next((i for i, line in enumerate(lines) if BOOTING in line), len(lines))
    return lines[:at], lines[at + 1 :]


def by_package(imports: Iterable[Import]) -> dict[str, float]:
    """Self time (seconds) summed per top-level package, the standard library's modules
    together as ``stdlib``, largest first.

    >>> by_package([Import("torch", 900_000, 1_000_000, 0), Import("torch._C", 100_000, 100_000, 1),
    ...             Import("json", 5_000, 10_000, 0), Import("json.decoder", 5_000, 5_000, 1)])
    {'torch': 1.0, 'stdlib': 0.01}
    """
    totals: Counter[str] = Counter()
    for found in imports:
        top = found.module.split(".")[0]
        totals["stdlib" if top in sys.stdlib_module_names else top] += found.self_us
    return {name: micros / 1e6 for name, micros in totals.most_common()}


def import_profile(repository: Path, models: str, timeout_s: float) -> dict[str, dict[str, float]]:
    """One start with one worker under ``PYTHONPROFILEIMPORTTIME=1``, stopped once ready: per
    package the master's and the worker's import self time (:func:`by_package`), and the
    worker's costliest :func:`entry_points` (``worker_entry_points``)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {"PYTHONPROFILEIMPORTTIME": "1", "SCORING_LOG_LEVEL": "info"}
        with server.start(Path(tmp), repository, models, 1, env) as srv:
            srv.wait_ready(timeout_s)
            log = srv.log()
    master, worker = split_at_fork(log)
    worker_imports = parse_importtime(worker)
    return {
        "master": by_package(parse_importtime(master)),
        "worker": by_package(worker_imports),
        "worker_entry_points": entry_points(worker_imports),
    }


def seconds(figure: dict[str, float]) -> str:
    return f"{figure['min']:.2f} / {figure['median']:.2f} / {figure['max']:.2f}"


def markdown(result: dict[str, Any], top: int = 12) -> str:
    """The start-to-ready table, then per case the largest imports of the master and the worker."""
    rows = []
    for case, found in result["cases"].items():
        s = found["summary"]
        rows.append((
            case, len(found["starts"]), seconds(s["ready_s"]), f"{TARGETS_S.get(case, float('nan')):g}",
            seconds(s["all_workers_s"]), seconds(s["worker_cpu_s"]), seconds(s["master_cpu_s"]),
        ))  # fmt: skip
    header = (
        "case", "starts", "ready s (min / median / max)", "target s", "every worker ready s",
        "CPU-s per worker at ready", "master CPU-s",
    )  # fmt: skip
    parts = [f"{report.machine_label()} ({result['date']}).", report.table(header, rows, "lrrrrrr")]
    for case, found in result["cases"].items():
        for model, figure in found["summary"]["models_s"].items():
            parts.append(f"{case}: {model} ready in {seconds(figure)} s.")
        imports = found.get("imports")
        if imports:
            packages = sorted(
                {*imports["worker"], *imports["master"]}, key=lambda p: -imports["worker"].get(p, 0)
            )
            lines = [
                (p, f"{imports['master'].get(p, 0):.3f}", f"{imports['worker'].get(p, 0):.3f}")
                for p in packages[:top]
            ]
            lines.append(
                ("all", f"{sum(imports['master'].values()):.3f}", f"{sum(imports['worker'].values()):.3f}")
            )
            parts.append(f"**{case}**, one worker: import self time per package, seconds (`-X importtime`)")
            parts.append(report.table(("package", "master", "worker"), lines, "lrr"))
            entries = [(module, f"{s:.3f}") for module, s in imports["worker_entry_points"].items()]
            parts.append(f"**{case}**: what the worker imported, each with all it pulled in, seconds")
            parts.append(report.table(("import", "cumulative s"), entries, "lr"))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repository", type=Path, default=server.DEMO_REPOSITORY)
    parser.add_argument("--cases", type=server.comma_list(CASES), default=list(CASES))
    parser.add_argument("--repeat", type=int, default=5, help="starts per case")
    parser.add_argument("--poll-ms", type=float, default=25.0)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a start may take")
    parser.add_argument("--no-imports", action="store_true", help="no -X importtime start")
    parser.add_argument("--out", type=Path, default=Path("out/startup.json"))
    args = parser.parse_args(argv)
    result = report.record(repeat=args.repeat, poll_ms=args.poll_ms, cases={})
    for case in args.cases:
        models, workers = CASES[case]
        starts = []
        for i in range(args.repeat):
            starts.append(one_start(args.repository, models, workers, args.poll_ms / 1000, args.timeout))
            print(f"{case} start {i + 1}: {starts[-1]}", flush=True)
        result["cases"][case] = {
            "models": models or "all",
            "workers": workers,
            "starts": starts,
            "summary": summary(starts),
        }
        if not args.no_imports:
            result["cases"][case]["imports"] = import_profile(args.repository, models, args.timeout)
    result["load_average_at_end"] = report.machine()["load_average"]
    report.publish(args.out, result, markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
