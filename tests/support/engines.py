"""Deploy files under their real engines: a systemd booted as PID 1 in a podman container
whose root is this machine's own root filesystem behind an overlay (``--rootfs /:O``: what the
unit changes stays in the container), so the unit runs with this checkout and its virtual
environment as they are, without an image build.

Why these podman flags: this machine's cgroups are v1 (``crun`` refuses them: "cgroups in hybrid
mode not supported"), so the runtime is ``runc`` with the ``cgroupfs`` manager; podman's default
limits exceed the hard limits a nested container may set, so ``--ulimit`` stays under them;
``/run`` and ``/tmp`` are fresh tmpfs without copying the host's (which holds podman's own
storage); ``--privileged`` gives systemd the capabilities it has on a real host to set up the
unit's sandbox (``ProtectSystem``, ``PrivateTmp``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from benchmarks.driver import poll

PODMAN = shutil.which("podman")
RUNC = shutil.which("runc")
SYSTEMD = "/lib/systemd/systemd"
PODMAN_BASE = ["--runtime", "runc", "--cgroup-manager", "cgroupfs"] if RUNC else []


def missing() -> str | None:
    """Why the engine tests cannot run here, or None."""
    if PODMAN is None:
        return "podman not installed (apt-get install podman runc)"
    if RUNC is None:
        return "runc not installed (apt-get install runc; crun refuses cgroup v1 hosts)"
    if not os.path.exists(SYSTEMD):
        return f"{SYSTEMD} missing (apt-get install systemd)"
    return None


def _env() -> dict[str, str]:
    """podman's environment: a containers.conf of our own (as scripts/container_check.py
    writes), with no default rlimits, which a nested container may not raise."""
    conf = Path(tempfile.gettempdir()) / "scoring-engines-containers.conf"
    if not conf.exists():
        conf.write_text('[containers]\ndefault_ulimits = []\n\n[engine]\nruntime = "runc"\n', encoding="utf-8")
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``podman`` with the runtime flags above; raise with its output when ``check`` fails."""
    assert PODMAN is not None
    done = subprocess.run(
        [PODMAN, *PODMAN_BASE, *args], capture_output=True, text=True, timeout=timeout, env=_env()
    )
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: {done.returncode}\n{done.stdout}\n{done.stderr}")
    return done


@dataclass
class SystemdHost:
    """A running container with systemd as PID 1; ``sh`` runs a shell command in it."""

    name: str

    def sh(self, command: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        return podman("exec", self.name, "/bin/sh", "-c", command, timeout=timeout, check=check)

    def journal(self, unit: str) -> str:
        return self.sh(f"journalctl -u {unit} --no-pager -n 200", check=False).stdout


@contextmanager
def systemd_host(boot_timeout_s: float = 90) -> Iterator[SystemdHost]:
    """Boot systemd in a container over this machine's root (host network: its ports are this
    machine's), wait until it manages units, and remove the container afterwards."""
    name = f"scoring-systemd-{uuid.uuid4().hex[:8]}"
    # The container's /tmp is a fresh tmpfs: a checkout under /tmp (a CI clone) is bound over it.
    checkout = Path(__file__).resolve().parents[2]
    under_tmp = checkout.is_relative_to("/tmp")
    binds = ["--volume", f"{checkout}:{checkout}"] if under_tmp else []
    podman(
        "run", "-d", "--name", name, "--network", "host", "--privileged", *binds,
        "--ulimit", "nofile=20000:20000", "--ulimit", "nproc=4096:4096",
        "--systemd=always",
        "--tmpfs", "/run:rw,notmpcopyup", "--tmpfs", "/run/lock:rw,notmpcopyup",
        "--tmpfs", "/tmp:rw,notmpcopyup", "--tmpfs", "/var/log/journal:rw,notmpcopyup",
        "--rootfs", "/:O", SYSTEMD,
    )  # fmt: skip
    host = SystemdHost(name)
    try:
        def managing() -> bool:  # "starting" still manages units; "offline" means no systemd yet
            state = host.sh("systemctl is-system-running", check=False).stdout.strip()
            return state in ("starting", "running", "degraded")

        poll(managing, boot_timeout_s, "systemd managing units", interval_s=0.5)
        yield host
    finally:
        podman("rm", "-f", "-t", "5", name, check=False)
