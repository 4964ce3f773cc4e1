"""Request payloads for any model described by its inputs (``model.toml`` or ``GET
/v2/models/{name}``), in every form the benchmarks send: the arrays themselves (in process),
V2 JSON, KServe V1 JSON and a KServe V2 gRPC ``ModelInferRequest``.

One builder, :func:`tensors`, makes the values: texts for BYTES inputs (two headlines and a
number by default, so that no two items of a run are equal; or a text of a given length), and
for numeric inputs standard normal numbers (integers 0-9, booleans at random). The demo models
take ``features`` FP32 [32] (feed-ranker) and ``text`` BYTES [1] with an optional ``query``
(all-MiniLM-L6-v2, which scores every text against :data:`QUERY`).

It imports nothing of the tests, so ``scripts/loadtest.py`` builds its payloads with it too.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from app.datatypes import NUMPY_DTYPES
from app.models.repository import TensorSpec, read_config

HEADLINES = (
    "Ten tips for a faster morning commute by bike",
    "The city council approved the new park budget on Tuesday",
    "How to cook perfect rice every single time",
    "Local team wins the championship after a dramatic overtime",
    "A beginner's guide to investing in index funds",
    "Scientists discover a new species of deep sea fish",
    "Why sleep matters more than you think for learning",
    "The best hiking trails within two hours of the city",
    "Stock markets rally as inflation cools for a third month",
    "Simple stretches to relieve back pain at your desk",
    "A review of the latest noise cancelling headphones",
    "Five easy vegetarian dinners for busy weeknights",
)
#: What the input named ``query`` carries (all-MiniLM-L6-v2 scores each text against it).
QUERY = "healthy cooking and outdoor sports"
QUERY_INPUT = "query"
_WORDS = ("an", "overload", "test", "sentence", "about", "scoring", "servers", "and", "the", "requests")

#: Makes one text from a random source.
TextSource = Callable[[random.Random], str]


class Tensor(NamedTuple):
    """One input of a request: ``array`` is ``[items, *item shape]`` (BYTES: an ``object``
    array of ``bytes``, as the server holds them)."""

    name: str
    datatype: str
    array: np.ndarray


def distinct_text(rng: random.Random) -> str:
    """A headline-like text (two headlines and a number): the items of a batch differ."""
    return f"{rng.choice(HEADLINES)}; {rng.choice(HEADLINES).lower()} ({rng.randrange(10_000)})"


def text_of(chars: int) -> TextSource:
    """A source of one English-like text of ``chars`` characters (1,500: about 256 tokens,
    MiniLM's ``max_seq_length``), the same for every item."""
    words = (_WORDS * (chars // 60 + 1))[: max(1, chars // 6)]
    text = " ".join(words)[:chars]
    return lambda _rng: text


def vocabulary(tokens: Iterable[str]) -> list[str]:
    """The whole words (ASCII letters, 2+ characters) among a WordPiece tokenizer's ``tokens``,
    given in token-id order: BERT's vocabulary lists its words roughly by frequency."""
    return [t for t in tokens if t.isascii() and t.isalpha() and len(t) > 1]


def model_words(repository: Path, model: str = "all-MiniLM-L6-v2") -> list[str]:
    """:func:`vocabulary` of a sentence-transformers model of ``repository``: the lines of the
    ``vocab.txt`` in its model folder (``[parameters]`` ``model_dir`` or ``model_package``).

    Raises:
        ValueError, FileNotFoundError: the folder cannot be resolved or has no ``vocab.txt``.
    """
    from app.handlers.sentence_embedding import resolve_model_dir  # imports torch

    config = read_config(repository / model)
    folder = resolve_model_dir(config.parameters, config.path)
    return vocabulary((folder / "vocab.txt").read_text(encoding="utf-8").splitlines())


def feed_texts(words: Sequence[str], count: int = 1000, seed: int = 0) -> list[str]:
    """``count`` texts of a feed's mixed lengths, the same for the same ``words`` and ``seed``:
    every other one a title (5-15 words, capitalised), the others descriptions (40-200 words
    in sentences of 6-20). Words are drawn with Zipf weights by their rank in ``words``
    (frequent words often, rare ones now and then, as in running text)."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) for rank in range(len(words))]

    def draw(n: int) -> list[str]:
        return rng.choices(words, weights=weights, k=n)

    texts = []
    for i in range(count):
        if i % 2 == 0:
            texts.append(" ".join(draw(rng.randint(5, 15))).capitalize())
            continue
        left = rng.randint(40, 200)
        sentences = []
        while left > 0:
            n = min(left, rng.randint(6, 20))
            sentences.append(" ".join(draw(n)).capitalize() + ".")
            left -= n
        texts.append(" ".join(sentences))
    return texts


def inputs_of(repository: Path, model: str, *, query: bool = True) -> list[TensorSpec]:
    """The inputs a benchmark sends to ``model`` of ``repository``: every input of its
    ``model.toml`` but the optional ones, except ``query`` where ``query`` is true (MiniLM then
    scores every text against it, which costs a second embedding per item); random numbers in
    an optional input such as ``truncate_prompt_tokens`` would change what is measured.

    Raises:
        ModelLoadError: the model's ``model.toml`` is missing or malformed.
    """
    return [
        spec
        for spec in read_config(repository / model).inputs
        if not (spec.optional and (spec.name != QUERY_INPUT or not query))
    ]


def inputs_of_metadata(metadata: Mapping[str, Any]) -> list[TensorSpec]:
    """The inputs of a ``GET /v2/models/{name}`` answer (shapes there carry the batch
    dimension first)."""
    return [TensorSpec(t["name"], t["datatype"], list(t["shape"][1:])) for t in metadata["inputs"]]


def tensors(
    inputs: Sequence[TensorSpec], items: int, rng: random.Random, text: TextSource = distinct_text
) -> list[Tensor]:
    """``items`` rows for each of ``inputs``, in order (-1 dimensions become 1). BYTES: the
    input ``query`` gets :data:`QUERY`, others ``text(rng)`` per item; numbers come from a
    numpy generator seeded from ``rng``."""
    out = []
    for spec in inputs:
        shape = (items, *(1 if d == -1 else d for d in spec.shape))
        if spec.datatype == "BYTES":
            texts = [
                (QUERY if spec.name == QUERY_INPUT else text(rng)).encode() for _ in range(np.prod(shape))
            ]
            array = np.empty(len(texts), dtype=object)
            array[:] = texts
            array = array.reshape(shape)
        else:
            numbers = np.random.default_rng(rng.randrange(1 << 30))
            dtype = NUMPY_DTYPES[spec.datatype]
            if dtype.kind == "b":
                array = numbers.random(shape) < 0.5
            elif dtype.kind in "iu":
                array = numbers.integers(0, 10, size=shape).astype(dtype)
            else:
                array = numbers.normal(size=shape).astype(dtype)
        out.append(Tensor(spec.name, spec.datatype, array))
    return out


def _plain(tensor: Tensor) -> np.ndarray:
    """The tensor's values as JSON takes them (BYTES decoded to ``str``)."""
    if tensor.datatype == "BYTES":
        decoded: np.ndarray = np.vectorize(bytes.decode, otypes=[object])(tensor.array)
        return decoded
    return tensor.array


def v2_json(request: Sequence[Tensor], outputs: Sequence[str] = ()) -> bytes:
    """An Open Inference Protocol (V2) JSON body: flat row-major ``data``; the ``outputs`` asked
    for by name (every output when empty)."""
    inputs = [
        {
            "name": t.name,
            "shape": list(t.array.shape),
            "datatype": t.datatype,
            "data": _plain(t).ravel().tolist(),
        }
        for t in request
    ]
    body: dict[str, Any] = {"inputs": inputs}
    if outputs:
        body["outputs"] = [{"name": name} for name in outputs]
    return json.dumps(body).encode()


def v2_binary(request: Sequence[Tensor], outputs: Sequence[str] = ()) -> tuple[bytes, dict[str, str]]:
    """A V2 request in Triton's binary tensor extension, as tritonclient sends it: the JSON
    header (each input's ``parameters.binary_data_size``, no ``data``; the ``outputs`` asked for
    as binary data, or every output with ``binary_data_output`` when empty), then each input's
    raw bytes (:func:`app.protocols.tensors.tensor_bytes`); and the HTTP headers it needs
    (``Inference-Header-Content-Length``: the JSON's length)."""
    from app.protocols.tensors import tensor_bytes

    raw = [tensor_bytes(t.array, t.datatype) for t in request]
    inputs = [
        {"name": t.name, "shape": list(t.array.shape), "datatype": t.datatype,
         "parameters": {"binary_data_size": len(data)}}
        for t, data in zip(request, raw, strict=True)
    ]  # fmt: skip
    header: dict[str, Any] = {"inputs": inputs}
    if outputs:
        header["outputs"] = [{"name": name, "parameters": {"binary_data": True}} for name in outputs]
    else:
        header["parameters"] = {"binary_data_output": True}
    head = json.dumps(header).encode()
    headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(head))}
    return head + b"".join(raw), headers


def feed_bodies(
    texts: Sequence[str], items: int, *, query: str | None = QUERY, outputs: Sequence[str] = ("score",)
) -> list[bytes]:
    """V2 JSON requests for all-MiniLM-L6-v2, ``items`` of ``texts`` each in order (the last
    partial group dropped): ``text`` BYTES ``[items, 1]``, ``query`` (the same ``query`` for
    every item, none when None) and the ``outputs`` asked for by name (all when empty)."""
    bodies = []
    for start in range(0, len(texts) - items + 1, items):
        group = list(texts[start : start + items])
        shape = [items, 1]
        inputs: list[dict[str, Any]] = [{"name": "text", "shape": shape, "datatype": "BYTES", "data": group}]
        if query is not None:
            queries = [query] * items
            inputs.append({"name": QUERY_INPUT, "shape": shape, "datatype": "BYTES", "data": queries})
        request: dict[str, Any] = {"inputs": inputs}
        if outputs:
            request["outputs"] = [{"name": name} for name in outputs]
        bodies.append(json.dumps(request).encode())
    return bodies


def v1_json(request: Sequence[Tensor]) -> bytes:
    """A KServe V1 body, ``{"instances": [...]}``: per instance one value (a scalar where an
    item is one element, else a nested list) for a single input, else an object of them."""
    rows = {t.name: _plain(t) for t in request}

    def item(name: str, i: int) -> Any:
        row = rows[name][i]
        return row.ravel().tolist()[0] if row.size == 1 else row.tolist()

    items = len(request[0].array)
    if len(request) == 1:
        instances = [item(request[0].name, i) for i in range(items)]
    else:
        instances = [{name: item(name, i) for name in rows} for i in range(items)]
    return json.dumps({"instances": instances}).encode()


def grpc_request(model: str, request: Sequence[Tensor], outputs: Sequence[str] = ()) -> Any:
    """A KServe V2 gRPC ``ModelInferRequest`` with raw input contents, as tritonclient sends it;
    the ``outputs`` asked for by name (every output when empty)."""
    from app.grpc.generated import grpc_service_pb2 as pb
    from app.protocols.tensors import tensor_bytes

    message = pb.ModelInferRequest(model_name=model)
    for t in request:
        message.inputs.add(name=t.name, datatype=t.datatype, shape=list(t.array.shape))
        message.raw_input_contents.append(tensor_bytes(t.array, t.datatype))
    for name in outputs:
        message.outputs.add(name=name)
    return message


def text_tensor(texts: Sequence[str], name: str = "text") -> Tensor:
    """A BYTES input of one text per item (``[len(texts), 1]``), as the text models take it."""
    array = np.empty(len(texts), dtype=object)
    array[:] = [t.encode() for t in texts]
    return Tensor(name, "BYTES", array.reshape(-1, 1))


def v2_bodies(
    repository: Path, model: str, items: int, count: int, seed: int = 0, text: TextSource = distinct_text
) -> list[bytes]:
    """``count`` different V2 JSON bodies of ``items`` items for ``model`` of ``repository``
    (:func:`inputs_of`), from a random source seeded with ``seed``."""
    inputs = inputs_of(repository, model)
    rng = random.Random(seed)
    return [v2_json(tensors(inputs, items, rng, text)) for _ in range(count)]
