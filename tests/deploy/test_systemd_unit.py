"""deploy/systemd/scoring-server.service under a real systemd (PID 1 in a podman container over
this machine's root, tests/support/engines.py): the unit as shipped, with a drop-in that only
says where this checkout, its virtual environment and a test repository are and which port to
use (what an operator's own paths replace). It starts (Type=notify), makes a run directory the
server accepts (0700, the service user's), turns ready, serves, reloads (SIGHUP) while serving
and stops cleanly, also in the middle of a reload whose model loads never end; with the 0750
mode the unit used to set, the server refuses to start.

Marked ``systemd``; skipped, saying why, where podman, runc or systemd are missing.
scripts/engine-checks runs these and the Kubernetes ones (docs/deploy.md, *Deploy files under
their engines*)."""

from __future__ import annotations

import shlex
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.driver import free_port, http, poll
from tests.support import engines
from tests.support.gunicorn import ROOT
from tests.support.toy_models import write_scale_model

pytestmark = [pytest.mark.systemd, pytest.mark.skipif(engines.missing() is not None, reason=str(engines.missing()))]

UNIT = ROOT / "deploy" / "systemd" / "scoring-server.service"
NAME = "scoring-server"
BODY = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1.0, 2.0]}]}


def _python_home() -> str:
    """The folder of the Python installation this checkout's venv points at."""
    cfg = dict(
        line.split(" = ", 1) for line in (ROOT / ".venv" / "pyvenv.cfg").read_text().splitlines() if " = " in line
    )
    return str(Path(cfg["home"]).parent)


def _drop_in(port: int, extra: str = "") -> str:
    """Where things are on this machine: the checkout and its venv instead of /opt, a test
    repository, a free port, CPU mode with 2 workers. Everything else is the shipped unit."""
    venv = (ROOT / ".venv").resolve()
    return "\n".join(
        [
            "[Service]",
            f"WorkingDirectory={ROOT}",
            "ExecStart=",
            f"ExecStart={venv}/bin/gunicorn -c gunicorn.conf.py",
            f"Environment=PYTHONPATH={ROOT} SCORING_PORT={port} SCORING_GRPC_PORT=0 SCORING_WORKERS=2",
            # This machine's Python lives under /root (pyenv), which ProtectHome=yes hides: keep
            # /root and /home hidden (an empty tmpfs) but for that one folder, read-only.
            "ProtectHome=tmpfs",
            f"BindReadOnlyPaths={_python_home()}",
            # A checkout under /tmp (a CI clone) is hidden by the unit's PrivateTmp=yes: bind it
            # (and its venv) into the service's own /tmp, read-only.
            *(f"BindReadOnlyPaths={path}" for path in sorted({ROOT, venv}) if path.is_relative_to("/tmp")),
            "Environment=SCORING_MODEL_REPOSITORY=/srv/model-repository",
            extra,
        ]
    )


def _scale_toml(load_delay_s: float = 0.0) -> str:
    """The toy scale model's model.toml, as the in-process tests write it (its load taking
    ``load_delay_s`` seconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_scale_model(Path(tmp), max_queue_delay_ms=0.0, load_delay_s=load_delay_s)
        return (folder / "model.toml").read_text()


def _install(host: engines.SystemdHost, drop_in: str) -> None:
    script = f"""
