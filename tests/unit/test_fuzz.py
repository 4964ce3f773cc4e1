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
from hypothesis import given
from hypothesis import strategies as st

from tests.support.fixtures import Client, MakeClient
from tests.support.fuzz import FUZZ, check, json_values, near_valid_v2_bodies, v1_bodies, v2_bodies
from tests.support.toy_models import write_scale_model


@pytest.fixture
async def fuzz_client(make_client: MakeClient, tmp_path: Path) -> Client:
    write_scale_model(tmp_path, "scale")
    client: Client = await make_client(tmp_path, max_items_per_request=64, max_json_depth=8)
    return client


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
