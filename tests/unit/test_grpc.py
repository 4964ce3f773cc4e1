"""The gRPC servicer in-process: a grpc.aio server on 127.0.0.1:0 over an app built by
``app.main.create_app``, called through the server's own generated stubs (they live in a
descriptor pool of their own, so they load beside any client's stubs)."""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil
import pytest

from app import errors
from app.grpc import codec
from app.grpc.errors import outcome, status_of
from app.grpc.generated import grpc_service_pb2 as pb
from app.grpc.generated import grpc_service_pb2_grpc as pb_grpc
from app.grpc.server import start_server
from app.http.state import CORE
from app.protocols.infer import InferRequest
from app.protocols.tensors import deserialize_bytes
from app.serving.context import NO_DEADLINE, RequestContext
from tests.support.fixtures import Client
from tests.support.messages import scale_request
from tests.support.tls import self_signed

Code = grpc.StatusCode


class Grpc:
    """A stub on a channel to the in-process server, and the HTTP client of the same app."""

    def __init__(self, http: Client, channel: Any, port: int) -> None:
        self.http = http
        self.port = port
        assert http.app is not None
        self.app = http.app
        self.channel = channel
        self.stub = pb_grpc.GRPCInferenceServiceStub(channel)

    async def error(self, rpc: str, request: Any, **kw: Any) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await getattr(self.stub, rpc)(request, **kw)
        return info.value


@pytest.fixture
async def served(make_client: Callable[..., Any], scale_repo: Path) -> AsyncIterator[Callable[..., Any]]:
    servers: list[Any] = []
    channels: list[Any] = []

    async def serve(**settings: Any) -> Grpc:
        http = await make_client(scale_repo, **settings)
        server, port = await start_server(http.server.app[CORE], "127.0.0.1", 0)
        servers.append(server)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        channels.append(channel)
        return Grpc(http, channel, port)

    yield serve
    for channel in channels:
        await channel.close()
    for server in servers:
        await server.stop(None)


def outputs_of(reply: pb.ModelInferResponse) -> dict[str, np.ndarray]:
    """Output arrays of a response, raw or typed."""
    out = {}
    for i, tensor in enumerate(reply.outputs):
        if reply.raw_output_contents:
            raw = reply.raw_output_contents[i]
            if tensor.datatype == "BYTES":
                arr = deserialize_bytes(memoryview(raw), int(np.prod(tensor.shape)), "", 1 << 20)
            else:
                arr = np.frombuffer(raw, dtype={"FP32": "<f4", "INT64": "<i8"}[tensor.datatype])
        else:
            arr = np.asarray(getattr(tensor.contents, codec.CONTENTS_FIELD[tensor.datatype]))
        out[tensor.name] = arr.reshape(list(tensor.shape))
    return out


async def test_health_and_metadata(served: Callable[..., Any]) -> None:
    g = await served()
    assert (await g.stub.ServerLive(pb.ServerLiveRequest())).live
    assert (await g.stub.ServerReady(pb.ServerReadyRequest())).ready
    assert (await g.stub.ModelReady(pb.ModelReadyRequest(name="scale"))).ready
    assert (await g.error("ModelReady", pb.ModelReadyRequest(name="nope"))).code() == Code.NOT_FOUND
    meta = await g.stub.ServerMetadata(pb.ServerMetadataRequest())
    assert meta.name == "scoring-server"
    model = await g.stub.ModelMetadata(pb.ModelMetadataRequest(name="scale"))
    http_meta = await (await g.http.get("/v2/models/scale")).json()
    assert [(t.name, t.datatype, list(t.shape)) for t in model.inputs] == [
        (t["name"], t["datatype"], t["shape"]) for t in http_meta["inputs"]
    ]
    assert list(model.versions) == http_meta["versions"] and model.platform == http_meta["platform"]


async def test_draining_worker_is_unready(served: Callable[..., Any]) -> None:
    g = await served()
    g.app[CORE].registry.begin_drain("test")
    assert not (await g.stub.ServerReady(pb.ServerReadyRequest())).ready
    assert not (await g.stub.ModelReady(pb.ModelReadyRequest(name="scale"))).ready
    assert (await g.stub.ServerLive(pb.ServerLiveRequest())).live


