"""The rerank API (``POST /v1/rerank``) in the shape Cohere's API defined and vLLM, Infinity and
Jina serve: the request and response bodies, and which models can serve it. No aiohttp here.

A model reranks when it takes a text and a query (BYTES inputs ``text`` and ``query``) and
returns an FP32 ``score``: a cross-encoder's relevance (``app.handlers.sequence_classification``)
or an embedding model's cosine of query and text, a bi-encoder
(``app.handlers.sentence_embedding``). Each document becomes one item, the pair (query,
document); the results come back sorted by score, highest first, cut to ``top_n``. A document
longer than the model's window takes several windows (``app.serving.windows``; its score is the
best window's, MaxP) and ``windows`` in its result says how many. Errors have OpenAI's shape, as
vLLM's ``/v1/rerank`` answers them (:func:`app.protocols.openai.error_body`).

Source: Cohere's API reference, "Rerank" (v1 and v2: ``query``, ``documents``, ``top_n``,
``return_documents`` -> ``results`` of ``index``, ``relevance_score``, ``document``); vLLM's
and Infinity's ``/rerank``.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

import msgspec
import numpy as np

from app.errors import InvalidInput
from app.models.repository import ModelConfig
from app.models.text import QUERY, SCORE, TEXT
from app.protocols import openai, text
from app.protocols.codec import Api, BodyNamedCodec, Route
from app.protocols.infer import InferInput, InferRequest, RequestedOutput
from app.protocols.tensors import RequestLimits, decode_json

#: What a document is ranked by (Cohere's ``rank_fields``: only this one).
RANKED_FIELD = "text"


class Document(msgspec.Struct):
    """A document given as an object (Cohere v1's ``{"text": ...}``)."""

    text: str


#: Cohere's fields that would change how a document is cut, which this server leaves to the
#: model's ``model.toml`` (windows, ``max_windows``): refused when given (400), not ignored.
_NOT_SUPPORTED = Annotated[Any, msgspec.Meta(description="Not supported: a request that sets it is a 400.")]


class RerankRequest(msgspec.Struct, omit_defaults=True):
    """Cohere's rerank request (v1 and v2 fields) with vLLM's extensions. ``rank_fields`` other
    than ``["text"]``, ``max_chunks_per_doc`` and ``max_tokens_per_doc`` are refused (400): a
    long document is scored in windows as its model's ``model.toml`` says."""

    query: str
    documents: list[str | Document]
    model: str
    top_n: int | None = None
    return_documents: bool = False
    rank_fields: list[str] | None = None
    max_chunks_per_doc: _NOT_SUPPORTED | None = None
    max_tokens_per_doc: _NOT_SUPPORTED | None = None
    #: vLLM's extension: the request's priority level, as Triton's ``parameters.priority``.
    priority: int | None = None
    #: vLLM's extension (``app.protocols.text``).
    truncate_prompt_tokens: text.TruncatePromptTokens | None = None


class ResultDocument(msgspec.Struct):
    text: str


class RerankResult(msgspec.Struct, omit_defaults=True):
    """One ranked document: its ``index`` in the request, its score and (extension) the windows
    it took."""

    index: int
    relevance_score: float
    windows: int
    document: ResultDocument | None = None


class ApiVersion(msgspec.Struct):
    version: str = "2"


class BilledUnits(msgspec.Struct):
    search_units: int = 1


class Meta(msgspec.Struct):
    api_version: ApiVersion = msgspec.field(default_factory=ApiVersion)
    billed_units: BilledUnits = msgspec.field(default_factory=BilledUnits)


class Usage(msgspec.Struct):
    """Tokens the model ran (vLLM's ``usage``)."""

    total_tokens: int


class RerankResponse(msgspec.Struct):
    """Cohere's rerank response, with vLLM's ``model`` and ``usage``."""

    id: str
    model: str
    results: list[RerankResult]
    meta: Meta
    usage: Usage


_decoder = msgspec.json.Decoder(RerankRequest)


def decode(body: bytes, limits: RequestLimits) -> RerankRequest:
    """The request, checked.

    Raises:
        InvalidInput: malformed JSON, a field of the wrong type, no documents, an empty query,
            a ``top_n`` that is not positive, a ``truncate_prompt_tokens`` of 0, a field this
            server does not implement (``rank_fields`` other than ``["text"]``,
            ``max_chunks_per_doc``, ``max_tokens_per_doc``).
    """
    request = decode_json(_decoder, body, limits.max_json_depth, "rerank request")
    _refuse_what_is_not_implemented(request)
    text.check_truncation(request.truncate_prompt_tokens)
    if not request.documents:
        raise InvalidInput("documents: give a non-empty list of documents to rank against the query")
    if not request.query:
        raise InvalidInput("query: give a non-empty query")
    if request.top_n is not None and request.top_n < 1:
        raise InvalidInput("top_n must be a positive number")
    limits.check_items(len(request.documents), "documents")
    return request


def _refuse_what_is_not_implemented(request: RerankRequest) -> None:
    """Raises InvalidInput (400) for a field of Cohere's this server does not implement: ignored,
    it would rank something other than what the client asked."""
    if request.rank_fields is not None and request.rank_fields != [RANKED_FIELD]:
        raise InvalidInput(
            'rank_fields: only ["text"] is supported; send each document as a string or as '
            '{"text": ...} holding what to rank'
        )
    for name in ("max_chunks_per_doc", "max_tokens_per_doc"):
        if getattr(request, name) is not None:
            raise InvalidInput(
                f"{name} is not supported: a long document is scored in windows as its model's "
                "model.toml says (max_windows); truncate_prompt_tokens keeps a document's last tokens"
            )


def texts(request: RerankRequest) -> list[str]:
    """The documents' texts, in order."""
    return [d if isinstance(d, str) else d.text for d in request.documents]


def pairs_request(
    config: ModelConfig, documents: list[str], queries: list[str], truncate_prompt_tokens: int | None = None
) -> InferRequest:
    """The inference request scoring each document with its query (``documents[i]`` with
    ``queries[i]``, ``[N, 1]`` BYTES each, and ``truncate_prompt_tokens`` when asked); asking for
    ``score`` (and ``tokens``, ``windows`` where the model has them). The rerank and score APIs'.

    Raises:
        InvalidInput: the model takes no (text, query) or returns no FP32 ``score``;
            ``truncate_prompt_tokens`` for a model that does not take it.
    """
    inputs = {s.name: s for s in config.inputs}
    outputs = {s.name: s for s in config.outputs}
    if (
        TEXT not in inputs
        or QUERY not in inputs
        or inputs[TEXT].datatype != "BYTES"
        or inputs[QUERY].datatype != "BYTES"
        or SCORE not in outputs
        or outputs[SCORE].datatype != "FP32"
    ):
        raise InvalidInput(
            f"model {config.name!r} does not score pairs (it needs BYTES inputs 'text' and 'query' and "
            "an FP32 output 'score')"
        )
    return InferRequest(
        model_name=config.name,
        inputs=[
            InferInput(TEXT, "BYTES", [len(documents), 1], documents),
            InferInput(QUERY, "BYTES", [len(queries), 1], queries),
            *text.truncation_inputs(config, truncate_prompt_tokens, len(documents)),
        ],
        outputs=[RequestedOutput(SCORE), *text.counts_wanted(config)],
    )


def infer_request(config: ModelConfig, request: RerankRequest) -> InferRequest:
    """The inference request: each document with the query (:func:`pairs_request`).

    Raises:
        InvalidInput: see :func:`pairs_request`.
    """
    documents = texts(request)
    return pairs_request(config, documents, [request.query] * len(documents), request.truncate_prompt_tokens)


def encode(request: RerankRequest, model: str, outputs: dict[str, np.ndarray]) -> bytes:
    """The response body: documents by score, highest first (ties by index), ``top_n`` of them."""
    scores = np.asarray(outputs[SCORE], dtype=np.float64).reshape(-1)
    windows = text.windows_each(outputs, len(scores))
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    if request.top_n is not None:
        order = order[: request.top_n]
    documents = texts(request)
    results: list[Any] = [
        RerankResult(
            index=i,
            relevance_score=float(scores[i]),
            windows=int(windows[i]),
            document=ResultDocument(documents[i]) if request.return_documents else None,
        )
        for i in order
    ]
    return msgspec.json.encode(
        RerankResponse(f"rerank-{uuid.uuid4().hex}", model, results, Meta(), Usage(text.token_count(outputs)))
    )


#: Cohere's rerank API (``app.protocols.codec.Api``); ``/v2/rerank`` is where Cohere's v2 client posts.
API = Api(
    protocol="rerank",
    title="Cohere's rerank API (as vLLM, Infinity and Jina serve it)",
    routes=(Route("/v1/rerank", "rerank"), Route("/v2/rerank", "rerankV2")),
    codec=BodyNamedCodec(decode, infer_request, lambda body, config, out: encode(body, config.name, out)),
    summary="Rerank documents against a query (Cohere's API) with a cross-encoder or an embedding model",
    request=RerankRequest,
    response=RerankResponse,
    answer="The documents by relevance, highest first; windows each took.",
    errors=openai.ERRORS,
)
