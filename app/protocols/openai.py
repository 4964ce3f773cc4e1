"""OpenAI's embeddings API (``POST /v1/embeddings``): the request and response bodies, and which
models it can serve. No aiohttp here.

A model serves embeddings when it takes text (a BYTES input; the first required one, the others
left out) and returns an FP32 output named ``embedding``; the OpenAI request's ``input`` (a
string or a list of strings) becomes that input, one item per string, and the ``embedding`` rows
come back in order, as JSON floats or (``encoding_format = "base64"``) as the base64 of their
little-endian float32 bytes, OpenAI's encoding. ``usage`` counts the tokens of the inputs from
the model's INT64 ``tokens`` output when it has one (0 otherwise). Token arrays as ``input``
are refused: this server tokenises itself. Errors have OpenAI's shape (:func:`error_body`).

``dimensions`` (Matryoshka): each embedding's first ``dimensions`` values, L2-normalised again;
more than the model makes is a 400 (:func:`shortened`).

**Multi-vector models** (an extension, the shape vLLM's ``token_embed`` pooling answers in): a
model whose ``embedding`` is ragged (``ragged = true``, shape ``[-1, dim]``: ColBERT's one row
per token, ``app.handlers.multi_vector``) answers each input's ``embedding`` as a list of
vectors, one per token row, in token order (``encoding_format = "base64"``: a list of base64
strings, one a row); ``dimensions`` is refused for it (400). ``input_type`` (``"query"`` or
``"document"``, ``app.protocols.text``) says what the inputs are; a model without that input
refuses it.

Source: OpenAI's API reference, "Embeddings" (``embeddings.create``, ``dimensions``) and
"Errors"; the same endpoint in text-embeddings-inference (``dimensions``: cut, then normalised;
above the model's width refused), Infinity and KServe. Kusupati et al., "Matryoshka
Representation Learning" (2022).
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import msgspec
import numpy as np
import orjson

from app.errors import InvalidInput
from app.models.repository import ModelConfig
from app.protocols import text
from app.protocols.codec import Api, BodyNamedCodec, ErrorShape, Route
from app.protocols.infer import InferInput, InferRequest, RequestedOutput
from app.protocols.tensors import RequestLimits, decode_json

EMBEDDING = "embedding"


class EmbeddingRequest(msgspec.Struct, omit_defaults=True):
    """OpenAI's ``CreateEmbeddingRequest``."""

    #: A string or a list of them (token arrays, ``list[int]``, are refused by :func:`decode`).
    input: str | list[Any]
    model: str
    encoding_format: Literal["float", "base64"] = "float"
    #: Matryoshka: the first ``dimensions`` values of each embedding, normalised again.
    dimensions: int | None = None
    user: str | None = None
    #: vLLM's extension: the request's priority level, as Triton's ``parameters.priority``
    #: (1 = the highest, 0 = the model's default; the model's ``priority_levels``).
    priority: int | None = None
    #: vLLM's extension (``app.protocols.text``).
    truncate_prompt_tokens: text.TruncatePromptTokens | None = None
    #: Extension (``app.protocols.text``): what the inputs are, for a retrieval model.
    input_type: text.InputType | None = None


class Embedding(msgspec.Struct):
    """One row of the answer: a vector (a multi-vector model's: a list of them, one a token)."""

    index: int
    #: A vector of floats, or its base64; a multi-vector model's: a list of either, one a token.
    embedding: list[Any] | str
    object: str = "embedding"


class Usage(msgspec.Struct):
    """Tokens of the inputs."""

    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct):
    """OpenAI's ``CreateEmbeddingResponse``."""

    data: list[Embedding]
    model: str
    usage: Usage
    object: str = "list"


_decoder = msgspec.json.Decoder(EmbeddingRequest)


def decode(body: bytes, limits: RequestLimits) -> EmbeddingRequest:
    """The request, its ``input`` a non-empty list of strings (a lone string is one).

    Raises:
        InvalidInput: malformed JSON, a field of the wrong type, token arrays, no input, a
            ``dimensions`` that is not positive, a ``truncate_prompt_tokens`` of 0.
    """
    request = decode_json(_decoder, body, limits.max_json_depth, "embeddings request")
    request.input = text.input_texts(request.input)
    if request.dimensions is not None and request.dimensions < 1:
        raise InvalidInput("dimensions must be a positive number")
    text.check_truncation(request.truncate_prompt_tokens)
    return request


def text_input(config: ModelConfig) -> str:
    """The input an embeddings request's texts go to.

    Raises:
        InvalidInput: the model takes no text or returns no FP32 ``embedding``.
    """
    outputs = {s.name: s for s in config.outputs}
    texts = [s.name for s in config.inputs if s.datatype == "BYTES" and not s.optional]
    if EMBEDDING not in outputs or outputs[EMBEDDING].datatype != "FP32" or not texts:
        raise InvalidInput(
            f"model {config.name!r} does not produce embeddings (it needs a text input and an FP32 "
            "output named 'embedding')"
        )
    return texts[0]