async def test_raw_infer_equals_the_json_path(served: Callable[..., Any]) -> None:
    g = await served()
    xs, tags = [[1.5, -2.0], [0.25, 8.0]], [b"ab", "h\u00e9".encode()]
    call = g.stub.ModelInfer(scale_request(xs, tags, id="req-7"))
    reply = await call
    assert reply.id == "req-7" and reply.model_name == "scale"
    assert ("x-request-id", "req-7") in tuple(await call.trailing_metadata())
    body = {
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [v for row in xs for v in row]},
            {"name": "tag", "datatype": "BYTES", "shape": [2, 1], "data": [t.decode() for t in tags]},
        ]
    }
    expected = await (await g.http.post("/v2/models/scale/infer", json=body)).json()
    got = outputs_of(reply)
    for out in expected["outputs"]:
        assert list(got[out["name"]].shape) == out["shape"]
        np.testing.assert_array_equal(got[out["name"]].ravel(), np.asarray(out["data"]))


async def test_typed_contents_in_typed_contents_out(served: Callable[..., Any]) -> None:
    g = await served()
    request = pb.ModelInferRequest(model_name="scale")
    request.outputs.add(name="y")
    x = request.inputs.add(name="x", datatype="FP32", shape=[1, 2])
    x.contents.fp32_contents.extend([3.0, 4.0])
    tag = request.inputs.add(name="tag", datatype="BYTES", shape=[1])
    tag.contents.bytes_contents.append(b"abc")
    reply = await g.stub.ModelInfer(request)
    assert not reply.raw_output_contents and [o.name for o in reply.outputs] == ["y"]
    raw = await g.stub.ModelInfer(scale_request([[3.0, 4.0]], [b"abc"]))
    np.testing.assert_array_equal(outputs_of(reply)["y"], outputs_of(raw)["y"])


def hostile_requests() -> list[tuple[str, pb.ModelInferRequest, grpc.StatusCode]]:
    """(what, request, expected status) for client mistakes."""
    cases = []

    def case(what: str, code: grpc.StatusCode = Code.INVALID_ARGUMENT) -> Callable[..., Any]:
        def add(edit: Callable[[pb.ModelInferRequest], None]) -> None:
            request = scale_request([[1.0, 2.0]], [b"t"])
            edit(request)
            cases.append((what, request, code))

        return add

    case("raw size off by one")(lambda r: r.raw_input_contents.__setitem__(0, b"\0" * 7))
    case("truncated BYTES length prefix")(lambda r: r.raw_input_contents.__setitem__(1, b"\1\0"))
    case("BYTES length past the end")(
        lambda r: r.raw_input_contents.__setitem__(1, struct.pack("<I", 99) + b"x")
    )
    case("huge declared shape")(lambda r: r.inputs[1].shape.__setitem__(1, 2**62))
    case("huge numeric shape")(lambda r: r.inputs[0].shape.__setitem__(1, 2**61))
    case("negative dimension")(lambda r: r.inputs[0].shape.__setitem__(0, -1))
    case("wrong datatype")(lambda r: setattr(r.inputs[0], "datatype", "FP64"))
    case("unknown datatype")(lambda r: setattr(r.inputs[0], "datatype", "FP33"))
    case("raw count != inputs")(lambda r: r.raw_input_contents.append(b""))
    case("raw and typed mixed")(lambda r: r.inputs[0].contents.fp32_contents.append(1.0))
    case("unknown output")(lambda r: r.outputs.add(name="nope"))
    case("bad timeout parameter")(lambda r: setattr(r.parameters["timeout"], "int64_param", -5))
    case("unknown model", Code.NOT_FOUND)(lambda r: setattr(r, "model_name", "nope"))
    return cases


@pytest.mark.parametrize(
    "what,request_,code", hostile_requests(), ids=lambda v: v if isinstance(v, str) else ""
)
async def test_client_mistakes_get_their_status_and_no_error_log(
    served: Callable[..., Any], caplog: pytest.LogCaptureFixture, what: str, request_: Any, code: Any
) -> None:
    g = await served()
    with caplog.at_level(logging.WARNING):
        err = await g.error("ModelInfer", request_)
    assert err.code() == code, (what, err.details())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], what
    # the worker still serves
    assert (await g.stub.ModelInfer(scale_request([[1.0, 2.0]], [b"t"]))).outputs


