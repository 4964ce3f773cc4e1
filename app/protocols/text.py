"""What the text APIs share (OpenAI's embeddings, the rerank and classify APIs): their texts,
the per-item counts a text model may return (``tokens``, ``windows``), and vLLM's
``truncate_prompt_tokens``. No aiohttp here.

**Counts.** A text model's INT64 ``tokens`` output (the tokens each item made the model run)
is what ``usage`` reports; without it ``usage`` is 0. Its ``windows`` output says how many
windows a long text took (``app.serving.windows``); without it, 1 each.

**``truncate_prompt_tokens``** (vLLM's field on its embeddings, classify, score and rerank
APIs): ``k >= 1`` keeps each text's *last* ``k`` tokens (left truncation, special tokens
counted), ``-1`` cuts at the model's maximum length; absent, the model's own policy holds
(``truncation`` in its ``model.toml``: windows, truncation or refusal). 0 and below -1 are a
400 (vLLM's rule for its sampling parameters). The server passes it to a model that declares
an optional INT64 input named ``truncate_prompt_tokens`` (shape ``[1]``), one value per item
(omitted: 0 = not asked); the model's handler truncates, and refuses a ``k`` above its
maximum length (400, as vLLM). A model without that input refuses a request that sets it (400
naming the model): silently ignoring it would answer another question.

**``input_type``** (an extension, Voyage AI's field name and values): ``"query"`` or
``"document"``, what the texts are, for a retrieval model whose queries and documents are
encoded apart (inference-free SPLADE's routes, ColBERT's markers); passed to a model that
declares an optional INT64 input ``input_type`` as 1 (a query) or 2 (a document) per item
(0: the model's default, as when omitted); a model without it refuses a request that sets it
(400).

**Ragged outputs.** A sparse or multi-vector model's output differs in length per item
(``ragged = true`` in its model.toml): the API receives it as B arrays (:func:`items`).

Source: vLLM's ``PoolingParams.truncate_prompt_tokens`` and ``_validate_truncation_size``
(``-1``: the model's ``max_model_len``; ``k``: the last ``k`` tokens; above ``max_model_len``
refused); Voyage AI's embeddings API (``input_type``).
"""

from __future__ import annotations

from typing import Annotated, Any, Generic, Literal, TypeVar

import msgspec
import numpy as np

from app.errors import InvalidInput
from app.models.repository import ModelConfig
from app.models.text import INPUT_TYPE, TOKENS, TRUNCATE, WINDOWS
from app.protocols.infer import InferInput, RequestedOutput

#: What a text of a retrieval model is (module docstring).
InputType = Literal["query", "document"]
#: ``input_type``'s values as the model takes them (INT64), by position: 0 the model's default.
INPUT_TYPES = ("", "query", "document")
#: A row of a :class:`PoolingResponse`'s ``data``.
Row = TypeVar("Row")

#: vLLM's ``truncate_prompt_tokens`` (module docstring).
TruncatePromptTokens = Annotated[
    int,
    msgspec.Meta(
        ge=-1,
        description="vLLM's: keep each text's last k tokens (k >= 1), or cut at the model's "
        "maximum length (-1); for a model that declares an INT64 input truncate_prompt_tokens.",
    ),
]


class UsageInfo(msgspec.Struct):
    """vLLM's ``usage``: the tokens the model ran (``prompt_tokens`` = ``total_tokens``; nothing
    is generated)."""

    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class PoolingResponse(msgspec.Struct, Generic[Row]):
    """The answer of vLLM's pooling APIs (classify, score): an id, when, the model, one row of
    ``data`` per item in order, ``usage``. Each API subclasses it with its row type."""

    id: str
    created: int
    model: str
    data: list[Row]
    usage: UsageInfo
    object: str = "list"


def input_texts(value: str | list[Any]) -> list[str]:
    """An OpenAI-style ``input`` as a non-empty list of strings (a lone string is one).

    Raises:
        InvalidInput: no input, or token arrays instead of strings.
    """
    texts = [value] if isinstance(value, str) else value
    if not texts:
        raise InvalidInput("input: give a string or a non-empty list of strings")
    if not all(isinstance(text, str) for text in texts):
        raise InvalidInput("input: token arrays are not supported; send the texts as strings")
    return texts


