"""The worker's accept loop (app.server.listener): pausing for balance and resuming by itself."""

from __future__ import annotations

import asyncio
import socket

from app.server.listener import Listener
from tests.conftest import eventually


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

