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
pieces          ``POST /v2/models/radar/infer``, 1-4 texts,    ``probabilities``, and each piece's
                ``probabilities`` and ``pieces`` asked for     span and ``probabilities``
completions     ``POST /v1/completions``, lm, 1-4 prompts,     each choice's ``token_logprobs``, its
                ``echo``, ``max_tokens`` 0 or 1 (with          ``top_logprobs`` values (highest
                ``temperature`` 0, as lm-evaluation-harness    first), ``usage``'s tokens
                sends it), ``logprobs`` none or 0-20
causal-rerank   ``POST /v1/rerank``, causal-rr, 2-8 documents  each ``relevance_score``, by ``index``
score           ``POST /score``, causal-rr, one query against  each ``score``, by ``index``
                1-4 documents or 1-4 pairs
==============  =============================================  ===================================

Texts are feed-like (:func:`benchmarks.payloads.feed_texts`: titles and descriptions of 5-200
words, ASCII); one request in eight also carries a post of 300-500 words, which the text models
split into windows or pieces (and ``causal-rr`` cuts at its end, as the model card does).
Prompts of ``lm`` are at most 1,000 characters (under its 1,024 tokens: never cut), queries of
``causal-rr`` a title. Pools are deterministic for a seed. Nothing here imports torch or aiohttp.

Beside equality with the reference (``oracle``), a reader checks what any right answer must
hold, so that a reference wrong in the same way as the answer is caught too: an answer per item
by index; rerank results sorted; a causal reranker's scores probabilities; each piece's span a
part of its text no longer than a piece, the pieces in text order and every character but white
space in one, their count the ``windows``, each piece's probabilities summing to 1 (a softmax
classifier), the text's their maximum; a completion's prompt echoed (and the greedy next token
after it with ``max_tokens`` 1), its tokens as many as its log-probs and offsets, each offset
where its token starts in their concatenation, spelling the whole prompt (an ASCII one: a
byte-level token decoded alone is no character of its own), no log-prob above 0 and none above
the best alternative listed, the next token's the best of all.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks import payloads
from benchmarks.stress.repository import CAUSAL_RR, CE, CLF, LM, MINILM, PIECE_CHARS, RADAR, RANKER

GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"
Headers = tuple[tuple[str, str], ...]
#: What an API's ``make`` returns: path (or gRPC method), body, headers, items.
Made = tuple[str, bytes, Headers, int]
JSON: Headers = (("Content-Type", "application/json"),)
#: The longest prompt of ``completions``, characters (ASCII: as many tokens at most).
PROMPT_CHARS = 1000
#: Rounding slack of a property between two float32 numbers of one answer.
SLACK = 1e-5


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
    """``make(rng, words)`` -> (path, body, headers, items) of one request; ``read(reply, call)``
    -> the answer's numbers as a flat float64 array (ValueError when the answer is malformed, does
    not fit the request ``call`` or breaks a property every right answer has: module docstring)."""

    name: str
    model: str
    protocol: str  # "http" or "grpc"
    make: Callable[[random.Random, Sequence[str]], Made]
    read: Callable[[Reply, Call], np.ndarray]


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


def _v2_outputs(reply: Reply) -> dict[str, Any]:
    return {o["name"]: o for o in _parsed(reply)["outputs"]}


def _read_v2_json(reply: Reply, call: Call) -> np.ndarray:
    return _flat(_v2_outputs(reply)["click_probability"]["data"], call.items, 1)


def _v1(rng: random.Random, _words: Sequence[str]) -> Made:
    items = rng.randint(1, 8)
    return f"/v1/models/{RANKER}:predict", _json({"instances": _features(rng, items).tolist()}), JSON, items


def _read_v1(reply: Reply, call: Call) -> np.ndarray:
    return _flat(_parsed(reply)["predictions"], call.items, 1)


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


def _grpc_reader(output: str, width: int) -> Callable[[Reply, Call], np.ndarray]:
    def read(reply: Reply, call: Call) -> np.ndarray:
        from app.grpc.generated import grpc_service_pb2 as pb

        response = pb.ModelInferResponse.FromString(reply.body)
        names = [o.name for o in response.outputs]
        raw = response.raw_output_contents[names.index(output)]
        return _flat(np.frombuffer(raw, "<f4"), call.items, width)

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


