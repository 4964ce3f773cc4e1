"""Inputs shared by a request's items (``shared`` in model.toml): sent once with batch dimension
1, over V2 JSON, V2 binary and gRPC; the demo feed-ranker's answer with its ``user`` sent once
equals the answer with it repeated; a handler that takes it ``once`` sees each distinct row once
and each item's row."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from app.errors import InvalidInput, ModelLoadError
from app.grpc.codec import decode_request
from app.models.base import distinct_rows, shared_rows
from app.models.repository import TensorSpec, read_config
from app.protocols.tensors import RequestLimits
from app.serving.dataplane import validate_inputs
from tests.support.fixtures import MakeClient
from tests.support.gunicorn import ROOT
from tests.support.toy_models import write_handler_toml

RANKER = ROOT / "model_repository" / "feed-ranker"


def body(features: np.ndarray, user: np.ndarray, binary: bool = False) -> tuple[bytes, dict[str, str]]:
    """A V2 request of ``features`` ``[N, 32]`` and ``user`` ``[1 or N, 32]``: JSON, or with
    Triton's binary tensor data."""
    tensors = [("features", features), ("user", user)]
    if not binary:
        doc = {"inputs": [{"name": n, "datatype": "FP32", "shape": list(a.shape), "data": a.ravel().tolist()}
                          for n, a in tensors]}  # fmt: skip
        return json.dumps(doc).encode(), {"Content-Type": "application/json"}
    raw = [a.astype("<f4").tobytes() for _, a in tensors]
    inputs = [{"name": n, "datatype": "FP32", "shape": list(a.shape), "parameters": {"binary_data_size": len(r)}}
              for (n, a), r in zip(tensors, raw, strict=True)]  # fmt: skip
    head = json.dumps({"inputs": inputs}).encode()
    return head + b"".join(raw), {"Inference-Header-Content-Length": str(len(head))}


@pytest.fixture
def ranker_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    shutil.copytree(RANKER, repo / "feed-ranker")
    return repo


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
async def test_the_feed_rankers_user_sent_once_answers_as_repeated(
    ranker_repo: Path, make_client: MakeClient, binary: bool
) -> None:
    client = await make_client(ranker_repo)
    rng = np.random.default_rng(0)
    features = rng.random((40, 32), dtype=np.float32)
    user = rng.random((1, 32), dtype=np.float32)
    answers = []
    for sent in (user, np.repeat(user, 40, axis=0)):
        data, headers = body(features, sent, binary)
        resp = await client.post("/v2/models/feed-ranker/infer", data=data, headers=headers)
        assert resp.status == 200, await resp.text()
        answers.append((await resp.json())["outputs"][0]["data"])
    assert answers[0] == answers[1]
    without = await client.post("/v2/models/feed-ranker/infer", data=body(features, np.zeros((1, 32), np.float32))[0],
                                headers={"Content-Type": "application/json"})  # fmt: skip
    assert (await without.json())["outputs"][0]["data"] != answers[0]  # the user changes the answer
    bad, headers = body(features, np.repeat(user, 3, axis=0))
    resp = await client.post("/v2/models/feed-ranker/infer", data=bad, headers=headers)
    assert resp.status == 400 and "batch size" in (await resp.json())["error"]  # 1 or N, not 3


def test_grpc_takes_a_shared_input_once() -> None:
    from app.grpc.generated import grpc_service_pb2 as pb

    config = read_config(RANKER)
    message = pb.ModelInferRequest(model_name="feed-ranker")
    for name, rows in (("features", 4), ("user", 1)):
        tensor = message.inputs.add(name=name, datatype="FP32", shape=[rows, 32])
        tensor.contents.fp32_contents.extend([float(rows)] * rows * 32)
    arrays = validate_inputs(config, decode_request(message, config, RequestLimits()), RequestLimits())
    assert arrays["features"].shape == (4, 32) and arrays["user"].shape == (4, 32)
    assert bool((arrays["user"] == 1.0).all())


