"""The workers' resources through a stress run: each live worker's RSS, open descriptors and
threads (psutil) every ``interval_s``, written as CSV rows as they come, and the bounds on them.

**RSS growth after warm-up**: for each worker, its RSS at the end of the main phase minus its
RSS once warm. Warm: ``warm_s`` after the worker was first seen ready (for the first workers,
the main phase's start: they warmed up in the warm-up phase) and, where the schedule repeats its
events every ``round_s``, one round later: a worker's first reload, new version or load holds
two copies of a model for a moment, and the allocator keeps those pages for the next one (here
+60-70 MB once, then level). With rounds, each level is the lowest sample of one round, the
first round once warm and the last round of the worker's life: a sample taken while a model is
swapped (two copies, +60-100 MB for seconds) is not compared against one taken between swaps,
and a leak still raises every round's lowest sample. Without (``round_s`` 0): the first sample
once warm and the last. Bound: ``rss_growth_mb`` (50 MB); a run in which no worker lived
long enough to be judged fails too (:func:`growth_verdict`).

**Descriptors and threads back to their baseline**: the samples taken with no client connected
(the idle pause after warm-up, and the idle end) per worker: each worker's count at the end at
most the baseline (a worker that was not there at the baseline, forked by a HUP or after a
SIGKILL, against the largest count of the baseline's workers).
"""

from __future__ import annotations

import csv
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import psutil

MB = 1 << 20


@dataclass(frozen=True)
class Sample:
    """One worker at one moment: monotonic ``at``, the run's ``phase``, ``rss`` bytes (of which
    ``anon`` bytes are anonymous memory: the heap, not the files mapped, such as the response
    cache's LMDB map, which counts in RSS up to its size), open descriptors and threads."""

    at: float
    phase: str
    pid: int
    rss: int
    anon: int
    fds: int
    threads: int


