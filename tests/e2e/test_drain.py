"""A worker stopped before it was ready, end to end: a HUP's new worker, told to stop while it
waits for its models off its listeners, opens none of them (HTTP, gRPC, the internal
endpoint) on its way out."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.support.gunicorn import Gunicorn, wait_for
from tests.support.toy_models import write_scale_model

pytestmark = pytest.mark.e2e


def test_a_new_worker_stopped_while_its_models_load_opens_no_listener(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_scale_model(repo, "scale", load_delay_s=4.0)
    # The old worker holds its listener 2 s, then while the new one boots: the new one then waits
    # for its model before it listens (with no grace the old one may be gone before the new one
    # has left its binding, and the new one would listen at once).
    env = {"SCORING_MODEL_REPOSITORY": str(repo), "SCORING_WORKERS": "1", "SCORING_DRAIN_GRACE_S": "2"}
    with Gunicorn(tmp_path, env) as srv:
        (first,) = srv.wait_workers(1)
        srv.wait_ready(90)
        srv.proc.send_signal(signal.SIGHUP)  # a new worker boots while the first one serves

        def newcomer_loading() -> int | None:
            states = srv.worker_states()
            return next(
                (pid for pid, state in states.items() if pid != first.pid and state == "loading"), None
            )

        newcomer = wait_for(newcomer_loading, 90, "the HUP's new worker loading its model", srv)
        os.kill(newcomer, signal.SIGTERM)
        wait_for(lambda: newcomer not in {w.pid for w in srv.workers()}, 30, "the new worker gone", srv)
        srv.wait_ready(90)  # gunicorn's next worker takes over
        lines = [line for line in srv.log().splitlines() if f"[{newcomer}]" in line]
    assert any("stopped before it was ready" in line for line in lines), lines
    assert not any("listening" in line for line in lines), "\n".join(lines)
