"""GPU slot leases: one lock file per (GPU, slot), ``<run_dir>/gpu-leases/<uuid>.slot<k>.lock``,
held with an exclusive ``flock`` for the life of the worker; the kernel releases it when the
process dies, however it dies. Lock files are never deleted (see ``gpu_stat.binding``).
"""

from __future__ import annotations

import fcntl
import os
import re
from pathlib import Path

__all__ = ["LEASE_DIR", "lock_path", "probe_leases", "safe_name", "try_lock"]

LEASE_DIR = "gpu-leases"
_LOCK_NAME = re.compile(r"^(?P<uuid>.+)\.slot(?P<slot>[0-9]+)\.lock$")


def safe_name(uuid: str) -> str:
    """``uuid`` as a file name (anything but letters, digits, ``_.-`` becomes ``_``)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", uuid)


def lock_path(lease_dir: Path, uuid: str, slot: int) -> Path:
    """The lock file of ``slot`` on the GPU ``uuid``."""
    return lease_dir / f"{safe_name(uuid)}.slot{slot}.lock"


def probe_leases(lease_dir: Path) -> dict[str, dict[int, int | None]]:
    """Held lock files: safe uuid -> {slot: holder pid, None if not written yet}. Probing takes a
    shared lock for an instant, so a sibling's exclusive attempt at that very instant fails and
    it plans again."""
    result: dict[str, dict[int, int | None]] = {}
    try:
        names = os.listdir(lease_dir)
    except FileNotFoundError:
        return result
    for name in names:
        match = _LOCK_NAME.match(name)
        if match is None:
            continue
        try:
            fd = os.open(lease_dir / name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                continue  # free (closing the descriptor drops the shared lock)
            except BlockingIOError:
                pass
            first_line = os.pread(fd, 32, 0).split(b"\n", 1)[0]
            holder = int(first_line) if first_line.isdigit() else None
        finally:
            os.close(fd)
        result.setdefault(match["uuid"], {})[int(match["slot"])] = holder
    return result


def try_lock(path: Path) -> int | None:
    """An exclusive lock on ``path`` (created if needed), or None if someone holds it.

    Raises:
        OSError: ``ELOOP`` when ``path`` is a link (never followed), or the usual open errors.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    # For diagnostics and for siblings' ranking; written so that a reader never sees a wrong pid.
    data = f"{os.getpid()}\n".encode()
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))
    return fd