def anonymous_bytes(pid: int) -> int:
    """``RssAnon`` of ``/proc/<pid>/status`` in bytes (Linux); 0 where it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def measure(processes: Iterable[psutil.Process], at: float, phase: str) -> list[Sample]:
    """A :class:`Sample` of each process still alive."""
    samples = []
    for p in processes:
        try:
            with p.oneshot():
                rss, fds, threads = p.memory_info().rss, p.num_fds(), p.num_threads()
        except psutil.Error:
            continue  # it died between the listing and the look
        samples.append(Sample(at, phase, p.pid, rss, anonymous_bytes(p.pid), fds, threads))
    return samples


class Monitor:
    """Samples ``workers()`` every ``interval_s`` on a thread of its own, into memory and the CSV
    file ``path`` (``t_s, phase, pid, rss_mb, anon_mb, fds, threads``); notes when each pid was first
    among ``ready()``."""

    def __init__(
        self,
        workers: Callable[[], list[psutil.Process]],
        ready: Callable[[], set[int]],
        path: Path,
        interval_s: float,
    ) -> None:
        self.workers, self.ready, self.path, self.interval_s = workers, ready, path, interval_s
        self.samples: list[Sample] = []
        self.phase = "start"
        self.began = time.monotonic()
        self.first_ready: dict[int, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stress-monitor", daemon=True)
        self._file: TextIO = open(path, "w", newline="")  # noqa: SIM115 - closed in stop()
        self._csv = csv.writer(self._file)
        self._csv.writerow(["t_s", "phase", "pid", "rss_mb", "anon_mb", "fds", "threads"])

    def start(self) -> Monitor:
        self._thread.start()
        return self

    def sample(self, phase: str | None = None) -> list[Sample]:
        """Sample every worker now (in ``phase``, default the current one); keep and write it."""
        now = time.monotonic()
        taken = measure(self.workers(), now, phase or self.phase)
        ready = self.ready()
        with self._lock:
            for s in taken:
                if s.pid in ready:
                    self.first_ready.setdefault(s.pid, now)
                row = [f"{now - self.began:.1f}", s.phase, s.pid, f"{s.rss / MB:.1f}", f"{s.anon / MB:.1f}"]
                self._csv.writerow([*row, s.fds, s.threads])
            self._file.flush()
            self.samples.extend(taken)
        return taken

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self._file.close()


def rss_growth(
    samples: list[Sample],
    main_began: float,
    warm_s: float,
    first_ready: dict[int, float],
    baseline: set[int],
    field: str = "rss",
    round_s: float = 0.0,
) -> dict[int, float]:
    """pid -> MB its RSS (``field`` "anon": its anonymous memory) grew from once warm to the end
    of the main phase (module docstring): warm at ``main_began`` (a worker of the ``baseline``),
    else ``warm_s`` after it was first seen ready, and ``round_s`` later; with ``round_s``, the
    lowest sample of the first ``round_s`` once warm against the lowest of its last ``round_s``
    (only workers that lived two rounds once warm), else its first sample once warm against its
    last (only workers with two such samples)."""
    growth = {}
    for pid in sorted({s.pid for s in samples if s.pid in baseline or s.pid in first_ready}):
        own = [s for s in samples if s.pid == pid and s.phase == "main"]
        start = (main_began if pid in baseline else first_ready[pid] + warm_s) + round_s
        warm = [s for s in own if s.at >= start]
        if not round_s:
            if len(warm) >= 2:
                growth[pid] = (getattr(warm[-1], field) - getattr(warm[0], field)) / MB
            continue
        if not warm or warm[-1].at - start < 2 * round_s:
            continue
        first = min(getattr(s, field) for s in warm if s.at < start + round_s)
        last = min(getattr(s, field) for s in warm if s.at > warm[-1].at - round_s)
        growth[pid] = (last - first) / MB
    return growth


def growth_verdict(growth: dict[int, float], bound_mb: float, round_s: float = 0.0) -> list[str]:
    """The bounds the RSS growth of :func:`rss_growth` broke (empty: none): a worker that grew
    more than ``bound_mb``, or no worker judged at all (a run too short to say anything about
    memory does not pass)."""
    if not growth:
        needs = f"two rounds ({2 * round_s:g} s)" if round_s else "two samples"
        return [f"RSS growth judged for no worker: none lived {needs} once warm in the main phase"]
    grown = growth.items()
    return [f"worker {pid}: RSS grew {mb:.1f} MB (bound {bound_mb:g})" for pid, mb in grown if mb > bound_mb]


def back_to_baseline(baseline: list[Sample], end: list[Sample]) -> list[str]:
    """What did not come back: each end sample's descriptors and threads against the same
    worker's baseline sample, or the largest of the baseline for a worker born since."""
    if not baseline:
        return ["no baseline sample"]
    by_pid = {s.pid: s for s in baseline}
    most_fds, most_threads = max(s.fds for s in baseline), max(s.threads for s in baseline)
    broken = []
    for s in end:
        base = by_pid.get(s.pid)
        fds, threads = (base.fds, base.threads) if base else (most_fds, most_threads)
        if s.fds > fds:
            broken.append(f"worker {s.pid}: {s.fds} descriptors at the end, {fds} at the baseline")
        if s.threads > threads:
            broken.append(f"worker {s.pid}: {s.threads} threads at the end, {threads} at the baseline")
    return broken


def idle(
    monitor: Monitor,
    phase: str,
    *,
    at_least_s: float = 16.0,
    settle_s: float = 1.0,
    timeout_s: float = 60.0,
    until: Callable[[list[Sample]], bool] | None = None,
) -> list[Sample]:
    """Samples of the idle workers once their descriptors have settled: after ``at_least_s``
    (the keep-alive connections the workers hold to each other for forwarding close after
    ``SCORING_PEER_KEEPALIVE_S`` idle, the plan's ``peer_keepalive_s``), once three looks
    ``settle_s`` apart agree and ``until`` (when given) holds for the last, at most ``timeout_s``."""
    began = time.monotonic()
    looks = [monitor.sample(phase)]
    while time.monotonic() - began < timeout_s:
        time.sleep(settle_s)
        looks.append(monitor.sample(phase))
        counts = [{(s.pid, s.fds, s.threads) for s in look} for look in looks[-3:]]
        if (
            time.monotonic() - began >= at_least_s
            and len(counts) == 3
            and counts[0] == counts[1] == counts[2]
            and (until is None or until(looks[-1]))
        ):
            break
    return looks[-1]