async def test_limits_and_malformed_messages(served: Callable[..., Any]) -> None:
    g = await served(max_items_per_request=2, max_string_bytes=8, max_request_bytes=4096)
    err = await g.error("ModelInfer", scale_request([[1.0, 2.0]] * 3, [b"t"] * 3))
    assert err.code() == Code.RESOURCE_EXHAUSTED and "SCORING_MAX_ITEMS_PER_REQUEST" in err.details()
    err = await g.error("ModelInfer", scale_request([[1.0, 2.0]], [b"x" * 9]))
    assert err.code() == Code.RESOURCE_EXHAUSTED and "SCORING_MAX_STRING_BYTES" in err.details()
    err = await g.error("ModelInfer", scale_request([[1.0, 2.0]], [b"x" * 5000]))
    assert err.code() == Code.RESOURCE_EXHAUSTED  # over max_request_bytes: grpcio refuses it
    # bytes that are no ModelInferRequest at all
    raw_call = g.channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await raw_call(b"\xff\xff\xff")
    assert (
        info.value.code() == Code.INVALID_ARGUMENT and "malformed ModelInferRequest" in info.value.details()
    )


async def test_api_keys_from_metadata(served: Callable[..., Any]) -> None:
    g = await served(api_keys="k-one")
    assert (await g.stub.ServerLive(pb.ServerLiveRequest())).live  # open, like /v2/health/live
    assert (await g.stub.ServerReady(pb.ServerReadyRequest())).ready
    request = scale_request([[1.0, 2.0]], [b"t"])
    for metadata in [(), (("authorization", "Bearer wrong"),), (("x-api-key", "k-on"),)]:
        err = await g.error("ModelInfer", request, metadata=metadata)
        assert err.code() == Code.UNAUTHENTICATED
    err = await g.error("ModelMetadata", pb.ModelMetadataRequest(name="scale"))
    assert err.code() == Code.UNAUTHENTICATED
    for metadata in [(("authorization", "Bearer k-one"),), (("x-api-key", "k-one"),)]:
        assert (await g.stub.ModelInfer(request, metadata=metadata)).outputs


async def test_requests_are_counted_with_protocol_grpc(served: Callable[..., Any]) -> None:
    g = await served()
    await g.stub.ModelInfer(scale_request([[1.0, 2.0]], [b"t"]))
    await g.error("ModelInfer", scale_request([[1.0, 2.0]], [b"t"], model_version="9"))
    await g.error("ModelInfer", hostile_requests()[0][1])
    registry = g.app[CORE].metrics.registry

    def count(code: str) -> float | None:
        labels = {"model": "scale", "version": "1", "protocol": "grpc", "code": code}
        value: float | None = registry.get_sample_value("scoring_requests_total", labels)
        return value

    unknown_model = scale_request([[1.0, 2.0]], [b"t"])
    unknown_model.model_name = "nope"
    await g.error("ModelInfer", unknown_model)
    assert count("OK") == 1.0
    assert count("INVALID_ARGUMENT") == 1.0
    unknown = {"model": "", "version": "", "protocol": "grpc"}
    assert registry.get_sample_value("scoring_requests_total", {**unknown, "code": "NOT_FOUND"}) == 2.0


class FakeContext:
    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining

    def time_remaining(self) -> float | None:
        return self.remaining


@pytest.mark.parametrize(
    "remaining,timeout_us,expected",
    [(None, None, 10.0), (2.5, None, 2.5), (None, 300_000, 0.3), (2.5, 300_000, 0.3), (0.1, 300_000, 0.1)],
)
async def test_deadline_is_the_earlier_of_grpc_and_the_timeout_parameter(
    make_client: Callable[..., Any], scale_repo: Path, remaining: Any, timeout_us: Any, expected: float
) -> None:
    http = await make_client(scale_repo, request_timeout_ms=10_000)
    plane = http.server.app[CORE].dataplane
    model = plane.get_model("scale", None)
    params = {} if timeout_us is None else {"timeout": timeout_us}
    transport = FakeContext(remaining).time_remaining()
    request = InferRequest("scale", [], parameters=params)
    context = RequestContext("r", NO_DEADLINE if transport is None else 100.0 + transport, arrival=100.0)
    settled = plane.settle_parameters(model, request, plane.settle(model, context))
    assert settled.deadline - 100.0 == pytest.approx(expected)


