"""The worker's event loop after a stop (app/server/eventloop.py), against the real kernel:
a child process waits in ``select`` with a 50 ms timeout, is stopped (SIGSTOP), data arrives
on its socket, and it is resumed (SIGCONT) 200 ms later."""

from __future__ import annotations

import os
import selectors
import signal
import socket
import time

import pytest

from app.server.eventloop import ResumingSelector


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
        # The stimulus, not a synchronisation: the child is stopped while it waits in select
        # (it spends all but microseconds of every 50 ms there), and stays stopped well past
        # the wait's timeout.
        time.sleep(0.1)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.05)
        theirs.send(b"request")
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
    # gone, and returns no events although the socket is readable. (Three tries: a child that
    # happened to be off the CPU between two waits when stopped would see the data.)
    assert b"-" in b"".join(_select_across_a_stop(selectors.DefaultSelector) for _ in range(3))


def test_the_workers_selector_sees_what_arrived_during_a_stop() -> None:
    assert _select_across_a_stop(ResumingSelector) == b"E"
