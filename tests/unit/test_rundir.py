"""The run directory is private (app.server.rundir): made fresh and unguessable by default, a
named one must be a real folder of this user closed to others, and nothing in it is entered or
opened through a link. That a server refuses to start on one that is not (real gunicorn):
tests/e2e/test_rundir.py."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from app.server import balance, rundir
from app.server.siblings import Membership
from gpu_stat.leases import try_lock


def test_the_default_is_a_fresh_private_folder_with_an_unguessable_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    first, second = rundir.prepare(None), rundir.prepare(None)
    assert first != second and first.parent == tmp_path == second.parent
    assert first.name.startswith("scoring-server-") and first.stat().st_mode & 0o777 == 0o700


def test_xdg_runtime_dir_is_used_only_when_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert rundir.prepare(None).parent == runtime
    runtime.chmod(0o777)  # anyone may write there: not a safe parent
    assert rundir.prepare(None).parent != runtime


def test_a_named_folder_is_made_private_or_checked(tmp_path: Path) -> None:
    made = rundir.prepare(tmp_path / "run")
    assert made.stat().st_mode & 0o777 == 0o700
    assert rundir.prepare(made) == made  # a HUP reload finds it again: ours, private


@pytest.mark.parametrize("kind", ["symlink", "open mode", "other owner", "file"])
def test_a_named_folder_that_is_not_ours_and_private_is_refused(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    named = tmp_path / "named"
    if kind == "symlink":
        named.symlink_to(target)
        expected = "symbolic link"
    elif kind == "open mode":
        named.mkdir()
        named.chmod(0o755)
        expected = "open to other users"
    elif kind == "other owner":
        if os.geteuid() != 0:
            pytest.skip("chown to another user needs root")  # CI and this machine run as root
        named.mkdir(mode=0o700)
        os.chown(named, 54321, 54321)
        expected = "belongs to uid 54321"
    else:
        named.write_text("")
        expected = "not a directory"
    with pytest.raises(rundir.RunDirError, match=expected):
        rundir.prepare(named)


def test_links_planted_in_the_run_dir_are_never_followed(tmp_path: Path) -> None:
    run = rundir.prepare(tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    (run / "peers").symlink_to(elsewhere)  # a worker's shard sockets would land there
    with pytest.raises(rundir.RunDirError, match="symbolic link"):
        rundir.private_subdir(run, "peers")
    (run / balance.FILE_NAME).symlink_to(elsewhere / "load")
    with pytest.raises(OSError) as caught:
        balance.LoadTable(run)
    assert caught.value.errno == errno.ELOOP and not (elsewhere / "load").exists()
    (run / "lease.lock").symlink_to(elsewhere / "lease.lock")
    with pytest.raises(OSError) as caught:
        try_lock(run / "lease.lock")
    assert caught.value.errno == errno.ELOOP and not (elsewhere / "lease.lock").exists()
    # a worker whose table is refused works alone rather than through the link
    assert Membership(str(run), os.getpid()).slot is None