def test_every_domain_error_has_one_status(caplog: pytest.LogCaptureFixture) -> None:
    assert status_of(errors.QueueFull("q")) == Code.UNAVAILABLE
    assert status_of(errors.ModelNotReady("m")) == Code.UNAVAILABLE
    assert status_of(errors.DeadlineExceeded("d")) == Code.DEADLINE_EXCEEDED
    assert status_of(errors.PayloadTooLarge("p")) == Code.RESOURCE_EXHAUSTED
    assert status_of(errors.InvalidInput("i")) == Code.INVALID_ARGUMENT
    subclasses = set()
    stack = [errors.ScoringError]
    while stack:
        cls = stack.pop()
        subclasses.add(cls)
        stack.extend(cls.__subclasses__())
    for cls in subclasses - {errors.ScoringError}:
        assert status_of(cls("x")) != Code.UNKNOWN
    code, details, trailer = outcome(errors.QueueFull("full", retry_after_s=0.2), "r1", "ModelInfer")
    assert code == Code.UNAVAILABLE and ("retry-after", "1") in trailer and ("x-request-id", "r1") in trailer
    with caplog.at_level(logging.ERROR):
        code, details, _ = outcome(KeyError("boom"), "r2", "ModelInfer")
    assert code == Code.INTERNAL and "r2" in details and "boom" not in details
    assert any(r.levelno == logging.ERROR and "r2" in r.getMessage() for r in caplog.records)


async def test_triton_extensions_answer_as_http_does(served: Callable[..., Any]) -> None:
    g = await served()
    await g.stub.ModelInfer(scale_request([[1.0, 2.0]], [b"t"]))
    config = (await g.stub.ModelConfig(pb.ModelConfigRequest(name="scale"))).config
    http_config = await (await g.http.get("/v2/models/scale/config")).json()
    assert (config.name, config.platform, config.backend, config.max_batch_size) == (
        http_config["name"], http_config["platform"], http_config["backend"], http_config["max_batch_size"]
    )  # fmt: skip
    for ours, theirs in [(config.input, http_config["input"]), (config.output, http_config["output"])]:
        assert [(t.name, pb.DataType.Name(t.data_type), list(t.dims)) for t in ours] == [
            (t["name"], t["data_type"], t["dims"]) for t in theirs
        ]
    delay = http_config["dynamic_batching"]["max_queue_delay_microseconds"]
    assert config.dynamic_batching.max_queue_delay_microseconds == delay
    kind = pb.ModelInstanceGroup.Kind.Name(config.instance_group[0].kind)
    assert kind == http_config["instance_group"][0]["kind"]

    stats = await g.stub.ModelStatistics(pb.ModelStatisticsRequest(name="scale"))
    http_stats = (await (await g.http.get("/v2/models/scale/stats")).json())["model_stats"]
    assert len(stats.model_stats) == len(http_stats) == 1
    ours_stat, theirs_stat = stats.model_stats[0], http_stats[0]
    assert ours_stat.inference_count == theirs_stat["inference_count"] == 1
    assert ours_stat.inference_stats.success.count == theirs_stat["inference_stats"]["success"]["count"] == 1
    assert [b.batch_size for b in ours_stat.batch_stats] == [
        b["batch_size"] for b in theirs_stat["batch_stats"]
    ]
    assert len((await g.stub.ModelStatistics(pb.ModelStatisticsRequest())).model_stats) == 1
    err = await g.error("ModelStatistics", pb.ModelStatisticsRequest(name="nope"))
    assert err.code() == Code.NOT_FOUND

    index = await g.stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=True))
    http_index = await (await g.http.post("/v2/repository/index", json={"ready": True})).json()
    assert [(m.name, m.version, m.state, m.reason) for m in index.models] == [
        (e["name"], e["version"], e["state"], e["reason"]) for e in http_index
    ]
    meta = await g.stub.ServerMetadata(pb.ServerMetadataRequest())
    assert {"model_configuration", "statistics", "model_repository"} <= set(meta.extensions)