def test_a_shared_once_input_is_refused_by_a_graph_model_and_on_an_output(tmp_path: Path) -> None:
    folder = tmp_path / "feed-ranker"
    shutil.copytree(RANKER, folder)
    toml = (folder / "model.toml").read_text()
    (folder / "model.toml").write_text(toml.replace('shared = "repeat"', 'shared = "once"'))
    with pytest.raises(ModelLoadError, match="only a handler takes"):
        read_config(folder)
    (folder / "model.toml").write_text(toml.replace('shape = [1]', 'shape = [1]\nshared = "repeat"'))
    with pytest.raises(ModelLoadError, match="shared applies to inputs only"):
        read_config(folder)


def test_distinct_rows_are_one_per_run_of_equal_rows() -> None:
    user = np.array([[1, 2], [1, 2], [1, 2], [3, 4], [3, 4], [1, 2]], np.float32)
    rows, index = distinct_rows(user)
    np.testing.assert_array_equal(rows, [[1, 2], [3, 4], [1, 2]])
    assert index.tolist() == [0, 0, 0, 1, 1, 2]
    np.testing.assert_array_equal(rows[index], user)
    texts = np.array([[b"a"], [b"a"], [b"b"]], dtype=object)
    rows, index = distinct_rows(texts)
    assert rows.ravel().tolist() == [b"a", b"b"] and index.tolist() == [0, 0, 1]


class OnceHandler:
    """y = x + sum(context); records the context rows and each item's row it was given."""

    SEEN: ClassVar[list[tuple[int, list[int]]]] = []

    def load(self, device: torch.device, config: Any) -> None:
        pass

    def preprocess(self, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        rows, index = inputs["context"], inputs[shared_rows("context")]
        self.SEEN.append((len(rows), index.tolist()))
        y: np.ndarray = inputs["x"] + rows.sum(axis=1, keepdims=True)[index]
        return y

    def predict(self, y: np.ndarray) -> np.ndarray:
        return y

    def postprocess(self, y: np.ndarray) -> dict[str, np.ndarray]:
        return {"y": y}


async def test_a_handler_takes_a_shared_input_once_per_request(tmp_path: Path, make_client: MakeClient) -> None:
    import asyncio

    repo = tmp_path / "repo"
    write_handler_toml(
        repo, "once", "tests.unit.test_shared_inputs:OnceHandler",
        [TensorSpec("x", "FP32", [1]), TensorSpec("context", "FP32", [2], shared="once")],
        [TensorSpec("y", "FP32", [1])], max_batch_size=16, max_queue_delay_ms=20.0,
    )  # fmt: skip
    client = await make_client(repo)
    OnceHandler.SEEN.clear()

    async def send(xs: list[float], context: list[float]) -> list[float]:
        doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [len(xs), 1], "data": xs},
                          {"name": "context", "datatype": "FP32", "shape": [1, 2], "data": context}]}  # fmt: skip
        resp = await client.post("/v2/models/once/infer", json=doc)
        assert resp.status == 200, await resp.text()
        data: list[float] = (await resp.json())["outputs"][0]["data"]
        return data

    first, second = await asyncio.gather(send([1.0, 2.0, 3.0], [10.0, 0.0]), send([5.0, 6.0], [100.0, 1.0]))
    assert first == [11.0, 12.0, 13.0] and second == [106.0, 107.0]
    batches = [seen for seen in OnceHandler.SEEN if sum(1 for _ in seen[1]) == 5]
    assert batches == [(2, [0, 0, 0, 1, 1])] or OnceHandler.SEEN[-2:] in (
        [(1, [0, 0, 0]), (1, [0, 0])], [(1, [0, 0]), (1, [0, 0, 0])]
    )  # one batch of both requests (each context once), or one batch each


def test_a_shared_input_of_another_batch_size_is_refused() -> None:
    from app.protocols.infer import InferInput, InferRequest

    config = read_config(RANKER)
    request = InferRequest("feed-ranker", [InferInput("features", "FP32", [4, 32], [0.0] * 128),
                                           InferInput("user", "FP32", [2, 32], [0.0] * 64)])  # fmt: skip
    with pytest.raises(InvalidInput, match="disagree on the batch size"):
        validate_inputs(config, request)
