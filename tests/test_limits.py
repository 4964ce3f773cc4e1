"""Request limits, each with its own 4xx JSON error: body size, items, string bytes, JSON
depth, header fields; keep-alive: requests per connection, Connection: close while draining."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from app.protocols.limits import check_json_depth
from app.serving.lifecycle import begin_drain
from app.serving.state import REGISTRY

V2 = "/v2/models/scale/infer"
V1 = "/v1/models/scale:predict"
JSON = {"Content-Type": "application/json"}


def v2_body(rows: int, tags: list[str] | None = None) -> dict[str, Any]:
    inputs = [{"name": "x", "shape": [rows, 2], "datatype": "FP32", "data": [[1.0, 2.0]] * rows}]
    if tags is not None:
        inputs.append({"name": "tag", "shape": [len(tags)], "datatype": "BYTES", "data": tags})
    return {"inputs": inputs}


async def error_of(resp: Any) -> str:
    assert resp.content_type == "application/json", await resp.text()
    body = await resp.json()
    assert set(body) == {"error"}
    return str(body["error"])


async def test_items_per_request_cap_both_protocols(make_client, scale_repo: Path) -> None:
    client = await make_client(scale_repo, max_items_per_request=3)
    assert (await client.post(V2, json=v2_body(3))).status == 200
    resp = await client.post(V2, json=v2_body(4))
    assert resp.status == 413
    assert "4 items" in await error_of(resp) and "SCORING_MAX_ITEMS_PER_REQUEST" in await error_of(resp)
    assert (await client.post(V1, json={"instances": [[1, 2]] * 3})).status == 200
    resp = await client.post(V1, json={"instances": [[1, 2]] * 4})
    assert resp.status == 413 and "at most 3" in await error_of(resp)


async def test_string_bytes_cap_counts_utf8_bytes(make_client, scale_repo: Path) -> None:
    client = await make_client(scale_repo, max_string_bytes=8)
    ok = await client.post(V2, json=v2_body(2, ["héllo", "12345678"]))  # 6 and 8 bytes
    assert ok.status == 200, await ok.text()
    resp = await client.post(V2, json=v2_body(2, ["ok", "ééééé"]))  # 10 bytes, 5 characters
    assert resp.status == 413
    message = await error_of(resp)
    assert "element 1 is 10 bytes" in message and "SCORING_MAX_STRING_BYTES" in message
    resp = await client.post(V1, json={"instances": [{"x": [1, 1], "tag": "x" * 9}]})
    assert resp.status == 413


async def test_json_depth_cap_before_decoding(make_client, scale_repo: Path) -> None:
    client = await make_client(scale_repo, max_json_depth=6)
    assert (await client.post(V2, json=v2_body(1))).status == 200  # depth 4
    deep = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [[[[[1]]]]]}]}
    resp = await client.post(V2, json=deep)
    assert resp.status == 400 and "deeper than 6" in await error_of(resp)
    resp = await client.post(V1, data=b'{"instances": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", headers=JSON)
    assert resp.status == 400 and "SCORING_MAX_JSON_DEPTH" in await error_of(resp)


async def test_deep_json_past_the_recursion_limit_is_a_400_not_a_500(make_client, scale_repo: Path) -> None:
    # A depth limit above Python's recursion limit leaves msgspec's RecursionError as the guard.
    client = await make_client(scale_repo, max_json_depth=1_000_000)
    for path in (V1, V2):
        body = b'{"inputs": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
        resp = await client.post(path, data=body, headers=JSON)
        assert resp.status == 400, await resp.text()


def test_json_depth_ignores_brackets_inside_strings() -> None:
    check_json_depth(b'{"a": [[1, 2], [3]], "b": {}}', 3)
    with pytest.raises(Exception, match="deeper than 2"):
        check_json_depth(b'{"a": [[1, 2], [3]], "b": {}}', 2)
    check_json_depth(b'["[[[[", "]]]]]]]]"]', 1)
    check_json_depth(b'["\\"[[[[", "\\\\", "[[["]', 1)  # escaped quote, escaped backslash
    check_json_depth(b"1", 0)
    check_json_depth(b'["' + b"[" * 1000 + b'"]', 2)  # a text full of brackets is fine
    with pytest.raises(Exception, match="deeper than 2"):
        check_json_depth(b"[[[1]]]", 2)


async def test_body_size_cap_is_a_json_413(make_client, scale_repo: Path) -> None:
    client = await make_client(scale_repo, max_request_bytes=4096)
    resp = await client.post(V2, data=b" " * 5000, headers=JSON)
    assert resp.status == 413 and "too large" in await error_of(resp)


async def test_header_limits_431_and_the_parser_backstop(make_client, scale_repo: Path) -> None:
    client = await make_client(scale_repo, max_header_bytes=512, max_headers=12)
    assert (await client.get("/v2/health/live", headers={"X-Big": "a" * 400})).status == 200
    resp = await client.get("/v2/health/live", headers={"X-Big": "a" * 600})
    assert resp.status == 431 and "'X-Big'" in await error_of(resp)
    many = {f"X-H{i}": "1" for i in range(12)}
    resp = await client.get("/v2/health/live", headers=many)
    assert resp.status == 431 and "SCORING_MAX_HEADERS" in await error_of(resp)
    resp = await client.get("/v2/models/" + "m" * 600)
    assert resp.status == 431 and "request line" in await error_of(resp)
    # Over twice the limit, aiohttp's parser refuses the header before the app sees it.
    resp = await client.get("/v2/health/live", headers={"X-Big": "a" * 1100})
    assert resp.status == 400


async def raw_requests(port: int, count: int) -> list[str]:
    """``count`` GETs on one keep-alive connection; each response's Connection header."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    seen = []
    try:
        for _ in range(count):
            writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            head = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
            length = int(head.split("content-length:")[1].split("\r\n")[0])
            await reader.readexactly(length)
            seen.append("close" if "connection: close" in head else "keep-alive")
            if seen[-1] == "close":
                assert await reader.read() == b""  # and the server closed it
                break
    finally:
        writer.close()
    return seen


async def test_requests_per_connection_cap(make_client, scale_repo: Path) -> None:
    client = await make_client(scale_repo, max_requests_per_connection=3)
    assert await raw_requests(client.port, 5) == ["keep-alive", "keep-alive", "close"]
    unlimited = await make_client(scale_repo, max_requests_per_connection=0)
    assert await raw_requests(unlimited.port, 5) == ["keep-alive"] * 5


async def test_draining_serves_but_closes_every_connection(make_client, scale_repo: Path) -> None:
    client = await make_client(scale_repo)
    assert await raw_requests(client.port, 2) == ["keep-alive", "keep-alive"]
    begin_drain(client.app, "test")
    assert client.app[REGISTRY].draining
    assert (await client.get("/v2/health/ready")).status == 503
    resp = await client.post(V2, json=v2_body(1))  # requests that still arrive are served
    assert resp.status == 200 and resp.headers["Connection"] == "close"
    assert json.loads(await resp.text())["outputs"][0]["data"] == [2.0, 4.0]
    assert await raw_requests(client.port, 2) == ["close"]
