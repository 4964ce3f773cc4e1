"""End to end on real gunicorn (2 workers, one server for the module): a request's priority
level travels with its context to the sibling that runs part or all of it. A model with two
priority levels whose default is the lower one: requests at priority 1 that are scattered over
both workers (HTTP) or forwarded whole by a busy worker (gRPC, one pinned channel) are all
counted at level 1 by the per-level metrics of every worker that ran them, none at level 2."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import grpc
import pytest

from app.grpc.generated import grpc_service_pb2 as pb
from app.grpc.generated import grpc_service_pb2_grpc as pb_grpc
from tests.support.balance import both_live
from tests.support.gunicorn import Gunicorn, wait_for
from tests.support.toy_models import write_scale_model

pytestmark = pytest.mark.e2e

V2 = "/v2/models/scale/infer"
_PRIORITY = re.compile(
    r'^scoring_priority_requests_total\{(?=[^}]*model="scale")(?=[^}]*outcome="admitted")'
    r'(?=[^}]*priority="(\d)")[^}]*\} ([0-9.e+]+)$',
    re.M,
)
_FORWARDED = re.compile(r'^scoring_forwarded_requests_total\{model="scale",version="1"\} ([0-9.e+]+)$', re.M)
_SHARDS = re.compile(r'^scoring_forwarded_shards_total\{model="scale",version="1"\} ([0-9.e+]+)$', re.M)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gunicorn]:
    tmp = tmp_path_factory.mktemp("priority-siblings")
    repo = tmp / "repo"
    folder = write_scale_model(repo, "scale", max_batch_size=2, max_queue_delay_ms=1.0, queue_capacity=256,
                               delay_ms=20)  # fmt: skip
    toml = folder / "model.toml"
    levels = "priority_levels = 2\ndefault_priority_level = 2\n[[inputs]]"
    toml.write_text(toml.read_text().replace("[[inputs]]", levels, 1))
    with Gunicorn(tmp, {"SCORING_MODEL_REPOSITORY": str(repo), "SCORING_WORKERS": "2"}) as srv:
        srv.wait_workers(2)
        srv.wait_ready(120)
        wait_for(lambda: both_live(srv), 30, "both workers in the load table", srv)
        yield srv


def admitted(srv: Gunicorn) -> dict[str, float]:
    """Requests (shards and forwarded requests counted where they ran) admitted per priority
    level, summed over the workers."""
    counts: dict[str, float] = {}
    for level, n in _PRIORITY.findall(srv.scrape()):
        counts[level] = counts.get(level, 0.0) + float(n)
    return counts


def total(pattern: re.Pattern[str], srv: Gunicorn) -> float:
    return sum(float(n) for n in pattern.findall(srv.scrape()))


def test_a_scattered_request_keeps_its_priority_on_the_sibling(server: Gunicorn) -> None:
    before, shards = admitted(server), total(_SHARDS, server)
    body = {
        "inputs": [{"name": "x", "shape": [8, 2], "datatype": "FP32", "data": [float(i) for i in range(16)]}],
        "parameters": {"priority": 1},
    }
    status, _, out = server.post(V2, body)
    assert status == 200, out
    assert out["outputs"][0]["data"] == [2.0 * i for i in range(16)]
    assert total(_SHARDS, server) == shards + 1  # one shard ran on the sibling
    after = admitted(server)
    assert after.get("1", 0) - before.get("1", 0) == 2  # this worker's shard and the sibling's
    assert after.get("2", 0) == before.get("2", 0), (before, after)


def request(x: float) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name="scale")
    message.inputs.add(name="x", datatype="FP32", shape=[1, 2]).contents.fp32_contents.extend([x, x])
    message.parameters["priority"].int64_param = 1
    return message


async def one_channel(url: str, tasks: int, calls: int) -> list[list[float]]:
    """``tasks`` concurrent callers on one channel (pinned to one worker), ``calls`` each."""
    answers: list[list[float]] = []
    async with grpc.aio.insecure_channel(url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        async def task(k: int) -> None:
            for i in range(calls):
                reply = await stub.ModelInfer(request(float(k * 100 + i)), timeout=10)
                answers.append(list(reply.outputs[0].contents.fp32_contents))

        await asyncio.gather(*(task(k) for k in range(tasks)))
    return answers


def test_a_forwarded_request_keeps_its_priority_on_the_sibling(server: Gunicorn) -> None:
    before, forwarded = admitted(server), total(_FORWARDED, server)
    answers = asyncio.run(one_channel(server.grpc_url, 8, 10))
    assert len(answers) == 80
    assert total(_FORWARDED, server) > forwarded  # the busy worker sent some to its sibling
    after = admitted(server)
    assert after.get("1", 0) - before.get("1", 0) == 80
    assert after.get("2", 0) == before.get("2", 0), (before, after)
    assert "Traceback" not in server.log()
