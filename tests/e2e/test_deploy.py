"""The Dockerfile's ENTRYPOINT + CMD with its ENV, run on this machine (no Docker) on 127.0.0.1
against a freshly exported feed-ranker repository: ready, every probe path of the manifests and
the image's HEALTHCHECK answer, it serves, it exports what prometheus-adapter reads, and it
drains on SIGTERM. The static checks of the same material: tests/deploy/test_deploy.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from app.settings import ENV_PREFIX
from tests.support.deploy import (
    HEALTH_LIVE,
    HEALTH_READY,
    METRICS_PATH,
    ImageConfig,
    adapter_rules,
    parse_dockerfile,
    probes_of,
    series_name,
    served_containers,
)
from tests.support.gunicorn import ROOT, free_port, poll

pytestmark = pytest.mark.e2e


def _get(url: str, timeout: float = 5.0, data: bytes | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json"} if data else {}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read()


def _tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])


@pytest.fixture(scope="module")
def image() -> ImageConfig:
    return parse_dockerfile()


def test_image_entrypoint_serves_and_drains(tmp_path: Path, image: ImageConfig) -> None:
    """The Dockerfile's command and ENV, on this machine: ready, probes, SIGTERM, exit 0."""
    exporter = ROOT / "scripts" / "export_ranking_model.py"
    repository = tmp_path / "models"
    export = subprocess.run(
        [sys.executable, str(exporter), "--out", str(repository / "feed-ranker")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert export.returncode == 0, export.stdout + export.stderr

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith((ENV_PREFIX, "GPU_STAT_")) and k != "PROMETHEUS_MULTIPROC_DIR"
    }
    # The image's ENV, except PATH: this checkout's virtualenv stands for the image's /opt/venv.
    env.update({k: v for k, v in image.env.items() if k != "PATH"})
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env.update(
        SCORING_HOST="127.0.0.1",
        SCORING_PORT=str(port),
        SCORING_MODEL_REPOSITORY=str(repository),
        # Not created beforehand: in the container /dev/shm starts empty, so must the server.
        PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "prometheus" / "scoring-metrics"),
    )
    assert isinstance(image.entrypoint, list)
    assert image.cmd is None or isinstance(image.cmd, list)
    argv = [*image.entrypoint, *(image.cmd or [])]
    executable = shutil.which(argv[0], path=env["PATH"])
    assert executable, f"{argv[0]} not found on PATH"
    log_path = tmp_path / "server.log"

    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [executable, *argv[1:]],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    run_dir = Path(tempfile.gettempdir()) / f"scoring-server-{proc.pid}"
    try:

        def ready() -> bool:
            assert proc.poll() is None, f"server exited with {proc.returncode}:\n{_tail(log_path)}"
            try:
                return _get(base + HEALTH_READY, timeout=2)[0] == 200
            except OSError:
                return False

        poll(ready, 90, HEALTH_READY, interval_s=0.5, diagnostics=lambda: _tail(log_path))

        # Every probe path of the manifests, and the image's HEALTHCHECK command itself.
        paths = {
            probe["httpGet"]["path"]
            for _, container in served_containers()
            for probe in probes_of(container).values()
        }
        for path in sorted(paths):
            code, body = _get(base + path)
            assert code == 200, f"{path}: {code} {body[:200]!r}"
        assert isinstance(image.healthcheck, list)
        check = subprocess.run(
            [
                shutil.which(image.healthcheck[0], path=env["PATH"]) or image.healthcheck[0],
                *image.healthcheck[1:],
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert check.returncode == 0, f"HEALTHCHECK failed: {check.stderr}"

        features = [[0.1 * i for i in range(32)]]
        body = json.dumps(
            {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 32], "data": features}]}
        ).encode()
        code, answer = _get(base + "/v2/models/feed-ranker/infer", data=body)
        assert code == 200, answer[:300]
        metrics_code, metrics_body = _get(base + METRICS_PATH)

        proc.send_signal(signal.SIGTERM)
        grace = int(image.env.get("SCORING_GRACEFUL_TIMEOUT_S", "30"))
        returncode = proc.wait(timeout=grace + 15)
        assert returncode == 0, f"exit status {returncode} after SIGTERM:\n{_tail(log_path)}"
        with pytest.raises(OSError):
            _get(base + HEALTH_LIVE, timeout=2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        shutil.rmtree(run_dir, ignore_errors=True)
    assert metrics_code == 200, metrics_body[:300]
    exported = metrics_body.decode()
    for rule in adapter_rules():
        assert f"\n{series_name(rule)}{{" in exported, f"{series_name(rule)} not in {METRICS_PATH}"
