"""Acceptance checks on a real GPU machine: NVML, binding, CUDA serving, GPU load.

Run on a machine with an NVIDIA GPU (nothing here is faked):

    python -m benchmarks.gpu_check --repository model_repository --out gpu_check.json

1. ``python -m gpu_stat --json`` through each NVML binding (nvidia-ml-py, py3nvml): the
   same GPUs, and torch's ``cuda:0`` is NVML's first one (UUIDs compared).
2. For ``SCORING_MAX_PROCESSES_PER_GPU`` = 1 and 2 (workers = GPUs x that): gunicorn
   serving the repository on the real NVML. Every worker's ``GET /v2`` says ``device
   cuda:0`` and names the GPU UUID it leased; NVML lists every worker's pid as a compute
   process and not the master's; the master maps no CUDA library; every model answers the
   CPU's numbers (in this process, same weights) within ``--atol``; after ``kill -9`` of a
   worker and after a HUP reload the (GPU, slot) layout is whole again.
3. Served load, per model, at the last layout: closed-loop clients at each
   ``--concurrency`` for ``--duration`` s from a client that is not the bound
   (:mod:`benchmarks.loadgen`: ``--client-processes`` client processes by default, or wrk),
   the client's own CPU reported beside each figure, with NVML's GPU utilisation sampled every
   0.2 s (percent of time a kernel ran; nvmlDeviceGetUtilizationRates).

``--load-only`` runs step 3 alone on one server (``--per-gpu``'s first value): on a machine
without a GPU it rehearses the load (CPU mode), e.g.
``python -m benchmarks.gpu_check --load-only --per-gpu 1 --concurrency 8 --duration 3``.

``tests/test_gpu.py`` runs checks 1 and 2 (``check_nvml``, ``check_binding``) as pytest tests.

Each check is recorded with its evidence in one JSON report; the exit status is 1 if
any failed. Traffic goes to 127.0.0.1 only and every phase stops by itself.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import numpy as np

from app.models.repository import read_config
from benchmarks import loadgen, payloads, server
from benchmarks.driver import poll
from benchmarks.loadgen import Request
from benchmarks.report import record, write_json
from gpu_stat import NvmlUnavailable, query_gpus
from tests.support.gunicorn import ROOT, Gunicorn

#: Libraries that only a process using CUDA maps. Not ``libcuda.so``: the driver's NVML
#: library maps it at ``nvmlInit`` (seen with driver 580.159.04), in the master too, and
#: that makes no CUDA context (NVML lists no master pid; the forked workers use CUDA).
CUDA_RUNTIME_LIBRARIES = ("libcudart", "libtorch_cuda", "libcublas")


class Report:
    """The checks' outcomes: ``check(name, ok, **evidence)`` records and prints one."""

    def __init__(self) -> None:
        self.checks: list[dict[str, Any]] = []
        self.figures: dict[str, Any] = {}

    def check(self, name: str, ok: bool, **evidence: Any) -> bool:
        self.checks.append({"check": name, "ok": bool(ok), **evidence})
        print(f"{'PASS' if ok else 'FAIL'} {name} {json.dumps(evidence, default=str)[:600]}", flush=True)
        return bool(ok)

    @property
    def failed(self) -> list[str]:
        return [c["check"] for c in self.checks if not c["ok"]]


def check_nvml(report: Report) -> int:
    """``python -m gpu_stat --json`` through both NVML bindings: the same GPUs, the first is
    torch's ``cuda:0`` (UUIDs compared). Returns how many GPUs nvidia-ml-py lists."""
    import torch

    views = {b: gpu_stat_json(b) for b in ("nvidia-ml-py", "py3nvml")}
    uuids = {b: [g["uuid"] for g in v] for b, v in views.items()}
    torch_uuid = "GPU-" + str(torch.cuda.get_device_properties(0).uuid) if torch.cuda.is_available() else None
    report.check(
        "gpu_stat --json: both NVML bindings list the same GPUs, the first is torch's cuda:0",
        bool(uuids["nvidia-ml-py"])
        and uuids["nvidia-ml-py"] == uuids["py3nvml"]
        and uuids["py3nvml"][0] == torch_uuid,
        uuids=uuids,
        torch_cuda0=torch_uuid,
        gpu_stat=views["nvidia-ml-py"],
    )
    return len(uuids["nvidia-ml-py"])


