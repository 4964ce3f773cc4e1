"""Hostile input, property-based (hypothesis): request bodies for both protocols, shaped like
valid requests and as arbitrary JSON or bytes, with invalid UTF-8 inside strings, shapes of
many dimensions, and corrupt compressed bodies, against the in-process app; never a 5xx,
always a JSON body."""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.datatypes import DATATYPES
from tests.conftest import Client, MakeClient
from tests.toy_models import write_scale_model

FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=40,
)
names = st.sampled_from(["x", "tag", "y", "", "X"]) | st.text(max_size=6)
datatypes = st.sampled_from(sorted(DATATYPES)) | st.text(max_size=6)
shapes = st.lists(st.integers(-2, 5) | st.sampled_from([2**31, 2**63 - 1]), max_size=4)
numbers = st.integers(-(2**70), 2**70) | st.floats() | st.booleans() | st.text(max_size=4)
data = st.lists(numbers | st.lists(numbers, max_size=4), max_size=12) | st.lists(
    st.text(max_size=12), max_size=6
)


@st.composite
def v2_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """Bodies with the V2 request's shape, valid or not in every field."""
    tensor: dict[str, Any] = {"name": draw(names), "shape": draw(shapes), "datatype": draw(datatypes), "data": draw(data)}
    if draw(st.booleans()):
        tensor["parameters"] = draw(st.dictionaries(st.text(max_size=5), scalars, max_size=2))
    body: dict[str, Any] = {"inputs": [tensor, *draw(st.lists(st.just(dict(tensor)), max_size=1))]}
    if draw(st.booleans()):
        body["id"] = draw(st.text(max_size=8) | st.integers())
    if draw(st.booleans()):
        body["parameters"] = {"timeout": draw(numbers | st.none())}
    if draw(st.booleans()):
        body["outputs"] = [{"name": draw(names)}]
    return body


@st.composite
def near_valid_v2_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """Valid requests for the scale model but for the values: any floats, any texts, off-by-one
    shapes, flat or nested data."""
    rows = draw(st.integers(0, 5))
    floats = st.floats() | st.integers(-(2**64), 2**64)
    values = draw(st.lists(floats, min_size=rows * 2, max_size=rows * 2 + draw(st.integers(0, 1))))
    nested = draw(st.booleans()) and len(values) == rows * 2
    x_data = [values[i : i + 2] for i in range(0, len(values), 2)] if nested else values
    shape = [rows + draw(st.sampled_from([0, 0, 0, 1, -1])), 2]
    inputs = [{"name": "x", "shape": shape, "datatype": "FP32", "data": x_data}]
    if draw(st.booleans()):
        texts = draw(st.lists(st.text(), min_size=rows, max_size=rows))
        inputs.append({"name": "tag", "shape": [rows], "datatype": "BYTES", "data": texts})
    return {"inputs": inputs}


@st.composite
def v1_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """Bodies with the V1 request's shape: instances of rows, objects or anything."""
    row = st.lists(numbers, max_size=4)
    instance = (
        row | st.fixed_dictionaries({"x": row}, optional={"tag": st.text(max_size=8) | numbers}) | json_values
    )
    return {"instances": draw(st.lists(instance, max_size=6))}


@pytest.fixture
async def fuzz_client(make_client: MakeClient, tmp_path: Path) -> Client:
    write_scale_model(tmp_path, "scale")
    client: Client = await make_client(tmp_path, max_items_per_request=64, max_json_depth=8)
    return client


async def check(client: Client, path: str, payload: bytes, headers: dict[str, str] | None = None) -> None:
    resp = await client.post(
        path, data=payload, headers={"Content-Type": "application/json", **(headers or {})}
    )
    text = await resp.text()
    assert resp.status < 500, (resp.status, text, payload[:300])
    if resp.status == 400 and resp.content_type == "text/plain":
        return  # refused by aiohttp's HTTP parser before the app runs (app.http.limits)
    if resp.status >= 400:
        assert set(json.loads(text)) == {"error"}, text


@FUZZ
@given(body=v2_bodies() | near_valid_v2_bodies())
async def test_v2_shaped_bodies_never_5xx(fuzz_client: Client, body: dict[str, Any]) -> None:
    await check(fuzz_client, "/v2/models/scale/infer", json.dumps(body).encode())


@FUZZ
@given(body=v1_bodies())
async def test_v1_shaped_bodies_never_5xx(fuzz_client: Client, body: dict[str, Any]) -> None:
    await check(fuzz_client, "/v1/models/scale:predict", json.dumps(body).encode())


@FUZZ
@given(value=json_values, path=st.sampled_from(["/v2/models/scale/infer", "/v1/models/scale:predict"]))
async def test_arbitrary_json_never_5xx(fuzz_client: Client, value: Any, path: str) -> None:
    await check(fuzz_client, path, json.dumps(value).encode())


@FUZZ
@given(
    raw=st.binary(max_size=200), path=st.sampled_from(["/v2/models/scale/infer", "/v1/models/scale:predict"])
)
async def test_arbitrary_bytes_never_5xx(fuzz_client: Client, raw: bytes, path: str) -> None:
    await check(fuzz_client, path, raw)


paths = st.sampled_from(["/v2/models/scale/infer", "/v1/models/scale:predict"])


@FUZZ
@given(body=v2_bodies() | v1_bodies(), junk=st.binary(min_size=1, max_size=4), where=st.integers(0, 10_000))
async def test_invalid_utf8_inside_strings_never_5xx(
    fuzz_client: Client, body: dict[str, Any], junk: bytes, where: int
) -> None:
    raw = json.dumps(body).encode()
    quotes = [i for i, c in enumerate(raw) if c == ord('"')]
    at = quotes[where % len(quotes)] + 1 if quotes else 0
    payload = raw[:at] + b"\xff" + junk + raw[at:]  # \xff never starts a UTF-8 sequence
    path = "/v2/models/scale/infer" if "inputs" in body else "/v1/models/scale:predict"
    await check(fuzz_client, path, payload)


@FUZZ
@given(dims=st.integers(20, 100), datatype=st.sampled_from(["FP32", "BYTES", "INT64"]))
async def test_shapes_of_many_dimensions_never_5xx(fuzz_client: Client, dims: int, datatype: str) -> None:
    value: Any = "a" if datatype == "BYTES" else 1
    body = {"inputs": [{"name": "x", "shape": [1] * dims, "datatype": datatype, "data": [value]}]}
    await check(fuzz_client, "/v2/models/scale/infer", json.dumps(body).encode())


@FUZZ
@given(
    raw=st.binary(max_size=300),
    encoding=st.sampled_from(["gzip", "br", "deflate", "x-gzip", "identity", "gzip, br", "bogus"]),
    path=paths,
)
async def test_corrupt_compressed_bodies_never_5xx(
    fuzz_client: Client, raw: bytes, encoding: str, path: str
) -> None:
    await check(fuzz_client, path, raw, {"Content-Encoding": encoding})


@FUZZ
@given(body=v2_bodies(), cut=st.integers(1, 60), encoding=st.sampled_from(["gzip", "deflate", "br"]))
async def test_truncated_compressed_bodies_never_5xx(
    fuzz_client: Client, body: dict[str, Any], cut: int, encoding: str
) -> None:
    raw = json.dumps(body).encode()
    if encoding == "br":
        import brotli

        packed = brotli.compress(raw)
    else:
        packed = gzip.compress(raw) if encoding == "gzip" else zlib.compress(raw)
    await check(
        fuzz_client,
        "/v2/models/scale/infer",
        packed[: max(1, len(packed) - cut)],
        {"Content-Encoding": encoding},
    )
