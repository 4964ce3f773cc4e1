"""Request limits, each with its own 4xx JSON error: body size, items, string bytes, JSON
depth, header fields, body time (408), undecodable bodies (400), aborted uploads (499, not
500); deadline caps; keep-alive: requests per connection, Connection: close while draining."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import threading
import time
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from app.http.state import CORE
from app.models.repository import read_config
from app.protocols.jsonbody import check_json_depth
from app.protocols.tensors import RequestLimits
from app.serving.dataplane import DataPlane
from app.serving.registry import ModelRegistry, ModelVersion
from app.serving.siblings import Alone
from app.settings import Settings
from tests.support.fixtures import Client, MakeClient, eventually, hold, measured, served
from tests.support.toy_models import ScaleHandler, write_scale_model

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


async def test_items_per_request_cap_both_protocols(make_client: MakeClient, scale_repo: Path) -> None:
    client: Client = await make_client(scale_repo, max_items_per_request=3)
    assert (await client.post(V2, json=v2_body(3))).status == 200
    resp = await client.post(V2, json=v2_body(4))
    assert resp.status == 413
    assert "4 items" in await error_of(resp) and "SCORING_MAX_ITEMS_PER_REQUEST" in await error_of(resp)
    assert (await client.post(V1, json={"instances": [[1, 2]] * 3})).status == 200
    resp = await client.post(V1, json={"instances": [[1, 2]] * 4})
    assert resp.status == 413 and "at most 3" in await error_of(resp)


async def test_string_bytes_cap_counts_utf8_bytes(make_client: MakeClient, scale_repo: Path) -> None:
    client: Client = await make_client(scale_repo, max_string_bytes=8)
    ok = await client.post(V2, json=v2_body(2, ["héllo", "12345678"]))  # 6 and 8 bytes
    assert ok.status == 200, await ok.text()
    resp = await client.post(V2, json=v2_body(2, ["ok", "ééééé"]))  # 10 bytes, 5 characters
    assert resp.status == 413
    message = await error_of(resp)
    assert "element 1 is 10 bytes" in message and "SCORING_MAX_STRING_BYTES" in message
    resp = await client.post(V1, json={"instances": [{"x": [1, 1], "tag": "x" * 9}]})
    assert resp.status == 413


async def test_json_depth_cap_before_decoding(make_client: MakeClient, scale_repo: Path) -> None:
    client: Client = await make_client(scale_repo, max_json_depth=6)
    assert (await client.post(V2, json=v2_body(1))).status == 200  # depth 4
    deep = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [[[[[1]]]]]}]}
    resp = await client.post(V2, json=deep)
    assert resp.status == 400 and "deeper than 6" in await error_of(resp)
    resp = await client.post(
        V1, data=b'{"instances": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", headers=JSON
    )
    assert resp.status == 400 and "SCORING_MAX_JSON_DEPTH" in await error_of(resp)


async def test_deep_json_past_the_recursion_limit_is_a_400_not_a_500(
    make_client: MakeClient, scale_repo: Path
) -> None:
    # A depth limit above Python's recursion limit leaves msgspec's RecursionError as the guard.
    client: Client = await make_client(scale_repo, max_json_depth=1_000_000)
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


async def test_body_size_cap_is_a_json_413(make_client: MakeClient, scale_repo: Path) -> None:
    client: Client = await make_client(scale_repo, max_request_bytes=4096)
    resp = await client.post(V2, data=b" " * 5000, headers=JSON)
    assert resp.status == 413 and "too large" in await error_of(resp)


async def test_header_limits_431_and_the_parser_backstop(make_client: MakeClient, scale_repo: Path) -> None:
    client: Client = await make_client(scale_repo, max_header_bytes=512, max_headers=12)
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


def port_of(client: Client) -> int:
    """The TCP port the in-process server listens on."""
    assert client.port is not None
    return client.port


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


async def test_requests_per_connection_cap(make_client: MakeClient, scale_repo: Path) -> None:
    client: Client = await make_client(scale_repo, max_requests_per_connection=3)
    assert await raw_requests(port_of(client), 5) == ["keep-alive", "keep-alive", "close"]
    unlimited: Client = await make_client(scale_repo, max_requests_per_connection=0)
    assert await raw_requests(port_of(unlimited), 5) == ["keep-alive"] * 5


def _infer_bytes() -> bytes:
    """One raw HTTP/1.1 inference request for the scale model."""
    body = json.dumps(v2_body(1)).encode()
    head = (
        f"POST {V2} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


LIVE = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"


async def _on_one_connection(
    client: Client, requests: list[bytes]
) -> tuple[list[tuple[int, str, float]], bytes]:
    """``requests`` sent back to back on one connection, each as soon as the previous answer
    came: [(status, connection header, seconds to the answer)], and what the connection gives
    after them within 0.5 s (b"" once the server closed it)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(client))
    seen = []
    try:
        for request in requests:
            sent = time.perf_counter()
            writer.write(request)
            head = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
            await reader.readexactly(int(head.split("content-length:")[1].split("\r\n")[0]))
            took = time.perf_counter() - sent
            status = int(head.split()[1])
            seen.append((status, "close" if "connection: close" in head else "keep-alive", took))
        try:
            after = await asyncio.wait_for(reader.read(), 0.5)
        except TimeoutError:
            after = b"(open)"
    finally:
        writer.close()
    return seen, after