@contextmanager
def serving(repo: Path, models: list[str], per_gpu: int) -> Iterator[Gunicorn]:
    """gunicorn serving ``models`` of ``repo`` on the real NVML with
    ``SCORING_MAX_PROCESSES_PER_GPU = per_gpu`` (stopped at the end of the block)."""
    env = {
        "SCORING_MODEL_REPOSITORY": str(repo),
        "SCORING_MODELS": ",".join(models),
        "SCORING_MAX_PROCESSES_PER_GPU": str(per_gpu),
        "SCORING_ACCESS_LOG": "",
        "SCORING_LOG_LEVEL": "info",
    }
    with (
        tempfile.TemporaryDirectory() as tmp,
        Gunicorn(Path(tmp), env, torch_threads=None, drain_grace_s=None) as srv,
    ):
        yield srv


def gpu_stat_json(backend: str) -> list[dict[str, Any]]:
    """``python -m gpu_stat --json`` with ``GPU_STAT_NVML_BACKEND=backend``."""
    env = {**os.environ, "GPU_STAT_NVML_BACKEND": backend}
    command = [sys.executable, "-m", "gpu_stat", "--json"]
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return list(json.loads(out.stdout))


def nvml_compute_pids() -> dict[str, set[int]]:
    """GPU UUID -> pids NVML lists as compute processes on it (``gpu_stat``, every GPU)."""
    return {g.uuid: {p.pid for p in g.processes or ()} for g in query_gpus(respect_visible_devices=False)}


@contextmanager
def utilisation_sampler(period_s: float = 0.2) -> Iterator[list[float]]:
    """Samples NVML's ``utilization.gpu`` (%, ``gpu_stat``) each ``period_s`` into the list
    yielded, until the block ends; one value per sample, the mean over the GPUs; none without
    NVML."""
    samples: list[float] = []
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(period_s):
            try:
                rates = [g.utilization_percent or 0 for g in query_gpus(respect_visible_devices=False)]
            except NvmlUnavailable:  # no GPU (--load-only on the CPU): no samples
                return
            samples.append(sum(rates) / max(1, len(rates)))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


def cpu_reference(repo: Path, bodies: dict[str, list[payloads.Tensor]]) -> dict[str, dict[str, np.ndarray]]:
    """Each model's outputs for its parity request, computed on the CPU in this process."""
    import torch

    from app.serving.runner import ModelRunner

    reference: dict[str, dict[str, np.ndarray]] = {}
    for name, request in bodies.items():
        runner = ModelRunner(read_config(repo / name))
        runner.load(torch.device("cpu"))
        outputs = runner.forward({t.name: t.array for t in request})
        reference[name] = {k: np.asarray(v, dtype=np.float32) for k, v in outputs.items()}
    return reference


def served_outputs(srv: Gunicorn, name: str, request: list[payloads.Tensor]) -> dict[str, np.ndarray]:
    """``name``'s outputs for ``request``, served over V2 JSON."""
    status, _, answer = srv.post(f"/v2/models/{name}/infer", payloads.v2_json(request))
    if status != 200:
        raise AssertionError(f"{name}: HTTP {status}: {answer}")
    return {o["name"]: np.asarray(o["data"], dtype=np.float32).reshape(o["shape"]) for o in answer["outputs"]}


