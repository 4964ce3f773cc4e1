"""Long texts in windows: what a text model does with a text longer than its ``max_seq_length``,
and how the windows' results are put back together per text.

``[parameters]`` of ``model.toml`` (read by the text handlers that take windows):

``truncation`` (str)
    ``"window"`` (the default of the sequence-classification handler):
    a long text becomes several windows of ``max_seq_length`` tokens (special tokens and, for a
    (query, text) pair, the query included), each repeating the last ``stride`` tokens of the one
    before; each window is priced and run, and the results are aggregated per text.
    ``"truncate"``: the text is cut after ``max_seq_length`` tokens (one window).
    ``"error"``: a longer text is refused (400 naming its tokens and the limit).
    Why windows by default for classifiers and cross-encoders: a moderation model that never sees
    the end of a post, or a reranker that never sees the relevant part of a document, is wrong
    without saying so; windows cost more, but the cost is priced before anything is queued and
    bounded by ``max_windows`` and ``max_request_tokens``.
``stride`` (int, tokens, default ``max_seq_length // 8``)
    Tokens each window repeats from the one before (Hugging Face tokenizers' ``stride``), so that
    a phrase cut at a window's edge is whole in the next one. The step between windows is the
    window's text tokens minus ``stride``.
``max_windows`` (int, default 16)
    Windows one text may take; a text needing more is refused with 413.
``max_request_tokens`` (int, default none)
    Tokens (all windows of all texts of one request) a request may cost; above: 413, before any
    window is queued.
``aggregate`` (str)
    How windows' class probabilities and scores become one per text: ``"max"`` (default: a post is
    flagged if any part of it is; for (query, text) pairs MaxP, the best passage's score: Dai and
    Callan, "Deeper Text Understanding for IR with Contextual Neural Language Modeling", SIGIR
    2019) or ``"mean"``. Embeddings are always aggregated by the token-weighted mean,
    renormalised (:func:`weighted_mean`).

Splitting uses the tokenizer's own overflow support (``return_overflowing_tokens`` with
``stride``, ``truncation="only_second"`` for pairs), the mechanism Hugging Face's
question-answering pipeline uses for long contexts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from app.errors import PayloadTooLarge

__all__ = ["AGGREGATES", "TRUNCATIONS", "WindowPolicy", "Windows", "aggregate", "split", "weighted_mean"]

TRUNCATIONS = ("window", "truncate", "error")
AGGREGATES = ("max", "mean")
PARAMETERS = ("truncation", "stride", "max_windows", "max_request_tokens", "aggregate")


def _positive_int(
    parameters: Mapping[str, Any], name: str, default: int | None, minimum: int = 1
) -> int | None:
    value = parameters.get(name, default)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"parameters.{name} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class WindowPolicy:
    """What a model does with long texts (see the module docstring for each field).

    Attributes:
        truncation: ``"window"``, ``"truncate"`` or ``"error"``.
        max_length: tokens per window, special tokens (and a pair's query) included.
        stride: tokens a window repeats from the one before (0 <= stride < max_length // 2).
        max_windows: windows per text, >= 1.
        max_request_tokens: tokens per request over all windows; None = no bound.
        aggregate: ``"max"`` or ``"mean"``.
    """

    truncation: str
    max_length: int
    stride: int
    max_windows: int = 16
    max_request_tokens: int | None = None
    aggregate: str = "max"

    @classmethod
    def from_parameters(
        cls, parameters: Mapping[str, Any], max_length: int, default_truncation: str = "window"
    ) -> WindowPolicy:
        """The policy ``[parameters]`` give, for windows of ``max_length`` tokens.

        Raises:
            ValueError: a value of the wrong type or out of range, naming the parameter.
        """
        truncation = parameters.get("truncation", default_truncation)
        if truncation not in TRUNCATIONS:
            raise ValueError(f"parameters.truncation must be one of {list(TRUNCATIONS)}, got {truncation!r}")
        how = parameters.get("aggregate", "max")
        if how not in AGGREGATES:
            raise ValueError(f"parameters.aggregate must be one of {list(AGGREGATES)}, got {how!r}")
        stride = _positive_int(parameters, "stride", max_length // 8, minimum=0)
        assert stride is not None
        if stride >= max_length // 2:
            raise ValueError(
                f"parameters.stride ({stride}) must be under half of max_seq_length ({max_length})"
            )
        max_windows = _positive_int(parameters, "max_windows", 16)
        assert max_windows is not None
        return cls(
            truncation=truncation,
            max_length=max_length,
            stride=stride,
            max_windows=max_windows,
            max_request_tokens=_positive_int(parameters, "max_request_tokens", None),
            aggregate=how,
        )


@dataclass(frozen=True)
class Windows:
    """A request's texts as windows (rows), ready to pad and run.

    Attributes:
        features: the tokenizer's ``input_ids``, ``attention_mask`` (and ``token_type_ids``
            where the model has them), one unpadded list of token ids per window.
        owner: int64 ``[W]``, the item (text) each window belongs to, ascending.
        lengths: int64 ``[W]``, tokens of each window, special tokens included.
        counts: int64 ``[B]``, windows per item (>= 1).
    """

    features: dict[str, list[list[int]]]
    owner: npt.NDArray[np.int64]
    lengths: npt.NDArray[np.int64]
    counts: npt.NDArray[np.int64]

    def tokens(self) -> npt.NDArray[np.int64]:
        """int64 ``[B]``: tokens of each item over all its windows (what it costs the model)."""
        return np.bincount(self.owner, weights=self.lengths, minlength=len(self.counts)).astype(np.int64)


def split(
    tokenizer: Any, texts: Sequence[str], queries: Sequence[str] | None, policy: WindowPolicy
) -> Windows:
    """Tokenise ``texts`` (with their ``queries``, as pairs, where given and non-empty) into
    windows per ``policy``.

    Args:
        tokenizer: a Hugging Face tokenizer (a fast one for ``"window"``: its overflow support).
        texts: B strings.
        queries: B strings ("" = no query) or None.
        policy: the model's :class:`WindowPolicy`.

    Raises:
        ValueError: (``"error"``) a text over ``max_length`` tokens; a query so long that no text
            token fits beside it.
        PayloadTooLarge: a text needing more than ``max_windows`` windows; a request over
            ``max_request_tokens``.
    """
    queries = list(queries) if queries is not None else [""] * len(texts)
    rows: dict[str, list[list[int]]] = {}
    owner: list[int] = []
    paired = [i for i, q in enumerate(queries) if q]
    single = [i for i, q in enumerate(queries) if not q]
    for group, pairs in ((single, False), (paired, True)):
        if not group:
            continue
        encoded = _encode(
            tokenizer, [texts[i] for i in group], [queries[i] for i in group] if pairs else None, policy
        )
        mapping = encoded.pop("overflow_to_sample_mapping", None)
        mapping = list(range(len(group))) if mapping is None else list(mapping)
        for key, values in encoded.items():
            if key in ("input_ids", "attention_mask", "token_type_ids"):
                rows.setdefault(key, []).extend(list(v) for v in values)
        owner.extend(group[m] for m in mapping)
    order = np.argsort(np.asarray(owner, dtype=np.int64), kind="stable")
    features = {key: [values[i] for i in order] for key, values in rows.items()}
    owners = np.asarray(owner, dtype=np.int64)[order]
    lengths = np.asarray([len(ids) for ids in features["input_ids"]], dtype=np.int64)
    counts = np.bincount(owners, minlength=len(texts)).astype(np.int64)
    if policy.truncation == "error":
        over = np.flatnonzero(lengths > policy.max_length)
        if over.size:
            i = int(over[0])
            raise ValueError(
                f"item {int(owners[i])} has {int(lengths[i])} tokens, over the model's {policy.max_length} "
                '(truncation = "error"; "window" or "truncate" in model.toml takes it)'
            )
    too_many = np.flatnonzero(counts > policy.max_windows)
    if too_many.size:
        i = int(too_many[0])
        raise PayloadTooLarge(
            f"item {i} needs {int(counts[i])} windows of {policy.max_length} tokens, over the model's "
            f"max_windows ({policy.max_windows}); shorten or split the text"
        )
    total = int(lengths.sum())
    if policy.max_request_tokens is not None and total > policy.max_request_tokens:
        raise PayloadTooLarge(
            f"the request's texts take {total} tokens in windows, over the model's max_request_tokens "
            f"({policy.max_request_tokens}); send fewer or shorter texts"
        )
    return Windows(features=features, owner=owners, lengths=lengths, counts=counts)


def _encode(
    tokenizer: Any, texts: list[str], queries: list[str] | None, policy: WindowPolicy
) -> dict[str, Any]:
    """The tokenizer's output for one group (single texts, or pairs) per ``policy``."""
    kwargs: dict[str, Any] = {"return_attention_mask": True}
    if policy.truncation == "error":
        kwargs["truncation"] = False
    elif policy.truncation == "truncate":
        kwargs.update(truncation=True, max_length=policy.max_length)
    else:
        kwargs.update(
            truncation="only_second" if queries is not None else True,
            max_length=policy.max_length,
            stride=policy.stride,
            return_overflowing_tokens=True,
        )
        if queries is not None:
            # The query is repeated in every window: it must leave room for text and stride.
            room = policy.max_length - policy.stride - 4
            lengths = tokenizer(queries, add_special_tokens=False, return_length=True)["length"]
            for n in lengths:
                if n > room // 2:
                    raise ValueError(
                        f"a query of {n} tokens leaves too little room for text in windows of "
                        f"{policy.max_length} tokens; at most {room // 2}"
                    )
    if queries is None:
        return dict(tokenizer(texts, **kwargs))
    return dict(tokenizer(queries, texts, **kwargs))


def aggregate(values: torch.Tensor, owner: torch.Tensor, items: int, how: str) -> torch.Tensor:
    """Per-window ``values`` ``[W, ...]`` put together per item: ``[items, ...]``.

    ``how``: ``"max"`` (element-wise maximum over an item's windows) or ``"mean"``. ``owner``:
    int64 ``[W]``, every item in ``range(items)`` owning at least one window.
    """
    index = owner.view(-1, *([1] * (values.dim() - 1))).expand_as(values)
    out = torch.zeros((items, *values.shape[1:]), dtype=values.dtype, device=values.device)
    return out.scatter_reduce(0, index, values, reduce="amax" if how == "max" else "mean", include_self=False)


def weighted_mean(
    vectors: torch.Tensor, weights: torch.Tensor, owner: torch.Tensor, items: int
) -> torch.Tensor:
    """Window embeddings ``[W, dim]`` to one unit vector per item ``[items, dim]``: the mean of an
    item's window vectors weighted by their tokens (``weights``, ``[W]``), L2-normalised again.

    Borrowed from vLLM's chunked processing of long embedding inputs (a mean over chunks),
    weighted here so that a short last window counts for its share of the text.
    """
    out = torch.zeros((items, vectors.shape[1]), dtype=vectors.dtype, device=vectors.device)
    out.index_add_(0, owner, vectors * weights.to(vectors.dtype).unsqueeze(1))
    return F.normalize(out, dim=1)
