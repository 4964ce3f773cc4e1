"""The worker's asyncio event loop: one that looks at its sockets again after a stop.

A stopped process (SIGSTOP, a paused container or VM, a debugger) sleeping in
``epoll_wait`` gets ``EINTR`` when it resumes (signal(7), *Interruption of system calls by
stop signals*). Python retries the wait with what is left of its timeout (PEP 475), and when
the stop outlasted the timeout it returns no events without asking the kernel again. The
event loop then runs the timers that came due during the stop before it has seen any socket:
aiohttp's keep-alive timer finds a connection idle whose next request is already in the
kernel's buffer, closes it, and the kernel answers the unread request with a reset (measured:
a request sent to a worker stopped for 8 s got ``ECONNRESET`` after ``SIGCONT``).

:class:`ResumingSelector` asks the kernel once more, without waiting, whenever a wait with a
timeout returns nothing: one extra ``epoll_wait(0)`` per timer wakeup without I/O (a few
hundred a second at most here). uvloop (``SCORING_UVLOOP=1``) has libuv's own loop, which
behaves as Python's does, and is not covered.
"""

from __future__ import annotations

import asyncio
import selectors


class ResumingSelector(selectors.DefaultSelector):
    """The platform's default selector; a ``select(timeout)`` that returns no events polls
    once more with timeout 0, so events that arrived while the process was stopped are
    handled before the timers that came due meanwhile."""

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready: list[tuple[selectors.SelectorKey, int]] = super().select(timeout)
        if not ready and timeout != 0:
            ready = super().select(0)
        return ready


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new asyncio event loop on :class:`ResumingSelector`."""
    return asyncio.SelectorEventLoop(ResumingSelector())