set -e
id scoring >/dev/null 2>&1 || useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin scoring
mkdir -p /srv/model-repository/scale /etc/systemd/system/{NAME}.service.d
printf '%s' {shlex.quote(_scale_toml())} > /srv/model-repository/scale/model.toml
cp {shlex.quote(str(UNIT))} /etc/systemd/system/{NAME}.service
printf '%s\\n' {shlex.quote(drop_in)} > /etc/systemd/system/{NAME}.service.d/paths.conf
systemctl daemon-reload
"""
    host.sh(script)


def _wait_ready(host: engines.SystemdHost, url: str, what: str) -> None:
    def ready() -> bool | None:
        try:
            return http("GET", f"{url}/v2/health/ready", timeout=5)[0] == 200 or None
        except OSError:  # not listening yet, or busy importing
            return None

    poll(ready, 180, what, interval_s=0.5, diagnostics=lambda: host.journal(NAME))


@pytest.fixture(scope="module")
def host() -> Iterator[engines.SystemdHost]:
    with engines.systemd_host() as running:
        yield running


def test_the_unit_starts_serves_reloads_and_stops_under_systemd(host: engines.SystemdHost) -> None:
    port = free_port()
    _install(host, _drop_in(port))
    verify = host.sh(f"systemd-analyze verify /etc/systemd/system/{NAME}.service", check=False)
    assert "scoring-server.service" not in verify.stderr, verify.stderr
    started = host.sh(f"systemctl start {NAME}", timeout=180, check=False)
    assert started.returncode == 0, host.journal(NAME)
    mode, owner = host.sh("stat -c '%a %U' /run/scoring-server").stdout.split()
    assert (mode, owner) == ("700", "scoring")
    url = f"http://127.0.0.1:{port}"
    _wait_ready(host, url, "ready")
    status, _, out = http("POST", f"{url}/v2/models/scale/infer", BODY)
    assert status == 200 and out["outputs"][0]["data"] == [2.0, 4.0]
    metrics = host.sh("ls /run/scoring-server/prometheus").stdout
    assert ".db" in metrics, "the Prometheus files live in the run directory"

    old = _workers(host)
    host.sh(f"systemctl reload {NAME}")
    poll(lambda: len(_workers(host) - old) == 2 == len(_workers(host)) or None, 180, "the reload",
         interval_s=0.5, diagnostics=lambda: host.journal(NAME))  # fmt: skip
    _wait_ready(host, url, "ready after the reload")
    assert http("POST", f"{url}/v2/models/scale/infer", BODY)[0] == 200

    # A stop during a reload whose model loads never end: the new workers stop without waiting
    # for them, the old ones stop waiting for the new ones, well inside TimeoutStopSec.
    slow = _scale_toml(load_delay_s=600.0)
    host.sh(f"printf '%s' {shlex.quote(slow)} > /srv/model-repository/scale/model.toml")
    serving = _workers(host)
    host.sh(f"systemctl reload {NAME}")
    poll(lambda: len(_workers(host) - serving) == 2 or None, 180, "the new workers booting",
         interval_s=0.5, diagnostics=lambda: host.journal(NAME))  # fmt: skip
    host.sh(f"systemctl stop {NAME}", timeout=90)
    shown = host.sh(f"systemctl show {NAME} -p Result -p ExecMainStatus -p ActiveState").stdout
    journal = host.journal(NAME)
    assert "Result=success" in shown and "ActiveState=inactive" in shown, shown + journal
    assert "SIGKILL" not in journal, journal
    assert host.sh("test -e /run/scoring-server", check=False).returncode != 0, "systemd removed it"


def _workers(host: engines.SystemdHost) -> set[int]:
    """The pids of the service's gunicorn workers (the main process's children)."""
    main = host.sh(f"systemctl show {NAME} -p MainPID --value").stdout.strip()
    return {int(pid) for pid in host.sh(f"ps --ppid {main} -o pid=", check=False).stdout.split()}


def test_a_run_directory_open_to_the_group_is_refused_at_start(host: engines.SystemdHost) -> None:
    """What the unit used to set (0750): the server refuses it and says how to fix it."""
    port = free_port()
    _install(host, _drop_in(port, "RuntimeDirectoryMode=0750\nRestart=no"))
    started = host.sh(f"systemctl start {NAME}", timeout=180, check=False)
    journal = host.journal(NAME)
    assert started.returncode != 0, journal
    assert "is open to other users (mode 750)" in journal, journal
    host.sh(f"systemctl reset-failed {NAME}", check=False)