def _read_v2_binary(reply: Reply, call: Call) -> np.ndarray:
    import tritonclient.http as triton

    size = reply.headers.get("inference-header-content-length")
    result = triton.InferenceServerClient.parse_response_body(
        reply.body, header_length=None if size is None else int(size)
    )
    embedding, score = result.as_numpy("embedding"), result.as_numpy("score")
    if embedding is None or score is None:
        raise ValueError("an output asked for is missing")
    return np.concatenate([_flat(embedding, call.items, 384), _flat(score, call.items, 1)])


def _embeddings(rng: random.Random, words: Sequence[str]) -> Made:
    texts = _texts(rng, words, rng.randint(1, 4))
    return "/v1/embeddings", _json({"model": MINILM, "input": texts}), JSON, len(texts)


def _by_index(rows: list[dict[str, Any]], field: str, items: int, width: int) -> np.ndarray:
    if sorted(r["index"] for r in rows) != list(range(items)):
        raise ValueError(f"indices {[r['index'] for r in rows]} for {items} items")
    return _flat([r[field] for r in sorted(rows, key=lambda r: r["index"])], items, width)


def _read_embeddings(reply: Reply, call: Call) -> np.ndarray:
    return _by_index(_parsed(reply)["data"], "embedding", call.items, 384)


# --- rerank (ce), classify (clf) ------------------------------------------------------------


def _rerank(rng: random.Random, words: Sequence[str]) -> Made:
    documents = _texts(rng, words, rng.randint(2, 8))
    query = payloads.feed_texts(words, 1, seed=rng.randrange(1 << 30))[0]
    return "/v1/rerank", _json({"model": CE, "query": query, "documents": documents}), JSON, len(documents)


def _read_rerank(reply: Reply, call: Call) -> np.ndarray:
    results = _parsed(reply)["results"]
    scores = [r["relevance_score"] for r in results]
    if scores != sorted(scores, reverse=True):
        raise ValueError("results not sorted by relevance")
    return _by_index(results, "relevance_score", call.items, 1)


def _classify(rng: random.Random, words: Sequence[str]) -> Made:
    texts = _texts(rng, words, rng.randint(1, 4))
    return "/v1/classify", _json({"model": CLF, "input": texts}), JSON, len(texts)


def _read_classify(reply: Reply, call: Call) -> np.ndarray:
    return _by_index(_parsed(reply)["data"], "probs", call.items, 3)


# --- the decoder models: pieces (radar), completions (lm), causal rerank and score (causal-rr) ---


def _probabilities(values: np.ndarray, what: str) -> np.ndarray:
    """``values`` when each is a probability (0 to 1, within :data:`SLACK`)."""
    if not np.all((values >= -SLACK) & (values <= 1 + SLACK)):
        raise ValueError(f"{what} outside [0, 1]: {values.tolist()[:8]}")
    return values


def _pieces(rng: random.Random, words: Sequence[str]) -> Made:
    texts = _texts(rng, words, rng.randint(1, 4))
    body = {
        "inputs": [{"name": "text", "shape": [len(texts), 1], "datatype": "BYTES", "data": texts}],
        "outputs": [{"name": name} for name in ("probabilities", "windows", "pieces")],
    }
    return f"/v2/models/{RADAR}/infer", _json(body), JSON, len(texts)


