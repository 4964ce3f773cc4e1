"""The master's brake on workers that keep dying while they boot (:class:`RestartBackoff`,
applied by ``app.server.gunicorn_config``'s ``pre_fork``, ``post_fork`` and ``child_exit``).
Runs in the master: no torch.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

__all__ = ["RestartBackoff", "wait_before_booting"]


class RestartBackoff:
    """The master's brake on a worker that keeps dying while it boots.

    gunicorn forks a replacement at once, whatever killed the last one; a worker that crashes
    while it boots (a segfault in a native library, an import that fails, a GPU that is gone)
    would be forked again and again, a few times a second, each time paying the import of
    torch. A worker that exited before it was ready is an *early exit*; with ``n`` of them in
    the last ``window_s`` seconds, the next worker waits ``min(max_s, first_s * 2 ** (n - 2))``
    seconds before it boots (none for a single one: a lone crash is replaced at once).
    Source: systemd's ``RestartSec``/``StartLimitBurst`` and Kubernetes' CrashLoopBackOff.

    Args:
        window_s: how far back early exits count, seconds.
        first_s: the delay after the second early exit, seconds.
        max_s: the longest delay, seconds.
    """

    def __init__(self, window_s: float = 120.0, first_s: float = 1.0, max_s: float = 60.0) -> None:
        self.window_s, self.first_s, self.max_s = window_s, first_s, max_s
        self._exits: deque[float] = deque(maxlen=64)

    def exited_early(self, now: float) -> None:
        """Record a worker that exited before it was ready (``now``: ``time.monotonic()``)."""
        self._exits.append(now)

    def delay_s(self, now: float) -> float:
        """How long the next worker should wait before it boots, seconds."""
        recent = sum(1 for t in self._exits if now - t <= self.window_s)
        if recent < 2:
            return 0.0
        return float(min(self.max_s, self.first_s * 2 ** (recent - 2)))


def wait_before_booting(delay_s: float, notify: Callable[[], None]) -> None:
    """Sleep ``delay_s`` seconds in a forked worker (``post_fork``), notifying gunicorn so its
    ``timeout`` does not kill the waiting worker."""
    end = time.monotonic() + delay_s
    while (left := end - time.monotonic()) > 0:
        notify()
        time.sleep(min(1.0, left))
