"""Requests the tests send to the scale toy model (tests/support/toy_models.py): the gRPC
raw-contents request, and the body of the binary tensor extension over HTTP."""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np

from app.grpc.generated import grpc_service_pb2 as pb

#: The HTTP header of the binary tensor extension: the length of the JSON part of the body.
HEADER = "Inference-Header-Content-Length"


def scale_request(xs: list[list[float]], tags: list[bytes], **kw: Any) -> pb.ModelInferRequest:
    """A raw-contents request for the scale toy model (x: FP32 [B, 2], tag: BYTES [B, 1])."""
    request = pb.ModelInferRequest(model_name="scale", **kw)
    request.inputs.add(name="x", datatype="FP32", shape=[len(xs), 2])
    request.inputs.add(name="tag", datatype="BYTES", shape=[len(tags), 1])
    request.raw_input_contents.append(np.asarray(xs, dtype="<f4").tobytes())
    request.raw_input_contents.append(b"".join(struct.pack("<I", len(t)) + t for t in tags))
    return request


def binary_body(header: dict[str, Any], *chunks: bytes) -> tuple[bytes, dict[str, str]]:
    """A binary-tensor body: the JSON ``header`` and the raw ``chunks`` after it; and its headers."""
    head = json.dumps(header).encode()
    return head + b"".join(chunks), {HEADER: str(len(head)), "Content-Type": "application/octet-stream"}
