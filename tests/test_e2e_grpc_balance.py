"""End to end on real gunicorn: ONE gRPC channel (one HTTP/2 connection, pinned to the worker
that accepted it) with 8 concurrent ModelInfer calls in flight against a model slow enough that
one worker saturates. With balancing, the busy worker forwards whole requests to its idle
sibling (app.server.forward) and both answer a real share of the items; without
(``SCORING_BALANCE=0``), the one worker that holds the connection answers them all."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import grpc
import pytest

from app.grpc.generated import grpc_service_pb2 as pb
from app.grpc.generated import grpc_service_pb2_grpc as pb_grpc
from tests.server import Gunicorn, wait_for
from tests.test_e2e_balance import _both_live, items_per_worker, shares
from tests.toy_models import write_scale_model

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
            wait_for(lambda: _both_live(srv), 30, "both workers in the load table", srv)
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