def _read_pieces(reply: Reply, call: Call) -> np.ndarray:
    """Each text's probabilities, then each piece's span and probabilities; the properties of
    the module docstring (pieces of at most :data:`~benchmarks.stress.repository.PIECE_CHARS`)."""
    texts = json.loads(call.body)["inputs"][0]["data"]
    outputs = _v2_outputs(reply)
    flat = _probabilities(_flat(outputs["probabilities"]["data"], call.items, 2), "probabilities")
    probabilities = flat.reshape(call.items, 2)
    windows = _flat(outputs["windows"]["data"], call.items, 1)
    rows = [flat]
    listed = _flat_list(outputs["pieces"]["data"], call.items)
    for i, (text, raw) in enumerate(zip(texts, listed, strict=True)):
        pieces = json.loads(raw)
        if len(pieces) != windows[i]:
            raise ValueError(f"text {i}: {len(pieces)} pieces, windows {windows[i]:g}")
        _check_spans(i, text, [(p["start"], p["stop"]) for p in pieces])
        each = np.array([p["probabilities"] for p in pieces], dtype=np.float64).reshape(len(pieces), 2)
        if np.abs(_probabilities(each, "a piece's probabilities").sum(axis=1) - 1).max() > SLACK:
            raise ValueError(f"text {i}: a piece's probabilities do not sum to 1: {each.tolist()}")
        if np.abs(each.max(axis=0) - probabilities[i]).max() > SLACK:
            raise ValueError(f"text {i}: probabilities {probabilities[i]} are not its pieces' maximum")
        rows += [np.array([[p["start"], p["stop"]] for p in pieces], dtype=np.float64).ravel(), each.ravel()]
    return np.concatenate(rows)


def _check_spans(i: int, text: str, spans: list[tuple[int, int]]) -> None:
    """Text ``i``'s pieces: each a part of it of at most
    :data:`~benchmarks.stress.repository.PIECE_CHARS`, in text order (windows of a piece over
    ``max_seq_length`` tokens overlap), every character but white space in one of them."""
    covered = bytearray(len(text))
    start = 0
    for a, b in spans:
        if not start <= a < b <= len(text):
            raise ValueError(f"text {i} of {len(text)} characters: a piece [{a}, {b}) after one from {start}")
        if b - a > PIECE_CHARS:
            raise ValueError(f"text {i}: a piece [{a}, {b}) over {PIECE_CHARS} characters")
        covered[a:b] = b"\x01" * (b - a)
        start = a
    missed = [k for k, c in enumerate(text) if not covered[k] and not c.isspace()]
    if missed:
        raise ValueError(
            f"text {i}: {len(missed)} characters in no piece, from {missed[0]}: {text[missed[0] :][:40]!r}"
        )


def _flat_list(values: Any, items: int) -> list[Any]:
    flat = list(np.asarray(values, dtype=object).ravel())
    if len(flat) != items:
        raise ValueError(f"{len(flat)} values for {items} items")
    return flat


def _completions(rng: random.Random, words: Sequence[str]) -> Made:
    texts = payloads.feed_texts(words, rng.randint(1, 4), seed=rng.randrange(1 << 30))
    prompts = [t[:PROMPT_CHARS] for t in texts]
    body: dict[str, Any] = {"model": LM, "prompt": prompts, "echo": True, "max_tokens": rng.choice([0, 1])}
    if body["max_tokens"] and rng.random() < 0.5:
        body["temperature"] = 0  # lm-evaluation-harness 0.4.4 and later: max_tokens 1, logprobs 1
    logprobs = rng.choice([None, 0, 1, 1, 5, 20])
    if logprobs is not None:
        body["logprobs"] = logprobs
    return "/v1/completions", _json(body), JSON, len(prompts)


def _read_completions(reply: Reply, call: Call) -> np.ndarray:
    """Per choice its token log-probs (a null as +1) and its alternatives' values, highest first;
    then ``usage``'s prompt and completion tokens; the properties of the module docstring."""
    request, answer = json.loads(call.body), _parsed(reply)
    prompts, choices, made = request["prompt"], answer["choices"], request["max_tokens"]
    if [c["index"] for c in choices] != list(range(call.items)):
        raise ValueError(f"choices {[c['index'] for c in choices]} for {call.items} prompts")
    rows = []
    for prompt, choice in zip(prompts, choices, strict=True):
        text, logprobs = choice["text"], choice["logprobs"]
        if not text.startswith(prompt) or (not made and text != prompt):
            raise ValueError(f"choice {choice['index']} is {text[:60]!r}, not its prompt")
        if ("logprobs" in request) != (logprobs is not None):
            raise ValueError(f"choice {choice['index']}: {logprobs!r} for logprobs {request.get('logprobs')}")
        if logprobs is not None:
            rows.append(_token_logprobs(prompt, text, logprobs, request["logprobs"], made))
    usage = answer["usage"]
    if usage["completion_tokens"] != made * call.items:
        raise ValueError(f"{usage['completion_tokens']} completion tokens for {call.items} x {made}")
    rows.append(np.array([usage["prompt_tokens"], usage["completion_tokens"]], dtype=np.float64))
    return np.concatenate(rows)