def check_truncation(value: int | None) -> None:
    """Raises InvalidInput (400) for a ``truncate_prompt_tokens`` of 0 (below -1 the decoder
    refuses)."""
    if value == 0:
        raise InvalidInput(
            "truncate_prompt_tokens must be -1 (the model's maximum length) or a positive number of tokens"
        )


def truncation_inputs(config: ModelConfig, value: int | None, items: int) -> list[InferInput]:
    """The ``truncate_prompt_tokens`` input of a request of ``items`` texts: none when not asked,
    else its value for each item, INT64 ``[items, 1]``.

    Raises:
        InvalidInput: asked of a model that declares no INT64 input ``truncate_prompt_tokens``.
    """
    return _per_item(
        config, TRUNCATE, value, items, "does not truncate on request", " to use the model's own truncation"
    )


def counts_wanted(config: ModelConfig, names: tuple[str, ...] = (TOKENS, WINDOWS)) -> list[RequestedOutput]:
    """The count outputs among ``names`` the model returns (INT64), to ask for beside its answer."""
    outputs = {s.name: s.datatype for s in config.outputs}
    return [RequestedOutput(name) for name in names if outputs.get(name) == "INT64"]


def token_count(outputs: dict[str, np.ndarray]) -> int:
    """The tokens all the items made the model run (``usage``); 0 without a ``tokens`` output."""
    return int(outputs[TOKENS].sum()) if TOKENS in outputs else 0


def usage(outputs: dict[str, np.ndarray]) -> UsageInfo:
    """vLLM's ``usage`` of a response: :func:`token_count` as prompt and total tokens."""
    tokens = token_count(outputs)
    return UsageInfo(tokens, tokens)


def windows_each(outputs: dict[str, np.ndarray], count: int) -> np.ndarray:
    """The windows each of ``count`` items took, int64 ``[count]``; 1 each without ``windows``."""
    return np.asarray(outputs[WINDOWS]).reshape(-1) if WINDOWS in outputs else np.ones(count, np.int64)


def input_type_inputs(config: ModelConfig, value: str | None, items: int) -> list[InferInput]:
    """The ``input_type`` input of a request of ``items`` texts: none when not asked, else its
    value for each item, INT64 ``[items, 1]`` (:data:`INPUT_TYPES`).

    Raises:
        InvalidInput: asked of a model that declares no INT64 input ``input_type``.
    """
    code = None if value is None else INPUT_TYPES.index(value)
    return _per_item(config, INPUT_TYPE, code, items, "encodes queries and documents alike")


def _per_item(
    config: ModelConfig, name: str, value: int | None, items: int, without: str, instead: str = ""
) -> list[InferInput]:
    """A request-wide field as the model's optional INT64 input ``name``: none when not asked
    (``value`` None), else ``value`` for each of ``items`` items, ``[items, 1]``.

    Raises:
        InvalidInput: asked of a model that declares no INT64 input ``name``; the message says
            what the model does ``without`` it and what leaving the field out gives
            (``instead``).
    """
    if value is None:
        return []
    spec = config.input(name)
    if spec is None or spec.datatype != "INT64":
        raise InvalidInput(
            f"{name}: model {config.name!r} {without} (its model.toml declares no INT64 input "
            f"{name!r}); leave it out{instead}"
        )
    return [InferInput(name, "INT64", [items, 1], np.full((items, 1), value, dtype=np.int64))]


def items(array: np.ndarray, count: int) -> list[np.ndarray]:
    """A ragged output as its ``count`` items' arrays: an object array ``[B]`` of them, or a
    numeric array whose first axis is the items (every item the same length)."""
    if array.dtype == object:
        return [np.asarray(item) for item in array.reshape(-1)]
    return list(np.asarray(array).reshape(count, *array.shape[1:])) if count else []
