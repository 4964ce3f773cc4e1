"""The worker's accept loop (app.server.listener): pausing for balance and resuming by itself,
pausing while out of file descriptors, and the last accepts of a drain."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket

import pytest

from app.server.listener import Listener
from tests.support.fixtures import eventually


async def test_a_listener_paused_for_balance_resumes_by_itself_once_the_balance_allows() -> None:
    loop = asyncio.get_running_loop()
    server = socket.create_server(("127.0.0.1", 0))
    allowed = [False]
    accepted: list[int] = []
    listener = Listener(
        loop,
        [server],
        asyncio.Protocol,
        None,
        may_accept=lambda: allowed[0],
        accepted=lambda: accepted.append(1),
    )
    listener.start()
    port = server.getsockname()[1]
    _, writer = await asyncio.open_connection("127.0.0.1", port)  # waits in the kernel's queue
    try:
        await eventually(lambda: listener.paused and listener.pauses == 1)
        assert accepted == []
        allowed[0] = True  # no tick, no explicit resume(): the listener looks again itself
        await eventually(lambda: accepted == [1])
        assert not listener.paused
    finally:
        writer.close()
        listener.stop()
        server.close()



class Starved:
    """A listening socket whose first ``failures`` accepts fail with EMFILE (the process is out
    of file descriptors), counting every call."""

    def __init__(self, sock: socket.socket, failures: int) -> None:
        self.sock_ = sock
        self.failures = failures
        self.calls = 0

    def fileno(self) -> int:
        return self.sock_.fileno()

    def setblocking(self, flag: bool) -> None:
        self.sock_.setblocking(flag)

    def accept(self) -> tuple[socket.socket, object]:
        self.calls += 1
        if self.calls <= self.failures:
            raise OSError(errno.EMFILE, "Too many open files")
        return self.sock_.accept()

    def close(self) -> None:
        self.sock_.close()


async def test_out_of_file_descriptors_pauses_accepting_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.get_running_loop()
    server = socket.create_server(("127.0.0.1", 0))
    starved = Starved(server, failures=4)
    accepted: list[int] = []
    listener = Listener(loop, [starved], asyncio.Protocol, None, lambda: True, lambda: accepted.append(1))
    listener.start()
    _, writer = await asyncio.open_connection("127.0.0.1", server.getsockname()[1])
    try:
        with caplog.at_level(logging.INFO, logger="app.server.listener"):
            await eventually(lambda: accepted == [1], 10)
    finally:
        writer.close()
        listener.stop()
        server.close()
    # paused 0.05 + 0.1 + 0.2 + 0.4 s between tries instead of retrying at once (a spin of
    # thousands of calls a second), and two lines for the whole episode
    assert starved.calls == 5
    lines = [r.getMessage() for r in caplog.records if r.name == "app.server.listener"]
    assert len(lines) == 2 and "Too many open files" in lines[0], lines
    assert "after 4 accept() failures" in lines[1] and listener.starved == 0


async def test_the_end_of_a_drain_takes_what_is_queued_then_closes_the_port() -> None:
    loop = asyncio.get_running_loop()
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted: list[int] = []
    listener = Listener(loop, [server], asyncio.Protocol, None, lambda: False, lambda: accepted.append(1))
    listener.start()
    writers = [(await asyncio.open_connection("127.0.0.1", port))[1] for _ in range(3)]  # queued
    try:
        await eventually(lambda: listener.paused)
        listener.stop(close=True)
        assert accepted == [1, 1, 1] and server.fileno() == -1
        with pytest.raises(ConnectionRefusedError):  # refused, not queued to be reset later
            await asyncio.open_connection("127.0.0.1", port)
    finally:
        for writer in writers:
            writer.close()


async def test_a_worker_stopped_before_it_listened_leaves_the_queued_connections_to_its_siblings() -> None:
    # A replacement that is stopped while its models still load (a HUP during its boot) never
    # accepted; the connections queued on the shared socket are its siblings' to answer.
    loop = asyncio.get_running_loop()
    server = socket.create_server(("127.0.0.1", 0))
    sibling_copy = server.dup()  # the copy another worker accepts on
    port = server.getsockname()[1]
    accepted: list[int] = []
    listener = Listener(loop, [server], asyncio.Protocol, None, lambda: True, lambda: accepted.append(1))
    writers = [(await asyncio.open_connection("127.0.0.1", port))[1] for _ in range(2)]  # queued
    try:
        listener.stop(close=True)
        assert accepted == [] and server.fileno() == -1
        sibling_copy.setblocking(False)
        taken = [sibling_copy.accept()[0] for _ in range(2)]  # still queued for the sibling
        for conn in taken:
            conn.close()
    finally:
        sibling_copy.close()
        for writer in writers:
            writer.close()
