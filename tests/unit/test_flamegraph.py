"""scripts/flamegraph: finding gunicorn's workers, ptrace checks, arguments; and real py-spy
recordings (SVG and speedscope, py-spy's own formats) where this machine allows ptrace."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fake_gpus import unused_pid
from tests.support.tools import load_tool

fg = load_tool("flamegraph")


def fake_proc(tmp_path: Path, procs: dict[int, tuple[str, int, int]], scope: int | None = None,
              cap_eff: str = "0000000000000000") -> Path:  # fmt: skip
    """A /proc with ``pid: (comm, ppid, uid)`` entries, our own CapEff and Yama's scope."""
    proc = tmp_path / "proc"
    for pid, (comm, ppid, uid) in procs.items():
        d = proc / str(pid)
        d.mkdir(parents=True)
        (d / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 4194560\n")
        (d / "status").write_text(f"Name:\t{comm}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
        (d / "cmdline").write_bytes(comm.encode() + b"\0-c\0x\0")
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "status").write_text(f"Name:\tpython\nCapEff:\t{cap_eff}\n")
    if scope is not None:
        yama = proc / "sys" / "kernel" / "yama"
        yama.mkdir(parents=True)
        (yama / "ptrace_scope").write_text(f"{scope}\n")
    return proc


SERVER = {  # for the ptrace checks
    1: ("init", 0, 0),
    100: ("gunicorn: master [scoring-server]", 1, 1000),
    101: ("python3 (worker) ) S 7", 100, 1000),  # comm with spaces and parentheses
    103: ("python3", 100, 1000),
    200: ("bash", 1, 1000),
}

MASTER = """
import subprocess, sys
children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
print(" ".join(str(c.pid) for c in children), flush=True)
sys.stdin.read()  # until the test closes stdin
for c in children:
    c.kill()
    c.wait()
"""


@pytest.fixture
def master() -> Iterator[tuple[int, list[int]]]:
    """A real process with two children, like a gunicorn master: (its pid, the children's)."""
    with subprocess.Popen(  # leaving the block closes both pipes and waits
        [sys.executable, "-c", MASTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout is not None and proc.stdin is not None
        children = [int(pid) for pid in proc.stdout.readline().split()]
        yield proc.pid, children
        proc.stdin.close()  # at EOF the master kills its children and exits
        proc.wait(30)


def test_workers_are_the_children_of_the_master_in_the_pid_file(
    tmp_path: Path, master: tuple[int, list[int]]
) -> None:
    pid, children = master
    pidfile = tmp_path / "gunicorn.pid"
    pidfile.write_text(f"{pid}\n")
    assert fg.targets(None, pidfile, False) == children  # oldest first
    assert fg.targets(None, pidfile, True) == [pid]  # --subprocesses: one profile of all
    assert fg.targets(children[1], None, False) == [children[1]]


def test_bad_pid_files_and_pids_are_explained(tmp_path: Path, master: tuple[int, list[int]]) -> None:
    pidfile = tmp_path / "gunicorn.pid"
    with pytest.raises(ValueError, match="cannot read pid file"):
        fg.targets(None, pidfile, False)
    pidfile.write_text("not a pid")
    with pytest.raises(ValueError, match="does not hold a pid"):
        fg.targets(None, pidfile, False)
    gone = unused_pid()
    pidfile.write_text(str(gone))
    with pytest.raises(ValueError, match="stale pid file"):
        fg.targets(None, pidfile, False)
    pidfile.write_text(str(master[1][0]))  # a process without children
    with pytest.raises(ValueError, match="has no workers"):
        fg.targets(None, pidfile, False)
    with pytest.raises(ValueError, match=f"no process {gone}"):
        fg.targets(gone, None, False)


@pytest.mark.parametrize(
    ("scope", "cap", "euid", "expected"),
    [
        (None, False, 1000, None),  # no Yama, same user
        (0, False, 1000, None),
        (1, False, 1000, "kernel.yama.ptrace_scope=0"),
        (1, True, 1000, None),  # CAP_SYS_PTRACE
        (1, False, 0, None),  # root
        (2, False, 1000, "only CAP_SYS_PTRACE"),
        (2, True, 1000, None),
        (3, True, 0, "disabled"),
    ],
)
def test_ptrace_problems_name_the_fix(
    tmp_path: Path, scope: int | None, cap: bool, euid: int, expected: str | None
) -> None:
    cap_eff = f"{1 << fg.CAP_SYS_PTRACE:016x}" if cap else "0" * 16
    proc = fake_proc(tmp_path, SERVER, scope=scope, cap_eff=cap_eff)
    problem = fg.ptrace_problem([101], proc, euid=euid)
    if expected is None:
        assert problem is None
    else:
        assert problem is not None and expected in problem
        if scope != 3:
            assert "--cap-add SYS_PTRACE" in problem


def test_another_users_process_needs_privileges(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, SERVER, scope=0)
    assert "another user" in (fg.ptrace_problem([101], proc, euid=1001) or "")
    assert fg.ptrace_problem([101], proc, euid=0) is None


def test_arguments() -> None:
    with pytest.raises(SystemExit):
        fg.make_parser().parse_args([])  # a target is required
    with pytest.raises(SystemExit):
        fg.make_parser().parse_args(["--pid", "1", "--pidfile", "x"])  # one of them
    args = fg.make_parser().parse_args(["--pid", "7", "--native", "--subprocesses", "--duration", "3"])
    cmd = fg.py_spy_command("py-spy", 7, args, Path("/tmp/o.svg"))
    assert cmd[:6] == ["py-spy", "record", "--pid", "7", "--duration", "3"]
    assert {"--native", "--subprocesses", "--function", "--format"} <= set(cmd) and "--idle" not in cmd
    assert cmd[cmd.index("--format") + 1] == "flamegraph"
    args = fg.make_parser().parse_args(["--pid", "7", "--lines", "--idle", "--format", "speedscope"])
    cmd = fg.py_spy_command("py-spy", 7, args, Path("o"))
    assert "--function" not in cmd and "--idle" in cmd and cmd[cmd.index("--format") + 1] == "speedscope"


@pytest.mark.parametrize("fmt", ["flamegraph", "speedscope"])
def test_real_recording_shows_the_busy_function(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str
) -> None:
    fg.find_py_spy()  # py-spy is a test dependency (setup.py)
    code = "def spin_here():\n    while True:\n        sum(range(1000))\nprint('ready', flush=True)\nspin_here()\n"
    # leaving the block closes the pipe and waits for the child
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) as child:
        try:
            if fg.ptrace_problem([child.pid]):
                pytest.skip("ptrace is not allowed on this machine")  # a host setting, not our code
            assert child.stdout is not None and child.stdout.readline() == "ready\n"  # interpreter up
            argv = ["--pid", str(child.pid), "--duration", "1", "--out", str(tmp_path), "--name", "spin"]
            rc = fg.main([*argv, "--format", fmt])
            assert rc == 0, capsys.readouterr().err
        finally:
            child.kill()
    if fmt == "flamegraph":
        assert "spin_here" in (tmp_path / "spin.svg").read_text()
    else:
        speedscope = json.loads((tmp_path / "spin.speedscope.json").read_text())
        assert any(f["name"] == "spin_here" for f in speedscope["shared"]["frames"])