def infer_request(config: ModelConfig, request: EmbeddingRequest) -> InferRequest:
    """The inference request of an embeddings request: its texts, ``[N, 1]`` BYTES, to the model's
    text input (and ``truncate_prompt_tokens`` when asked); asking for ``embedding`` (and
    ``tokens`` when the model has it).

    Raises:
        InvalidInput: see :func:`text_input`; a ``dimensions`` above the model's width;
            ``truncate_prompt_tokens`` for a model that does not take it.
    """
    name = text_input(config)
    spec = next(s for s in config.outputs if s.name == EMBEDDING)
    if request.dimensions is not None and spec.ragged:
        raise InvalidInput(
            f"dimensions: model {config.name!r} makes multi-vector embeddings (a vector per token); "
            "leave dimensions out"
        )
    if request.dimensions is not None and spec.shape[-1] >= 0:
        _check_dimensions(config.name, request.dimensions, spec.shape[-1])
    texts = list(request.input)
    return InferRequest(
        model_name=config.name,
        inputs=[
            InferInput(name, "BYTES", [len(texts), 1], texts),
            *text.truncation_inputs(config, request.truncate_prompt_tokens, len(texts)),
            *text.input_type_inputs(config, request.input_type, len(texts)),
        ],
        outputs=[RequestedOutput(EMBEDDING), *text.counts_wanted(config, (text.TOKENS,))],
    )


def _check_dimensions(model: str, dimensions: int, width: int) -> None:
    """Raises InvalidInput (400) when ``dimensions`` is more than ``width``, the model's."""
    if dimensions > width:
        raise InvalidInput(
            f"dimensions: model {model!r} makes {width}-dimensional embeddings; ask for at most {width}"
        )


def shortened(vectors: np.ndarray, dimensions: int) -> np.ndarray:
    """Matryoshka embeddings: the first ``dimensions`` values of each row of ``vectors`` (float32
    ``[N, D]``), each row L2-normalised again (a row of zeros stays zeros); float32
    ``[N, dimensions]``. The norm is summed in float64, as text-embeddings-inference does."""
    head = vectors[:, :dimensions]
    norms = np.sqrt(np.square(head, dtype=np.float64).sum(axis=1, keepdims=True))
    scale = np.divide(1.0, norms, out=np.zeros_like(norms), where=norms > 0).astype(np.float32)
    rows: np.ndarray = head * scale
    return rows


def encode(request: EmbeddingRequest, model: str, outputs: dict[str, np.ndarray]) -> bytes:
    """The response body (:class:`EmbeddingResponse`): one row per input, in order (cut to
    ``dimensions`` when it asks for fewer than the model makes); ``usage`` from ``tokens`` (0
    without). A float is written in the shortest form that reads back as the same float32 (as
    text-embeddings-inference writes them), not as the 17 digits of its float64: 8 unit vectors
    of 384 values take 38.0 KB instead of 64.8 KB.

    Raises:
        InvalidInput: ``dimensions`` above the width of a model whose width is not declared.
    """
    if outputs[EMBEDDING].dtype == object:  # a multi-vector model's: rows per input
        return _encode_rows(request, model, outputs)
    vectors = np.ascontiguousarray(outputs[EMBEDDING], dtype="<f4").reshape(len(request.input), -1)
    if request.dimensions is not None and request.dimensions != vectors.shape[1]:
        _check_dimensions(model, request.dimensions, vectors.shape[1])
        vectors = np.ascontiguousarray(shortened(vectors, request.dimensions), dtype="<f4")
    if request.encoding_format == "base64":
        rows: list[Any] = [base64.b64encode(row.tobytes()).decode("ascii") for row in vectors]
    else:
        rows = list(vectors)  # float32 rows: orjson writes each value in its shortest float32 form
    tokens = text.token_count(outputs)
    body = {
        "data": [{"index": i, "embedding": row, "object": "embedding"} for i, row in enumerate(rows)],
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "object": "list",
    }
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def _encode_rows(request: EmbeddingRequest, model: str, outputs: dict[str, np.ndarray]) -> bytes:
    """The response body of a multi-vector model (module docstring): each input's rows, float32
    ``[n_i, dim]``, as a list of vectors (or of base64 strings, one a row)."""
    data = []
    for i, rows in enumerate(text.items(outputs[EMBEDDING], len(request.input))):
        rows = np.ascontiguousarray(rows, dtype="<f4")
        if request.encoding_format == "base64":
            embedding: Any = [base64.b64encode(row.tobytes()).decode("ascii") for row in rows]
        else:
            embedding = rows  # orjson writes a float32 matrix as lists in the shortest float32 form
        data.append({"index": i, "embedding": embedding, "object": "embedding"})
    tokens = text.token_count(outputs)
    body = {
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "object": "list",
    }
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


class OpenAIErrorDetail(msgspec.Struct):
    """What went wrong: the message, OpenAI's error type, the parameter (never named here) and a
    code (``model_not_found`` for a 404)."""

    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(msgspec.Struct):
    """OpenAI's error body."""

    error: OpenAIErrorDetail


#: OpenAI's error type of each status class.
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}  # fmt: skip


def error_body(status: int, message: str) -> bytes:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    code = "model_not_found" if status == 404 else None
    return msgspec.json.encode(OpenAIError(OpenAIErrorDetail(message, kind, None, code)))


#: OpenAI's error shape: the OpenAI-style APIs' (embeddings; rerank and classify, as vLLM answers).
ERRORS = ErrorShape(OpenAIError, error_body)

#: OpenAI's embeddings API (``app.protocols.codec.Api``).
API = Api(
    protocol="openai",
    title="OpenAI's embeddings API",
    routes=(Route("/v1/embeddings", "createEmbedding"),),
    codec=BodyNamedCodec(decode, infer_request, lambda body, config, out: encode(body, config.name, out)),
    summary="Embeddings (OpenAI's API) of any model that makes them",
    request=EmbeddingRequest,
    response=EmbeddingResponse,
    answer="One embedding per input, in order; usage in tokens.",
    errors=ERRORS,
)
