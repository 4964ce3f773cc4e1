"""The server's run directory: private to the user that runs the server, never reused from
someone else, never entered through a link.

It holds the GPU leases (``gpu_stat``), the load table (:class:`app.server.siblings.LoadTable`), the
workers' shard sockets (``peers/``: whoever can connect to one can hand a worker work and read
its answers), the Prometheus multiprocess files and gunicorn's control socket. So:

- **Default**: a new directory with an unpredictable name, made by ``tempfile.mkdtemp``
  (mode 0700) in ``$XDG_RUNTIME_DIR`` when that is a private directory of this user (systemd's
  per-user ``/run/user/<uid>``), else in the temp dir. A HUP reload keeps it (the master sets
  ``SCORING_RUN_DIR`` to it).
- **Named** (``SCORING_RUN_DIR``): made with mode 0700 when it does not exist (its parent must);
  one that exists must be a real directory (not a link), owned by this user, and not open to
  group or others, or the server refuses to start and says how to fix it.
- Inside it, folders are made 0700 and files opened with ``O_NOFOLLOW``: a link planted where
  a file or folder is expected is refused, never followed.

Source: the rules of ``tempfile.mkdtemp`` and of systemd's ``RuntimeDirectory=`` (a private,
per-service directory), and the CWE-377/CWE-59 advice (insecure temporary files, link following).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

__all__ = ["RunDirError", "check_private", "make_default", "open_private", "prepare", "private_subdir"]

_PREFIX = "scoring-server-"


class RunDirError(RuntimeError):
    """The run directory (or something in it) is not private to this user."""


def check_private(path: Path) -> None:
    """Raise unless ``path`` is a real directory owned by this user with no group/other access.

    Raises:
        RunDirError: a link, not a directory, another owner, or group/other permission bits.
        FileNotFoundError: ``path`` does not exist.
    """
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise RunDirError(f"{path} is a symbolic link; the run directory must be a real directory")
    if not stat.S_ISDIR(info.st_mode):
        raise RunDirError(f"{path} is not a directory")
    if info.st_uid != os.geteuid():
        raise RunDirError(
            f"{path} belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()}); "
            "name a directory of your own, or leave SCORING_RUN_DIR unset for a fresh one"
        )
    if info.st_mode & 0o077:
        raise RunDirError(
            f"{path} is open to other users (mode {stat.S_IMODE(info.st_mode):o}); "
            f"make it private (chmod 700 {path}) or leave SCORING_RUN_DIR unset for a fresh one"
        )


def make_default() -> Path:
    """A new private directory (``mkdtemp``, 0700) in ``$XDG_RUNTIME_DIR`` when that is a private
    directory of this user, else in the temp dir."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    parent: str | None = None
    if runtime:
        try:
            check_private(Path(runtime))
            parent = runtime
        except (OSError, RunDirError):
            parent = None
    return Path(tempfile.mkdtemp(prefix=_PREFIX, dir=parent))


def prepare(named: Path | None) -> Path:
    """The run directory to use: ``named`` (made 0700 if missing, else checked), or a new
    default one (:func:`make_default`).

    Raises:
        RunDirError: ``named`` exists and is not private to this user (:func:`check_private`).
        FileNotFoundError: ``named``'s parent does not exist.
    """
    if named is None:
        return make_default()
    with contextlib.suppress(FileExistsError):
        os.mkdir(named, 0o700)
    check_private(named)
    return named


def private_subdir(parent: Path, name: str) -> Path:
    """``parent/name``, made 0700 when missing; an existing one must be private too.

    Raises:
        RunDirError: it exists as a link, a file, or a folder that is not private.
    """
    path = parent / name
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    check_private(path)
    return path


def open_private(path: Path, flags: int, mode: int = 0o600) -> int:
    """``os.open(path, flags | O_NOFOLLOW | O_CLOEXEC, mode)``: a file descriptor, never through
    a link.

    Raises:
        OSError: ``ELOOP`` when ``path`` is a link, or the usual open errors.
    """
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
