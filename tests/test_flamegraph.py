"""scripts/flamegraph: finding gunicorn's workers, ptrace checks, arguments, the SVG and
speedscope output; and one real py-spy recording where this machine allows ptrace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.scripts import load_script

fg = load_script("flamegraph", "flamegraph")


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


SERVER = {
    1: ("init", 0, 0),
    100: ("gunicorn: master [scoring-server]", 1, 1000),
    101: ("python3 (worker) ) S 7", 100, 1000),  # comm with spaces and parentheses
    103: ("python3", 100, 1000),
    200: ("bash", 1, 1000),
}


def test_workers_are_the_children_of_the_master_in_the_pid_file(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, SERVER)
    pidfile = tmp_path / "gunicorn.pid"
    pidfile.write_text("100\n")
    assert fg.parent_pid(101, proc) == 100
    assert fg.children(100, proc) == [101, 103]
    assert fg.targets(None, pidfile, False, proc) == [101, 103]
    assert fg.targets(None, pidfile, True, proc) == [100]  # --subprocesses: one graph of all
    assert fg.targets(103, None, False, proc) == [103]


def test_bad_pid_files_and_pids_are_explained(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, SERVER)
    pidfile = tmp_path / "gunicorn.pid"
    with pytest.raises(ValueError, match="cannot read pid file"):
        fg.targets(None, pidfile, False, proc)
    pidfile.write_text("not a pid")
    with pytest.raises(ValueError, match="does not hold a pid"):
        fg.targets(None, pidfile, False, proc)
    pidfile.write_text("999")
    with pytest.raises(ValueError, match="stale pid file"):
        fg.targets(None, pidfile, False, proc)
    pidfile.write_text("200")
    with pytest.raises(ValueError, match="has no workers"):
        fg.targets(None, pidfile, False, proc)
    with pytest.raises(ValueError, match="no process 999"):
        fg.targets(999, None, False, proc)


def test_real_children_are_found() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in fg.children(os.getpid())
    finally:
        child.kill()
        child.wait()


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
    cmd = fg.py_spy_command("py-spy", 7, args, Path("/tmp/o.folded"))
    assert cmd[:6] == ["py-spy", "record", "--pid", "7", "--duration", "3"]
    assert {"--native", "--subprocesses", "--function", "--format"} <= set(cmd) and "--idle" not in cmd
    assert cmd[cmd.index("--format") + 1] == "raw"
    args = fg.make_parser().parse_args(["--pid", "7", "--lines", "--idle"])
    cmd = fg.py_spy_command("py-spy", 7, args, Path("o"))
    assert "--function" not in cmd and "--idle" in cmd


FOLDED = [
    'process 9:"gunicorn -c a;b";run (gunicorn/arbiter.py:1);_run_once (asyncio/base_events.py:2) 3',
    "_worker (concurrent/futures/thread.py:69);run_batch (app/models/runner.py:170);"
    "BertModel.forward (transformers/models/bert/modeling_bert.py:620) 6",
    "_worker (concurrent/futures/thread.py:69);run_batch (app/models/runner.py:170) 1",
    "",
]


def test_folded_stacks_become_speedscope_and_svg() -> None:
    stacks = fg.parse_folded(FOLDED)
    assert stacks[("process 9", "run (gunicorn/arbiter.py:1)", "_run_once (asyncio/base_events.py:2)")] == 3
    doc = fg.to_speedscope(stacks, "worker")
    (profile,) = doc["profiles"]
    assert profile["type"] == "sampled" and sum(profile["weights"]) == 10 == profile["endValue"]
    frames = doc["shared"]["frames"]
    assert len(frames) == len({f["name"] for f in frames}) == 6
    assert {"name": "BertModel.forward", "file": "transformers/models/bert/modeling_bert.py", "line": 620} in frames
    assert all(0 <= i < len(frames) for s in profile["samples"] for i in s)
    svg = fg.render_svg(stacks, "t <&>", "sub")
    root = ET.fromstring(svg)  # well-formed XML, title escaped
    titles = [t.text for t in root.iter("{http://www.w3.org/2000/svg}title")]
    assert "BertModel.forward (transformers/models/bert/modeling_bert.py:620) (6 samples, 60.00%)" in titles
    assert "all (10 samples, 100.00%)" in titles
    with pytest.raises(ValueError, match="not a collapsed stack"):
        fg.parse_folded(["no count here"])


def test_real_recording_shows_the_busy_function(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        fg.find_py_spy()
    except FileNotFoundError:
        pytest.skip("py-spy is not installed")
    code = "def spin_here():\n    while True:\n        sum(range(1000))\nprint('ready', flush=True)\nspin_here()\n"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        if fg.ptrace_problem([child.pid]):
            pytest.skip("ptrace is not allowed here")
        assert child.stdout is not None and child.stdout.readline() == "ready\n"  # interpreter up
        rc = fg.main(["--pid", str(child.pid), "--duration", "1", "--out", str(tmp_path), "--name", "spin"])
        err = capsys.readouterr().err
        if rc != 0 and "permission" in err.lower():
            pytest.skip(f"py-spy may not attach here: {err}")
        assert rc == 0, err
    finally:
        child.kill()
        child.wait()
    assert "spin_here" in (tmp_path / "spin.svg").read_text()
    speedscope = json.loads((tmp_path / "spin.speedscope.json").read_text())
    assert any(f["name"] == "spin_here" for f in speedscope["shared"]["frames"])


def test_stacks_recorded_elsewhere_can_be_rendered(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folded = tmp_path / "stacks.txt"
    folded.write_text("\n".join(FOLDED))
    assert fg.main(["--folded", str(folded), "--out", str(tmp_path / "out"), "--name", "w"]) == 0
    assert "BertModel.forward" in (tmp_path / "out" / "w.svg").read_text()
    assert json.loads((tmp_path / "out" / "w.speedscope.json").read_text())["name"] == "stacks"
    folded.write_text("garbage")
    assert fg.main(["--folded", str(folded), "--out", str(tmp_path / "out")]) == 2
    assert "not a collapsed stack" in capsys.readouterr().err
