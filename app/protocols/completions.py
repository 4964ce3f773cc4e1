"""OpenAI's legacy completions API (``POST /v1/completions``) for scoring prompts: ``echo = true``
with ``max_tokens`` 0 returns each prompt's token log-probs, and with ``max_tokens`` 1 the greedy
next token after them too, as OpenAI's API answered it and vLLM serves it. No aiohttp here.

Why this route: it is how clients already ask a server for a text's log-likelihood.
lm-evaluation-harness's ``local-completions`` model (0.4.4 and later) scores ``loglikelihood``
and ``loglikelihood_rolling`` tasks with ``echo=True, max_tokens=1, logprobs=1,
temperature=0`` against any OpenAI-compatible server, reading ``token_logprobs[ctxlen:-1]``
(the continuation, the generated token left out) and, for "is greedy", whether each token's
log-prob is the largest of its ``top_logprobs`` row; the stock ``openai`` client's
``completions.create`` sends the same. The per-token answer (``choices[i].logprobs``:
``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``) is that API's shape. A route
of our own would reach none of them.

A model serves it when it takes text (a BYTES input ``text``) and returns its token log-probs as
BYTES ``token_logprobs`` (``app.handlers.causal_lm``). Each prompt (a string, or a list of them)
is one item and one choice, in order. The model lists every prompt's tokens (its optional INT64
input ``return_token_logprobs`` set to 1 where declared), so that a prompt longer than the model
takes is refused (400 naming its tokens and the limit, as vLLM answers) rather than scored in
part, unless vLLM's ``truncate_prompt_tokens`` asks for its last tokens (the model's optional
INT64 input of that name; a model without it refuses the field; the choice's ``text`` is still
the prompt, its lists and ``usage`` the kept tokens'). The request's ``logprobs``
(0 to 20: the alternatives listed per token, vLLM's default bound) reaches the model's
``top_logprobs``; without ``logprobs`` a choice's ``logprobs`` is null. ``max_tokens = 1``
reaches the model's optional INT64 input ``next_token``: the choice's ``text`` is the prompt
and the greedy next token, its lists one entry longer, as vLLM answers ``echo`` with one
generated token; ``usage.completion_tokens`` counts it. ``usage.prompt_tokens`` counts the
tokens the model ran (its ``tokens`` output: a scoring prefix included).

Refused (400, saying what to send): no ``echo`` (a completion without it lists only the tokens
it generates: lm-evaluation-harness 0.4.2-0.4.3 ask so, with token arrays and ``logprobs = 10``,
and no server that generates nothing can answer it), ``max_tokens`` other than 0 or 1, token
arrays as ``prompt`` (the server tokenizes), an empty prompt (vLLM: "The decoder prompt cannot be
empty"), sampling (``temperature`` above 0) with ``max_tokens = 1`` (the token is the greedy
one), ``n`` other than 1, ``stream``. Other sampling fields (``top_p``, ``stop``, ``seed``...)
change nothing and are accepted as they come. Errors have OpenAI's shape.

Source: OpenAI's API reference, "Completions (Legacy)" (``echo``, ``logprobs``: "the API will
always return the logprob of the sampled token, so there may be up to logprobs+1 elements");
vLLM's ``OpenAIServingCompletion`` (``echo`` with ``max_tokens`` 0 or more, prompt log-probs,
``_create_completion_logprobs``); lm-evaluation-harness ``lm_eval/models/openai_completions.py``
(``LocalCompletionsAPI._create_payload``, ``parse_logprobs``).
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
RETURN, TOP, NEXT = "return_token_logprobs", "top_logprobs", "next_token"
#: The bound on ``logprobs``: vLLM's default ``max_logprobs`` (OpenAI's legacy API: 5).
MAX_LOGPROBS = 20


class CompletionRequest(msgspec.Struct, omit_defaults=True):
    """OpenAI's legacy ``CreateCompletionRequest``, the fields a scoring request uses; the
    sampling fields are accepted and change nothing (module docstring)."""

    model: str
    prompt: str | list[Any]
    echo: bool = False
    #: OpenAI's default is 16; this server generates at most the greedy next token: 0 or 1.
    max_tokens: int | None = 16
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    #: Above 0 asks to sample the generated token: refused with ``max_tokens = 1``.
    temperature: float | None = None
    n: int | None = None
    stream: bool | None = None
    user: str | None = None
    #: vLLM's extension: the request's priority level, as Triton's ``parameters.priority``.
    priority: int | None = None
    #: vLLM's extension (``app.protocols.text``): keep each prompt's last k tokens.
    truncate_prompt_tokens: text.TruncatePromptTokens | None = None


class Choice(msgspec.Struct):
    """One prompt's answer: the prompt echoed (and the greedy next token where one was asked),
    its token log-probs (OpenAI's ``logprobs`` object, as the model wrote it) or null."""

    text: str
    index: int
    logprobs: msgspec.Raw | None
    finish_reason: str = "length"


class Usage(msgspec.Struct):
    """Tokens the model ran, and those generated (one per prompt with ``max_tokens = 1``)."""

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


class _Listed(msgspec.Struct):
    """The part of a ``token_logprobs`` JSON :func:`encode` reads: the tokens."""

    tokens: list[str]


_listed = msgspec.json.Decoder(_Listed)


def decode(body: bytes, limits: RequestLimits) -> CompletionRequest:
    """The request, its ``prompt`` a non-empty list of non-empty strings (a lone string is one).

    Raises:
        InvalidInput: malformed JSON, a field of the wrong type, no prompt, an empty prompt,
            token arrays, no ``echo``, a ``max_tokens`` other than 0 or 1, sampling with
            ``max_tokens = 1``, ``n`` other than 1, ``stream``, a ``truncate_prompt_tokens`` of 0.
        PayloadTooLarge: more prompts than ``limits.max_items``.
    """
    request = decode_json(_decoder, body, limits.max_json_depth, "completions request")
    if not request.echo:
        raise InvalidInput(
            "send echo=true: this server scores prompts and generates at most the greedy next token, "
            "and a completion without echo lists only generated tokens (lm-evaluation-harness 0.4.4 "
            "and later send echo=true with max_tokens=1)"
        )
    if request.max_tokens not in (0, 1):
        raise InvalidInput(
            f"max_tokens must be 0 (the prompt's token log-probs) or 1 (and the greedy next token), "
            f"got {request.max_tokens}: this server generates no more"
        )
    if request.max_tokens == 1 and request.temperature is not None and request.temperature > 0:
        raise InvalidInput(
            f"temperature {request.temperature} asks to sample the next token; this server gives the "
            "greedy one: send temperature=0"
        )
    if request.n not in (None, 1):
        raise InvalidInput(f"n must be 1 (one choice per prompt), got {request.n}")
    if request.stream:
        raise InvalidInput("stream is not supported: send stream=false (the answer comes in one body)")
    text.check_truncation(request.truncate_prompt_tokens)
    try:
        request.prompt = text.input_texts(request.prompt)
    except InvalidInput as exc:
        raise InvalidInput(str(exc).replace("input:", "prompt:", 1)) from None
    empty = next((i for i, prompt in enumerate(request.prompt) if not prompt), None)
    if empty is not None:
        raise InvalidInput(f"prompt {empty} is empty: a prompt needs at least one token to score")
    limits.check_items(len(request.prompt), "prompt")
    return request


def infer_request(config: ModelConfig, request: CompletionRequest) -> InferRequest:
    """The inference request: the prompts, ``[N, 1]`` BYTES, to ``text``; the model's
    ``return_token_logprobs`` (1), ``top_logprobs`` (the request's ``logprobs``), ``next_token``
    (``max_tokens``) and ``truncate_prompt_tokens`` where it declares them and they are asked;
    its ``token_logprobs`` and ``tokens`` (where it has it) asked for.

    Raises:
        InvalidInput: the model takes no ``text`` or returns no BYTES ``token_logprobs``; it
            declares no ``top_logprobs`` for ``logprobs`` above 0, no ``next_token`` for
            ``max_tokens = 1``, no ``truncate_prompt_tokens`` for that field.
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
    asked = {RETURN: 1, TOP: request.logprobs or 0, NEXT: request.max_tokens or 0}
    for name in (TOP, NEXT):
        if asked[name] and inputs.get(name) != "INT64":
            field = "logprobs above 0" if name == TOP else "max_tokens = 1"
            raise InvalidInput(
                f"{field}: model {config.name!r} declares no INT64 input {name!r} (add it to its "
                "model.toml, optional, shape [1])"
            )
    given = [InferInput(TEXT, "BYTES", [count, 1], prompts)]
    for name, value in asked.items():
        if inputs.get(name) == "INT64" and value:
            given.append(InferInput(name, "INT64", [count, 1], np.full((count, 1), value, np.int64)))
    given += text.truncation_inputs(config, request.truncate_prompt_tokens, count)
    wanted = [RequestedOutput(LOGPROBS), *text.counts_wanted(config, (text.TOKENS,))]
    return InferRequest(model_name=config.name, inputs=given, outputs=wanted)


def encode(request: CompletionRequest, model: str, outputs: dict[str, np.ndarray]) -> bytes:
    """The response body: one choice per prompt, in order; with ``max_tokens = 1`` each text
    ends with its greedy next token (the last of the model's listed tokens)."""
    prompts = list(request.prompt)
    lists = np.asarray(outputs[LOGPROBS]).reshape(-1)
    choices = []
    for i, prompt in enumerate(prompts):
        listed = bytes(lists[i])
        generated = _listed.decode(listed).tokens[-1] if request.max_tokens and listed else ""
        raw = msgspec.Raw(listed) if request.logprobs is not None and listed else None
        choices.append(Choice(prompt + generated, i, raw))
    tokens = text.token_count(outputs)
    made = len(prompts) * (request.max_tokens or 0)
    usage = Usage(tokens, tokens + made, made)
    created = int(time.time())
    return msgspec.json.encode(CompletionResponse(f"cmpl-{uuid.uuid4().hex}", created, model, choices, usage))


#: OpenAI's legacy completions API, for scoring (``app.protocols.codec.Api``).
API = Api(
    protocol="completions",
    title="OpenAI's legacy completions API, scoring prompts (echo, max_tokens 0 or 1)",
    routes=(Route("/v1/completions", "createCompletion"),),
    codec=BodyNamedCodec(decode, infer_request, lambda body, config, out: encode(body, config.name, out)),
    summary="Token log-probs of prompts, and the greedy next token (OpenAI's legacy completions with "
    "echo and max_tokens 0 or 1) from a causal LM",
    request=CompletionRequest,
    response=CompletionResponse,
    answer="One choice per prompt, in order: the prompt echoed (and its greedy next token) and its "
    "token log-probs.",
    errors=openai.ERRORS,
)