async def test_a_channel_outlives_its_connections(served: Callable[..., Any]) -> None:
    """With a short max connection age the server keeps asking the channel to reconnect
    (GOAWAY); calls over the one channel keep succeeding across several reconnections."""
    g = await served(grpc_max_connection_age_s=0.2, grpc_grace_s=1.0)
    me = psutil.Process()
    local_ports: set[int] = set()
    loop = asyncio.get_running_loop()
    stop = loop.time() + 30
    while len(local_ports) < 3 and loop.time() < stop:  # bounded: until three connections served
        assert (await g.stub.ModelInfer(scale_request([[1.0, 2.0]], [b"t"]), timeout=10)).outputs
        local_ports |= {c.laddr.port for c in me.connections("tcp") if c.raddr and c.raddr.port == g.port}
    assert len(local_ports) >= 3, local_ports


async def test_oversized_tensors_are_refused_before_they_are_parsed(served: Callable[..., Any]) -> None:
    g = await served(max_items_per_request=16)
    request = scale_request([[1.0, 2.0]], [b""])
    request.inputs[1].shape[:] = [1, 100_000]  # 100 000 valid empty strings for one item
    request.raw_input_contents[1] = b"\0\0\0\0" * 100_000
    err = await g.error("ModelInfer", request)
    assert err.code() == Code.INVALID_ARGUMENT and "holds more than the 16 elements" in err.details()
    request.inputs[1].shape[:] = [17, 1]
    err = await g.error("ModelInfer", request)
    assert err.code() == Code.RESOURCE_EXHAUSTED and "17 items" in err.details()


async def test_tls_with_the_http_certificate(
    make_client: Callable[..., Any], scale_repo: Path, tmp_path: Path
) -> None:
    cert, key = self_signed(tmp_path)
    http = await make_client(scale_repo, certfile=cert, keyfile=key)
    server, port = await start_server(http.server.app[CORE], "127.0.0.1", 0)
    credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    try:
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            assert (await stub.ServerLive(pb.ServerLiveRequest(), timeout=10)).live
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as plain:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await pb_grpc.GRPCInferenceServiceStub(plain).ServerLive(pb.ServerLiveRequest(), timeout=5)
            assert info.value.code() == Code.UNAVAILABLE
    finally:
        await server.stop(None)


async def test_mutual_tls_requires_a_client_certificate_signed_by_the_client_ca(
    make_client: Callable[..., Any], scale_repo: Path, tmp_path: Path
) -> None:
    """SCORING_CLIENT_CA_FILE: a client with a certificate the CA signed is served; one without
    a certificate, or with another, is refused at the handshake (UNAVAILABLE)."""
    (tmp_path / "server").mkdir()
    (tmp_path / "client").mkdir()
    (tmp_path / "stranger").mkdir()
    cert, key = self_signed(tmp_path / "server")
    client_cert, client_key = self_signed(tmp_path / "client")  # self-signed: its own CA
    stranger_cert, stranger_key = self_signed(tmp_path / "stranger")
    http = await make_client(scale_repo, certfile=cert, keyfile=key, client_ca_file=client_cert)
    server, port = await start_server(http.server.app[CORE], "127.0.0.1", 0)

    root = cert.read_bytes()
    pairs = {
        "client": (client_key.read_bytes(), client_cert.read_bytes()),
        "stranger": (stranger_key.read_bytes(), stranger_cert.read_bytes()),
        "none": (None, None),
    }

    async def live(who: str) -> bool:
        private, chain = pairs[who]
        credentials = grpc.ssl_channel_credentials(root_certificates=root, private_key=private, certificate_chain=chain)
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            try:
                return bool((await stub.ServerLive(pb.ServerLiveRequest(), timeout=5)).live)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == Code.UNAVAILABLE, exc
                return False

    try:
        assert await live("client") is True
        assert await live("none") is False
        assert await live("stranger") is False
    finally:
        await server.stop(None)
