"""One client's bad input never costs another client anything, in process (where the behaviour
lives in the app): shapes of more dimensions than any model takes, tensors declaring millions
of elements, an output asked for twice, a content coding the server does not decode, a deadline
shorter than any answer. Under gunicorn (an oversized header; texts that are not UTF-8 beside
honest ones, on the real sentence model): tests/e2e/test_hostile_inputs.py."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from app.grpc.generated import grpc_service_pb2 as pb
from app.grpc.generated import grpc_service_pb2_grpc as pb_grpc
from app.grpc.server import start_server
from app.http.state import CORE
from app.protocols import tensors
from tests.support.fixtures import Client, MakeClient
from tests.support.messages import binary_body, scale_request

V2 = "/v2/models/scale/infer"


@pytest.fixture
async def served(make_client: MakeClient, scale_repo: Path) -> AsyncIterator[Callable[..., Any]]:
    """``serve(**settings) -> (http client, gRPC stub)`` of one in-process app."""
    servers: list[Any] = []
    channels: list[Any] = []

    async def serve(**settings: Any) -> tuple[Client, Any]:
        http: Client = await make_client(scale_repo, **settings)
        assert http.app is not None
        server, port = await start_server(http.app[CORE], "127.0.0.1", 0)
        servers.append(server)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        channels.append(channel)
        return http, pb_grpc.GRPCInferenceServiceStub(channel)

    yield serve
    for channel in channels:
        await channel.close()
    for server in servers:
        await server.stop(None)


# --- shapes and element counts: refused before any per-element work ----------------------


async def test_more_dimensions_than_any_model_takes_is_400_over_every_protocol(
    served: Callable[..., Any],
) -> None:
    http, stub = await served()
    shape = [1] * 70 + [2]
    body, headers = binary_body(
        {"inputs": [{"name": "x", "shape": shape, "datatype": "FP32", "parameters": {"binary_data_size": 8}}]},
        np.ones(2, "<f4").tobytes(),
    )
    resp = await http.post(V2, data=body, headers=headers)
    assert resp.status == 400 and "71 dimensions" in (await resp.json())["error"]
    request = pb.ModelInferRequest(model_name="scale")
    request.inputs.add(name="x", datatype="FP32", shape=shape)
    request.raw_input_contents.append(np.ones(2, "<f4").tobytes())
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.ModelInfer(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "71 dimensions" in str(info.value.details())


@pytest.mark.parametrize("protocol", ["binary", "grpc"])
async def test_millions_of_elements_are_refused_before_the_first_is_read(
    served: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, protocol: str
) -> None:
    """4 million empty strings declared (16 MB of length prefixes): refused from the shape and
    the model's spec, without decoding a single element; over gRPC for an input the model does
    not declare too (its data is never read)."""
    decoded: list[int] = []
    real = tensors.deserialize_bytes

    def spy(view: memoryview, count: int, where: str, max_string_bytes: int) -> np.ndarray:
        decoded.append(count)
        return real(view, count, where, max_string_bytes)

    monkeypatch.setattr(tensors, "deserialize_bytes", spy)
    http, stub = await served(max_request_bytes=20 * 2**20)
    count = 4_000_000
    raw = b"\0\0\0\0" * count
    for name in ("tag", "undeclared"):
        tensor = {"name": name, "shape": [1, count], "datatype": "BYTES"}
        x = {"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1.0, 1.0]}
        if protocol == "binary":
            body, headers = binary_body(
                {"inputs": [x, {**tensor, "parameters": {"binary_data_size": len(raw)}}]}, raw
            )
            resp = await http.post(V2, data=io.BytesIO(body), headers=headers)
            assert resp.status == 400, await resp.text()
            error = (await resp.json())["error"]
        else:
            request = scale_request([[1.0, 1.0]], [b""])
            request.inputs[1].name = name
            request.inputs[1].shape[:] = [1, count]
            request.raw_input_contents[1] = raw
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ModelInfer(request)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            error = str(info.value.details())
        assert ("holds more than" in error) if name == "tag" else ("unknown input" in error), error
    assert decoded == []


# --- smaller gaps ---------------------------------------------------------------------------


async def test_an_output_asked_for_twice_is_400(served: Callable[..., Any]) -> None:
    http, stub = await served()
    body = {
        "inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}],
        "outputs": [{"name": "y"}, {"name": "y"}],
    }
    resp = await http.post(V2, json=body)
    assert resp.status == 400 and "asked for more than once" in (await resp.json())["error"]
    request = scale_request([[1.0, 2.0]], [b""])
    request.outputs.add(name="y")
    request.outputs.add(name="y")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.ModelInfer(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_content_coding_the_server_does_not_decode_is_415(served: Callable[..., Any]) -> None:
    http, _ = await served()
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]})
    for coding in ("compress", "gzip, identity", "x-snappy"):
        resp = await http.post(
            V2, data=body.encode(), headers={"Content-Type": "application/json", "Content-Encoding": coding}
        )
        assert resp.status == 415 and "Content-Encoding" in (await resp.json())["error"], coding
    ok = await http.post(V2, data=body.encode(), headers={"Content-Type": "application/json", "Content-Encoding": "identity"})
    assert ok.status == 200


@pytest.mark.parametrize("deadline_s", [1e-6, 1e-3])
async def test_a_grpc_deadline_shorter_than_any_answer_is_deadline_exceeded(
    served: Callable[..., Any], deadline_s: float
) -> None:
    """Not UNAVAILABLE, which invites a retry that cannot succeed either."""
    _, stub = await served()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.ModelInfer(scale_request([[1.0, 2.0]], [b""]), timeout=deadline_s)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