async def _refused_twice(client: Client) -> tuple[list[tuple[int, str]], float, bytes]:
    """Two refused requests back to back on one connection (the second inside the first's
    Retry-After): [(status, connection header)], the second answer's seconds, and what the
    connection gives after them within 0.5 s (b"" once the server closed it)."""
    seen, after = await _on_one_connection(client, [_infer_bytes()] * 2)
    return [(status, conn) for status, conn, _ in seen], seen[-1][2], after


@contextlib.asynccontextmanager
async def busy(client: Client) -> AsyncIterator[None]:
    """The model held on a batch of one item with a full batch queued behind it, at 0.1 s per
    item: a new request (1 s deadline) would wait ~1 s, past the 0.8 s admission headroom,
    though alone it would take 0.1 s: refused with 503 + Retry-After."""
    batcher = served(client.app, "scale")
    held = hold(client.app, "scale")
    one = v2_body(1)
    tasks = [asyncio.create_task(client.post(V2, json=one, headers={"X-Request-Timeout-Ms": "30000"}))]
    await eventually(lambda: batcher.running_batch is not None)
    tasks += [
        asyncio.create_task(client.post(V2, json=one, headers={"X-Request-Timeout-Ms": "30000"}))
        for _ in range(batcher.max_batch_size)
    ]
    await eventually(lambda: batcher.queue.items == batcher.max_batch_size)
    measured(batcher).rate.item_s, measured(batcher).rate.overhead_s = 0.1, 0.0
    try:
        yield
    finally:
        held.set()
        for task in tasks:
            (await task).release()


async def test_a_client_that_ignores_retry_after_is_held(make_client: MakeClient, scale_repo: Path) -> None:
    client: Client = await make_client(scale_repo, request_timeout_ms=1000, impatient_hold_ms=200.0)
    async with busy(client):
        seen, took, after = await _refused_twice(client)
    # the impatient 503 waits out the hold and keeps the connection (no reconnect to pay)
    assert seen == [(503, "keep-alive"), (503, "keep-alive")]
    assert took >= 0.2
    assert after == b"(open)"


async def test_a_client_that_keeps_ignoring_retry_after_is_held_longer_each_time(
    make_client: MakeClient, scale_repo: Path
) -> None:
    client: Client = await make_client(
        scale_repo, request_timeout_ms=1000, impatient_hold_ms=100.0, impatient_hold_max_ms=200.0
    )
    infer = _infer_bytes()
    async with busy(client):
        seen, after = await _on_one_connection(client, [infer] * 4 + [LIVE, infer])
    statuses = [status for status, _, _ in seen]
    assert statuses == [503, 503, 503, 503, 200, 503]
    assert all(conn == "keep-alive" for _, conn, _ in seen) and after == b"(open)"
    first, once, twice, capped, _, again = (took for _, _, took in seen)
    assert first < 0.1  # the first refusal is sent at once
    assert once >= 0.1 and twice >= 0.2  # held 100 ms, then twice as long
    assert 0.2 <= capped < 0.35  # 200 ms at most, not 400
    # another answer on the connection (here a 200) ends the streak: held 100 ms again
    assert 0.1 <= again < 0.19


