"""What README.md, docs/model-repository.md and docs/reliability.md say the server answers, asked
of the in-process app: README's error table, row by row (each row's case sent, its status
checked; a row without a case here fails), the extensions ``GET /v2`` lists, the status of a
request with more items than the model's ``queue_capacity``, and that of a deadline of ``inf``."""

from __future__ import annotations

import asyncio
import json
import math
import re
import struct
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from app.http.state import CORE
from tests.support.fixtures import eventually
from tests.support.gunicorn import ROOT
from tests.support.metrics import v2_body
from tests.support.toy_models import ScaleHandler, write_scale_model

Probe = Callable[[Any], Awaitable[Any]]


def section(text: str, title: str) -> str:
    """The Markdown section under the heading ``title``, to the next heading."""
    start = text.index(title)
    following = re.search(r"\n#+ ", text[start + len(title) :])
    return text[start : start + len(title) + following.start()] if following else text[start:]


def error_rows() -> list[tuple[str, str]]:
    """README's error table: (status, when) per row."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("<!-- error-table -->") : readme.index("<!-- /error-table -->")]
    rows = [line.strip("|").split("|") for line in table.splitlines() if line.startswith("| ")]
    return [(status.strip(), when.strip()) for status, when in rows[2:]]  # the header rows left out


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def binary_nan() -> tuple[bytes, dict[str, str]]:
    raw = struct.pack("<2f", math.nan, 1.0)
    head = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2],
                                   "parameters": {"binary_data_size": len(raw)}}]}).encode()  # fmt: skip
    return head + raw, {"Inference-Header-Content-Length": str(len(head))}


async def test_readmes_error_table_is_what_the_server_answers(make_client: Callable[..., Any], tmp_path: Path) -> None:
    write_scale_model(tmp_path, queue_capacity=8, max_batch_size=8, fail_on=13, oom_on=17, hang_on=5,
                      hang_gate="docs-table")  # fmt: skip
    write_scale_model(tmp_path, "slow", delay_ms=400, warmup_delay_ms=0)
    write_scale_model(tmp_path, "broken", refuse="a model that cannot load")
    gate = ScaleHandler.GATES["docs-table"] = threading.Event()
    client = await make_client(tmp_path, wait=False, max_request_bytes=65_536, max_items_per_request=16,
                               max_string_bytes=100)  # fmt: skip
    keyed = await make_client(tmp_path, wait=False, api_keys="secret")
    for app in (client.server.app, keyed.server.app):  # every model warm but the broken one
        registry = app[CORE].registry

        def settled(r: Any = registry) -> bool:
            return all(m.ready or m.error for m in r.entries()) and bool(r.failures())

        await eventually(settled)
    url = "/v2/models/scale/infer"

    async def queue_full(c: Any) -> Any:  # one batch holds the model; 8 items fill the queue
        unit = c.server.app[CORE].registry.get("scale").unit
        held = asyncio.create_task(c.post(url, json=v2_body(5.0)))
        await eventually(lambda: [5.0] in ScaleHandler.BATCHES["scale"])  # on the model, held
        queued = asyncio.create_task(c.post(url, json=v2_body(1.0, items=8)))
        await eventually(lambda: unit.queue.items == 8)
        resp = await c.post(url, json=v2_body(2.0))
        gate.set()
        await asyncio.gather(held, queued)
        return resp

    probes: dict[str, Probe] = {
        "a malformed JSON body": lambda c: c.post(url, data=b"{", headers={"Content-Type": "application/json"}),
        "JSON nested deeper than `SCORING_MAX_JSON_DEPTH`": lambda c: c.post(
            url, data=nested(40), headers={"Content-Type": "application/json"}),
        "a tensor of the wrong datatype": lambda c: c.post(url, json={"inputs": [
            {"name": "x", "shape": [1, 2], "datatype": "INT32", "data": [1, 1]}]}),
        "a tensor of the wrong shape": lambda c: c.post(url, json={"inputs": [
            {"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 1, 1]}]}),
        "a shape whose size does not match its data": lambda c: c.post(url, json={"inputs": [
            {"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [1, 1]}]}),
        "NaN or infinity in a float input (unless the model allows them)": lambda c: c.post(
            url, data=binary_nan()[0], headers=binary_nan()[1]),
        "a deadline that is not a positive finite number": lambda c: c.post(
            url, json=v2_body(1.0), headers={"X-Request-Timeout-Ms": "inf"}),
        "no valid API key (with `SCORING_API_KEYS` set)": lambda c: keyed.post(url, json=v2_body(1.0)),
        "an unknown model or version": lambda c: c.post("/v2/models/nope/infer", json=v2_body(1.0)),
        "a body over `SCORING_MAX_REQUEST_BYTES`": lambda c: c.post(
            url, data=b" " * 70_000, headers={"Content-Type": "application/json"}),
        "more items than `SCORING_MAX_ITEMS_PER_REQUEST`": lambda c: c.post(url, json=v2_body(1.0, items=17)),
        "more items than the model's `queue_capacity`": lambda c: c.post(url, json=v2_body(1.0, items=9)),
        "a string over `SCORING_MAX_STRING_BYTES`": lambda c: c.post(url, json={"inputs": [
            {"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 1]},
            {"name": "tag", "shape": [1, 1], "datatype": "BYTES", "data": ["t" * 200]}]}),
        "a content type other than JSON or `application/octet-stream`": lambda c: c.post(
            url, data=b"x", headers={"Content-Type": "text/plain"}),
        "header fields too large": lambda c: c.post(url, json=v2_body(1.0), headers={"X-Big": "x" * 9_000}),
        "the model itself raised (naming the model and the `X-Request-Id`)": lambda c: c.post(
            url, json=v2_body(13.0)),
        "the queue is full, or the backlog would not let the request finish in time": queue_full,
        "the model cannot serve: its load failed (the reason in the body), or it is unloading": lambda c: c.post(
            "/v2/models/broken/infer", json=v2_body(1.0)),
        "the deadline passed, or the request could not finish in time even alone": lambda c: c.post(
            "/v2/models/slow/infer", json=v2_body(1.0), headers={"X-Request-Timeout-Ms": "50"}),
        "one item does not fit in device memory even alone": lambda c: c.post(url, json=v2_body(17.0)),
    }  # fmt: skip
    rows = error_rows()
    assert {when for _, when in rows} == set(probes), "each row of README's error table needs its case here"
    for status, when in rows:
        resp = await probes[when](client)
        code = int(status.split()[0])
        assert resp.status == code, (when, resp.status, await resp.text())
        if "Retry-After" in status:
            assert resp.headers.get("Retry-After", "").isdigit(), when
        if code != 431:  # aiohttp's own parser answers those
            assert "error" in await resp.json(content_type=None), when


async def test_the_docs_say_what_the_server_answers(make_client: Callable[..., Any], tmp_path: Path) -> None:
    write_scale_model(tmp_path, queue_capacity=8)
    client = await make_client(tmp_path)
    readme = (ROOT / "README.md").read_text()

    served = (await (await client.get("/v2")).json())["extensions"]
    listed = re.search(r"`GET /v2` \(lists the extensions served:\s*(.*?)\)", readme, re.S)
    assert listed is not None and re.findall(r"`(\w+)`", listed.group(1)) == served

    row = next(line for line in (ROOT / "docs/model-repository.md").read_text().splitlines()
               if line.startswith("| `queue_capacity` |"))  # fmt: skip
    assert "(more: 413)" in row
    assert ("413", "more items than the model's `queue_capacity`") in error_rows()

    resp = await client.post("/v2/models/scale/infer", json=v2_body(1.0), headers={"X-Request-Timeout-Ms": "inf"})
    assert resp.status == 400
    deadlines = section((ROOT / "docs/reliability.md").read_text(), "### Deadline cap")
    assert "`inf`" in deadlines and "refused with 400" in deadlines
    assert not re.search(r"`inf`[^.]*clipped", deadlines)
