"""API keys, checked by every front end: ``Authorization: Bearer <key>`` or ``X-API-Key: <key>``
(HTTP headers; the same names as gRPC metadata).

Keys come from ``SCORING_API_KEYS`` (comma-separated) and/or ``SCORING_API_KEYS_FILE``
(one per line; blank lines and ``#`` comments ignored). The file is re-read when it
changes (its mtime, size or inode), so keys rotate without a restart: write the new file
and rename it over the old one. Whether it changed is looked at (one ``stat()``) at most
once per ``KEY_FILE_RECHECK_S`` second, not on every request: a rotation takes effect
within that second. A key file that cannot be read leaves no key from it
(requests fail closed, with an error in the log) until it can be read again.

A presented key is hashed (SHA-256) and compared with ``hmac.compare_digest`` against
*every* configured key's hash, without stopping at a match, so the time taken says
neither which key matched nor how much of a key was right. Which paths and RPCs are open
without a key is the front ends' (``app.http.auth``, ``app.grpc.servicer``).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from app.settings import Settings

log = logging.getLogger(__name__)

API_KEY_HEADER = "X-API-Key"
_UNREADABLE = (-1, -1, -1)
#: Longest time a changed key file goes unnoticed, seconds.
KEY_FILE_RECHECK_S = 1.0


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def read_key_file(path: Path) -> list[str]:
    """The keys in ``path``: one per line, stripped; blank lines and ``#`` comments skipped.

    Raises:
        OSError: the file cannot be read.
    """
    keys = []
    for line in path.read_text(encoding="utf-8").splitlines():
        key = line.split("#", 1)[0].strip()
        if key:
            keys.append(key)
    return keys


@dataclass(eq=False)
class ApiKeys:
    """The configured keys (as SHA-256 digests), with the key file re-read when it changes.

    Args:
        keys: keys from the environment.
        path: the key file, or None.
        recheck_s: the file is looked at (``stat()``) at most this often, seconds.
        clock: monotonic seconds (tests pass a fake one).
    """

    keys: tuple[str, ...] = ()
    path: Path | None = None
    recheck_s: float = KEY_FILE_RECHECK_S
    clock: Callable[[], float] = time.monotonic
    _static: list[bytes] = field(default_factory=list, init=False)
    _from_file: list[bytes] = field(default_factory=list, init=False)
    _stamp: tuple[int, int, int] | None = field(default=None, init=False)
    _next_check: float = field(default=float("-inf"), init=False)

    def __post_init__(self) -> None:
        self._static = [_digest(k) for k in self.keys]
        self._refresh()

    @classmethod
    def from_settings(cls, settings: Settings) -> ApiKeys:
        return cls(settings.api_key_list, settings.api_keys_file)

    @property
    def enabled(self) -> bool:
        """True when keys are configured (even if the key file is empty or unreadable)."""
        return bool(self._static) or self.path is not None

    def _refresh(self) -> None:
        """Re-read the key file if its (mtime, size, inode) changed since the last read;
        looks at most once per ``recheck_s``."""
        if self.path is None:
            return
        now = self.clock()
        if now < self._next_check:
            return
        self._next_check = now + self.recheck_s
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp == self._stamp:
                return
            keys = read_key_file(self.path)
        except OSError as exc:
            if self._stamp != _UNREADABLE:
                log.error("API key file %s unreadable (%s): no key from it is accepted", self.path, exc)
            self._stamp, self._from_file = _UNREADABLE, []
            return
        self._stamp, self._from_file = stamp, [_digest(k) for k in keys]
        log.info("API key file %s read: %d key(s)", self.path, len(keys), extra={"event": "api_keys"})

    def check(self, presented: str | None) -> bool:
        """True when ``presented`` is one of the keys; constant time over all keys."""
        self._refresh()
        if not presented:
            return False
        digest = _digest(presented)
        match = False
        for known in (*self._static, *self._from_file):
            match |= hmac.compare_digest(digest, known)
        return match


def presented_key(authorization: str | None, api_key: str | None) -> str | None:
    """The key a request presents: ``authorization`` as ``Bearer <key>``, else ``api_key`` (the
    ``X-API-Key`` header or metadata); None without either."""
    scheme, _, credentials = (authorization or "").partition(" ")
    if scheme.lower() == "bearer" and credentials.strip():
        return credentials.strip()
    return api_key or None
