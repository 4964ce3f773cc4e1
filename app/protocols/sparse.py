"""text-embeddings-inference's sparse embeddings API (``POST /embed_sparse``): the request and
response bodies, and which models can serve it. No aiohttp here.

A model embeds sparsely when it takes text (a BYTES input ``text``) and returns a sparse vector as
two ragged outputs (``ragged = true``, shape ``[-1]``): INT64 ``indices``, its non-zero terms'
vocabulary ids, and FP32 ``values``, their weights (``app.handlers.sparse_embedding``). Each text
of ``inputs`` is one item; the answer is, per text in order, its non-zero terms as
``{"index": id, "value": weight}``, ids ascending (TEI's ``EmbedSparseResponse``).

Fields beyond TEI's (extensions):

``model`` (required)
    The model: this server serves many.
``top_k`` (int >= 1)
    Each text's ``top_k`` largest weights only (the rest dropped; ties by the lower id).
``threshold`` (number)
    Weights below it dropped (applied before ``top_k``).
``input_type`` (``"query"`` or ``"document"``)
    What the texts are (``app.protocols.text``): an inference-free model's queries take its
    static term weights, its documents the encoder; empty: the model's default route.
``priority`` (vLLM's on its APIs; Triton's ``parameters.priority``).

Why the API prunes and not the model: the model returns a text's every non-zero term, so a long
text in windows is pruned once its windows are merged (a term among a window's top k is not
always among the text's), and one vector cached per text (the response cache keys on the
model's inputs) answers every ``top_k`` and ``threshold``; what travels between siblings and
sits in the cache is a few hundred terms a text for a trained SPLADE (12 bytes each).

TEI's ``truncate`` and ``truncation_direction``: ``truncate: true`` with ``"left"`` keeps each
text's last tokens (``truncate_prompt_tokens = -1``, for a model that declares that input);
otherwise the model's own ``truncation`` holds (model.toml: cut at ``max_seq_length`` on the
right by default, as TEI's ``truncate: true``; a long text's windows merged where the model
takes windows; refused where it says ``"error"``). ``prompt_name`` is refused: a model's prompts
are its folder's, applied by ``input_type``.

Errors are ``{"error": "<message>"}`` (TEI's ``error``; its ``error_type`` is not sent).

Source: text-embeddings-inference's router (``router/src/http/types.rs``: ``EmbedSparseRequest``
``inputs``, ``truncate``, ``truncation_direction``, ``prompt_name``; ``SparseValue`` ``index``,
``value``; ``EmbedSparseResponse``).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
import numpy as np
import orjson

from app.errors import InvalidInput
from app.models.repository import ModelConfig
from app.protocols import text
from app.protocols.codec import Api, BodyNamedCodec, Route
from app.protocols.infer import InferInput, InferRequest, RequestedOutput
from app.protocols.tensors import RequestLimits, decode_json

TEXT, INDICES, VALUES = "text", "indices", "values"


class EmbedSparseRequest(msgspec.Struct, omit_defaults=True):
    """TEI's ``EmbedSparseRequest`` with this server's extensions (module docstring)."""

    inputs: str | list[Any]
    model: str
    truncate: bool | None = None
    truncation_direction: Literal["right", "left", "Right", "Left"] = "right"
    prompt_name: str | None = None
    #: Extension: each text's largest weights only.
    top_k: int | None = None
    #: Extension: weights below it dropped.
    threshold: float | None = None
    #: Extension (``app.protocols.text``).
    input_type: text.InputType | None = None
    #: vLLM's extension: the request's priority level, as Triton's ``parameters.priority``.
    priority: int | None = None


class SparseValue(msgspec.Struct):
    """One non-zero term of a text: its vocabulary id and weight."""

    index: int
    value: float


#: TEI's ``EmbedSparseResponse``: per text, its non-zero terms.
EmbedSparseResponse = list[list[SparseValue]]

_decoder = msgspec.json.Decoder(EmbedSparseRequest)


def decode(body: bytes, limits: RequestLimits) -> EmbedSparseRequest:
    """The request, ``inputs`` a non-empty list of strings (a lone string is one).

    Raises:
        InvalidInput: malformed JSON, a field of the wrong type, no inputs, token arrays, a
            ``top_k`` below 1, a ``prompt_name``.
        PayloadTooLarge: more texts than ``limits.max_items``.
    """
    request = decode_json(_decoder, body, limits.max_json_depth, "embed_sparse request")
    request.inputs = text.input_texts(request.inputs)
    if request.top_k is not None and request.top_k < 1:
        raise InvalidInput("top_k must be a positive number of terms")
    if request.prompt_name is not None:
        raise InvalidInput(
            "prompt_name is not supported: a model's prompts are its folder's, applied by input_type "
            '("query" or "document")'
        )
    limits.check_items(len(request.inputs), "inputs")
    return request


def check_model(config: ModelConfig) -> None:
    """Raises InvalidInput (400) for a model that makes no sparse embeddings (module docstring)."""
    outputs = {s.name: s for s in config.outputs}
    sparse = all(
        name in outputs and outputs[name].datatype == datatype and outputs[name].ragged
        for name, datatype in ((INDICES, "INT64"), (VALUES, "FP32"))
    )
    takes_text = any(s.name == TEXT and s.datatype == "BYTES" for s in config.inputs)
    if not sparse or not takes_text:
        raise InvalidInput(
            f"model {config.name!r} does not produce sparse embeddings (it needs a BYTES input 'text' "
            "and ragged outputs 'indices' INT64 and 'values' FP32)"
        )


def infer_request(config: ModelConfig, request: EmbedSparseRequest) -> InferRequest:
    """The inference request: the texts, ``[N, 1]`` BYTES (with ``input_type`` and
    ``truncate_prompt_tokens`` where asked); asking for ``indices`` and ``values``.

    Raises:
        InvalidInput: see :func:`check_model`; ``input_type`` or a left truncation asked of a
            model without that input.
    """
    check_model(config)
    texts = list(request.inputs)
    left = request.truncate and request.truncation_direction.lower() == "left"
    return InferRequest(
        model_name=config.name,
        inputs=[
            InferInput(TEXT, "BYTES", [len(texts), 1], texts),
            *text.input_type_inputs(config, request.input_type, len(texts)),
            *text.truncation_inputs(config, -1 if left else None, len(texts)),
        ],
        outputs=[RequestedOutput(INDICES), RequestedOutput(VALUES)],
    )


def pruned(
    ids: np.ndarray, weights: np.ndarray, top_k: int | None, threshold: float | None
) -> tuple[np.ndarray, np.ndarray]:
    """One text's terms (ids ascending, their weights) without the weights below ``threshold``,
    then its ``top_k`` largest (ties: the lower id first), ids ascending."""
    if threshold is not None:
        kept = weights >= threshold
        ids, weights = ids[kept], weights[kept]
    if top_k is not None and len(ids) > top_k:
        best = np.sort(np.argsort(-weights, kind="stable")[:top_k])
        ids, weights = ids[best], weights[best]
    return ids, weights


def encode(request: EmbedSparseRequest, outputs: dict[str, np.ndarray]) -> bytes:
    """The response body: per text, in order, its terms (:func:`pruned`) as ``{"index",
    "value"}`` (a value in the shortest form that reads back as the same float32)."""
    count = len(request.inputs)
    rows = []
    for ids, weights in zip(
        text.items(outputs[INDICES], count), text.items(outputs[VALUES], count), strict=True
    ):
        ids, weights = pruned(
            np.asarray(ids, dtype=np.int64),
            np.asarray(weights, dtype=np.float32),
            request.top_k,
            request.threshold,
        )
        rows.append([{"index": i, "value": v} for i, v in zip(ids.tolist(), weights, strict=True)])
    return orjson.dumps(rows, option=orjson.OPT_SERIALIZE_NUMPY)


#: TEI's sparse embeddings API (``app.protocols.codec.Api``).
API = Api(
    protocol="embed_sparse",
    title="text-embeddings-inference's sparse embeddings API",
    routes=(Route("/embed_sparse", "embedSparse"),),
    codec=BodyNamedCodec(decode, infer_request, lambda body, config, out: encode(body, out)),
    summary="Sparse embeddings (SPLADE; text-embeddings-inference's API) of a sparse encoder",
    request=EmbedSparseRequest,
    response=EmbedSparseResponse,
    answer="Per text, in order: its non-zero terms, vocabulary ids ascending.",
)
