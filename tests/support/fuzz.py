"""Hypothesis settings and request-body strategies for the fuzz tests of both protocols (HTTP and
gRPC), and their check: never a 5xx, and an error is a JSON ``{"error": ...}``."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from app.datatypes import DATATYPES
from tests.support.fixtures import Client

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


async def check(client: Client, path: str, payload: bytes, headers: dict[str, str] | None = None) -> None:
    resp = await client.post(
        path, data=payload, headers={"Content-Type": "application/json", **(headers or {})}
    )
    text = await resp.text()
    assert resp.status < 500, (resp.status, text, payload[:300])
    if resp.status == 400 and resp.content_type == "text/plain":
        return  # refused by aiohttp's HTTP parser before the app runs (app.http.edge)
    if resp.status >= 400:
        assert set(json.loads(text)) == {"error"}, text
