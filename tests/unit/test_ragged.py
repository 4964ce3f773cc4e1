"""Ragged outputs (``ragged = true`` in model.toml: the first item dimension differs per item)
through the whole core: the handler's rows checked against the declaration, carried per item
through batching, the response cache and a sibling's wire, and sent over V2 JSON and gRPC as the
rows end to end plus ``<name>_lengths``, over V1 as one nested list per item."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from app.datatypes import ragged
from app.errors import InferenceFailed
from app.grpc.codec import encode_response
from app.models.repository import TensorSpec
from app.protocols.infer import InferResponse, OutputTensor, lengths_name
from app.server import wire
from app.serving.runner import _output
from tests.support.fixtures import MakeClient
from tests.support.toy_models import NonzeroRowsHandler, write_ragged_model

ROWS = TensorSpec("rows", "FP32", [-1, 2], ragged=True)


def v2_body(*items: list[float]) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [len(items), len(items[0])], "data": list(items)}]}


def split_rows(outputs: list[dict[str, Any]]) -> list[np.ndarray]:
    by_name = {o["name"]: o for o in outputs}
    rows = np.asarray(by_name["rows"]["data"], np.float32).reshape(by_name["rows"]["shape"])
    lengths = by_name[lengths_name("rows")]["data"]
    assert by_name[lengths_name("rows")]["datatype"] == "INT64"
    return np.split(rows, np.cumsum(lengths)[:-1])


def test_a_handler_breaking_the_ragged_declaration_fails_its_batch_with_the_reason() -> None:
    good = _output("m", ROWS, [np.ones((3, 2)), np.ones((0, 2))], 2)
    assert good.dtype == object and [r.shape for r in good] == [(3, 2), (0, 2)]
    assert good[0].dtype == np.float32
    with pytest.raises(InferenceFailed, match="ragged output 'rows' has 1 rows for 2 items"):
        _output("m", ROWS, [np.ones((3, 2))], 2)
    with pytest.raises(InferenceFailed, match=r"an item of shape \[3, 5\]"):
        _output("m", ROWS, [np.ones((3, 5)), np.ones((1, 2))], 2)
    with pytest.raises(InferenceFailed, match=r"output 'y' has shape \[3\], .* \(a batch of 2\)"):
        _output("m", TensorSpec("y", "FP32", [1]), np.ones(3), 2)


def test_a_ragged_tensor_crosses_the_sibling_wire_whole() -> None:
    sent = ragged([np.arange(6, dtype=np.float32).reshape(3, 2), np.zeros((0, 2), np.float32)])
    tensor = msgspec.msgpack.decode(msgspec.msgpack.encode(wire.to_tensor(sent)), type=wire.Tensor)
    got = wire.from_tensor(tensor)
    assert got.dtype == object and len(got) == 2
    np.testing.assert_array_equal(got[0], sent[0])
    assert got[1].shape == (0, 2) and got[1].dtype == np.float32


def test_grpc_sends_a_ragged_output_as_rows_and_lengths() -> None:
    rows = ragged([np.ones((2, 2), np.float32), np.full((1, 2), 3, np.float32)])
    response = InferResponse("m", "1", [OutputTensor("rows", "FP32", rows, ragged=True)])
    message = encode_response(response, raw=False)
    assert [(o.name, list(o.shape)) for o in message.outputs] == [("rows", [3, 2]), ("rows_lengths", [2])]
    assert list(message.outputs[1].contents.int64_contents) == [2, 1]
    assert list(message.outputs[0].contents.fp32_contents) == [1, 1, 1, 1, 3, 3]


async def test_ragged_outputs_over_v2_and_v1_with_mixed_lengths_and_the_cache(
    tmp_path: Path, make_client: MakeClient
) -> None:
    repo = tmp_path / "repo"
    write_ragged_model(repo, response_cache=True)
    client = await make_client(repo, response_cache_path=tmp_path / "cache", response_cache_lookup_timeout_ms=60_000.0)
    items = [[1.0, 0.0, 3.0], [0.0, 0.0, 0.0], [5.0, 6.0, 7.0]]
    for attempt in range(2):  # computed, then (the same items) from the response cache
        resp = await client.post("/v2/models/ragged/infer", json=v2_body(*items))
        assert resp.status == 200, await resp.text()
        outputs = (await resp.json())["outputs"]
        got = split_rows(outputs)
        assert len(got) == 3, attempt
        for x, rows in zip(items, got, strict=True):
            np.testing.assert_array_equal(rows, NonzeroRowsHandler.expected(x))
        counts = next(o for o in outputs if o["name"] == "count")["data"]
        assert counts == [2, 0, 3]
    stats = (await (await client.get("/v2/models/ragged/stats")).json())["model_stats"][0]["inference_stats"]
    assert (stats["cache_hit"]["count"], stats["cache_miss"]["count"]) == (3, 3)  # the second came cached
    resp = await client.post("/v1/models/ragged:predict", json={"instances": [[2.0, 0.0]]})
    assert resp.status == 200, await resp.text()
    prediction = (await resp.json())["predictions"][0]
    assert prediction["rows"] == [[2.0, 4.0]] and prediction["count"] == [1]
    metadata = await (await client.get("/v2/models/ragged")).json()
    assert {"name": "rows_lengths", "datatype": "INT64", "shape": [-1]} in metadata["outputs"]
    assert {"name": "rows", "datatype": "FP32", "shape": [-1, 2]} in metadata["outputs"]


async def test_a_variable_dimension_model_answers_1000_mixed_requests_at_c16(
    tmp_path: Path, make_client: MakeClient
) -> None:
    """Requests of different lengths never share a batch (a batch of unequal rows could not be
    stacked; before, the first such batch ended the serving loop for good)."""
    import asyncio
    import random

    repo = tmp_path / "repo"
    write_ragged_model(repo)
    client = await make_client(repo)
    rng = random.Random(3)
    bodies = [[[float(rng.randint(0, 2)) for _ in range(n)] for _ in range(rng.randint(1, 3))]
              for n in (rng.randint(1, 6) for _ in range(1000))]  # fmt: skip
    gate = asyncio.Semaphore(16)
    NonzeroRowsHandler.SHAPES.clear()

    async def one(items: list[list[float]]) -> None:
        async with gate:
            resp = await client.post("/v2/models/ragged/infer", json=v2_body(*items))
            assert resp.status == 200, await resp.text()
            for x, rows in zip(items, split_rows((await resp.json())["outputs"]), strict=True):
                np.testing.assert_array_equal(rows, NonzeroRowsHandler.expected(x))

    await asyncio.gather(*(one(b) for b in bodies))
    assert len(NonzeroRowsHandler.SHAPES) < 1000  # requests of one length still share batches
    ready = await client.get("/v2/models/ragged/ready")
    assert ready.status == 200
