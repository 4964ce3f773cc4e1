"""Tracing from real gunicorn workers to an OTLP/HTTP receiver on 127.0.0.1 (tests/support/otlp.py
decodes the real protobufs): a V2 HTTP request and a gRPC call sent with a W3C ``traceparent``
produce the server span, the queue wait, the batch (linked) and the forward pass in the caller's
trace; a request scattered over the two workers has spans from both, in that trace."""

from __future__ import annotations

import random
from pathlib import Path

import grpc
import numpy as np
import pytest

from app.grpc.generated import grpc_service_pb2 as pb
from app.grpc.generated import grpc_service_pb2_grpc as pb_grpc
from app.protocols.tensors import tensor_bytes
from benchmarks.driver import poll
from tests.support.gunicorn import Gunicorn
from tests.support.otlp import Receiver, Span
from tests.support.toy_models import write_scale_model

pytestmark = pytest.mark.e2e


def traceparent() -> tuple[str, str]:
    trace_id = f"{random.getrandbits(128):032x}"
    return trace_id, f"00-{trace_id}-{random.getrandbits(64):016x}-01"


def x(items: int) -> dict[str, object]:
    return {"inputs": [{"name": "x", "shape": [items, 2], "datatype": "FP32", "data": [1.0] * (2 * items)}]}


def test_http_and_grpc_requests_are_traced_across_workers(tmp_path: Path) -> None:
    write_scale_model(tmp_path / "repo", "scale", max_batch_size=8, queue_capacity=256)
    with Receiver() as receiver:
        env = {
            "SCORING_MODEL_REPOSITORY": str(tmp_path / "repo"), "SCORING_WORKERS": "2",
            "OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_SERVICE_NAME": "scoring-test",
        }  # fmt: skip
        with Gunicorn(tmp_path, env) as srv:
            srv.wait_ready(120, count=2)

            def spans_of(trace_id: str, names: set[str]) -> list[Span]:
                def arrived() -> list[Span] | None:
                    spans = receiver.of_trace(trace_id)
                    return spans if names <= {s.name for s in spans} else None

                return poll(arrived, 30, f"spans {names} of trace {trace_id}", diagnostics=srv.log_tail)

            # V2 HTTP
            trace_id, header = traceparent()
            status, _, _ = srv.post(
                "/v2/models/scale/infer", x(1), {"traceparent": header, "X-Request-Id": "h-1"}
            )
            assert status == 200
            spans = spans_of(trace_id, {"queue", "batch", "forward", "encode"})
            server = [s for s in spans if s.kind == 2]  # SPAN_KIND_SERVER
            assert len(server) == 1 and server[0].parent_id == header.split("-")[2]
            assert server[0].attributes["scoring.request_id"] == "h-1" and server[0].service == "scoring-test"
            batch = next(s for s in spans if s.name == "batch")
            assert (trace_id, server[0].span_id) in batch.links
            forward = next(s for s in spans if s.name == "forward")
            assert forward.parent_id == batch.span_id

            # gRPC, the context in the call's metadata
            trace_id, header = traceparent()
            message = pb.ModelInferRequest(model_name="scale", id="g-1")
            message.inputs.add(name="x", datatype="FP32", shape=[1, 2])
            message.raw_input_contents.append(tensor_bytes(np.ones((1, 2), np.float32), "FP32"))
            with grpc.insecure_channel(srv.grpc_url) as channel:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
                stub.ModelInfer(message, timeout=30, metadata=[("traceparent", header)])
            spans = spans_of(trace_id, {"queue", "batch", "forward", "encode"})
            server = [s for s in spans if s.kind == 2]
            assert len(server) == 1 and server[0].attributes["scoring.request_id"] == "g-1"

            # a request larger than a batch, scattered over both workers: one trace, both pids
            trace_id, header = traceparent()
            status, _, _ = srv.post("/v2/models/scale/infer", x(20), {"traceparent": header})
            assert status == 200
            spans = spans_of(trace_id, {"batch", "forward"})

            def both() -> bool:
                return len({s.pid for s in receiver.of_trace(trace_id) if s.name == "batch"}) == 2

            poll(both, 30, "batch spans from both workers", diagnostics=srv.log_tail)
