"""Hostile gRPC messages, property-based (hypothesis), against the in-process server: inference
requests shaped like valid ones but wrong in every field (raw sizes that don't match shape x
datatype, truncated or lying BYTES length prefixes, huge or negative shapes, wrong datatypes,
raw and typed contents mixed), and arbitrary bytes as the message. Never INTERNAL, UNKNOWN or a
hang; the server answers a valid request afterwards."""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.datatypes import DATATYPES
from app.grpc.generated import grpc_service_pb2 as pb
from app.grpc.generated import grpc_service_pb2_grpc as pb_grpc
from app.grpc.server import start_server
from app.http.state import CORE
from tests.support.fuzz import FUZZ
from tests.support.toy_models import write_scale_model

#: What a client mistake may get; never INTERNAL or UNKNOWN.
CLIENT_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}

names = st.sampled_from(["x", "tag", "y", "", "X"]) | st.text(max_size=6)
datatypes = st.sampled_from(sorted(DATATYPES)) | st.text(max_size=6)
dims = st.integers(-2, 6) | st.sampled_from([2**31, 2**62, 2**63 - 1, -(2**63)])
shapes = st.lists(dims, max_size=4)


@st.composite
def bytes_payloads(draw: st.DrawFn) -> bytes:
    """BYTES raw data: well-formed, truncated, or with lying length prefixes."""
    items = draw(st.lists(st.binary(max_size=12), max_size=6))
    data = b"".join(struct.pack("<I", len(i)) + i for i in items)
    mode = draw(st.sampled_from(["ok", "truncate", "lie", "junk"]))
    if mode == "truncate" and data:
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif mode == "lie":
        data = struct.pack("<I", draw(st.integers(0, 2**32 - 1))) + data
    elif mode == "junk":
        data += draw(st.binary(max_size=5))
    return data


@st.composite
def infer_requests(draw: st.DrawFn) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=draw(st.sampled_from(["scale", "scale", "nope", ""])))
    raw = draw(st.booleans())
    for _ in range(draw(st.integers(0, 3))):
        tensor = request.inputs.add(name=draw(names), datatype=draw(datatypes), shape=draw(shapes))
        if raw:
            payload = draw(
                bytes_payloads()
                | st.binary(max_size=40)
                | st.integers(0, 6).map(lambda n: np.ones((n, 2), "<f4").tobytes())
            )
            request.raw_input_contents.append(payload)
        else:
            field = draw(
                st.sampled_from(["fp32_contents", "bytes_contents", "int_contents", "bool_contents"])
            )
            values = {
                "fp32_contents": st.lists(st.floats(width=32), max_size=8),
                "bytes_contents": st.lists(st.binary(max_size=8), max_size=4),
                "int_contents": st.lists(st.integers(-(2**31), 2**31 - 1), max_size=8),
                "bool_contents": st.lists(st.booleans(), max_size=8),
            }[field]
            getattr(tensor.contents, field).extend(draw(values))
    if raw and draw(st.booleans()):
        request.raw_input_contents.append(draw(st.binary(max_size=8)))  # one too many
    if draw(st.booleans()):
        request.outputs.add(name=draw(names))
    if draw(st.booleans()):
        param = request.parameters["timeout"]
        choice = draw(st.sampled_from(["int64_param", "string_param", "bool_param", "double_param"]))
        value = {
            "int64_param": st.integers(-(2**63), 2**63 - 1),
            "string_param": st.text(max_size=4),
            "bool_param": st.booleans(),
            "double_param": st.floats(),
        }[choice]
        setattr(param, choice, draw(value))
    return request


@pytest.fixture
async def stub(make_client: Any, tmp_path: Path) -> AsyncIterator[Any]:
    write_scale_model(tmp_path, "scale")
    http = await make_client(tmp_path, max_items_per_request=64)
    server, port = await start_server(http.server.app[CORE], "127.0.0.1", 0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield channel
    await channel.close()
    await server.stop(None)


async def expect_client_error_or_ok(call: Any, what: Any) -> None:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        assert exc.code() in CLIENT_ERRORS, (exc.code(), exc.details(), what)


async def still_serves(channel: Any) -> None:
    request = pb.ModelInferRequest(model_name="scale")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 2]).contents.fp32_contents.extend([1.0, 2.0])
    reply = await pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
    assert reply.outputs


@FUZZ
@given(request=infer_requests())
async def test_hostile_infer_requests_are_client_errors(stub: Any, request: pb.ModelInferRequest) -> None:
    call = pb_grpc.GRPCInferenceServiceStub(stub).ModelInfer(request, timeout=30)
    await expect_client_error_or_ok(call, request)


@FUZZ
@given(raw=st.binary(max_size=200), method=st.sampled_from(["ModelInfer", "ModelMetadata", "ModelConfig"]))
async def test_arbitrary_bytes_are_client_errors(stub: Any, raw: bytes, method: str) -> None:
    call = stub.unary_unary(f"/inference.GRPCInferenceService/{method}")(raw, timeout=30)
    await expect_client_error_or_ok(call, raw)


async def test_the_server_still_serves_after_hostile_input(stub: Any) -> None:
    hostile = pb.ModelInferRequest(model_name="scale", raw_input_contents=[b"\xff" * 3])
    hostile.inputs.add(name="tag", datatype="BYTES", shape=[2**62])
    await expect_client_error_or_ok(pb_grpc.GRPCInferenceServiceStub(stub).ModelInfer(hostile), hostile)
    await still_serves(stub)
