"""One client's bad input never costs another client anything, under gunicorn where the
behaviour lives in the process: an oversized header, and texts that are not UTF-8 beside honest
ones (the real sentence model). In process: tests/unit/test_hostile_inputs.py."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest

from app.grpc.generated import grpc_service_pb2 as pb
from app.grpc.generated import grpc_service_pb2_grpc as pb_grpc
from tests.support.gunicorn import ROOT, Gunicorn
from tests.support.messages import binary_body
from tests.support.toy_models import write_scale_model

pytestmark = pytest.mark.e2e


def test_an_oversized_header_gets_the_json_431_without_an_echo(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_scale_model(repo, "scale")
    with Gunicorn(tmp_path, {"SCORING_MODEL_REPOSITORY": str(repo)}) as srv:
        srv.wait_ready(60)
        for big in ("A" * 100_000, "B" * 12_000):  # over the parser's bound, between the two
            with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
                request = f"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Big: {big}\r\n\r\n"
                sock.sendall(request.encode())
                answer = b""
                while chunk := sock.recv(65536):
                    answer += chunk
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.split()[1] == b"431", answer[:300]
            assert b"application/json" in head and b"AAAA" not in body and b"BBBB" not in body
            assert "SCORING_MAX_HEADER_BYTES" in json.loads(body)["error"]


# --- bad UTF-8 beside honest clients, on the real sentence model ----------------------------


@pytest.mark.slow
def test_texts_that_are_not_utf8_fail_only_their_own_requests(tmp_path: Path) -> None:
    """Four clients send BYTES that are not UTF-8 (gRPC raw contents, gRPC bytes_contents, HTTP
    binary tensors, the optional query) while sixteen honest clients score texts on the same
    worker: every honest request succeeds, every bad one gets 400 / INVALID_ARGUMENT."""
    env = {"SCORING_MODEL_REPOSITORY": str(ROOT / "model_repository"), "SCORING_MODELS": "all-MiniLM-L6-v2"}
    with Gunicorn(tmp_path, env) as srv:
        srv.wait_ready(180)
        statuses: dict[str, list[Any]] = {"honest": [], "bad": []}
        bad = b"caf\xe9 \xff\xfe"

        async def run() -> None:
            channel = grpc.aio.insecure_channel(srv.grpc_url)
            stub = pb_grpc.GRPCInferenceServiceStub(channel)

            def text_request(texts: list[bytes], query: bytes | None = None, typed: bool = False) -> Any:
                request = pb.ModelInferRequest(model_name="all-MiniLM-L6-v2")
                request.outputs.add(name="score")
                tensor = request.inputs.add(name="text", datatype="BYTES", shape=[len(texts), 1])
                if typed:
                    tensor.contents.bytes_contents.extend(texts)
                    return request
                request.raw_input_contents.append(b"".join(struct.pack("<I", len(t)) + t for t in texts))
                if query is not None:
                    request.inputs.add(name="query", datatype="BYTES", shape=[len(texts), 1])
                    request.raw_input_contents.append(
                        b"".join(struct.pack("<I", len(query)) + query for _ in texts)
                    )
                return request

            async def honest(i: int) -> None:
                for _ in range(3):
                    reply = await stub.ModelInfer(text_request([f"honest text {i} number {n}".encode() for n in range(4)]))
                    statuses["honest"].append(len(reply.raw_output_contents))

            async def attacker(kind: str) -> None:
                for _ in range(3):
                    try:
                        if kind == "raw":
                            await stub.ModelInfer(text_request([b"fine", bad]))
                        elif kind == "typed":
                            await stub.ModelInfer(text_request([bad], typed=True))
                        elif kind == "query":
                            await stub.ModelInfer(text_request([b"fine"], query=bad))
                        statuses["bad"].append("OK")
                    except grpc.aio.AioRpcError as exc:
                        statuses["bad"].append(exc.code())

            await asyncio.gather(
                *(honest(i) for i in range(16)), *(attacker(k) for k in ("raw", "typed", "query"))
            )
            await channel.close()

        thread_errors: list[int] = []

        def http_attacker() -> None:
            for _ in range(3):
                chunk = struct.pack("<I", len(bad)) + bad
                body, headers = binary_body(
                    {"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES",
                                 "parameters": {"binary_data_size": len(chunk)}}]},
                    chunk,
                )  # fmt: skip
                thread_errors.append(srv.post("/v2/models/all-MiniLM-L6-v2/infer", body, headers=headers)[0])

        http = threading.Thread(target=http_attacker)
        http.start()
        asyncio.run(run())
        http.join(120)
        assert statuses["honest"] == [1] * 48, statuses["honest"]  # one output asked: score
        assert statuses["bad"] == [grpc.StatusCode.INVALID_ARGUMENT] * 9, statuses["bad"]
        assert thread_errors == [400, 400, 400]
        assert srv.log().count("Traceback") == 0
