"""OpenAI's legacy completions API (``POST /v1/completions``) for scoring prompts: ``echo = true``
with ``max_tokens = 0`` returns each prompt's token log-probs and generates nothing, as OpenAI's
API answered it and vLLM serves it. No aiohttp here.

Why this route: it is how clients already ask a server for a text's log-likelihood.
lm-evaluation-harness's ``local-completions`` model scores ``loglikelihood`` and
``loglikelihood_rolling`` tasks with exactly ``echo=True, max_tokens=0, logprobs=1`` against any
OpenAI-compatible server, and the stock ``openai`` client's ``completions.create`` sends it; the
per-token answer (``choices[i].logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``) is that API's shape. A route of our own would reach none of them.

A model serves it when it takes text (a BYTES input ``text``) and returns its token log-probs as
BYTES ``token_logprobs`` (``app.handlers.causal_lm``); the request's ``logprobs`` (0 to 5: the
alternatives listed per token) reaches the model's optional INT64 inputs
``return_token_logprobs`` and ``top_logprobs`` where it declares them; without ``logprobs`` a
choice's ``logprobs`` is null. Each prompt (a string, or a list of them) is one item and one
choice, in order; ``text`` echoes the prompt. This server generates nothing: a request without
``echo`` or with ``max_tokens`` other than 0 is a 400, and so are token arrays as ``prompt`` (the
server tokenizes). Sampling fields (``temperature``, ``top_p``, ``n``, ``stop``, ``seed``...)
change nothing when nothing is generated and are accepted as they come. ``usage.prompt_tokens``
counts the tokens the model ran (its ``tokens`` output: a scoring prefix included). Errors have
OpenAI's shape.

Source: OpenAI's API reference, "Completions (Legacy)" (``echo``, ``logprobs`` up to 5, the
``logprobs`` object); vLLM's ``/v1/completions`` (``echo`` with prompt log-probs);
lm-evaluation-harness ``lm_eval/models/openai_completions.py`` (``LocalCompletionsAPI``).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any

import msgspec
import numpy as np

from app.errors import InvalidInput
from app.models.repository import ModelConfig
from app.protocols import openai, text
from app.protocols.codec import Api, BodyNamedCodec, Route
from app.protocols.infer import InferInput, InferRequest, RequestedOutput
from app.protocols.tensors import RequestLimits, decode_json

TEXT, LOGPROBS = "text", "token_logprobs"
RETURN, TOP = "return_token_logprobs", "top_logprobs"
#: OpenAI's bound on ``logprobs``.
MAX_LOGPROBS = 5


class CompletionRequest(msgspec.Struct, omit_defaults=True):
    """OpenAI's legacy ``CreateCompletionRequest``, the fields a scoring request uses; the
    sampling fields are accepted and change nothing (module docstring)."""

    model: str
    prompt: str | list[Any]
    echo: bool = False
    #: OpenAI's default is 16; this server generates nothing: 0 is required.
    max_tokens: int | None = 16
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    user: str | None = None
    #: vLLM's extension: the request's priority level, as Triton's ``parameters.priority``.
    priority: int | None = None


class Choice(msgspec.Struct):
    """One prompt's answer: the prompt echoed, its token log-probs (OpenAI's ``logprobs`` object,
    as the model wrote it) or null."""

    text: str
    index: int
    logprobs: msgspec.Raw | None
    finish_reason: str = "length"


class Usage(msgspec.Struct):
    """Tokens the model ran; none generated."""

    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class CompletionResponse(msgspec.Struct):
    """OpenAI's legacy ``Completion``."""

    id: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    object: str = "text_completion"


_decoder = msgspec.json.Decoder(CompletionRequest)


def decode(body: bytes, limits: RequestLimits) -> CompletionRequest:
    """The request, its ``prompt`` a non-empty list of strings (a lone string is one).

    Raises:
        InvalidInput: malformed JSON, a field of the wrong type, no prompt, token arrays, no
            ``echo`` or a ``max_tokens`` other than 0 (this server generates nothing).
        PayloadTooLarge: more prompts than ``limits.max_items``.
    """
    request = decode_json(_decoder, body, limits.max_json_depth, "completions request")
    if not request.echo or request.max_tokens != 0:
        raise InvalidInput(
            "this server scores prompts and generates nothing: send echo=true and max_tokens=0 "
            "(with logprobs for the per-token log-probs)"
        )
    try:
        request.prompt = text.input_texts(request.prompt)
    except InvalidInput as exc:
        raise InvalidInput(str(exc).replace("input:", "prompt:", 1)) from None
    limits.check_items(len(request.prompt), "prompt")
    return request


def infer_request(config: ModelConfig, request: CompletionRequest) -> InferRequest:
    """The inference request: the prompts, ``[N, 1]`` BYTES, to ``text``; with ``logprobs``, the
    model's ``return_token_logprobs`` and ``top_logprobs`` where it declares them and its
    ``token_logprobs`` asked for (and ``tokens`` where the model has it).

    Raises:
        InvalidInput: the model takes no ``text`` or returns no BYTES ``token_logprobs``.
    """
    inputs = {s.name: s.datatype for s in config.inputs}
    outputs = {s.name: s.datatype for s in config.outputs}
    if inputs.get(TEXT) != "BYTES" or outputs.get(LOGPROBS) != "BYTES":
        raise InvalidInput(
            f"model {config.name!r} does not score prompts (it needs a BYTES input 'text' and a BYTES "
            "output 'token_logprobs': a causal LM)"
        )
    prompts = list(request.prompt)
    count = len(prompts)
    given = [InferInput(TEXT, "BYTES", [count, 1], prompts)]
    wanted = [*text.counts_wanted(config, (text.TOKENS,))]
    if request.logprobs is not None:
        wanted.append(RequestedOutput(LOGPROBS))
        for name, value in ((RETURN, 1), (TOP, request.logprobs)):
            if inputs.get(name) == "INT64":
                given.append(InferInput(name, "INT64", [count, 1], np.full((count, 1), value, np.int64)))
    return InferRequest(model_name=config.name, inputs=given, outputs=wanted or [RequestedOutput(LOGPROBS)])


def encode(request: CompletionRequest, model: str, outputs: dict[str, np.ndarray]) -> bytes:
    """The response body: one choice per prompt, in order."""
    prompts = list(request.prompt)
    lists = np.asarray(outputs[LOGPROBS]).reshape(-1) if LOGPROBS in outputs else None
    choices = [
        Choice(prompt, i, msgspec.Raw(bytes(lists[i])) if lists is not None and len(lists[i]) else None)
        for i, prompt in enumerate(prompts)
    ]
    tokens = text.token_count(outputs)
    return msgspec.json.encode(
        CompletionResponse(
            f"cmpl-{uuid.uuid4().hex}", int(time.time()), model, choices, Usage(tokens, tokens)
        )
    )


#: OpenAI's legacy completions API, for scoring (``app.protocols.codec.Api``).
API = Api(
    protocol="completions",
    title="OpenAI's legacy completions API, scoring prompts (echo, max_tokens = 0)",
    routes=(Route("/v1/completions", "createCompletion"),),
    codec=BodyNamedCodec(decode, infer_request, lambda body, config, out: encode(body, config.name, out)),
    summary="Token log-probs of prompts (OpenAI's legacy completions with echo and max_tokens = 0) "
    "from a causal LM",
    request=CompletionRequest,
    response=CompletionResponse,
    answer="One choice per prompt, in order: the prompt echoed and its token log-probs.",
    errors=openai.ERRORS,
)
