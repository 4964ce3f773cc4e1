"""Each API the stress run drives: a pool of distinct requests (:func:`pool`) and how an answer
becomes the numbers it is checked by (:attr:`Api.read`).

==============  =============================================  ===================================
API             request                                        numbers read from the answer
==============  =============================================  ===================================
v2-json         ``POST /v2/models/feed-ranker/infer``, 1-8     ``click_probability``
                items of FP32 [32]
v2-binary       MiniLM, Triton's binary tensors in and out     ``embedding`` ([n, 384]) and ``score``
                (tritonclient's own body builder and parser)
v1              ``POST /v1/models/feed-ranker:predict``        ``predictions``
embeddings      ``POST /v1/embeddings``, MiniLM, 1-4 texts     each ``embedding``, by ``index``
rerank          ``POST /v1/rerank``, ce, 2-8 documents         each ``relevance_score``, by ``index``
classify        ``POST /v1/classify``, clf, 1-4 texts          each ``probs``, by ``index``
grpc-ranker     gRPC ``ModelInfer``, feed-ranker, raw          ``click_probability``
grpc-clf        gRPC ``ModelInfer``, clf, raw BYTES            ``probabilities``
==============  =============================================  ===================================

Texts are feed-like (:func:`benchmarks.payloads.feed_texts`: titles and descriptions of 5-200
words); one request in eight also carries a post of 300-500 words, which the text models split
into windows. Pools are deterministic for a seed. Nothing here imports torch or aiohttp.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks import payloads
from benchmarks.stress.repository import CE, CLF, MINILM, RANKER

GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"
Headers = tuple[tuple[str, str], ...]
#: What an API's ``make`` returns: path (or gRPC method), body, headers, items.
Made = tuple[str, bytes, Headers, int]
JSON: Headers = (("Content-Type", "application/json"),)


@dataclass(frozen=True)
class Call:
    """One distinct request: ``path`` (HTTP) or the gRPC method, the ``body`` bytes (a
    serialized ``ModelInferRequest`` for gRPC), the ``headers`` and the ``items`` it carries."""

    index: int
    path: str
    body: bytes
    headers: Headers
    items: int


@dataclass(frozen=True)
class Reply:
    """An answer as a client read it: HTTP status (gRPC: 200 for OK), lower-case headers (gRPC:
    the trailing metadata), the body (gRPC: the serialized ``ModelInferResponse``)."""

    status: int
    headers: Mapping[str, str]
    body: bytes


@dataclass(frozen=True)
class Api:
    """``make(rng, words)`` -> (path, body, headers, items) of one request; ``read(reply)`` ->
    the answer's numbers as a flat float64 array (ValueError when the answer is malformed or does
    not fit the request's items)."""

    name: str
    model: str
    protocol: str  # "http" or "grpc"
    make: Callable[[random.Random, Sequence[str]], Made]
    read: Callable[[Reply, int], np.ndarray]


def _texts(rng: random.Random, words: Sequence[str], count: int) -> list[str]:
    texts = payloads.feed_texts(words, count, seed=rng.randrange(1 << 30))
    if rng.random() < 1 / 8:  # a long post: windows
        long = payloads.feed_texts(words, 8, seed=rng.randrange(1 << 30))[1::2]
        texts[-1] = " ".join(long)[: rng.randint(1800, 3000)]
    return texts


def _features(rng: random.Random, items: int) -> np.ndarray:
    return np.random.default_rng(rng.randrange(1 << 30)).normal(size=(items, 32)).astype(np.float32)


def _json(body: Any) -> bytes:
    return json.dumps(body).encode()


def _flat(values: Any, items: int, width: int) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64).ravel()
    if array.size != items * width:
        raise ValueError(f"{array.size} numbers for {items} items of {width}")
    return array


def _parsed(reply: Reply) -> Any:
    return json.loads(reply.body)


# --- V2 JSON, V1, gRPC: the feed-ranker ------------------------------------------------------


def _v2_json(rng: random.Random, _words: Sequence[str]) -> Made:
    items = rng.randint(1, 8)
    x = _features(rng, items)
    body = {
        "inputs": [{"name": "features", "shape": [items, 32], "datatype": "FP32", "data": x.ravel().tolist()}]
    }
    return f"/v2/models/{RANKER}/infer", _json(body), JSON, items


def _read_v2_json(reply: Reply, items: int) -> np.ndarray:
    answer = _parsed(reply)
    (output,) = [o for o in answer["outputs"] if o["name"] == "click_probability"]
    return _flat(output["data"], items, 1)


def _v1(rng: random.Random, _words: Sequence[str]) -> Made:
    items = rng.randint(1, 8)
    return f"/v1/models/{RANKER}:predict", _json({"instances": _features(rng, items).tolist()}), JSON, items


def _read_v1(reply: Reply, items: int) -> np.ndarray:
    return _flat(_parsed(reply)["predictions"], items, 1)


def _grpc_ranker(rng: random.Random, _words: Sequence[str]) -> Made:
    items = rng.randint(1, 8)
    tensor = payloads.Tensor("features", "FP32", _features(rng, items))
    return GRPC_INFER, payloads.grpc_request(RANKER, [tensor]).SerializeToString(), (), items


