"""The classify API (``POST /v1/classify``) in the shape vLLM serves: the request and response
bodies, and which models can serve it. No aiohttp here.

A model classifies when it takes text (a BYTES input ``text``) and returns FP32
``probabilities`` whose ``labels`` ``model.toml`` declares (``app.handlers.sequence_classification``).
Each input is one item; each result names the most probable label, all the probabilities in
label order and (extension) the windows the text took (``app.serving.windows``: a long text's
probabilities are its windows', put together by the model's ``aggregate``). Errors have OpenAI's
shape, as vLLM answers them.

Source: vLLM's ``/classify`` (``ClassificationRequest``: ``model``, ``input``;
``ClassificationResponse``: ``data`` of ``index``, ``label``, ``probs``, ``num_classes``;
``usage``); Infinity's ``/classify`` serves the same texts with a list of label scores.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
import numpy as np

from app.errors import InvalidInput
from app.models.repository import ModelConfig
from app.models.text import PROBABILITIES, TEXT
from app.protocols import openai, text
from app.protocols.codec import Api, BodyNamedCodec, Route
from app.protocols.infer import InferInput, InferRequest, RequestedOutput
from app.protocols.tensors import RequestLimits, decode_json


class ClassifyRequest(msgspec.Struct, omit_defaults=True):
    """vLLM's ``ClassificationRequest``: ``input`` a string or a list of them."""

    input: str | list[Any]
    model: str
    user: str | None = None
    #: vLLM's extension: the request's priority level, as Triton's ``parameters.priority``.
    priority: int | None = None
    #: vLLM's (``app.protocols.text``).
    truncate_prompt_tokens: text.TruncatePromptTokens | None = None


class Classification(msgspec.Struct):
    """One text's result."""

    index: int
    label: str
    probs: list[float]
    num_classes: int
    windows: int = 1
    object: str = "classification"


class ClassifyResponse(text.PoolingResponse[Classification]):
    """vLLM's ``ClassificationResponse``."""


_decoder = msgspec.json.Decoder(ClassifyRequest)


def decode(body: bytes, limits: RequestLimits) -> ClassifyRequest:
    """The request, its ``input`` a non-empty list of strings (a lone string is one).

    Raises:
        InvalidInput: malformed JSON, a field of the wrong type, no input, token arrays, a
            ``truncate_prompt_tokens`` of 0.
    """
    request = decode_json(_decoder, body, limits.max_json_depth, "classify request")
    request.input = text.input_texts(request.input)
    text.check_truncation(request.truncate_prompt_tokens)
    limits.check_items(len(request.input), "input")
    return request


def labels(config: ModelConfig) -> list[str]:
    """The label names of the model's ``probabilities``.

    Raises:
        InvalidInput: the model takes no text or has no FP32 ``probabilities`` with labels.
    """
    outputs = {s.name: s for s in config.outputs}
    spec = outputs.get(PROBABILITIES)
    takes_text = any(s.name == TEXT and s.datatype == "BYTES" for s in config.inputs)
    if spec is None or spec.datatype != "FP32" or not spec.labels or not takes_text:
        raise InvalidInput(
            f"model {config.name!r} does not classify (it needs a BYTES input 'text' and an FP32 output "
            "'probabilities' with labels)"
        )
    return list(spec.labels)


def infer_request(config: ModelConfig, request: ClassifyRequest) -> InferRequest:
    """The inference request: the texts, ``[N, 1]`` BYTES; asking for ``probabilities`` (and
    ``tokens``, ``windows`` where the model has them).

    Raises:
        InvalidInput: see :func:`labels`; ``truncate_prompt_tokens`` for a model that does not
            take it.
    """
    labels(config)
    texts = list(request.input)
    return InferRequest(
        model_name=config.name,
        inputs=[
            InferInput(TEXT, "BYTES", [len(texts), 1], texts),
            *text.truncation_inputs(config, request.truncate_prompt_tokens, len(texts)),
        ],
        outputs=[RequestedOutput(PROBABILITIES), *text.counts_wanted(config)],
    )


def encode(config: ModelConfig, outputs: dict[str, np.ndarray]) -> bytes:
    """The response body: one result per input, in order."""
    names = labels(config)
    probabilities = np.asarray(outputs[PROBABILITIES], dtype=np.float32).reshape(-1, len(names))
    count = len(probabilities)
    windows = text.windows_each(outputs, count)
    data = [
        Classification(i, names[int(np.argmax(row))], row.tolist(), len(names), int(windows[i]))
        for i, row in enumerate(probabilities)
    ]
    response = ClassifyResponse(
        f"classify-{uuid.uuid4().hex}", int(time.time()), config.name, data, text.usage(outputs)
    )
    return msgspec.json.encode(response)


#: vLLM's classify API (``app.protocols.codec.Api``).
API = Api(
    protocol="classify",
    title="vLLM's classify API",
    routes=(Route("/v1/classify", "classify"),),
    codec=BodyNamedCodec(decode, infer_request, lambda body, config, out: encode(config, out)),
    summary="Classify texts (vLLM's API) with a sequence classifier",
    request=ClassifyRequest,
    response=ClassifyResponse,
    answer="Per text, in order: the top label, the probabilities, windows taken.",
    errors=openai.ERRORS,
)
