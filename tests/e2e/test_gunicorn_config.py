"""A HUP reload reads the gunicorn configuration afresh under real gunicorn, with the checkout's
thin ``gunicorn.conf.py`` and with the packaged module (``-c python:app.server.gunicorn_config``,
what ``scoring-server`` runs): a GPU that appeared is counted again and gets a worker.

The GPUs are the fake NVML backend's (``GPU_STAT_FAKE_NVML``); the settings and hooks of both
forms are compared in tests/unit/test_gunicorn_config.py.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from app.server.cli import CONFIG
from tests.support.fake_gpus import gpu, gpu_uuid, write_fake
from tests.support.gunicorn import Gunicorn, wait_for
from tests.support.toy_models import write_scale_model

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("config", ["gunicorn.conf.py", CONFIG])
def test_a_hup_reload_counts_the_gpus_again(tmp_path: Path, config: str) -> None:
    write_scale_model(tmp_path / "repo", "scale")
    fake = write_fake(tmp_path / "gpus.json", [gpu(0)])
    env = {
        "SCORING_MODEL_REPOSITORY": str(tmp_path / "repo"),
        "GPU_STAT_FAKE_NVML": str(fake),
        "SCORING_MAX_PROCESSES_PER_GPU": "1",
        "SCORING_DEVICE": "cpu",
        "SCORING_ACCESS_LOG": "",
        "SCORING_DRAIN_GRACE_S": "0.2",
    }
    with Gunicorn(tmp_path, env, config=config) as srv:
        srv.wait_ready(count=1)
        (first,) = srv.wait_workers(1)
        write_fake(fake, [gpu(0), gpu(1)])
        os.kill(srv.proc.pid, signal.SIGHUP)

        def two_new_workers_ready() -> bool:
            pids = {w.pid for w in srv.workers()}
            return len(pids) == 2 and first.pid not in pids and srv.all_workers_ready()

        wait_for(two_new_workers_ready, 90, "two new workers after the reload", srv)
        bound = {w["binding"]["gpu_uuid"] for w in srv.answering_workers(2).values()}
        assert bound == {gpu_uuid(0), gpu_uuid(1)}
        assert srv.stop() == 0, srv.log_tail()
