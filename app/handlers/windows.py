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
    ``"pieces"``: the text is cut into pieces of at most ``piece_chars`` characters on word
    boundaries (:func:`piece_spans`), each an item, their results put together as windows' are:
    the moderation seed's cut (posts in pieces of at most 300 characters, each classified). A
    piece longer than ``max_seq_length`` tokens (300 characters of Chinese, emoji, a URL can
    be several hundred) is split again into windows of that piece, with ``stride``, as a long
    text is: nothing is cut silently, and each window reports the span its tokens cover. A piece
    is its words and the spaces between them, never the white space around them, whatever the
    text's length (a text of one piece too).
    Why windows by default for classifiers and cross-encoders: a moderation model that never sees
    the end of a post, or a reranker that never sees the relevant part of a document, is wrong
    without saying so; windows cost more, but the cost is priced before anything is queued and
    bounded by ``max_windows`` and ``max_request_tokens``.
``stride`` (int, tokens, default ``max_seq_length // 8``)
    Tokens each window repeats from the one before (Hugging Face tokenizers' ``stride``), so that
    a phrase cut at a window's edge is whole in the next one. The step between windows is the
    window's text tokens minus ``stride``.
``piece_chars`` (int, characters, default 300; with ``truncation = "pieces"`` only)
    The longest piece.
``max_windows`` (int, default 16)
    Windows (or pieces) one text may take; a text needing more is refused with 413.
``max_request_tokens`` (int, default none)
    Tokens (all windows of all texts of one request) a request may cost; above: 413, before any
    window is queued.
``aggregate`` (str)
    How windows' class probabilities and scores become one per text: ``"max"`` (default: a post is
    flagged if any part of it is; for (query, text) pairs MaxP, the best passage's score: Dai and
    Callan, "Deeper Text Understanding for IR with Contextual Neural Language Modeling", SIGIR
    2019) or ``"mean"``. Embeddings are always aggregated by the token-weighted mean,
    renormalised (:func:`weighted_mean`).

Splitting uses the tokenizer's own overflow (``stride``; ``only_second`` truncation for pairs;
offsets), the mechanism Hugging Face's question-answering pipeline uses for long contexts
(:meth:`app.handlers.tokenizing.TextTokenizer.windows`). A window is an ordinary item of the model
(priced, admitted, batched with other requests' items: :mod:`app.serving.windows`): it carries the
span of the text its tokens cover (as its ``text`` input: the response cache keys on it, a
sibling worker sees it) and its own token ids as its preparation, so that it runs exactly the
tokens the overflow made, tokenized once.

A handler offers windows by implementing :class:`Windowed`; its outputs are put back together per
text by the rules it declares there (:data:`MERGES`), not by their names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from app.errors import PayloadTooLarge

if TYPE_CHECKING:  # the tokenizers library only where a text model loads, not in every worker
    from app.handlers.tokenizing import Parts, TextTokenizer, Window

__all__ = [
    "AGGREGATES",
    "MERGES",
    "SPARSE_MERGES",
    "TRUNCATIONS",
    "Span",
    "WindowPolicy",
    "Windowed",
    "aggregate",
    "merge",
    "merge_outputs",
    "merges",
    "piece_bounds",
    "piece_spans",
    "rows",
    "sparse",
    "split",
    "weighted_mean",
]

#: A word: a run of characters that are not white space.
_WORD = re.compile(r"\S+")
TRUNCATIONS = ("window", "truncate", "error", "pieces")
AGGREGATES = ("max", "mean")
PARAMETERS = ("truncation", "stride", "max_windows", "max_request_tokens", "aggregate", "piece_chars")


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
        truncation: ``"window"``, ``"truncate"``, ``"error"`` or ``"pieces"``.
        max_length: tokens per window, special tokens (and a pair's query) included; for pieces,
            the lesser of that and ``piece_chars``: the window stage splits only texts whose
            UTF-8 bytes (plus 4) exceed it, which holds for both units (a character is at
            least one byte, a token at least one byte).
        stride: tokens a window repeats from the one before (0 <= stride < max_length // 2;
            for pieces, of ``max_seq_length``, between the windows of a piece too long).
        max_windows: windows (or pieces) per text, >= 1.
        max_request_tokens: tokens per request over all windows; None = no bound.
        aggregate: ``"max"`` or ``"mean"``.
        piece_chars: characters per piece (``"pieces"``), else None.
    """

    truncation: str
    max_length: int
    stride: int
    max_windows: int = 16
    max_request_tokens: int | None = None
    aggregate: str = "max"
    piece_chars: int | None = None

    @property
    def overflow_stride(self) -> int | None:
        """The stride of the tokenizer's overflow windows this policy cuts (``"window"``,
        ``"pieces"`` for a piece too long, and ``"error"`` which counts them); None where it
        cuts none."""
        return self.stride if self.truncation in ("window", "error", "pieces") else None

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
        piece_chars = _positive_int(parameters, "piece_chars", 300 if truncation == "pieces" else None)
        if piece_chars is not None and truncation != "pieces":
            raise ValueError('parameters.piece_chars applies to truncation = "pieces"')
        return cls(
            truncation=truncation,
            max_length=min(max_length, piece_chars) if piece_chars is not None else max_length,
            piece_chars=piece_chars,
            stride=stride,
            max_windows=max_windows,
            max_request_tokens=_positive_int(parameters, "max_request_tokens", None),
            aggregate=how,
        )


@dataclass(frozen=True)
class Span:
    """One window of a text as an item: the characters ``[start, stop)`` its tokens cover,
    ``tokens``, how many text tokens it has (special tokens and a pair's query not counted: the
    weight of its embedding in :func:`weighted_mean`), and ``prepared``, the item's preparation
    as the handler's ``item_costs`` would have made it (``app.models.base.PREPARED``: the
    window's own token ids), so that the window is not tokenized again."""

    start: int
    stop: int
    tokens: int
    prepared: Parts = ()


#: How a per-window output becomes one per text: ``"weighted_mean"`` (embeddings:
#: :func:`weighted_mean`), ``"sum"``, ``"max"``, ``"mean"``, ``"last"`` (the last window's),
#: ``"concat"`` (BYTES JSON arrays, one per window, joined into one array per text in window
#: order: per-piece results), ``"rows"`` (a ragged output: each window's rows, ``[n_w, ...]``,
#: one after the other in window order: multi-vectors), ``"sparse_max"`` and ``"sparse_sum"``
#: (a sparse vector as two ragged outputs, its term ids and their weights: the union of the
#: windows' terms, each weighted by its largest, or summed, weight; the two outputs merge
#: together: :func:`merge_outputs`).
MERGES = ("weighted_mean", "sum", "max", "mean", "last", "concat", "rows", "sparse_max", "sparse_sum")
#: The rules that merge a pair of outputs together (:func:`merge_outputs`), by their reduction.
SPARSE_MERGES = {"sparse_max": np.maximum, "sparse_sum": np.add}


@runtime_checkable
class Windowed(Protocol):
    """A handler that splits long texts into windows, each an item (module docstring); the
    window stage (``app.serving.windows``) finds it by this interface.

    ``window_policy``: what the model does with long texts. ``window_merges``: for each output
    the handler returns, its rule in :data:`MERGES`. ``split_windows(texts, queries, truncate)``:
    each text's windows (with its query where one is given and non-empty), as :func:`split`
    checks them, and one item for a text whose ``truncate`` (the request's INT64
    ``truncate_prompt_tokens`` per item, where the model declares it; 0: not asked) asks to cut
    it; called on a thread of the window stage's, several at once (it must be thread-safe).
    """

    @property
    def window_policy(self) -> WindowPolicy: ...

    @property
    def window_merges(self) -> Mapping[str, str]: ...

    def split_windows(
        self,
        texts: Sequence[str],
        queries: Sequence[str] | None,
        truncate: npt.NDArray[np.int64] | None = None,
    ) -> list[list[Span]]: ...


def merges(outputs: Sequence[str], policy: WindowPolicy, rules: Mapping[str, str]) -> dict[str, str]:
    """The merge rule of each of ``outputs``: ``rules`` where given, else the policy's
    ``aggregate``; each in :data:`MERGES`.

    Raises:
        ValueError: a rule that is not one of :data:`MERGES`.
    """
    out = {name: rules.get(name, policy.aggregate) for name in outputs}
    bad = {name: rule for name, rule in out.items() if rule not in MERGES}
    if bad:
        raise ValueError(f"window merge rules {bad} are not among {list(MERGES)}")
    return out


def split(
    tokenizer: TextTokenizer, texts: Sequence[str], queries: Sequence[str] | None, policy: WindowPolicy
) -> list[list[Window]]:
    """The windows of each text (with its query, as a pair, where given and non-empty) per
    ``policy``: the tokenizer's overflow windows (:meth:`TextTokenizer.windows`), in text order;
    a text that fits is one window.

    Raises:
        ValueError: (``"error"``) a text over ``max_length`` tokens; a query so long that too
            little text fits beside it in a window.
        PayloadTooLarge: a text needing more than ``max_windows`` windows; windows over
            ``max_request_tokens`` tokens in all.
    """
    room = (policy.max_length - policy.stride - 4) // 2
    # a query of b UTF-8 bytes has at most 2b + 1 tokens (a byte or a character each, and a
    # SentencePiece word-start piece): only a query that may not fit is counted
    wanted = sorted({q for q in queries if 2 * len(q.encode()) + 1 > room}) if queries is not None else []
    if wanted:
        for n in tokenizer.count(wanted):
            if n > room:
                more = "+" if n >= policy.max_length else ""
                raise ValueError(
                    f"a query of {n}{more} tokens leaves too little room for text in windows of "
                    f"{policy.max_length} tokens; at most {room}"
                )
    if policy.truncation == "pieces":
        out = tokenizer.pieces(texts, [piece_spans(t, policy.piece_chars or 1) for t in texts], queries)
    else:
        out = tokenizer.windows(texts, queries)
    for item, windows in enumerate(out):
        if policy.truncation == "error" and len(windows) > 1:
            (count,) = tokenizer.whole_counts([texts[item]])
            raise ValueError(
                f"item {item} has {count} tokens, over the model's {tokenizer.max_length} "
                '(truncation = "error" in its model.toml): send a shorter text'
            )
        if len(windows) > policy.max_windows:
            unit = f"pieces of {policy.piece_chars} characters (and windows of pieces too long)" if (
                policy.piece_chars
            ) else f"windows of {policy.max_length} tokens"  # fmt: skip
            raise PayloadTooLarge(
                f"item {item} needs {len(windows)} {unit}, over the model's max_windows "
                f"({policy.max_windows}); shorten or split the text"
            )
    total = sum(len(w.ids) for windows in out for w in windows)
    if policy.max_request_tokens is not None and total > policy.max_request_tokens:
        raise PayloadTooLarge(
            f"the request's texts take {total} tokens in windows, over the model's max_request_tokens "
            f"({policy.max_request_tokens}); send fewer or shorter texts"
        )
    return out


def piece_spans(text: str, max_chars: int) -> list[tuple[int, int]]:
    """``text`` cut into pieces of at most ``max_chars`` characters on word boundaries, as
    ``[start, stop)`` character spans in order: greedily, each piece as many whole words (runs
    of non-space characters) as fit with the spaces between them as the text has them; a word
    longer than ``max_chars`` is cut every ``max_chars`` characters, its tail going on as a word.
    A text without words is one piece, the whole text. White space between pieces, before the
    first and after the last belongs to none, a text of one piece included
    (:func:`piece_bounds`).

    Source: the moderation service this design learnt from cut posts so (pieces of at most 300
    characters, each classified by TrustSafeAI/RADAR-Vicuna-7B)."""
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    out: list[tuple[int, int]] = []
    start = stop = -1  # the piece being filled; -1: none
    for match in _WORD.finditer(text):
        begin, end = match.span()
        while end - begin > max_chars:  # a word longer than a piece: pieces of its own
            if start >= 0:
                out.append((start, stop))
                start = -1
            out.append((begin, begin + max_chars))
            begin += max_chars
        if start >= 0 and end - start > max_chars:
            out.append((start, stop))
            start = -1
        if start < 0:
            start = begin
        stop = end
    if start >= 0:
        out.append((start, stop))
    return out or [(0, len(text))]


def piece_bounds(text: str) -> tuple[int, int]:
    """The span of ``text`` that its pieces cover, ``[start, stop)``: from its first word to the
    end of its last (:func:`piece_spans`' rule for white space); the whole text where it has no
    word. What a text of one piece is scored on, whether or not it went through the window
    stage. (``str.strip`` and the word pattern's ``\\S`` agree on white space: both are
    Unicode's, ``Py_UNICODE_ISSPACE``.)"""
    stripped = text.strip()
    if not stripped:
        return 0, len(text)
    start = len(text) - len(text.lstrip())
    return start, start + len(stripped)


def concat(values: npt.NDArray[Any], counts: npt.NDArray[np.int64]) -> npt.NDArray[np.object_]:
    """Per-window BYTES JSON arrays ``[W, 1]`` (each text's windows consecutive, ``counts``
    ``[B]``) joined per text into one JSON array, in window order: ``[B, 1]`` object."""
    flat = np.asarray(values, dtype=object).reshape(-1)
    out = np.empty(len(counts), dtype=object)
    start = 0
    for item, count in enumerate(counts):
        inner = [bytes(v).strip()[1:-1].strip() for v in flat[start : start + int(count)]]
        out[item] = b"[" + b",".join(part for part in inner if part) + b"]"
        start += int(count)
    return out.reshape(len(counts), *np.asarray(values).shape[1:])


def aggregate(values: npt.NDArray[Any], counts: npt.NDArray[np.int64], how: str) -> npt.NDArray[Any]:
    """Per-window ``values`` ``[W, ...]`` (each item's windows consecutive, ``counts`` ``[B]`` of
    them, all >= 1) put together per item, ``[B, ...]``: ``"max"`` element-wise, ``"mean"``, or
    ``"sum"``."""
    starts = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    if how == "max":
        return np.maximum.reduceat(values, starts, axis=0)
    total = np.add.reduceat(values, starts, axis=0)
    if how == "sum":
        return total
    return (total / counts.reshape(-1, *([1] * (values.ndim - 1)))).astype(values.dtype)


def weighted_mean(
    vectors: npt.NDArray[np.float32], weights: npt.NDArray[Any], counts: npt.NDArray[np.int64]
) -> npt.NDArray[np.float32]:
    """Window embeddings ``[W, dim]`` to one unit vector per item ``[B, dim]``: the mean of an
    item's window vectors weighted by their text tokens (``weights``, ``[W]``; all 0 counts
    as equal weights), L2-normalised again (a zero vector stays zero).

    Borrowed from vLLM's chunked processing of long embedding inputs (a mean over chunks),
    weighted here so that a short last window counts for its share of the text.
    """
    w = np.asarray(weights, dtype=np.float64).reshape(-1, 1)
    w = np.where(w > 0, w, 1e-9)
    summed = aggregate(vectors.astype(np.float64) * w, counts, "sum")
    norms = np.linalg.norm(summed, axis=1, keepdims=True)
    return (summed / np.where(norms > 0, norms, 1.0)).astype(np.float32)


def merge(
    values: npt.NDArray[Any], rule: str, counts: npt.NDArray[np.int64], weights: npt.NDArray[Any]
) -> npt.NDArray[Any]:
    """Per-window ``values`` ``[W, ...]`` (each text's windows consecutive: ``counts`` ``[B]``,
    text tokens per window ``weights`` ``[W]``) put together per text by ``rule``
    (:data:`MERGES`), ``[B, ...]``.

    Raises:
        ValueError: an unknown rule.
    """
    if rule == "weighted_mean":
        return weighted_mean(values, weights, counts)
    if rule == "last":
        return values[np.cumsum(counts) - 1]
    if rule == "concat":
        return concat(values, counts)
    if rule in ("sum", "max", "mean"):
        return aggregate(values, counts, rule)
    if rule == "rows":
        return rows(values, counts)
    if rule in SPARSE_MERGES:
        raise ValueError(f"window merge rule {rule!r} merges a pair of outputs together: merge_outputs")
    raise ValueError(f"window merge rule {rule!r} is not one of {list(MERGES)}")


def rows(values: npt.NDArray[Any], counts: npt.NDArray[np.int64]) -> npt.NDArray[np.object_]:
    """A ragged output's per-window arrays (object ``[W]``, each ``[n_w, ...]``; each text's
    windows consecutive, ``counts`` ``[B]``) as one array per text, its windows' rows one after
    the other in window order: object ``[B]``."""
    flat = np.asarray(values, dtype=object).reshape(-1)
    out = np.empty(len(counts), dtype=object)
    start = 0
    for item, count in enumerate(counts):
        parts = list(flat[start : start + int(count)])
        out[item] = parts[0] if len(parts) == 1 else np.concatenate(parts)
        start += int(count)
    return out


def merge_outputs(
    results: Mapping[str, npt.NDArray[Any]],
    rules: Mapping[str, str],
    counts: npt.NDArray[np.int64],
    weights: npt.NDArray[Any],
) -> dict[str, npt.NDArray[Any]]:
    """Every per-window output of ``results`` (``[W, ...]``; each text's windows consecutive,
    ``counts`` ``[B]``, text tokens per window ``weights`` ``[W]``) put together per text by its
    rule in ``rules`` (:data:`MERGES`), ``[B, ...]``: each alone (:func:`merge`), except the two
    outputs of a sparse rule, merged together (:func:`sparse`): the integer one holds the term
    ids, the floating one their weights.

    Raises:
        ValueError: an output without a rule, an unknown rule, or a sparse rule not held by
            exactly one integer and one floating ragged output.
    """
    out: dict[str, npt.NDArray[Any]] = {}
    for rule in SPARSE_MERGES:
        pair = [name for name in results if rules.get(name) == rule]
        if not pair:
            continue
        kinds = {_element_kind(results[name]): name for name in pair}
        if len(pair) != 2 or set(kinds) != {"i", "f"}:
            raise ValueError(
                f"window merge rule {rule!r} needs one integer and one floating ragged output "
                f"(a sparse vector's ids and weights), got {pair}"
            )
        out[kinds["i"]], out[kinds["f"]] = sparse(results[kinds["i"]], results[kinds["f"]], counts, rule)
    for name, values in results.items():
        if name in out:
            continue
        found = rules.get(name)
        if found is None:
            raise ValueError(f"output {name!r} has no window merge rule (the handler's window_merges)")
        out[name] = merge(values, found, counts, weights)
    return out


def _element_kind(values: npt.NDArray[Any]) -> str:
    """The numpy kind (``"i"``, ``"f"``, ...) of a ragged output's arrays (of the array itself
    where it is not ragged)."""
    flat = np.asarray(values).reshape(-1)
    if flat.dtype != object:
        return flat.dtype.kind
    return np.asarray(flat[0]).dtype.kind if len(flat) else "O"


def sparse(
    indices: npt.NDArray[Any], values: npt.NDArray[Any], counts: npt.NDArray[np.int64], rule: str
) -> tuple[npt.NDArray[np.object_], npt.NDArray[np.object_]]:
    """The windows' sparse vectors (object ``[W]`` of term ids and of their weights, each
    ``[n_w]``; each text's windows consecutive, ``counts`` ``[B]``) as one per text: the union of
    its windows' ids, ascending, each weighted by the largest (``"sparse_max"``: SPLADE's max
    pooling over the whole text's tokens) or the sum (``"sparse_sum"``) of its windows' weights;
    object ``[B]`` each."""
    reduce = SPARSE_MERGES[rule]
    flat_ids = np.asarray(indices, dtype=object).reshape(-1)
    flat_values = np.asarray(values, dtype=object).reshape(-1)
    out_ids = np.empty(len(counts), dtype=object)
    out_values = np.empty(len(counts), dtype=object)
    start = 0
    for item, count in enumerate(counts):
        window = slice(start, start + int(count))
        start += int(count)
        if count == 1:
            out_ids[item], out_values[item] = flat_ids[window][0], flat_values[window][0]
            continue
        ids = np.concatenate(list(flat_ids[window]))
        weights = np.concatenate(list(flat_values[window]))
        unique, where = np.unique(ids, return_inverse=True)
        merged = np.full(len(unique), -np.inf if rule == "sparse_max" else 0, dtype=weights.dtype)
        reduce.at(merged, where, weights)
        out_ids[item], out_values[item] = unique.astype(ids.dtype, copy=False), merged
    return out_ids, out_values