def _grpc_clf(rng: random.Random, words: Sequence[str]) -> Made:
    texts = _texts(rng, words, rng.randint(1, 4))
    array = np.empty((len(texts), 1), dtype=object)
    array[:, 0] = [t.encode() for t in texts]
    message = payloads.grpc_request(CLF, [payloads.Tensor("text", "BYTES", array)])
    message.outputs.add(name="probabilities")
    return GRPC_INFER, message.SerializeToString(), (), len(texts)


def _grpc_reader(output: str, width: int) -> Callable[[Reply, int], np.ndarray]:
    def read(reply: Reply, items: int) -> np.ndarray:
        from app.grpc.generated import grpc_service_pb2 as pb

        response = pb.ModelInferResponse.FromString(reply.body)
        names = [o.name for o in response.outputs]
        raw = response.raw_output_contents[names.index(output)]
        return _flat(np.frombuffer(raw, "<f4"), items, width)

    return read


# --- V2 binary, embeddings: MiniLM ----------------------------------------------------------


def _v2_binary(rng: random.Random, words: Sequence[str]) -> Made:
    import tritonclient.http as triton

    texts = _texts(rng, words, rng.randint(1, 4))
    text = triton.InferInput("text", [len(texts), 1], "BYTES")
    text.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=object), binary_data=True)
    outputs = [triton.InferRequestedOutput(name, binary_data=True) for name in ("embedding", "score")]
    body, json_size = triton.InferenceServerClient.generate_request_body([text], outputs=outputs)
    headers = (
        ("Content-Type", "application/octet-stream"),
        ("Inference-Header-Content-Length", str(json_size)),
    )
    return f"/v2/models/{MINILM}/infer", body, headers, len(texts)


def _read_v2_binary(reply: Reply, items: int) -> np.ndarray:
    import tritonclient.http as triton

    size = reply.headers.get("inference-header-content-length")
    result = triton.InferenceServerClient.parse_response_body(
        reply.body, header_length=None if size is None else int(size)
    )
    embedding, score = result.as_numpy("embedding"), result.as_numpy("score")
    if embedding is None or score is None:
        raise ValueError("an output asked for is missing")
    return np.concatenate([_flat(embedding, items, 384), _flat(score, items, 1)])


def _embeddings(rng: random.Random, words: Sequence[str]) -> Made:
    texts = _texts(rng, words, rng.randint(1, 4))
    return "/v1/embeddings", _json({"model": MINILM, "input": texts}), JSON, len(texts)


def _by_index(rows: list[dict[str, Any]], field: str, items: int, width: int) -> np.ndarray:
    if sorted(r["index"] for r in rows) != list(range(items)):
        raise ValueError(f"indices {[r['index'] for r in rows]} for {items} items")
    return _flat([r[field] for r in sorted(rows, key=lambda r: r["index"])], items, width)


def _read_embeddings(reply: Reply, items: int) -> np.ndarray:
    return _by_index(_parsed(reply)["data"], "embedding", items, 384)


# --- rerank (ce), classify (clf) ------------------------------------------------------------


def _rerank(rng: random.Random, words: Sequence[str]) -> Made:
    documents = _texts(rng, words, rng.randint(2, 8))
    query = payloads.feed_texts(words, 1, seed=rng.randrange(1 << 30))[0]
    return "/v1/rerank", _json({"model": CE, "query": query, "documents": documents}), JSON, len(documents)


def _read_rerank(reply: Reply, items: int) -> np.ndarray:
    results = _parsed(reply)["results"]
    scores = [r["relevance_score"] for r in results]
    if scores != sorted(scores, reverse=True):
        raise ValueError("results not sorted by relevance")
    return _by_index(results, "relevance_score", items, 1)


def _classify(rng: random.Random, words: Sequence[str]) -> Made:
    texts = _texts(rng, words, rng.randint(1, 4))
    return "/v1/classify", _json({"model": CLF, "input": texts}), JSON, len(texts)


def _read_classify(reply: Reply, items: int) -> np.ndarray:
    return _by_index(_parsed(reply)["data"], "probs", items, 3)


APIS: dict[str, Api] = {
    api.name: api
    for api in (
        Api("v2-json", RANKER, "http", _v2_json, _read_v2_json),
        Api("v2-binary", MINILM, "http", _v2_binary, _read_v2_binary),
        Api("v1", RANKER, "http", _v1, _read_v1),
        Api("embeddings", MINILM, "http", _embeddings, _read_embeddings),
        Api("rerank", CE, "http", _rerank, _read_rerank),
        Api("classify", CLF, "http", _classify, _read_classify),
        Api("grpc-ranker", RANKER, "grpc", _grpc_ranker, _grpc_reader("click_probability", 1)),
        Api("grpc-clf", CLF, "grpc", _grpc_clf, _grpc_reader("probabilities", 3)),
    )
}


def pool(api: Api, size: int, words: Sequence[str], seed: int = 0) -> list[Call]:
    """``size`` distinct requests of ``api`` (the same for the same ``seed`` and ``words``)."""
    rng = random.Random(f"{api.name}/{seed}")
    calls = []
    for index in range(size):
        path, body, headers, items = api.make(rng, words)
        calls.append(Call(index, path, body, headers, items))
    return calls


def words_of(tokenizer_json: str) -> list[str]:
    """The whole words (:func:`benchmarks.payloads.vocabulary`) of a WordPiece tokenizer's
    ``tokenizer.json`` text, in token-id order."""
    vocab: dict[str, int] = json.loads(tokenizer_json)["model"]["vocab"]
    return payloads.vocabulary(sorted(vocab, key=vocab.__getitem__))
