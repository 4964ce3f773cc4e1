"""End to end on real gunicorn: ONE gRPC channel (one HTTP/2 connection, pinned to the worker
that accepted it) with 8 concurrent ModelInfer calls in flight against a model slow enough that
one worker saturates. With balancing, the busy worker forwards whole requests to its idle
sibling (app.server.forward) and both answer a real share of the items; without
(``SCORING_BALANCE=0``), the one worker that holds the connection answers them all."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path

import grpc
import pytest

from app.grpc.generated import grpc_service_pb2 as pb
from app.grpc.generated import grpc_service_pb2_grpc as pb_grpc
from tests.support.balance import both_live, items_per_worker, shares
from tests.support.gunicorn import Gunicorn, wait_for
from tests.support.toy_models import write_scale_model

pytestmark = pytest.mark.e2e

CONCURRENT = 8
CALLS_PER_TASK = 20
_FORWARDED = re.compile(r'^scoring_forwarded_requests_total\{model="scale",version="1"\} ([0-9.e+]+)$', re.M)


def request(x: float) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name="scale")
    message.inputs.add(name="x", datatype="FP32", shape=[1, 2]).contents.fp32_contents.extend([x, x])
    return message


async def one_channel(url: str) -> list[tuple[float, list[float]]]:
    """``CONCURRENT`` tasks on one channel, each sending ``CALLS_PER_TASK`` calls one after the
    other (10 s deadline each); returns (x, y) per call."""
    answers: list[tuple[float, list[float]]] = []
    async with grpc.aio.insecure_channel(url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        async def task(k: int) -> None:
            for i in range(CALLS_PER_TASK):
                x = float(k * 1000 + i)
                reply = await stub.ModelInfer(request(x), timeout=10)
                answers.append((x, list(reply.outputs[0].contents.fp32_contents)))

        await asyncio.gather(*(task(k) for k in range(CONCURRENT)))
    return answers


@pytest.mark.parametrize("balance", [True, False], ids=["balanced", "SCORING_BALANCE=0"])
def test_one_grpc_channel_keeps_both_workers_busy(tmp_path: Path, balance: bool) -> None:
    repo = tmp_path / "repo"
    write_scale_model(
        repo, "scale", max_batch_size=2, max_queue_delay_ms=1.0, queue_capacity=256, delay_ms=20
    )
    env = {
        "SCORING_MODEL_REPOSITORY": str(repo),
        "SCORING_WORKERS": "2",
        "SCORING_BALANCE": str(int(balance)),
    }
    with Gunicorn(tmp_path, env) as srv:
        pids = [w.pid for w in srv.wait_workers(2)]
        srv.wait_ready(120)
        if balance:
            wait_for(lambda: both_live(srv), 30, "both workers in the load table", srv)
        before = items_per_worker(srv)
        answers = asyncio.run(one_channel(srv.grpc_url))
        assert len(answers) == CONCURRENT * CALLS_PER_TASK
        assert all(y == [2 * x, 2 * x] for x, y in answers)
        share = shares(before, items_per_worker(srv), pids)
        metrics = srv.get("/metrics")[2]
        forwarded = sum(float(n) for n in _FORWARDED.findall(metrics))
        if balance:
            assert all(s >= 0.25 for s in share.values()), (share, srv.log()[-3000:])
            assert forwarded >= 0.25 * len(answers), forwarded
        else:
            assert sorted(share.values()) == [0.0, 1.0], share
            assert forwarded == 0
        assert "Traceback" not in srv.log()


Outcome = tuple[grpc.StatusCode, str]


async def burst(stub: pb_grpc.GRPCInferenceServiceStub, calls: int, timeout_us: int) -> list[Outcome]:
    """``calls`` calls at once, with a server-side deadline (Triton's ``timeout`` parameter,
    microseconds) and a much later client deadline (a hang guard); (code, details) each."""

    async def call(x: float) -> Outcome:
        message = request(x)
        message.parameters["timeout"].int64_param = timeout_us
        try:
            await stub.ModelInfer(message, timeout=30)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
        return grpc.StatusCode.OK, ""

    return list(await asyncio.gather(*(call(float(i)) for i in range(calls))))


async def stop_the_sibling(srv: Gunicorn, pids: list[int]) -> tuple[list[Outcome], list[Outcome]]:
    """On one channel: find the worker holding it (a lone call on an idle server is never
    forwarded), SIGSTOP the other, send a burst at once, then bursts until one succeeds
    whole (bounded); SIGCONT. Returns the first burst's outcomes and the last burst's."""
    async with grpc.aio.insecure_channel(srv.grpc_url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        before = items_per_worker(srv)
        assert await burst(stub, 1, 1_000_000) == [(grpc.StatusCode.OK, "")]
        (holder,) = [pid for pid, n in items_per_worker(srv).items() if n > before.get(pid, 0.0)]
        (other,) = [pid for pid in pids if pid != holder]
        os.kill(other, signal.SIGSTOP)
        try:
            first = await burst(stub, CONCURRENT, 2_000_000)
            last = first
            for _ in range(30):  # the sibling's heartbeat goes stale after 1 s (STALE_S)
                if {code for code, _ in last} == {grpc.StatusCode.OK}:
                    break
                last = await burst(stub, CONCURRENT, 2_000_000)
        finally:
            os.kill(other, signal.SIGCONT)
    return first, last


def test_a_stopped_sibling_costs_forwarded_calls_deadline_exceeded_not_a_hang(tmp_path: Path) -> None:
    """SIGSTOP the worker that does not hold the channel: while its heartbeat is fresh (1 s)
    the holder may forward calls to it, and those end with the server's own
    DEADLINE_EXCEEDED at their 2 s deadline (the client's 30 s deadline never fires); once it
    is stale, every call runs on the holder and succeeds."""
    repo = tmp_path / "repo"
    write_scale_model(
        repo, "scale", max_batch_size=2, max_queue_delay_ms=1.0, queue_capacity=256, delay_ms=20
    )
    env = {"SCORING_MODEL_REPOSITORY": str(repo), "SCORING_WORKERS": "2", "SCORING_TIMEOUT_S": "60"}
    with Gunicorn(tmp_path, env) as srv:
        pids = [w.pid for w in srv.wait_workers(2)]
        srv.wait_ready(120)
        wait_for(lambda: both_live(srv), 30, "both workers in the load table", srv)
        first, last = asyncio.run(stop_the_sibling(srv, pids))
        for code, details in first:
            assert code in (grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED), first
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                assert "did not answer" in details, first  # the server's deadline, not the client's
        assert {code for code, _ in last} == {grpc.StatusCode.OK}, (first, last)
