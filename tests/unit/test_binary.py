"""Triton's binary tensor data extension in-process: codec unit tests, round trips through the
app, hostile binary bodies (hand-picked and hypothesis-fuzzed) -> 4xx, never 5xx."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.errors import InvalidInput, PayloadTooLarge
from app.models.repository import read_config
from app.protocols import tensors, v2
from app.protocols.infer import RawData
from app.protocols.tensors import RequestLimits
from app.serving.dataplane import validate_inputs
from tests.support.fixtures import Client, MakeClient
from tests.support.fuzz import FUZZ
from tests.support.toy_models import write_scale_model

HEADER = "Inference-Header-Content-Length"
V2_INFER = "/v2/models/scale/infer"


def bytes_tensor(values: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


def binary_body(header: dict[str, Any], *chunks: bytes) -> tuple[bytes, dict[str, str]]:
    head = json.dumps(header).encode()
    return head + b"".join(chunks), {HEADER: str(len(head)), "Content-Type": "application/octet-stream"}


def x_input(rows: int, size: object = None) -> dict[str, Any]:
    return {
        "name": "x", "shape": [rows, 2], "datatype": "FP32",
        "parameters": {"binary_data_size": rows * 8 if size is None else size},
    }  # fmt: skip


def split_response(raw: bytes, header_length: str | None) -> tuple[dict[str, Any], bytes]:
    if header_length is None:
        return json.loads(raw), b""
    n = int(header_length)
    return json.loads(raw[:n]), raw[n:]


# --- codec ---------------------------------------------------------------------------------


def test_bytes_round_trip_and_every_bad_length() -> None:
    values = [b"", b"a", "héllo".encode(), b"\x00\xff" * 10]
    raw = bytes_tensor(values)
    out = tensors.deserialize_bytes(memoryview(raw), 4, "t", 1000)
    assert out.dtype == object and list(out) == values
    assert tensors.serialize_bytes(out) == raw
    with pytest.raises(InvalidInput, match="ends inside element 4"):
        tensors.deserialize_bytes(memoryview(raw), 5, "t", 1000)
    with pytest.raises(InvalidInput, match="bytes left after 3"):
        tensors.deserialize_bytes(memoryview(raw), 3, "t", 1000)
    with pytest.raises(InvalidInput, match="declares 4294967295 bytes"):
        tensors.deserialize_bytes(memoryview(b"\xff\xff\xff\xff"), 1, "t", 2**33)
    with pytest.raises(PayloadTooLarge, match="SCORING_MAX_STRING_BYTES"):
        tensors.deserialize_bytes(memoryview(raw), 4, "t", 5)


@pytest.mark.parametrize(
    ("value", "fragment"),
    [("abc", "non-negative integer"), ("-1", "non-negative integer"), ("1e3", "non-negative integer"),
     ("", "non-negative integer"), ("99999999999999999999999", "non-negative integer"),
     ("٣", "non-negative integer"), ("100", "only 10 bytes")],
)  # fmt: skip
def test_split_body_rejects_bad_header_lengths(value: str, fragment: str) -> None:
    with pytest.raises(InvalidInput, match=fragment):
        v2.split_body(b"0123456789", value)


def test_attach_binary_keeps_views_and_validation_decodes_with_frombuffer(tmp_path: Path) -> None:
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    body, headers = binary_body({"inputs": [x_input(3)]}, x.tobytes())
    head, rest = v2.split_body(body, headers[HEADER])
    request = v2.decode_request(head, "scale")
    v2.attach_binary(request, rest)
    assert isinstance(request.inputs[0].data, RawData)  # nothing decoded yet
    config = read_config(write_scale_model(tmp_path, "scale"))
    data = validate_inputs(config, request, RequestLimits())["x"]
    assert data.dtype == np.float32 and data.flags.writeable
    np.testing.assert_array_equal(data, x)
    with pytest.raises(PayloadTooLarge, match="3 items"):
        validate_inputs(config, request, RequestLimits(max_items=2))


# --- through the app -----------------------------------------------------------------------


@pytest.fixture
async def client(make_client: MakeClient, tmp_path: Path) -> Client:
    write_scale_model(tmp_path, "scale")
    made: Client = await make_client(tmp_path, max_items_per_request=64, max_string_bytes=64)
    return made


async def test_binary_inputs_and_outputs_match_the_json_path(client: Client) -> None:
    x = np.array([[1.5, -2.0], [3.0, 4.25]], dtype=np.float32)
    tags = [b"abc", "héllo".encode()]
    header = {
        "id": "b-1",
        "inputs": [x_input(2), {"name": "tag", "shape": [2, 1], "datatype": "BYTES",
                                "parameters": {"binary_data_size": len(bytes_tensor(tags))}}],
        "parameters": {"binary_data_output": True},
    }  # fmt: skip
    body, headers = binary_body(header, x.tobytes(), bytes_tensor(tags))
    resp = await client.post(V2_INFER, data=body, headers=headers)
    assert resp.status == 200, await resp.text()
    assert resp.content_type == "application/octet-stream"
    doc, rest = split_response(await resp.read(), resp.headers.get(HEADER))
    assert doc["id"] == "b-1" and [o["name"] for o in doc["outputs"]] == ["y", "tag_length"]
    y_meta, len_meta = doc["outputs"]
    assert "data" not in y_meta and y_meta["parameters"]["binary_data_size"] == 16
    y = np.frombuffer(rest[:16], dtype="<f4").reshape(y_meta["shape"])
    lengths = np.frombuffer(rest[16:], dtype="<i8").reshape(len_meta["shape"])
    assert len(rest) == 16 + len_meta["parameters"]["binary_data_size"]

    as_json = {"inputs": [{"name": "x", "shape": [2, 2], "datatype": "FP32", "data": x.ravel().tolist()},
                          {"name": "tag", "shape": [2, 1], "datatype": "BYTES", "data": ["abc", "héllo"]}]}  # fmt: skip
    expected = await (await client.post(V2_INFER, json=as_json)).json()
    np.testing.assert_array_equal(y.ravel(), expected["outputs"][0]["data"])
    np.testing.assert_array_equal(lengths.ravel(), expected["outputs"][1]["data"])


async def test_per_output_binary_choice_overrides_the_default(client: Client) -> None:
    x = np.ones((1, 2), dtype=np.float32)
    header = {
        "inputs": [x_input(1)],
        "outputs": [{"name": "tag_length", "parameters": {"binary_data": False}}, {"name": "y"}],
        "parameters": {"binary_data_output": True},
    }
    body, headers = binary_body(header, x.tobytes())
    resp = await client.post(V2_INFER, data=body, headers=headers)
    doc, rest = split_response(await resp.read(), resp.headers.get(HEADER))
    assert doc["outputs"][0] == {"name": "tag_length", "datatype": "INT64", "shape": [1, 1], "data": [0]}
    assert doc["outputs"][1]["parameters"] == {"binary_data_size": 8}
    np.testing.assert_array_equal(np.frombuffer(rest, dtype="<f4"), [2, 2])
    # no binary output asked for: a plain JSON answer without the header
    body, headers = binary_body({"inputs": [x_input(1)]}, x.tobytes())
    resp = await client.post(V2_INFER, data=body, headers=headers)
    assert resp.content_type == "application/json" and HEADER not in resp.headers
    assert (await resp.json())["outputs"][0]["data"] == [2, 2]


async def test_json_sent_as_octet_stream_or_without_type_is_accepted(client: Client) -> None:
    payload = json.dumps({"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]})
    for headers in ({"Content-Type": "application/octet-stream"}, {}):
        resp = await client.post(
            V2_INFER, data=payload.encode(), headers=headers, skip_auto_headers={"Content-Type"}
        )
        assert resp.status == 200, await resp.text()


X2 = np.ones((2, 2), dtype=np.float32).tobytes()
TAG_OK = {"name": "tag", "shape": [2], "datatype": "BYTES", "parameters": {"binary_data_size": 14}}


@pytest.mark.parametrize(
    ("header", "chunks", "declared", "status", "fragment"),
    [
        ({"inputs": [x_input(2, 15)]}, [X2[:-1]], None, 400, "15 bytes of data != 4 elements"),
        ({"inputs": [x_input(2, 17)]}, [X2], None, 400, "runs past the body"),
        ({"inputs": [x_input(2, -1)]}, [X2], None, 400, "non-negative integer"),
        ({"inputs": [x_input(2, 2**62)]}, [X2], None, 400, "runs past the body"),
        ({"inputs": [x_input(2, "16")]}, [X2], None, 400, "non-negative integer"),
        ({"inputs": [x_input(2)]}, [X2, b"extra"], None, 400, "bytes after the JSON header"),
        ({"inputs": [x_input(2)]}, [X2[:-1]], None, 400, "runs past the body"),
        ({"inputs": [x_input(2)]}, [X2], 10**9, 400, "only"),
        ({"inputs": [x_input(2)]}, [X2], "x1", 400, "non-negative integer"),
        ({"inputs": [x_input(2)]}, [X2], 3, 400, "invalid inference request"),
        ({"inputs": [{**x_input(2), "data": [1, 2, 3, 4]}]}, [X2], None, 400, "both data and"),
        ({"inputs": [{"name": "x", "shape": [2, 2], "datatype": "FP32"}]}, [], None, 400, "no data"),
        ({"inputs": [{**x_input(2), "shape": [2**40, 2]}]}, [X2], None, 413, "items"),
        ({"inputs": [{**x_input(2), "shape": [-2, 2]}]}, [X2], None, 400, "non-negative"),
        ({"inputs": [{**x_input(2), "datatype": "FP64"}]}, [X2], None, 400, "FP64 but model scale expects FP32"),
        ({"inputs": [{**x_input(2), "datatype": "BF16"}]}, [X2], None, 400, "BF16 but model scale expects FP32"),
        (
            {"inputs": [{**x_input(2), "parameters": {"shared_memory_region": "r"}}]},
            [X2],
            None,
            400,
            "shared-memory",
        ),
        (
            {"inputs": [x_input(2), TAG_OK]},
            [X2, bytes_tensor([b"abcdef", b"ab"])[:14]],
            None,
            400,
            "declares 2 bytes",
        ),
        (
            {"inputs": [x_input(2), {**TAG_OK, "parameters": {"binary_data_size": 8}}]},
            [X2, struct.pack("<II", 2**32 - 1, 0)],
            None,
            400,
            "declares 4294967295",
        ),
        (
            {"inputs": [x_input(2), {**TAG_OK, "parameters": {"binary_data_size": 74}}]},
            [X2, bytes_tensor([b"a" * 65, b"b"])],
            None,
            413,
            "per string",
        ),
        (  # a huge declared BYTES shape is refused before anything is allocated for it
            {"inputs": [x_input(2), {**TAG_OK, "shape": [1, 2**40]}]},
            [X2, bytes_tensor([b"abcdef", b"ab"])[:14]],
            None,
            400,
            "holds more than the 64 elements",
        ),
        (
            {"inputs": [x_input(2)], "parameters": {"binary_data_output": "yes"}},
            [X2],
            None,
            400,
            "true or false",
        ),
        (
            {"inputs": [x_input(2)], "outputs": [{"name": "y", "parameters": {"binary_data": 1}}]},
            [X2],
            None,
            400,
            "true or false",
        ),
    ],
)
async def test_hostile_binary_bodies_get_a_clear_4xx(
    client: Client, header: dict[str, Any], chunks: list[bytes], declared: Any, status: int, fragment: str
) -> None:
    body, headers = binary_body(header, *chunks)
    if declared is not None:
        headers[HEADER] = str(declared)
    resp = await client.post(V2_INFER, data=body, headers=headers)
    assert resp.status == status, await resp.text()
    error = (await resp.json())["error"]
    assert fragment in error, error


async def test_compressed_binary_body_is_decoded(client: Client) -> None:
    import gzip

    x = np.array([[1, 2]], dtype=np.float32)
    body, headers = binary_body({"inputs": [x_input(1)]}, x.tobytes())
    resp = await client.post(
        V2_INFER, data=gzip.compress(body), headers={**headers, "Content-Encoding": "gzip"}
    )
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["outputs"][0]["data"] == [2, 4]


# --- fuzz ----------------------------------------------------------------------------------

ASCII = st.characters(min_codepoint=33, max_codepoint=126)
sizes = (
    st.integers(-3, 40) | st.sampled_from([2**31, 2**32, 2**63, 2**64 + 1]) | st.text(max_size=3) | st.none()
)


@st.composite
def binary_requests(draw: st.DrawFn) -> tuple[bytes, dict[str, str]]:
    """Binary requests for the scale model, valid or wrong in every size: declared sizes, shapes,
    BYTES length prefixes, the header length, truncation."""
    rows = draw(st.integers(0, 4))
    x_shape = draw(st.sampled_from([[rows, 2], [rows], [rows, 2, 1], [2**40, 2]]))
    x_raw = draw(st.binary(min_size=rows * 8, max_size=rows * 8) | st.binary(max_size=40))
    inputs: list[dict[str, Any]] = [
        {"name": "x", "shape": x_shape, "datatype": draw(st.sampled_from(["FP32", "FP32", "BOOL", "BYTES"])),
         "parameters": {"binary_data_size": draw(st.just(len(x_raw)) | sizes)}}
    ]  # fmt: skip
    chunks = [x_raw]
    if draw(st.booleans()):
        lengths = draw(st.lists(st.integers(0, 8) | st.sampled_from([2**31, 2**32 - 1]), max_size=5))
        tag_raw = b"".join(struct.pack("<I", n) + b"t" * min(n, 8) for n in lengths)
        tag_raw = tag_raw[: draw(st.integers(0, len(tag_raw)))] if draw(st.booleans()) else tag_raw
        inputs.append({"name": "tag", "shape": [draw(st.integers(0, 5))], "datatype": "BYTES",
                       "parameters": {"binary_data_size": draw(st.just(len(tag_raw)) | sizes)}})  # fmt: skip
        chunks.append(tag_raw)
    header: dict[str, Any] = {"inputs": inputs}
    if draw(st.booleans()):
        header["parameters"] = {"binary_data_output": draw(st.booleans() | st.integers())}
    head = json.dumps(header).encode()
    body = head + b"".join(chunks)
    body = body[: draw(st.integers(0, len(body)))] if draw(st.integers(0, 4)) == 0 else body
    declared = draw(
        st.just(str(len(head))) | st.integers(-5, len(body) + 5).map(str) | st.text(ASCII, max_size=4)
    )
    return body, {HEADER: declared, "Content-Type": "application/octet-stream"}


@FUZZ
@given(request=binary_requests())
async def test_fuzzed_binary_bodies_never_5xx(
    client: Client, request: tuple[bytes, dict[str, str]]
) -> None:
    body, headers = request
    resp = await client.post(V2_INFER, data=body, headers=headers)
    raw = await resp.read()
    assert resp.status < 500, (resp.status, raw[:300], body[:300], headers)
    if resp.status >= 400:
        assert set(json.loads(raw)) == {"error"}
    else:
        split_response(raw, resp.headers.get(HEADER))
