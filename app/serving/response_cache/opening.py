"""The response cache's open LMDB environment, shared by the threads of one worker: opened
lazily (an environment must not cross a fork, and one process opens a given store once), looked
at again every :attr:`Opener.CHECK_S` seconds (a store removed or replaced while the server runs
is opened anew where it was), let go of on failure (and opened again a second later), and closed
by the last thread that still uses it once it is let go of.

Source: LMDB's documentation (``mdb_env_open``: one environment per process and file;
``mdb_reader_check``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import lmdb

from app.serving.response_cache.writes import Tables

log = logging.getLogger(__name__)


class Handle:
    """One open environment, its named databases, and the threads using it."""

    __slots__ = ("env", "inode", "retired", "tables", "users")

    def __init__(self, env: lmdb.Environment, tables: Tables, inode: tuple[int, int]) -> None:
        self.env, self.tables, self.inode = env, tables, inode
        self.users = 0
        #: Let go of: closed once no thread uses it.
        self.retired = False


class Opener:
    """The store's environment at ``path`` with a map of ``max_bytes`` (module docstring); any
    thread may call its methods."""

    #: Seconds between two checks that the store's file is still where it was.
    CHECK_S = 1.0
    #: Seconds between two log lines about a failing store.
    LOG_S = 60.0

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path, self.max_bytes = path, max_bytes
        self._lock = threading.Lock()
        self._handle: Handle | None = None
        self._checked = 0.0
        self._logged = -self.LOG_S
        self._retry_at = 0.0

    @contextlib.contextmanager
    def session(self) -> Iterator[Handle | None]:
        """The open environment for one call (None: the store fails), kept open until it ends."""
        with self._lock:
            handle = self._current()
            if handle is not None:
                handle.users += 1
        if handle is None:
            yield None
            return
        try:
            yield handle
        finally:
            with self._lock:
                handle.users -= 1
                if handle.retired and not handle.users:
                    _close(handle.env)

    def failed(self, what: str, exc: BaseException) -> None:
        """The store failed (``what``, ``exc``): logged at most once a minute, its environment let
        go of, opened again after :attr:`CHECK_S`."""
        with self._lock:
            self._note(what, exc, time.monotonic())
            self._retire()

    def close(self) -> None:
        """Let go of the environment (closed now, or by the last thread using it)."""
        with self._lock:
            self._retire()

    def _current(self) -> Handle | None:
        """The open environment, opened or reopened as needed (under ``_lock``)."""
        now = time.monotonic()
        handle = self._handle
        if handle is not None:
            if now - self._checked < self.CHECK_S:
                return handle
            self._checked = now
            with contextlib.suppress(OSError):
                st = os.stat(self.path / "data.mdb")
                if (st.st_dev, st.st_ino) == handle.inode:
                    return handle
            self._retire()  # removed or replaced while open: open what is there now
        if now < self._retry_at:
            return None
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            env = lmdb.open(
                str(self.path), map_size=self.max_bytes, max_dbs=3, sync=False, metasync=False,
                readahead=False, max_readers=1024,
            )  # fmt: skip
        except (lmdb.Error, OSError) as exc:
            self._note("cannot be opened", exc, now)
            return None
        try:
            env.reader_check()  # readers of processes that died free their slots
            tables = Tables(env.open_db(b"items"), env.open_db(b"order"), env.open_db(b"meta"))
            st = os.stat(self.path / "data.mdb")
        except (lmdb.Error, OSError) as exc:
            _close(env)
            self._note("cannot be opened", exc, now)
            return None
        self._handle, self._checked = Handle(env, tables, (st.st_dev, st.st_ino)), now
        return self._handle

    def _retire(self) -> None:
        """Let go of the open environment (under ``_lock``): closed now, or by its last user."""
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.retired = True
            if not handle.users:
                _close(handle.env)

    def _note(self, what: str, exc: BaseException, now: float) -> None:
        """Log a failure (at most once a minute); look again in :attr:`CHECK_S` (under ``_lock``)."""
        if now - self._logged >= self.LOG_S:
            self._logged = now
            log.warning("response cache %s: %s: %s; computing instead", what, type(exc).__name__, exc,
                        extra={"event": "response_cache_error"})  # fmt: skip
        self._retry_at = now + self.CHECK_S


def _close(env: lmdb.Environment) -> None:
    with contextlib.suppress(Exception):  # a handle on a broken store closes as it can
        env.close()