def check_layout(report: Report, srv: Gunicorn, workers: int, per_gpu: int, when: str) -> None:
    """The binding checks of one moment: devices, UUIDs, slots, NVML's process lists, the master."""
    seen = srv.answering_workers(workers, 120)
    layout = sorted((w["binding"]["gpu_uuid"], int(w["binding"]["slot"])) for w in seen.values())
    report.check(
        f"per_gpu={per_gpu} {when}: every worker serves on cuda:0 of its leased GPU, one per slot",
        all(w["device"] == "cuda:0" and w["binding"]["device"] == "cuda:0" for w in seen.values())
        and len(set(layout)) == workers
        and set(Counter(u for u, _ in layout).values()) == {per_gpu},
        layout=layout,
        devices={pid: w["device"] for pid, w in seen.items()},
    )
    listed = nvml_compute_pids()

    def workers_listed() -> bool:
        listed.update(nvml_compute_pids())
        return all(pid in listed.get(w["binding"]["gpu_uuid"], set()) for pid, w in seen.items())

    with suppress(AssertionError):
        poll(workers_listed, 10, "NVML to list the workers", interval_s=0.2)
    master_maps = Path(f"/proc/{srv.proc.pid}/maps").read_text()
    report.check(
        f"per_gpu={per_gpu} {when}: NVML lists every worker on its GPU and not the master",
        workers_listed() and all(srv.proc.pid not in pids for pids in listed.values()),
        nvml={u: sorted(p) for u, p in listed.items()},
        workers=sorted(seen),
        master=srv.proc.pid,
    )
    report.check(
        f"per_gpu={per_gpu} {when}: the master maps neither the CUDA runtime nor torch",
        not any(lib in master_maps for lib in CUDA_RUNTIME_LIBRARIES),
        cuda_mapped=sorted({line.split()[-1] for line in master_maps.splitlines() if "cuda" in line}),
    )


def parity_bodies(repo: Path, models: list[str]) -> dict[str, list[payloads.Tensor]]:
    """16 items per model, the same for the CPU reference and the served answer."""
    rng = random.Random(7)
    return {name: payloads.tensors(payloads.inputs_of(repo, name), 16, rng) for name in models}


def check_parity(
    report: Report, srv: Gunicorn, bodies: dict[str, Any], reference: dict[str, Any], atol: float
) -> None:
    for name, body in bodies.items():
        got = served_outputs(srv, name, body)
        diffs = {k: float(np.max(np.abs(got[k] - v))) for k, v in reference[name].items()}
        ok = max(diffs.values()) <= atol
        report.check(f"{name}: CUDA answers match the CPU (atol {atol:g})", ok, max_abs_diff=diffs)


def wait_whole(srv: Gunicorn, workers: int) -> None:
    srv.wait_workers(workers, 120)
    srv.wait_ready(300, count=workers)


def kill_one_and_wait(srv: Gunicorn, workers: int) -> None:
    """``kill -9`` of the oldest worker; wait until its replacement is ready."""
    victim = srv.workers()[0].pid
    os.kill(victim, signal.SIGKILL)
    poll(lambda: victim not in {w.pid for w in srv.workers()}, 30, "the killed worker to go")
    wait_whole(srv, workers)


def hup_and_wait(srv: Gunicorn, workers: int) -> None:
    """HUP; wait until no worker from before is left and ``workers`` are ready."""
    before = {w.pid for w in srv.workers()}
    srv.proc.send_signal(signal.SIGHUP)
    poll(
        lambda: not before & {w.pid for w in srv.workers()} and len(srv.ready_workers()) == workers,
        300,
        "HUP to replace every worker",
        diagnostics=srv.log_tail,
    )


def check_binding(
    report: Report,
    srv: Gunicorn,
    workers: int,
    per_gpu: int,
    bodies: dict[str, Any],
    reference: dict[str, Any],
    atol: float,
) -> None:
    """The binding checks of one ``per_gpu`` layout, its ``workers`` ready: the layout at start,
    the CPU's numbers, the layout after ``kill -9`` of a worker and after a HUP reload, and the
    CPU's numbers again."""
    check_layout(report, srv, workers, per_gpu, "at start")
    check_parity(report, srv, bodies, reference, atol)
    kill_one_and_wait(srv, workers)
    check_layout(report, srv, workers, per_gpu, "after kill -9 of a worker")
    hup_and_wait(srv, workers)
    check_layout(report, srv, workers, per_gpu, "after HUP")
    check_parity(report, srv, bodies, reference, atol)


