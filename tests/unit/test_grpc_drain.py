"""The gRPC side of a worker's drain, in process (``app.grpc.server``, ``app.grpc.server``): a
stop answers the calls a busy worker had not taken yet, an aged-out connection lets its calls
finish, and a worker stopped before it was ready never listens."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from aiohttp import web

from app.grpc.generated import grpc_service_pb2_grpc as pb_grpc
from app.grpc.server import AnswerGate, start_server, stop_servers
from app.http.state import CORE
from app.serving.siblings import Alone
from app.settings import Settings
from benchmarks.driver import free_port
from tests.support.fixtures import eventually
from tests.support.gunicorn import ROOT
from tests.support.messages import scale_request
from tests.support.toy_models import ScaleHandler, write_scale_model

#: Calls of the burst, each on a connection of its own, spread by the kernel over the servers.
CALLS = 12
#: gRPC servers of the worker on its port (the default of grpc_servers).
SERVERS = 4


def channel(port: int) -> Any:
    """An aio channel with a connection of its own (not shared with the other channels)."""
    return grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])


async def test_calls_not_yet_handed_to_python_are_answered_at_a_stop(
    make_client: Callable[..., Any], tmp_path: Path
) -> None:
    """A busy worker's event loop lets grpcio hand it one call per server per turn; the others
    wait in grpcio's core, which cancels them when the server shuts down (clients got CANCELLED
    without an answer: app.grpc.server). Here the loop is blocked while a burst of 12 calls
    arrives, and the servers stop the moment it is free: every call is answered, none by a
    CANCELLED of the shutdown."""
    write_scale_model(tmp_path)
    http = await make_client(tmp_path)
    core = http.server.app[CORE]
    gate = AnswerGate()
    port = free_port()
    servers = [(await start_server(core, "127.0.0.1", port, gate))[0]]
    servers += [(await start_server(core, "127.0.0.1", port, gate))[0] for _ in range(SERVERS - 1)]
    command = [sys.executable, "-m", "tests.support.grpc_burst", str(port), str(CALLS)]
    # Blocking on purpose: the event loop stays blocked until the stop (below).
    burst = subprocess.Popen(  # noqa: ASYNC220
        command, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert burst.stdin is not None and burst.stdout is not None
    try:
        # From here the event loop is blocked, as a busy worker's is (connecting needs no Python).
        assert burst.stdout.readline() == "ready\n"
        burst.stdin.write("go\n")
        burst.stdin.flush()
        assert burst.stdout.readline() == "sent\n"
        time.sleep(0.3)  # noqa: ASYNC251  # the burst reaches grpcio's core; the loop cannot take it
        assert gate.calls == 0  # nothing handed over yet
        await stop_servers(servers, gate, grace_s=5.0)
        out, _ = await asyncio.to_thread(burst.communicate, timeout=60)
    finally:
        if burst.poll() is None:
            burst.kill()
    ended = json.loads(out.splitlines()[-1])
    assert ended == [{"code": "OK", "served": True}] * CALLS, ended
    assert gate.calls == CALLS


async def test_an_aged_out_connection_lets_its_calls_finish(
    make_client: Callable[..., Any], tmp_path: Path
) -> None:
    """A connection past grpc_max_connection_age_s gets GOAWAY; a call of 1.5 s in flight on it
    finishes (the age's grace is not grpc_grace_s, which is for a worker's stop)."""
    write_scale_model(tmp_path, hang_on=5.0, hang_s=1.5)
    http = await make_client(tmp_path, grpc_max_connection_age_s=0.2, grpc_grace_s=0.1)
    server, port = await start_server(http.server.app[CORE], "127.0.0.1", 0)
    try:
        async with channel(port) as ch:
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            for _ in range(2):
                reply = await stub.ModelInfer(scale_request([[5.0, 5.0]], [b"slow"]), timeout=20)
                assert reply.outputs[0].name == "y"
    finally:
        await server.stop(None)


class ServingSibling(Alone):
    """Another worker of the server serves: a new worker keeps off its listeners until warm."""

    def others_serving(self) -> bool:
        return True


async def test_a_worker_stopped_before_it_was_ready_never_listens(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker that waits for its models before it listens (a sibling serves) and is told to
    stop meanwhile (its registry drains, as the gunicorn worker's SIGTERM does) ends its startup
    without opening the gRPC listener."""
    from app.main import create_app

    write_scale_model(tmp_path, load_delay_s=3.0)
    ScaleHandler.LOADS.pop("scale", None)
    port = free_port()
    settings = Settings(model_repository=tmp_path, device="cpu", grpc_port=port)
    app = await create_app(settings, siblings=ServingSibling())
    runner = web.AppRunner(app)
    with caplog.at_level(logging.INFO, logger="app.grpc.server"):
        startup = asyncio.create_task(runner.setup())
        # in its startup, waiting off the listeners for the model, whose load has begun
        await eventually(lambda: ScaleHandler.LOADS.get("scale", 0) >= 1)
        assert not startup.done()
        app[CORE].registry.begin_drain("SIGTERM")
        await asyncio.wait_for(startup, 10)
        try:
            with pytest.raises(OSError):
                await asyncio.open_connection("127.0.0.1", port)
        finally:
            await runner.cleanup()
    assert "gRPC listening" not in caplog.text
