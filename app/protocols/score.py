"""vLLM's score API (``POST /score``, ``/v1/score``): a relevance score for each pair of texts,
``text_1`` against ``text_2``, from a cross-encoder or an embedding model (the cosine of the two:
a bi-encoder), as the rerank API scores them (:func:`app.protocols.rerank.pairs_request`:
``text_1`` is the query, ``text_2`` the document). No aiohttp here.

Pairs: one ``text_1`` with each ``text_2`` (1:1, 1:N; a lone string is one text), or the
``i``-th of each list together (N:N); other lengths are a 400. Scores come back in pair order.
``usage`` counts the tokens the model ran (its ``tokens`` output; 0 without). Errors have
OpenAI's shape, as vLLM answers them.

Source: vLLM's ``/score`` (``ScoreRequest``: ``model``, ``text_1``, ``text_2``,
``truncate_prompt_tokens``; ``ScoreResponse``: ``data`` of ``index``, ``object``, ``score``;
``usage``).
"""

from __future__ import annotations

import time
import uuid

import msgspec
import numpy as np

from app.errors import InvalidInput
from app.models.repository import ModelConfig
from app.models.text import SCORE
from app.protocols import openai, rerank, text
from app.protocols.codec import Api, BodyNamedCodec, Route
from app.protocols.infer import InferRequest
from app.protocols.tensors import RequestLimits, decode_json


class ScoreRequest(msgspec.Struct, omit_defaults=True):
    """vLLM's ``ScoreRequest``: ``text_1`` and ``text_2`` a string or a list of them each."""

    model: str
    text_1: str | list[str]
    text_2: str | list[str]
    #: vLLM's extension: the request's priority level, as Triton's ``parameters.priority``.
    priority: int | None = None
    #: vLLM's (``app.protocols.text``).
    truncate_prompt_tokens: text.TruncatePromptTokens | None = None


class ScoreData(msgspec.Struct):
    """One pair's score."""

    index: int
    score: float
    object: str = "score"


class ScoreResponse(text.PoolingResponse[ScoreData]):
    """vLLM's ``ScoreResponse``."""


_decoder = msgspec.json.Decoder(ScoreRequest)


def pairs(request: ScoreRequest) -> tuple[list[str], list[str]]:
    """(queries, documents) of the request's pairs, one each per pair (module docstring).

    Raises:
        InvalidInput: no text on a side, or lengths that are not 1:1, 1:N or N:N.
    """
    first = [request.text_1] if isinstance(request.text_1, str) else request.text_1
    second = [request.text_2] if isinstance(request.text_2, str) else request.text_2
    if not first or not second:
        raise InvalidInput("text_1 and text_2: give a string or a non-empty list of strings each")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise InvalidInput(
            f"text_1 has {len(first)} texts and text_2 {len(second)}: pair them 1:1, 1:N or N:N"
        )
    return first, second


def decode(body: bytes, limits: RequestLimits) -> ScoreRequest:
    """The request, checked.

    Raises:
        InvalidInput: malformed JSON, a field of the wrong type, lengths that do not pair, a
            ``truncate_prompt_tokens`` of 0.
        PayloadTooLarge: more pairs than ``limits.max_items``.
    """
    request = decode_json(_decoder, body, limits.max_json_depth, "score request")
    text.check_truncation(request.truncate_prompt_tokens)
    limits.check_items(len(pairs(request)[1]), "text_2")
    return request


def infer_request(config: ModelConfig, request: ScoreRequest) -> InferRequest:
    """The inference request of the request's pairs (:func:`app.protocols.rerank.pairs_request`).

    Raises:
        InvalidInput: see :func:`app.protocols.rerank.pairs_request`.
    """
    queries, documents = pairs(request)
    return rerank.pairs_request(config, documents, queries, request.truncate_prompt_tokens)


def encode(config: ModelConfig, outputs: dict[str, np.ndarray]) -> bytes:
    """The response body: one score per pair, in order."""
    scores = np.asarray(outputs[SCORE], dtype=np.float64).reshape(-1)
    data = [ScoreData(i, float(score)) for i, score in enumerate(scores)]
    return msgspec.json.encode(
        ScoreResponse(f"score-{uuid.uuid4().hex}", int(time.time()), config.name, data, text.usage(outputs))
    )


#: vLLM's score API (``app.protocols.codec.Api``).
API = Api(
    protocol="score",
    title="vLLM's score API",
    routes=(Route("/score", "score"), Route("/v1/score", "scoreV1")),
    codec=BodyNamedCodec(decode, infer_request, lambda body, config, out: encode(config, out)),
    summary="Score text pairs (vLLM's API) with a cross-encoder or an embedding model",
    request=ScoreRequest,
    response=ScoreResponse,
    answer="One score per pair, in pair order; usage in tokens.",
    errors=openai.ERRORS,
)
