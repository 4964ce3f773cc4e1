#!/usr/bin/env python3
"""Record py-spy profiles of every scoring-server worker: flame graph SVG or speedscope JSON.

    scripts/flamegraph --pid 4242 --duration 10                  # one process
    scripts/flamegraph --pidfile /tmp/scoring.pid --duration 10  # every worker, one file each
    scripts/flamegraph --pidfile /tmp/scoring.pid --subprocesses # master + workers, one file
    scripts/flamegraph --pidfile /tmp/scoring.pid --format speedscope  # https://www.speedscope.app
    scripts/flamegraph --pid 4242 --native                       # with C/C++ frames (torch ops)

For each target one ``py-spy record`` samples the stacks of every thread for ``--duration``
seconds while the server keeps running (all targets at once), and py-spy itself writes the
output in ``--format``: ``flamegraph`` (``<out>/<name>.svg``, interactive: zoom, search),
``speedscope`` (``<out>/<name>.speedscope.json``), ``raw`` collapsed stacks (``<out>/<name>.txt``,
the input of flamegraph.pl or inferno) or ``chrometrace`` (``<out>/<name>.json``).

What this script adds to py-spy: finding the workers (the children of the master in gunicorn's
``--pid`` file, ``gpu_stat.family``), recording them all in parallel, one file each (names get
``-<pid>`` when there are several), and saying why py-spy would be refused before it tries.
Idle threads are left out unless ``--idle``; samples are grouped by function (``--lines``
groups by line instead).

py-spy reads another process's memory (ptrace rules apply): run as the same user as the
server, or as root, and in a container add the SYS_PTRACE capability (``docker run
--cap-add SYS_PTRACE``; Kubernetes ``securityContext.capabilities.add: [SYS_PTRACE]``).
Installing: ``pip install py-spy``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpu_stat.family import live_children

PROC = Path("/proc")
CAP_SYS_PTRACE = 19
#: py-spy's output formats and the file suffix of each.
SUFFIXES = {"flamegraph": ".svg", "speedscope": ".speedscope.json", "raw": ".txt", "chrometrace": ".json"}


# --- finding the processes -------------------------------------------------------------------


def read_pidfile(path: Path) -> int:
    """The pid in gunicorn's pid file.

    Raises:
        ValueError: the file is missing, or does not hold a positive integer.
    """
    try:
        text = path.read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read pid file {path}: {exc.strerror}") from None
    if not text.isdigit() or int(text) <= 0:
        raise ValueError(f"pid file {path} does not hold a pid: {text[:40]!r}")
    return int(text)


def targets(pid: int | None, pidfile: Path | None, subprocesses: bool) -> list[int]:
    """The pids to record: ``pid``; or for a pid file, the master with ``subprocesses`` (one
    profile of all) else each of its live workers, oldest first.

    Raises:
        ValueError: no such process, or a master without workers.
    """
    if pid is not None:
        if not psutil.pid_exists(pid):
            raise ValueError(f"no process {pid}")
        return [pid]
    assert pidfile is not None
    master = read_pidfile(pidfile)
    if not psutil.pid_exists(master):
        raise ValueError(f"pid file {pidfile} names {master}, which is not running (stale pid file?)")
    if subprocesses:
        return [master]
    workers = live_children(master)
    if not workers:
        raise ValueError(f"gunicorn master {master} has no workers (yet?)")
    return workers


# --- ptrace permission -----------------------------------------------------------------------


def _has_cap_sys_ptrace(proc: Path) -> bool:
    try:
        for line in (proc / "self" / "status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_SYS_PTRACE & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _uid(pid: int, proc: Path) -> int | None:
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[2])  # effective uid
    except (OSError, ValueError, IndexError):
        pass
    return None


FIX = (
    "run this as the server's user or with sudo; in a container give it the capability: "
    "docker run --cap-add SYS_PTRACE, Kubernetes securityContext.capabilities.add: [SYS_PTRACE]"
)


def ptrace_problem(pids: Iterable[int], proc: Path = PROC, euid: int | None = None) -> str | None:
    """Why py-spy would be refused access to ``pids`` (Yama ptrace_scope, capabilities, other
    users), with the fix; None when it should work."""
    euid = os.geteuid() if euid is None else euid
    privileged = euid == 0 or _has_cap_sys_ptrace(proc)
    scope_file = proc / "sys" / "kernel" / "yama" / "ptrace_scope"
    try:
        scope = int(scope_file.read_text().strip())
    except (OSError, ValueError):
        scope = 0  # no Yama: classic rules (same user, or CAP_SYS_PTRACE)
    if scope >= 3:
        return (
            f"{scope_file} is 3: ptrace is disabled on this machine until reboot; "
            "py-spy cannot attach to any process"
        )
    if scope == 2 and not privileged:
        return f"{scope_file} is 2: only CAP_SYS_PTRACE may attach; {FIX}"
    if scope == 1 and not privileged:
        return (
            f"{scope_file} is 1: only a parent may attach to its children without CAP_SYS_PTRACE "
            f"(or lower it: sudo sysctl kernel.yama.ptrace_scope=0); {FIX}"
        )
    if not privileged:
        others = [p for p in pids if _uid(p, proc) not in (None, euid)]
        if others:
            return f"processes {others} belong to another user; {FIX}"
    return None


# --- recording -------------------------------------------------------------------------------


def find_py_spy() -> str:
    """The py-spy executable: on PATH, else next to this Python (a virtualenv's bin/)."""
    for candidate in (shutil.which("py-spy"), str(Path(sys.executable).parent / "py-spy")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError("py-spy not found: pip install py-spy (into the server's virtualenv)")


def py_spy_command(py_spy: str, pid: int, args: argparse.Namespace, output: Path) -> list[str]:
    """``py-spy record`` of ``pid`` into ``output`` in ``args.format``, with the chosen flags."""
    cmd = [py_spy, "record", "--pid", str(pid), "--duration", str(args.duration)]
    cmd += ["--rate", str(args.rate), "--format", args.format, "--output", str(output)]
    flags = {
        "--native": args.native,
        "--subprocesses": args.subprocesses,
        "--idle": args.idle,
        "--gil": args.gil,
        "--threads": args.threads,
        "--nonblocking": args.nonblocking,
        "--function": not args.lines,
    }
    return cmd + [flag for flag, on in flags.items() if on]


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="py-spy profiles (flame graph SVG, speedscope JSON) of a running scoring server.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--pid", type=int, help="one process to record")
    which.add_argument("--pidfile", type=Path, help="gunicorn's --pid file: record every worker")
    parser.add_argument("--format", choices=sorted(SUFFIXES), default="flamegraph", help="py-spy's output")
    parser.add_argument("--duration", type=int, default=10, help="seconds to record")
    parser.add_argument("--rate", type=int, default=100, help="samples per second")
    parser.add_argument("--out", type=Path, default=Path("flamegraphs"), help="output folder")
    parser.add_argument("--name", default="flamegraph", help="file name stem")
    parser.add_argument("--native", action="store_true", help="include C/C++ frames (slower)")
    parser.add_argument(
        "--subprocesses", action="store_true", help="include the target's child processes in its profile"
    )
    parser.add_argument("--idle", action="store_true", help="include idle threads (waiting, sleeping)")
    parser.add_argument("--gil", action="store_true", help="only samples holding the GIL")
    parser.add_argument("--threads", action="store_true", help="one root per thread")
    parser.add_argument("--lines", action="store_true", help="group samples by line, not function")
    parser.add_argument("--nonblocking", action="store_true", help="do not pause the target to sample")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.duration < 1 or args.rate < 1:
        parser.error("--duration and --rate must be at least 1")
    try:
        pids = targets(args.pid, args.pidfile, args.subprocesses)
        py_spy = find_py_spy()
    except (ValueError, FileNotFoundError) as exc:
        print(f"flamegraph: {exc}", file=sys.stderr)
        return 2
    problem = ptrace_problem(pids)
    if problem:
        print(f"flamegraph: py-spy will not be allowed to read the processes: {problem}", file=sys.stderr)
        return 3
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = SUFFIXES[args.format]
    outputs = {
        pid: args.out / f"{args.name if len(pids) == 1 else f'{args.name}-{pid}'}{suffix}" for pid in pids
    }
    print(f"recording {len(pids)} process(es) {pids} for {args.duration} s ...", flush=True)
    running = {
        pid: subprocess.Popen(
            py_spy_command(py_spy, pid, args, output), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for pid, output in outputs.items()
    }
    failed = 0
    for pid, child in running.items():
        said = child.communicate()[0].decode(errors="replace")
        if child.returncode != 0 or not outputs[pid].exists():
            failed += 1
            print(f"flamegraph: py-spy failed on {pid}:\n{said.strip()}", file=sys.stderr)
            if re.search(r"permission denied|operation not permitted|EPERM", said, re.I):
                print(f"flamegraph: {FIX}", file=sys.stderr)
            continue
        print(f"pid {pid} -> {outputs[pid]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
