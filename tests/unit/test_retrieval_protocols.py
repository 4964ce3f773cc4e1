"""The retrieval APIs' wire formats with hand-made ragged outputs (object arrays of per-item arrays,
as a sparse or multi-vector model returns them): TEI's ``/embed_sparse`` (its answer's shape,
top_k and threshold, what it refuses), the multi-vector extension of ``/v1/embeddings`` (a list of
vectors per input, float and base64), ``input_type`` to the models that take it; and rerank over a
ColBERT model's MaxSim ``score``."""

from __future__ import annotations

import base64

import numpy as np
import orjson
import pytest

from app.errors import InvalidInput, PayloadTooLarge
from app.models.repository import ModelConfig, TensorSpec
from app.protocols import openai, rerank, sparse
from app.protocols.tensors import RequestLimits


def _ragged(*arrays: np.ndarray) -> np.ndarray:
    out = np.empty(len(arrays), dtype=object)
    for i, array in enumerate(arrays):
        out[i] = array
    return out


def _config(outputs: list[TensorSpec], *, input_type: bool = True, truncates: bool = True) -> ModelConfig:
    inputs = [TensorSpec("text", "BYTES", [1]), TensorSpec("query", "BYTES", [1], optional=True)]
    if input_type:
        inputs.append(TensorSpec("input_type", "INT64", [1], optional=True))
    if truncates:
        inputs.append(TensorSpec("truncate_prompt_tokens", "INT64", [1], optional=True))
    return ModelConfig(name="m", format="handler", handler="h", inputs=inputs, outputs=outputs)


SPARSE = [
    TensorSpec("indices", "INT64", [-1], ragged=True),
    TensorSpec("values", "FP32", [-1], ragged=True),
    TensorSpec("tokens", "INT64", [1]),
]
COLBERT = [
    TensorSpec("embedding", "FP32", [-1, 4], ragged=True),
    TensorSpec("score", "FP32", [1]),
    TensorSpec("tokens", "INT64", [1]),
]


def _sparse_request(body: dict[str, object]) -> sparse.EmbedSparseRequest:
    return sparse.decode(orjson.dumps({"model": "m", **body}), RequestLimits())


def test_embed_sparse_answers_tei_shape_ids_ascending() -> None:
    request = _sparse_request({"inputs": ["a", "b"]})
    outputs = {
        "indices": _ragged(np.array([3, 17, 2040], np.int64), np.array([], np.int64)),
        "values": _ragged(np.array([0.5, 1.25, 0.1], np.float32), np.array([], np.float32)),
    }
    raw = sparse.encode(request, outputs)
    assert orjson.loads(raw) == [
        [{"index": 3, "value": 0.5}, {"index": 17, "value": 1.25}, {"index": 2040, "value": 0.1}],
        [],
    ]
    assert b'"value":0.1}' in raw  # float32's shortest form, not 0.10000000149011612


def test_top_k_and_threshold_prune_each_text_then_keep_ids_ascending() -> None:
    ids = np.array([1, 5, 9, 12, 30], np.int64)
    weights = np.array([0.2, 2.0, 0.7, 2.0, 0.05], np.float32)
    outputs = {"indices": _ragged(ids), "values": _ragged(weights)}
    top = orjson.loads(sparse.encode(_sparse_request({"inputs": "x", "top_k": 3}), outputs))
    assert [t["index"] for t in top[0]] == [5, 9, 12]  # the three largest, by id
    tie = orjson.loads(sparse.encode(_sparse_request({"inputs": "x", "top_k": 1}), outputs))
    assert [t["index"] for t in tie[0]] == [5]  # a tie: the lower id
    both = orjson.loads(
        sparse.encode(_sparse_request({"inputs": "x", "threshold": 0.5, "top_k": 2}), outputs)
    )
    assert [t["index"] for t in both[0]] == [5, 12]
    cut = orjson.loads(sparse.encode(_sparse_request({"inputs": "x", "threshold": 0.5}), outputs))
    assert [t["index"] for t in cut[0]] == [5, 9, 12]


