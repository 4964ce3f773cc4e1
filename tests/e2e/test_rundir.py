"""A real gunicorn server refuses to start on a run directory that is not private
(app.server.rundir), and creates nothing through a link."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.gunicorn import ROOT, free_port

pytestmark = pytest.mark.e2e


def test_a_server_refuses_to_start_on_a_run_dir_that_is_not_private(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    (tmp_path / "run").symlink_to(target)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SCORING_", "PROMETHEUS_"))}
    env.update(
        PYTHONPATH=str(ROOT), SCORING_RUN_DIR=str(tmp_path / "run"), SCORING_PORT=str(free_port()),
        SCORING_GRPC_PORT="0",
    )  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    assert "SCORING_RUN_DIR" in done.stderr and "symbolic link" in done.stderr, done.stderr[-2000:]
    assert list(target.iterdir()) == []  # nothing was created through the link
