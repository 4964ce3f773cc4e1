"""Triton's binary tensor data extension for the V2 HTTP/REST protocol.

A request body is a JSON inference request of ``Inference-Header-Content-Length`` bytes, then
the raw data of every input whose ``parameters.binary_data_size`` is set, in input order. A
fixed-size datatype is its elements little-endian, row-major; a BYTES tensor is each element
as a 4-byte little-endian length then that many bytes. Responses work the same way for the
outputs asked for as binary (``parameters.binary_data`` per output, or
``parameters.binary_data_output`` for all), whose JSON then carries
``parameters.binary_data_size`` instead of ``data``.

Source: triton-inference-server/server ``docs/protocol/extension_binary_data.md`` and the
client's ``tritonclient/http/_utils.py`` (``_get_inference_request``). No aiohttp here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from app.errors import InvalidInput
from app.protocols.infer import InferRequest, InferResponse, RawData
from app.protocols.tensors import tensor_bytes

#: Request and response header: length in bytes of the JSON part at the start of the body.
HEADER_LENGTH = "Inference-Header-Content-Length"


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    """Split a request body at ``Inference-Header-Content-Length``.

    Args:
        body: the whole (decompressed) request body.
        header_length: the header's value, or None when absent (all of ``body`` is JSON).

    Returns:
        The JSON part and a zero-copy view of the binary part after it (empty when none).

    Raises:
        InvalidInput: the header is not a decimal integer within ``[0, len(body)]``.
    """
    if header_length is None:
        return body, memoryview(b"")
    text = header_length.strip()
    if not text.isdecimal() or not text.isascii() or len(text) > 20:
        raise InvalidInput(f"{HEADER_LENGTH} must be a non-negative integer, got {header_length[:40]!r}")
    size = int(text)
    if size > len(body):
        raise InvalidInput(f"{HEADER_LENGTH} is {size} but the body has only {len(body)} bytes")
    view = memoryview(body)
    return body[:size] if size < len(body) else body, view[size:]


def _declared_size(parameters: dict[str, Any], where: str) -> int | None:
    size = parameters.get("binary_data_size")
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise InvalidInput(f"{where}: parameters.binary_data_size must be a non-negative integer")
    return size


def attach_binary(request: InferRequest, binary: memoryview) -> None:
    """Give every input that declares ``parameters.binary_data_size`` its part of ``binary``, in
    input order, as :class:`~app.protocols.infer.RawData` (a view: nothing is copied or
    decoded here; validation decodes it once the tensor's name, datatype and size are known to
    fit the model: :func:`app.protocols.infer.validate_inputs`).

    Raises:
        InvalidInput: a declared size is not a non-negative integer; sizes do not add up to
            the binary part's length; an input has both ``data`` and binary data, or neither;
            shared-memory parameters (not supported).
    """
    offset = 0
    for i, tensor in enumerate(request.inputs):
        where = f"inputs[{i}] ({tensor.name!r})"
        if "shared_memory_region" in tensor.parameters:
            raise InvalidInput(f"{where}: shared-memory tensors are not supported by this server")
        size = _declared_size(tensor.parameters, where)
        if size is None:
            if tensor.data is None:
                raise InvalidInput(f"{where}: no data: give data or parameters.binary_data_size")
            continue
        if tensor.data is not None:
            raise InvalidInput(f"{where}: both data and parameters.binary_data_size given")
        if size > len(binary) - offset:
            raise InvalidInput(
                f"{where}: binary_data_size {size} runs past the body ({len(binary) - offset} bytes left)"
            )
        tensor.data = RawData(binary[offset : offset + size])
        offset += size
    if offset != len(binary):
        raise InvalidInput(
            f"the body has {len(binary) - offset} bytes after the JSON header and the inputs' "
            f"binary_data_size; {HEADER_LENGTH} or a binary_data_size is wrong"
        )


def response_document(response: InferResponse) -> tuple[dict[str, Any], list[bytes]]:
    """The JSON object of ``response`` (``$inference_response``) and the binary chunks of the
    outputs marked binary, in order; JSON outputs keep numpy ``data`` for orjson to write."""
    body: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id is not None:
        body["id"] = response.id
    if response.parameters:
        body["parameters"] = response.parameters
    tensors: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for out in response.outputs:
        tensor: dict[str, Any] = {"name": out.name, "datatype": out.datatype, "shape": list(out.array.shape)}
        if out.binary:
            raw = tensor_bytes(out.array, out.datatype)
            tensor["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        elif out.datatype == "BYTES":
            tensor["data"] = [
                v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in out.array.ravel()
            ]
        else:
            tensor["data"] = np.ascontiguousarray(out.array).ravel()
        tensors.append(tensor)
    body["outputs"] = tensors
    return body, chunks