def load_phase(
    report: Report,
    srv: Gunicorn,
    repo: Path,
    models: list[str],
    levels: list[int],
    seconds: float,
    items: int,
    client: str = "processes",
    processes: int = 4,
) -> dict[str, Any]:
    """Closed-loop load per model and level, V2 JSON, from a client that is not the bound
    (:func:`benchmarks.loadgen.client`: ``client`` "processes" = ``processes`` client processes,
    "wrk" or "auto"), with NVML utilisation sampled during each level. Each row carries the
    client's CPU (seconds, µs per item) and the machine's load average after the level."""
    figures: dict[str, Any] = {}
    for name in models:
        path = f"/v2/models/{name}/infer"
        requests = [Request(path, body) for body in payloads.v2_bodies(repo, name, items, 256, seed=1)]
        warm = loadgen.client(srv.url, srv.grpc_url, "v2-json", levels[0], client, processes)
        warm(requests, 2.0)  # connections, caches
        rows = []
        for c in levels:
            run = loadgen.client(srv.url, srv.grpc_url, "v2-json", c, client, processes)
            with utilisation_sampler() as util:
                row = run(requests, seconds).figures(items)
            row["gpu_util_mean_pct"] = float(np.mean(util)) if util else float("nan")
            row["gpu_util_samples"] = len(util)
            row["load_average"] = os.getloadavg()[0]
            print(f"load {name} items={items}: {row}", flush=True)
            rows.append(row)
        figures[name] = rows
        # A 503 is admission refusing past capacity (with Retry-After): counted, not a failure.
        failed = sum(n for r in rows for status, n in r["statuses"].items() if status != "503")
        refused = sum(r["statuses"].get("503", 0) for r in rows)
        report.check(f"{name}: load ran without errors ({refused} refused with 503)", failed == 0, rows=rows)
    return figures


def load_only(args: argparse.Namespace, report: Report) -> None:
    """``--load-only``: no NVML or binding check, one server of ``--per-gpu``'s first value in
    workers (per GPU on a GPU host; in all on the CPU), the load phase only: a rehearsal of the
    load on a machine without a GPU, or the load figures alone on one with a GPU."""
    workers = args.per_gpu[0]
    with (
        tempfile.TemporaryDirectory() as tmp,
        server.start(Path(tmp), args.repository.resolve(), ",".join(args.models), workers) as srv,
    ):
        srv.wait_ready(600, count=workers)
        report.figures[f"load_per_gpu_{workers}"] = load_phase(
            report, srv, args.repository.resolve(), args.models, args.concurrency, args.duration, args.items,
            args.client, args.client_processes,
        )  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repository", type=Path, default=server.DEMO_REPOSITORY)
    parser.add_argument("--models", type=server.comma_list(), default=[server.RANKER, server.MINILM])
    parser.add_argument(
        "--per-gpu", type=server.levels, default=[1, 2], help="SCORING_MAX_PROCESSES_PER_GPU values"
    )
    parser.add_argument("--concurrency", type=server.levels, default=[1, 8, 64])
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per load level")
    parser.add_argument("--items", type=int, default=8, help="items per request in the load phase")
    parser.add_argument("--atol", type=float, default=1e-3)
    parser.add_argument(
        "--client", choices=("processes", "wrk", "auto"), default="processes", help="the load client"
    )
    parser.add_argument("--client-processes", type=int, default=4, help="client processes of the load")
    parser.add_argument(
        "--load-only", action="store_true", help="only the load phase (runs on the CPU: a rehearsal)"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report = Report()
    if args.load_only:
        load_only(args, report)
        result = record(failed=report.failed, **report.figures, checks=report.checks)
        write_json(args.out, result)
        print(json.dumps({"failed": report.failed}), flush=True)
        return 1 if report.failed else 0
    import torch

    models = args.models
    repo = args.repository.resolve()
    report.figures["torch"] = torch.__version__
    report.figures["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None

    gpus = check_nvml(report)
    bodies = parity_bodies(repo, models)
    reference = cpu_reference(repo, bodies)
    levels = args.concurrency
    for per_gpu in args.per_gpu:
        workers = gpus * per_gpu
        with serving(repo, models, per_gpu) as srv:
            started = time.monotonic()
            wait_whole(srv, workers)
            report.figures[f"boot_s_per_gpu_{per_gpu}"] = round(time.monotonic() - started, 1)
            check_binding(report, srv, workers, per_gpu, bodies, reference, args.atol)
            report.figures[f"load_per_gpu_{per_gpu}"] = load_phase(
                report,
                srv,
                repo,
                models,
                levels,
                args.duration,
                args.items,
                args.client,
                args.client_processes,
            )
            report.figures[f"log_tail_per_gpu_{per_gpu}"] = srv.log_tail(3000)
    result = record(failed=report.failed, **report.figures, checks=report.checks)
    write_json(args.out, result)
    print(json.dumps({"failed": report.failed}), flush=True)
    return 1 if report.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
