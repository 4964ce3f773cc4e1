r"""One inference request type for every protocol front end (HTTP V2 JSON, V2 JSON + binary,
KServe V1, gRPC, OpenAI embeddings), and one response type.

A front end decodes its wire format into an :class:`InferRequest` and hands it, with the
request's context (``app.serving.context.RequestContext``: its arrival, the deadline its
transport named), to the data plane (:meth:`app.serving.dataplane.DataPlane.infer`), which
validates it against the model, settles its one deadline, runs it and builds the
:class:`InferResponse`; the front end then encodes that response in its own wire format.

Source: KServe's ``InferRequest``/``InferInput``/``InferResponse``
(kserve/kserve ``python/kserve/kserve/protocol/infer_type.py``), reduced to what the server
needs; no aiohttp and no grpc here. The classes are plain ``msgspec.Struct``\ s (cheaper to
build than dataclasses; nothing is validated on construction).
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np


class RawData(msgspec.Struct):
    """A tensor's data as raw bytes, not yet decoded (binary tensor data, gRPC
    ``raw_input_contents``): little-endian row-major elements, BYTES length-prefixed.
    :func:`app.serving.dataplane.validate_inputs` decodes it once its name, datatype and size
    fit the model."""

    data: memoryview | bytes


class InferInput(msgspec.Struct):
    """One input tensor of a request.

    Attributes:
        name: the model input it feeds.
        datatype: Open Inference Protocol datatype name (``"FP32"``, ``"BYTES"``...).
        shape: the tensor's shape, batch dimension first; None = infer it from nested ``data``
            (KServe V1 bodies carry no shape).
        data: JSON values (flat or nested row-major lists; BYTES as ``str``), raw bytes
            (:class:`RawData`: binary tensor data, gRPC raw contents), or a numpy array already
            of ``datatype``'s dtype (gRPC typed contents; BYTES as an ``object`` array of
            ``bytes``), any shape with ``prod(shape)`` elements; None until a binary part
            fills it (:func:`app.protocols.v2.attach_binary`).
        parameters: the tensor's ``parameters`` as sent.
    """

    name: str
    datatype: str
    shape: list[int] | None
    data: list[Any] | np.ndarray | RawData | None
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)


class RequestedOutput(msgspec.Struct):
    """An output the client asked for.

    Attributes:
        name: the model output.
        binary_data: True/False = send it as binary tensor data / as JSON; None = the
            request's default (:attr:`InferRequest.binary_data_output`).
        parameters: the output's ``parameters`` as sent.
    """

    name: str
    binary_data: bool | None = None
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)


class InferRequest(msgspec.Struct):
    """One inference request, whatever protocol it came in.

    Attributes:
        model_name, model_version: the model addressed (version None = the highest).
        inputs: the input tensors, in the order sent.
        id: the client's request id, echoed in the response.
        parameters: the request's ``parameters`` (``timeout`` in microseconds, Triton's).
        outputs: the outputs asked for; None = every output in model order.
        binary_data_output: send outputs not named in ``outputs`` (or all) as binary tensor
            data (Triton's ``parameters.binary_data_output``).
    """

    model_name: str
    inputs: list[InferInput]
    model_version: str | None = None
    id: str | None = None
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)
    outputs: list[RequestedOutput] | None = None
    binary_data_output: bool = False


def lengths_name(output: str) -> str:
    """The name of the tensor that carries a ragged output's per-item lengths over the Open
    Inference Protocol (``app.protocols.tensors.wire_tensors``): ``<output>_lengths``."""
    return f"{output}_lengths"


class OutputTensor(msgspec.Struct):
    """One output of a response: ``array`` is ``[B, ...]`` of the output's datatype (BYTES:
    ``object`` array of ``bytes``); ``binary`` = the client wants it as binary tensor data;
    ``ragged``: a ragged output (``app.models.repository.TensorSpec.ragged``), ``array`` an
    object array ``[B]`` of the items' arrays ``[n_i, ...]``."""

    name: str
    datatype: str
    array: np.ndarray
    binary: bool = False
    ragged: bool = False


class InferResponse(msgspec.Struct):
    """An inference response before encoding: model, echoed request id, outputs in order."""

    model_name: str
    model_version: str
    outputs: list[OutputTensor]
    id: str | None = None
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)