def test_embed_sparse_request_reaches_the_model_as_its_inputs() -> None:
    config = _config(SPARSE)
    request = sparse.infer_request(
        config, _sparse_request({"inputs": ["a", "b", "c"], "input_type": "query", "truncate": True,
                                 "truncation_direction": "left"})
    )  # fmt: skip
    given = {t.name: t for t in request.inputs}
    assert given["text"].data == ["a", "b", "c"] and given["text"].shape == [3, 1]
    assert np.asarray(given["input_type"].data).tolist() == [[1]] * 3  # 1: a query
    assert np.asarray(given["truncate_prompt_tokens"].data).tolist() == [[-1]] * 3
    assert [o.name for o in request.outputs or []] == ["indices", "values"]
    right = sparse.infer_request(config, _sparse_request({"inputs": "a", "truncate": True}))
    assert [t.name for t in right.inputs] == ["text"]  # the model's own truncation
    document = sparse.infer_request(config, _sparse_request({"inputs": "a", "input_type": "document"}))
    assert np.asarray(document.inputs[1].data).tolist() == [[2]]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"inputs": []}, "non-empty list"),
        ({"inputs": "a", "top_k": 0}, "top_k must be a positive"),
        ({"inputs": "a", "prompt_name": "query"}, "prompt_name is not supported"),
        ({"inputs": "a", "input_type": "passage"}, "input_type"),
        ({"inputs": [[1, 2]]}, "token arrays"),
    ],
)
def test_embed_sparse_refuses(body: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        _sparse_request(body)


def test_embed_sparse_refuses_what_the_model_cannot_do() -> None:
    with pytest.raises(PayloadTooLarge, match="at most 2"):
        sparse.decode(b'{"model": "m", "inputs": ["a", "b", "c"]}', RequestLimits(max_items=2))
    dense = _config([TensorSpec("embedding", "FP32", [4])])
    with pytest.raises(InvalidInput, match="does not produce sparse embeddings"):
        sparse.infer_request(dense, _sparse_request({"inputs": "a"}))
    plain = _config(SPARSE, input_type=False, truncates=False)
    with pytest.raises(InvalidInput, match="declares no INT64 input 'input_type'"):
        sparse.infer_request(plain, _sparse_request({"inputs": "a", "input_type": "query"}))
    with pytest.raises(InvalidInput, match="truncate_prompt_tokens"):
        sparse.infer_request(
            plain, _sparse_request({"inputs": "a", "truncate": True, "truncation_direction": "Left"})
        )


def _embeddings_request(body: dict[str, object]) -> openai.EmbeddingRequest:
    return openai.decode(orjson.dumps({"model": "m", **body}), RequestLimits())


def test_a_multi_vector_model_answers_a_list_of_vectors_per_input() -> None:
    rows: list[np.ndarray] = [np.arange(12, dtype=np.float32).reshape(3, 4) / 10, np.ones((1, 4), np.float32)]
    outputs = {"embedding": _ragged(*rows), "tokens": np.array([[5], [3]], np.int64)}
    request = _embeddings_request({"input": ["a", "b"]})
    body = orjson.loads(openai.encode(request, "m", outputs))
    assert [d["index"] for d in body["data"]] == [0, 1] and body["usage"]["prompt_tokens"] == 8
    for got, want in zip(body["data"], rows, strict=True):
        np.testing.assert_array_equal(np.asarray(got["embedding"], np.float32), want)
    encoded = orjson.loads(
        openai.encode(_embeddings_request({"input": ["a", "b"], "encoding_format": "base64"}), "m", outputs)
    )
    for got, want in zip(encoded["data"], rows, strict=True):
        assert len(got["embedding"]) == len(want)
        decoded = np.stack([np.frombuffer(base64.b64decode(row), "<f4") for row in got["embedding"]])
        np.testing.assert_array_equal(decoded, want)


def test_embeddings_input_type_and_dimensions_for_a_multi_vector_model() -> None:
    config = _config(COLBERT)
    request = openai.infer_request(config, _embeddings_request({"input": ["q"], "input_type": "query"}))
    (given,) = [t for t in request.inputs if t.name == "input_type"]
    assert np.asarray(given.data).tolist() == [[1]]
    with pytest.raises(InvalidInput, match="multi-vector embeddings"):
        openai.infer_request(config, _embeddings_request({"input": ["q"], "dimensions": 2}))
    dense = _config([TensorSpec("embedding", "FP32", [4])], input_type=False)
    with pytest.raises(InvalidInput, match="input_type"):
        openai.infer_request(dense, _embeddings_request({"input": ["q"], "input_type": "document"}))


def test_rerank_ranks_by_a_colbert_models_maxsim_score() -> None:
    config = _config(COLBERT)
    request = rerank.decode(b'{"model": "m", "query": "q", "documents": ["a", "b", "c"]}', RequestLimits())
    inputs = {t.name: t for t in rerank.infer_request(config, request).inputs}
    assert inputs["query"].data == ["q"] * 3 and inputs["text"].data == ["a", "b", "c"]
    outputs = {"score": np.array([[3.5], [9.25], [1.0]], np.float32), "tokens": np.array([[4], [4], [4]])}
    body = orjson.loads(rerank.encode(request, "m", outputs))
    assert [r["index"] for r in body["results"]] == [1, 0, 2]
    assert body["results"][0]["relevance_score"] == 9.25
