"""The worker's event loop after a stop (app/server/eventloop.py), against the real kernel:
a child process waits in ``select`` with a 50 ms timeout, is stopped (SIGSTOP), data arrives
on its socket, and it is resumed (SIGCONT) 200 ms later."""

from __future__ import annotations

import os
import selectors
import signal
import socket
import time

import psutil
import pytest

from app.server.listener import ResumingSelector
from benchmarks.driver import poll


def _waiting_in_epoll(pid: int) -> bool:
    """The process's (single) thread sleeps in ``epoll_wait`` (its kernel wait channel)."""
    with open(f"/proc/{pid}/wchan") as wchan:
        return "epoll" in wchan.read()


def _select_across_a_stop(selector_class: type[selectors.BaseSelector]) -> bytes:
    """What the first ``select(0.05)`` that spans the stop returned in the child: b"E" with
    the socket's event, b"-" with nothing."""
    ours, theirs = socket.socketpair()
    report_r, report_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: wait in select until something arrives or a wait spans the stop
        try:
            selector = selector_class()
            selector.register(ours, selectors.EVENT_READ)
            os.write(report_w, b"r")
            while True:
                began = time.monotonic()
                events = selector.select(0.05)
                if events or time.monotonic() - began > 0.15:
                    os.write(report_w, b"E" if events else b"-")
                    break
        finally:
            os._exit(0)
    try:
        assert os.read(report_r, 1) == b"r"
        child = psutil.Process(pid)
        poll(lambda: _waiting_in_epoll(pid), 5, "the child waiting in epoll_wait", interval_s=0.001)
        os.kill(pid, signal.SIGSTOP)
        poll(lambda: child.status() == psutil.STATUS_STOPPED, 5, "the child stopped", interval_s=0.001)
        theirs.send(b"request")
        # The stimulus, not a synchronisation: the stop outlasts the child's 50 ms timeout.
        time.sleep(0.2)
        os.kill(pid, signal.SIGCONT)
        return os.read(report_r, 1)
    finally:
        os.kill(pid, signal.SIGCONT)
        os.waitpid(pid, 0)
        for fd in (report_r, report_w):
            os.close(fd)
        ours.close()
        theirs.close()


@pytest.mark.skipif(not hasattr(selectors, "EpollSelector"), reason="the stop/EINTR path is Linux's")
def test_the_default_selector_loses_what_arrived_during_a_stop() -> None:
    # The premise of ResumingSelector: Python retries the interrupted wait, finds its timeout
    # gone, and returns no events although the socket is readable. (Three tries: a child
    # whose wait ended between the check and the stop would see the data.)
    assert b"-" in b"".join(_select_across_a_stop(selectors.DefaultSelector) for _ in range(3))


def test_the_workers_selector_sees_what_arrived_during_a_stop() -> None:
    assert _select_across_a_stop(ResumingSelector) == b"E"