async def test_a_503_whose_retry_after_outlasts_the_keep_alive_closes_its_connection(
    make_client: MakeClient, scale_repo: Path
) -> None:
    # A client that waits the Retry-After would come back as the idle timer closes the
    # connection, and its request would be reset: such a 503 closes the connection itself.
    client: Client = await make_client(scale_repo, request_timeout_ms=1000, keepalive_s=1)
    async with busy(client):
        seen, after = await _on_one_connection(client, [_infer_bytes()])
    ((status, connection, _),) = seen
    assert (status, connection) == (503, "close") and after == b""


async def test_a_503_asks_a_wait_shorter_than_the_keep_alive_on_a_connection_kept_open(
    make_client: MakeClient, scale_repo: Path
) -> None:
    # A backlog of ~9 s: asked to wait as long, a polite client would come back as the idle timer
    # (5 s) closed the connection, and closing it at once would let an impatient client reconnect
    # and be refused as often as it likes, never held: the wait asked is cut to 4 s, the
    # connection kept, and the impatient client's next 503 held.
    client: Client = await make_client(scale_repo, request_timeout_ms=3000, keepalive_s=5)
    async with busy(client):
        measured(served(client.app, "scale")).rate.item_s = 1.0
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(client))
        try:
            heads = []
            for _ in range(2):
                writer.write(_infer_bytes())
                head = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
                await reader.readexactly(int(head.split("content-length:")[1].split("\r\n")[0]))
                heads.append(head)
        finally:
            writer.close()
    for head in heads:
        assert head.startswith("http/1.1 503") and "retry-after: 4\r\n" in head, head
        assert "connection: close" not in head


async def test_without_a_hold_an_impatient_client_pays_a_reconnect(
    make_client: MakeClient, scale_repo: Path
) -> None:
    client: Client = await make_client(scale_repo, request_timeout_ms=1000, impatient_hold_ms=0.0)
    async with busy(client):
        seen, _, after = await _refused_twice(client)
    assert seen == [(503, "keep-alive"), (503, "close")]
    assert after == b""  # the server closed the connection


async def test_draining_serves_but_closes_every_connection(make_client: MakeClient, scale_repo: Path) -> None:
    client: Client = await make_client(scale_repo)
    assert await raw_requests(port_of(client), 2) == ["keep-alive", "keep-alive"]
    client.app[CORE].registry.begin_drain("test")
    assert client.app[CORE].registry.draining
    assert (await client.get("/v2/health/ready")).status == 503
    resp = await client.post(V2, json=v2_body(1))  # requests that still arrive are served
    assert resp.status == 200 and resp.headers["Connection"] == "close"
    assert json.loads(await resp.text())["outputs"][0]["data"] == [2.0, 4.0]
    assert await raw_requests(port_of(client), 2) == ["close"]


# --- request bodies: time limit, aborted uploads, undecodable bodies ----------------------

# A grace equal to the body timer's tick (0.5 s): the timer fires as the timeout expires.
SLOW = {"body_timeout_s": 5.0, "body_grace_s": 0.5, "min_body_rate_bytes_s": 1000.0}


def raw_post(body: bytes, *headers: bytes, length: int | None = None) -> bytes:
    """A POST of ``body`` to the V2 endpoint; Content-Length ``length`` (default: the body's)
    unless a Transfer-Encoding header is given."""
    head = [b"POST " + V2.encode() + b" HTTP/1.1", b"Host: x", b"Content-Type: application/json", *headers]
    if not any(h.lower().startswith(b"transfer-encoding") for h in headers):
        head.append(b"Content-Length: %d" % (len(body) if length is None else length))
    return b"\r\n".join(head) + b"\r\n\r\n" + body