def _token_logprobs(prompt: str, text: str, logprobs: dict[str, Any], top: int, made: int) -> np.ndarray:
    tokens, own, offsets = logprobs["tokens"], logprobs["token_logprobs"], logprobs["text_offset"]
    if not len(tokens) == len(own) == len(offsets) or len(tokens) <= made:
        raise ValueError(f"{len(tokens)} tokens, {len(own)} log-probs, {len(offsets)} offsets")
    if offsets != [sum(map(len, tokens[:k])) for k in range(len(tokens))]:
        raise ValueError(f"offsets {offsets[:8]}... are not the tokens' {[len(t) for t in tokens[:8]]}...")
    if made and text != prompt + tokens[-1]:
        raise ValueError(f"the text {text[-40:]!r} does not end with the next token {tokens[-1]!r}")
    if prompt.isascii() and "".join(tokens[: len(tokens) - made]) != prompt:
        raise ValueError(f"the tokens spell {''.join(tokens)[:60]!r}..., not the prompt")
    values = np.array([1.0 if v is None else v for v in own], dtype=np.float64)
    if np.any(values[values != 1.0] > SLACK):
        raise ValueError(f"a log-prob above 0: {values.max()}")
    alternatives = []
    for t, listed in enumerate(logprobs.get("top_logprobs") or [None] * len(tokens)):
        if listed is None:
            continue
        best = sorted(listed.values(), reverse=True)
        beaten = own[t] is not None and bool(best) and own[t] > best[0] + SLACK
        if top and (not 0 < len(best) <= top + 1 or beaten):
            raise ValueError(f"token {t}: log-prob {own[t]} beside alternatives {listed}")
        if made and t == len(tokens) - 1 and best and own[t] < best[0] - SLACK:
            raise ValueError(f"the next token {tokens[t]!r} ({own[t]}) is not the greedy one: {listed}")
        alternatives += best
    return np.concatenate([values, np.array(alternatives, dtype=np.float64)])


def _query(rng: random.Random, words: Sequence[str]) -> str:
    return payloads.feed_texts(words, 1, seed=rng.randrange(1 << 30))[0]  # a title


def _causal_rerank(rng: random.Random, words: Sequence[str]) -> Made:
    documents = _texts(rng, words, rng.randint(2, 8))
    body = {"model": CAUSAL_RR, "query": _query(rng, words), "documents": documents}
    return "/v1/rerank", _json(body), JSON, len(documents)


def _read_causal_rerank(reply: Reply, call: Call) -> np.ndarray:
    return _probabilities(_read_rerank(reply, call), "relevance scores")


def _score(rng: random.Random, words: Sequence[str]) -> Made:
    documents = _texts(rng, words, rng.randint(1, 4))
    queries: str | list[str] = _query(rng, words)
    if rng.random() < 0.5:  # N:N, each query with its document
        queries = [_query(rng, words) for _ in documents]
    body = {"model": CAUSAL_RR, "text_1": queries, "text_2": documents}
    return "/score", _json(body), JSON, len(documents)


def _read_score(reply: Reply, call: Call) -> np.ndarray:
    return _probabilities(_by_index(_parsed(reply)["data"], "score", call.items, 1), "scores")


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
        Api("pieces", RADAR, "http", _pieces, _read_pieces),
        Api("completions", LM, "http", _completions, _read_completions),
        Api("causal-rerank", CAUSAL_RR, "http", _causal_rerank, _read_causal_rerank),
        Api("score", CAUSAL_RR, "http", _score, _read_score),
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