async def exchange(port: int, data: bytes, timeout_s: float = 30.0) -> tuple[int, bytes]:
    """Send ``data`` and read until the server closes: (status, the whole response)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        async with asyncio.timeout(timeout_s):  # a bound for a broken server, not a measurement
            response = await reader.read()
    finally:
        writer.close()
    return int(response.split(b" ", 2)[1]), response


@pytest.mark.parametrize(
    "data",
    [
        raw_post(b'{"inputs": [', length=1000),  # 10 bytes, then nothing
        raw_post(b"{", length=10**9),  # a 1 GB Content-Length
        raw_post(b"FFFFFFFFFFFFFFFF\r\nabc", b"Transfer-Encoding: chunked"),  # a 2**64 chunk
    ],
    ids=["stalled", "huge-content-length", "huge-chunk"],
)
async def test_a_body_too_slow_is_408_and_the_connection_closes(
    make_client: MakeClient, scale_repo: Path, caplog: pytest.LogCaptureFixture, data: bytes
) -> None:
    client: Client = await make_client(scale_repo, **SLOW)
    status, response = await exchange(port_of(client), data)  # returns: the server closed it
    assert status == 408 and b"Connection: close" in response
    assert b"request body too slow" in response
    m = await (await client.get("/metrics")).text()
    assert 'scoring_requests_total{code="408",model="scale",protocol="v2",version="1"} 1.0' in m
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_a_body_at_the_minimum_rate_is_read(make_client: MakeClient, scale_repo: Path) -> None:
    client: Client = await make_client(scale_repo, **SLOW)
    body = json.dumps(v2_body(1)).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
    try:
        writer.write(raw_post(b"", b"Connection: close", length=len(body)))
        for i in range(0, len(body), 40):  # in pieces, each flushed to the socket
            writer.write(body[i : i + 40])
            await writer.drain()
        async with asyncio.timeout(30):
            response = await reader.read()
    finally:
        writer.close()
    assert response.startswith(b"HTTP/1.1 200"), response


async def test_an_aborted_upload_is_not_a_server_error(
    make_client: MakeClient, scale_repo: Path, caplog: pytest.LogCaptureFixture
) -> None:
    client: Client = await make_client(scale_repo)
    for _ in range(5):
        _, writer = await asyncio.open_connection("127.0.0.1", client.port)
        writer.write(raw_post(b'{"inputs": [', length=5000))
        await writer.drain()
        writer.transport.abort()  # a reset, mid-body

    aborted = 'scoring_requests_total{code="499",model="scale",protocol="v2",version="1"} 5.0'

    async def scraped() -> str | None:  # once the server has seen the five resets
        text = await (await client.get("/metrics")).text()
        return text if aborted in text else None

    metrics = await eventually(scraped, timeout_s=30)
    assert 'code="500"' not in metrics
    assert "Traceback" not in caplog.text and "ERROR" not in caplog.text


@pytest.mark.parametrize(
    ("encoding", "body"),
    [
        (b"gzip", b"\x1f\x8b\x08\x00not gzip at all"),
        (b"br", b"\x8b\x00not brotli"),
        (b"deflate", b"not deflate"),
    ],
)
async def test_a_corrupt_compressed_body_is_400(
    make_client: MakeClient, scale_repo: Path, caplog: pytest.LogCaptureFixture, encoding: bytes, body: bytes
) -> None:
    client: Client = await make_client(scale_repo)
    status, response = await exchange(port_of(client), raw_post(body, b"Content-Encoding: " + encoding))
    assert status == 400 and b"request body cannot be decoded" in response
    assert "Traceback" not in caplog.text


async def test_what_the_parser_refuses_is_its_400_without_a_traceback(
    make_client: MakeClient, scale_repo: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # zstd without backports.zstd, refused with the headers; a deflate body cut short, seen
    # at the end of the message: aiohttp's parser answers both before the app runs (a
    # plain-text 400, like the header backstop above), and its traceback is demoted.
    client: Client = await make_client(scale_repo)
    truncated = zlib.compress(json.dumps(v2_body(1)).encode())[:-4]
    for data in (
        raw_post(b"(\xb5/\xfd", b"Content-Encoding: zstd"),
        raw_post(truncated, b"Content-Encoding: deflate"),
    ):
        status, _ = await exchange(port_of(client), data)
        assert status == 400
    assert "Traceback" not in caplog.text and not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_invalid_utf8_and_too_many_dimensions_are_400(
    make_client: MakeClient, scale_repo: Path
) -> None:
    client: Client = await make_client(scale_repo)
    text = b'{"inputs":[{"name":"tag","shape":[1],"datatype":"BYTES","data":["\xff\xfe"]}]}'
    for path in (V2, V1):
        body = text if path == V2 else b'{"instances":[{"x":[1,2],"tag":"\xff"}]}'
        resp = await client.post(path, data=body, headers=JSON)
        assert resp.status == 400 and "UTF-8" in await error_of(resp)
    deep = {"inputs": [{"name": "x", "shape": [1] * 70, "datatype": "FP32", "data": [1.0]}]}
    resp = await client.post(V2, json=deep)
    assert resp.status == 400 and "70 dimensions" in await error_of(resp)


# --- deadlines: a client's deadline is clipped to the model's or the server's maximum ------


def test_effective_deadline_clips_to_the_model_then_the_server_maximum(tmp_path: Path) -> None:
    entry = ModelVersion(read_config(write_scale_model(tmp_path, "scale")))
    settings = Settings(model_repository=tmp_path, request_timeout_ms=2000, max_request_timeout_ms=5000)
    plane = DataPlane(ModelRegistry(), settings, RequestLimits(), Alone())
    arrival = 1000.0
    assert plane.deadline(entry, arrival, None) == arrival + 2.0
    assert plane.deadline(entry, arrival, arrival + 3.0) == arrival + 3.0
    for huge in (60.0, 1e308, math.inf):
        assert plane.deadline(entry, arrival, arrival + huge) == arrival + 5.0
    assert plane.deadline(entry, arrival, math.nan) == arrival + 2.0  # none given
    assert plane.deadline(entry, arrival, arrival - 1.0) == arrival + 2.0  # already past: none
    entry.config.max_timeout_ms = 500.0
    assert plane.deadline(entry, arrival, 1e308) == arrival + 0.5
    assert plane.deadline(entry, arrival, None) == arrival + 0.5  # the default is clipped too


async def test_a_huge_client_deadline_is_clipped(make_client: MakeClient, tmp_path: Path) -> None:
    gate = threading.Event()
    ScaleHandler.GATES["clip"] = gate
    write_scale_model(tmp_path, "scale", hang_on=7.0, hang_gate="clip")
    client: Client = await make_client(tmp_path, max_request_timeout_ms=200, hung_inference_s=0)
    stuck = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [7.0, 7.0]}]}
    try:
        resp = await client.post(V2, json=stuck, headers={"X-Request-Timeout-Ms": "1e308"})
        assert resp.status == 504 and "within 200 ms" in await error_of(resp)
        body = {**v2_body(1), "parameters": {"timeout": 1e300}}  # microseconds
        resp = await client.post(V2, json=body)  # behind a batch far past its expected time
        # the time left to the clipped deadline, not 1e300 us
        assert resp.status == 503 and re.search(r"of its (19\d|200) ms", await error_of(resp))
    finally:
        gate.set()


async def test_overload_is_refused_before_the_body_is_decoded(
    make_client: MakeClient, scale_repo: Path
) -> None:
    client: Client = await make_client(scale_repo, request_timeout_ms=1000)
    batcher = served(client.app, "scale")
    # An idle model: the request is decoded and judged in full (early refusal waits for a
    # storm: a full batch queued), so malformed JSON is the client's 400.
    resp = await client.post(V2, data=b"{not json at all", headers=JSON)
    assert resp.status == 400
    # Hold the inference thread and queue one full batch (one item per request).
    held = hold(client.app, "scale")
    one = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1.0, 2.0]}]}
    first = asyncio.create_task(client.post(V2, json=one))  # runs (and waits) first
    await eventually(lambda: batcher.running_batch is not None)
    queued = [asyncio.create_task(client.post(V2, json=one)) for _ in range(batcher.max_batch_size)]
    await eventually(lambda: batcher.queue.items == batcher.max_batch_size)
    measured(batcher).rate.item_s, measured(batcher).rate.overhead_s = 0.1, 0.0  # alone 0.1 s; behind: ~1 s
    resp = await client.post(V2, data=b"{not json at all", headers=JSON)
    assert resp.status == 503 and "cannot take another request" in await error_of(resp)
    assert int(resp.headers["Retry-After"]) >= 1
    # A deadline the work fits is judged by the full admission, after decoding: the 400.
    resp = await client.post(V2, data=b"{not json at all", headers={**JSON, "X-Request-Timeout-Ms": "60000"})
    assert resp.status == 400
    held.set()
    for task in [first, *queued]:
        (await task).release()
    m = await (await client.get("/metrics")).text()
    assert 'scoring_rejected_total{model="scale",reason="admission",version="1"} 1.0' in m
