"""Tokenizing for the text handlers: the folder's Rust tokenizer called directly, each text once.

:class:`TextTokenizer` wraps the folder's ``tokenizer.json`` as ``tokenizers.Tokenizer`` objects
configured once at load (truncation to ``max_seq_length``; windows with ``stride``) and never
changed afterwards: a ``tokenizers.Tokenizer`` only raises "Already borrowed" when one thread
changes its settings while another encodes (transformers' wrapper sets truncation and padding on
every call), so the prepare threads and the window threads share one object with no copies and no
lock, and the Rust batch encoder runs without the GIL. It gives each item's token ids as small
int32 arrays (``encode``, ``encode_pairs``: what ``item_costs`` returns as the items'
preparation, ``app.models.base.Priced``), a text's windows with their own ids (``windows``, the
tokenizer's overflow with ``stride``: what Hugging Face's question-answering pipeline does for
long contexts); :func:`pad` pads rows into the model's ``[U, T]`` arrays with an
explicit pad id on either side, so that a tokenizer without a pad token (Llama's, GPT-2's) serves
once its handler names one (``app.handlers.decoders``); padding on the left keeps a decoder's last
token in the last column.

Nothing here imports transformers: a folder without ``tokenizer.json`` (a slow tokenizer only)
is converted by transformers once, at load (:func:`load_tokenizer`).

Source: text-embeddings-inference tokenizes with the same Rust library on its own workers and
keeps each request's encodings until its batch runs; vLLM's pooling models pad token ids
themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from tokenizers import Encoding, Tokenizer, normalizers

from app.handlers.folder_json import read_json_object

__all__ = [
    "Alloc",
    "Ids",
    "Parts",
    "TextTokenizer",
    "Window",
    "load_tokenizer",
    "pad",
    "prepared_array",
    "special_token",
    "with_lowercase",
]

log = logging.getLogger(__name__)

#: One string's token ids (or token type ids), int32 ``[n]``.
Ids = npt.NDArray[np.int32]
#: One item's preparation (``app.models.base.PREPARED``): its token rows, e.g. ``(ids,)``,
#: ``(ids, type_ids)`` of a pair, or an embedding item's ``(text ids, query ids)``.
Parts = tuple[Ids, ...]

_EMPTY: Ids = np.zeros(0, dtype=np.int32)


def _ids(values: Sequence[int]) -> Ids:
    return np.array(values, dtype=np.int32)


def prepared_array(parts: Sequence[Parts]) -> npt.NDArray[np.object_]:
    """The items' preparations as an ``object`` array ``[B]`` of tuples (filled one by one:
    numpy would otherwise unpack the tuples into a second axis)."""
    out = np.empty(len(parts), dtype=object)
    for i, item in enumerate(parts):
        out[i] = item
    return out


@dataclass(frozen=True)
class Window:
    """One window of a text: the characters ``[start, stop)`` its text tokens cover, ``tokens``
    (how many text tokens it has: special tokens and a pair's query not counted), and the
    window's own token rows as the model runs them (``ids``, and ``type_ids`` for a pair)."""

    start: int
    stop: int
    tokens: int
    ids: Ids
    type_ids: Ids | None = None


def _token_name(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_token(folder: Path, name: str) -> str | None:
    """The text of the folder's special token ``name`` (``"pad_token"``, ``"mask_token"``...) as
    its ``tokenizer_config.json``, else its ``special_tokens_map.json``, names it; None where
    neither does.

    Raises:
        ValueError: a file that is not valid JSON.
    """
    for file in ("tokenizer_config.json", "special_tokens_map.json"):
        found = _token_name(read_json_object(folder / file).get(name))
        if found:
            return found
    return None


def with_lowercase(tokenizer: Tokenizer) -> Tokenizer:
    """``tokenizer`` with a Lowercase normalizer first, unless one is there: what
    sentence-transformers does for ``do_lower_case`` (its Transformer module)."""
    current: Any = tokenizer.normalizer
    chain: list[Any] = [current] if current is not None else []
    if isinstance(current, normalizers.Sequence):
        chain = [current[i] for i in range(len(current))]
    if not any(isinstance(n, normalizers.Lowercase) for n in chain):
        tokenizer.normalizer = normalizers.Sequence([normalizers.Lowercase(), *chain])
    return tokenizer


def load_tokenizer(folder: Path) -> Tokenizer:
    """The folder's ``tokenizer.json``; without one, transformers' conversion of its slow
    tokenizer (``AutoTokenizer(use_fast=True).backend_tokenizer``, imported only then).

    Raises:
        ValueError: no ``tokenizer.json`` and nothing transformers can convert.
    """
    file = folder / "tokenizer.json"
    if file.is_file():
        return Tokenizer.from_file(str(file))
    from transformers import AutoTokenizer  # only for folders without tokenizer.json

    log.info("%s has no tokenizer.json: converting its tokenizer once with transformers", folder)
    converted = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, use_fast=True)
    backend = getattr(converted, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise ValueError(f"{folder}: no tokenizer.json and its tokenizer has no fast (Rust) version")
    return Tokenizer.from_str(backend.to_str())


class TextTokenizer:
    """The folder's tokenizer, configured once (module docstring); safe to share between threads.

    Args:
        source: the tokenizer; it becomes this object's plain tokenizer (truncation to
            ``max_length``, no padding) and must not be used elsewhere.
        max_length: tokens per string or window, special tokens included.
        pad_id: the id padding positions hold (masked out; None: rows of different lengths
            cannot be padded, :func:`app.handlers.tokenizing.pad`).
        padding_side: ``"right"`` or ``"left"`` (decoder models pool the last token: left keeps
            it in the last column).
        stride: tokens a window repeats from the one before; None: no windows.
        pairs: whether (query, text) pairs are windowed or cut (a cross-encoder's); each
            configuration is a tokenizer object of its own (tens of ms to build for a large
            vocabulary).
        keeps_last: whether texts may be cut to their last tokens on request (:meth:`keep_last`).

    Raises:
        ValueError: ``padding_side`` neither, or single strings whose token type ids are not all
            one value (then the model's type ids could not be made from lengths alone).
    """

    def __init__(
        self,
        source: Tokenizer,
        max_length: int,
        pad_id: int | None,
        *,
        padding_side: str = "right",
        stride: int | None = None,
        pairs: bool = True,
        keeps_last: bool = False,
    ) -> None:
        if padding_side not in ("right", "left"):
            raise ValueError(f'padding_side must be "right" or "left", got {padding_side!r}')
        self.max_length, self.pad_id, self.padding_side = max_length, pad_id, padding_side
        self.stride = stride
        text = source.to_str() if stride is not None or keeps_last else ""

        def copy(stride: int = 0, strategy: str = "longest_first", direction: str = "right") -> Tokenizer:
            return _configured(Tokenizer.from_str(text), max_length, stride, strategy, direction)

        self._single_windows = self._pair_windows = self._single_last = self._pair_last = None
        if stride is not None:
            self._single_windows = copy(stride)
            self._pair_windows = copy(stride, "only_second") if pairs else None
        if keeps_last:  # the last max_length tokens: a pair's text cut, its query whole
            self._single_last = copy(direction="left")
            self._pair_last = copy(strategy="only_second", direction="left") if pairs else None
        self._plain = _configured(source, max_length)
        types = set(self._plain.encode("a b").type_ids)
        if len(types) != 1:
            raise ValueError(f"single strings get token type ids {sorted(types)}; one value is supported")
        #: The token type id of every position of a single string (0 for BERT's template).
        self.single_type_id = types.pop()

    @classmethod
    def from_folder(
        cls,
        folder: Path,
        max_length: int,
        *,
        stride: int | None = None,
        pad_token: str | None = None,
        lowercase: bool = False,
        pairs: bool = True,
        keeps_last: bool = False,
    ) -> TextTokenizer:
        """The folder's tokenizer (:func:`load_tokenizer`), its pad token and padding side from
        ``tokenizer_config.json`` / ``special_tokens_map.json`` / ``tokenizer.json``'s padding.

        Args:
            pad_token: the token to pad with when the folder names none (a decoder model's
                documented fallback, e.g. its EOS token); None: such a folder cannot pad.
            lowercase: lowercase texts first (:func:`with_lowercase`).
            pairs, keeps_last: as for the constructor.

        Raises:
            ValueError: as :func:`load_tokenizer`; a pad token the vocabulary does not hold.
        """
        tokenizer = load_tokenizer(folder)
        if lowercase:
            tokenizer = with_lowercase(tokenizer)
        config = read_json_object(folder / "tokenizer_config.json")
        name = special_token(folder, "pad_token")
        padding = tokenizer.padding or {}
        pad_id: int | None = None
        if name is None and padding.get("pad_token"):
            name = str(padding["pad_token"])
        if name is None:
            name = pad_token
        if name is not None:
            pad_id = tokenizer.token_to_id(name)
            if pad_id is None:
                raise ValueError(f"{folder}: pad token {name!r} is not in the tokenizer's vocabulary")
        side = str(config.get("padding_side") or "right")
        return cls(
            tokenizer,
            max_length,
            pad_id,
            padding_side=side,
            stride=stride,
            pairs=pairs,
            keeps_last=keeps_last,
        )

    @staticmethod
    def model_max_length(folder: Path) -> int | None:
        """``model_max_length`` of the folder's ``tokenizer_config.json`` (None: absent or the
        "no limit" sentinel transformers writes, ~1e30)."""
        value = read_json_object(folder / "tokenizer_config.json").get("model_max_length")
        if isinstance(value, int | float) and 0 < value < 1e9:
            return int(value)
        return None

    def id_to_token(self, token_id: int) -> str | None:
        """The token of an id (None: not in the vocabulary)."""
        return self._plain.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token (None: not in the vocabulary)."""
        return self._plain.token_to_id(token)

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Each token id decoded alone, special tokens kept (a byte-level token holding part of
        a character decodes to U+FFFD)."""
        return list(self._plain.decode_batch([[int(i)] for i in ids], skip_special_tokens=False))

    def get_vocab(self) -> dict[str, int]:
        """Token -> id (the name ``tokenizers`` and transformers give it)."""
        return self._plain.get_vocab()

    def encode(self, texts: Sequence[str], *, special: bool = True) -> list[Ids]:
        """Each text's ids, special tokens included (``special``: the post-processor's, e.g. a
        BOS token), truncated to ``max_length``."""
        return [_ids(e.ids) for e in self._plain.encode_batch_fast(list(texts), add_special_tokens=special)]

    def encode_pairs(self, queries: Sequence[str], texts: Sequence[str]) -> list[tuple[Ids, Ids]]:
        """Each (query, text) pair's ids and token type ids, truncated to ``max_length`` with
        transformers' default ``longest_first``."""
        encoded = self._plain.encode_batch_fast(list(zip(queries, texts, strict=True)))
        return [(_ids(e.ids), _ids(e.type_ids)) for e in encoded]

    def whole_counts(self, texts: Sequence[str]) -> list[int]:
        """Tokens of each text whole, special tokens included, however many: what :meth:`encode`
        gives it before the cut at ``max_length`` (its kept part and the overflow's parts, each
        part's special tokens counted once). For the message that refuses a text too long."""
        out = []
        for e in self._plain.encode_batch_fast(list(texts)):
            parts = (e, *e.overflowing)
            text = sum(len(p.ids) - sum(p.special_tokens_mask) for p in parts)
            out.append(text + sum(e.special_tokens_mask))
        return out

    def count(self, texts: Sequence[str]) -> list[int]:
        """Tokens of each text alone, no special tokens, at most ``max_length`` (a count of
        ``max_length`` means "that many or more")."""
        return [len(e.ids) for e in self._plain.encode_batch_fast(list(texts), add_special_tokens=False)]

    def windows(self, texts: Sequence[str], queries: Sequence[str] | None = None) -> list[list[Window]]:
        """Each text's windows (with its query, as a pair, where one is given and non-empty): the
        tokenizer's overflow of ``max_length`` tokens with ``stride`` (``only_second`` for
        pairs), in text order; a text that fits is one window with the ids :meth:`encode` /
        :meth:`encode_pairs` give it; an empty text one empty window.

        Raises:
            RuntimeError: the tokenizer was made without ``stride`` (or, given queries, without
                ``pairs``).
            Exception: what the Rust tokenizer raises for a pair whose query leaves no room
                (callers check :meth:`count` first).
        """
        wanted = list(queries) if queries is not None else [""] * len(texts)
        if self._single_windows is None or (self._pair_windows is None and any(wanted)):
            raise RuntimeError("this tokenizer was made without a stride (or pairs): no such windows")
        out: list[list[Window]] = [[] for _ in texts]
        single = [i for i, q in enumerate(wanted) if not q]
        paired = [i for i, q in enumerate(wanted) if q]
        if single:
            encoded = self._single_windows.encode_batch([texts[i] for i in single])
            for item, encoding in zip(single, encoded, strict=True):
                out[item] = _windows_of(encoding, 0, len(texts[item]), pair=False)
        if paired and self._pair_windows is not None:
            encoded = self._pair_windows.encode_batch([(wanted[i], texts[i]) for i in paired])
            for item, encoding in zip(paired, encoded, strict=True):
                out[item] = _windows_of(encoding, 1, len(texts[item]), pair=True)
        return out

    def pieces(
        self,
        texts: Sequence[str],
        spans: Sequence[Sequence[tuple[int, int]]],
        queries: Sequence[str] | None = None,
    ) -> list[list[Window]]:
        """Each text's pieces (``spans``: its ``[start, stop)`` character spans, e.g.
        ``app.models.windows.piece_spans``), each piece tokenized on its own as :meth:`encode`
        (with the text's query, as a pair, where one is given and non-empty: :meth:`encode_pairs`);
        all pieces in one batch call of the Rust tokenizer. A piece over ``max_length`` tokens
        becomes the windows :meth:`windows` makes of it alone (``stride``), each with the span of
        the text its tokens cover: nothing is cut away.

        Raises:
            RuntimeError: a piece too long for a tokenizer made without a stride (or pairs).
        """
        wanted = list(queries) if queries is not None else [""] * len(texts)
        owners = [(i, start, stop) for i, s in enumerate(spans) for start, stop in s]
        single = [k for k, (i, _, _) in enumerate(owners) if not wanted[i]]
        paired = [k for k, (i, _, _) in enumerate(owners) if wanted[i]]
        encoded: dict[int, Encoding] = {}
        for keys, pair in ((single, False), (paired, True)):
            if not keys:
                continue
            batch: list[Any] = [
                (wanted[owners[k][0]], texts[owners[k][0]][owners[k][1] : owners[k][2]])
                if pair
                else texts[owners[k][0]][owners[k][1] : owners[k][2]]
                for k in keys
            ]
            encoded.update(zip(keys, self._plain.encode_batch_fast(batch), strict=True))
        long = [k for k in range(len(owners)) if encoded[k].overflowing]
        split = dict(
            zip(
                long,
                self.windows(
                    [texts[owners[k][0]][owners[k][1] : owners[k][2]] for k in long],
                    [wanted[owners[k][0]] for k in long],
                ),
                strict=True,
            )
        )
        out: list[list[Window]] = [[] for _ in texts]
        for k, (i, start, stop) in enumerate(owners):
            if k in split:  # the piece's own windows, their spans moved into the text
                out[i] += [replace(w, start=start + w.start, stop=start + w.stop) for w in split[k]]
                continue
            e = encoded[k]
            side = 1 if wanted[i] else 0
            tokens = sum(1 for s in e.sequence_ids if s == side)
            out[i].append(Window(start, stop, tokens, _ids(e.ids), _ids(e.type_ids) if side else None))
        return out

    def keep_last(
        self, texts: Sequence[str], keep: Sequence[int], queries: Sequence[str] | None = None
    ) -> list[Window]:
        """Each text cut to its last ``keep[i]`` tokens, special tokens counted (left truncation:
        vLLM's ``truncate_prompt_tokens``), as one window each; with a non-empty query, the pair
        (query, text) of at most ``keep[i]`` tokens, the text cut and the query whole. A window's
        span is the whole text (the same text and ``keep`` always give the same ids).

        Raises:
            ValueError: a ``keep`` outside ``[1, max_length]``; a ``keep`` (or ``max_length``)
                too small for the special tokens and the query beside any text.
            RuntimeError: the tokenizer was made without ``keeps_last`` (or, given queries, ``pairs``).
        """
        wanted = list(queries) if queries is not None else [""] * len(texts)
        if self._single_last is None or (self._pair_last is None and any(wanted)):
            raise RuntimeError("this tokenizer was made without keeps_last (or pairs): it cannot cut texts")
        bad = [k for k in keep if not 1 <= k <= self.max_length]
        if bad:
            raise ValueError(
                f"truncate_prompt_tokens {bad[0]} is not between 1 and the model's {self.max_length} tokens"
            )
        out: list[Window] = [Window(0, 0, 0, _EMPTY)] * len(texts)
        for tokenizer, items, side in (
            (self._single_last, [i for i, q in enumerate(wanted) if not q], 0),
            (self._pair_last, [i for i, q in enumerate(wanted) if q], 1),
        ):
            if not items or tokenizer is None:
                continue
            try:
                encoded = tokenizer.encode_batch([(wanted[i], texts[i]) if side else texts[i] for i in items])
            except Exception as exc:  # the Rust library's truncation error: a query with no room
                raise ValueError(
                    f"a query leaves no room for text in {self.max_length} tokens: {exc}"
                ) from None
            for i, encoding in zip(items, encoded, strict=True):
                out[i] = _last_of(encoding, keep[i], side, len(texts[i]))
        return out


def _last_of(encoding: Encoding, keep: int, side: int, length: int) -> Window:
    """One encoding (sequence ``side`` the text) cut to its last ``keep`` tokens by dropping
    the text's first tokens.

    Raises:
        ValueError: fewer than ``keep`` tokens left once every text token is dropped.
    """
    sequences = encoding.sequence_ids
    text = [j for j, s in enumerate(sequences) if s == side]
    drop = len(sequences) - keep
    if drop > len(text):
        raise ValueError(
            f"truncate_prompt_tokens {keep} leaves no room for text: its "
            f"{'query and ' if side else ''}special tokens take {len(sequences) - len(text)}"
        )
    kept = np.ones(len(sequences), dtype=bool)
    kept[text[: max(drop, 0)]] = False
    ids = np.array(encoding.ids, dtype=np.int32)[kept]
    type_ids = np.array(encoding.type_ids, dtype=np.int32)[kept] if side else None
    return Window(0, length, len(text) - max(drop, 0), ids, type_ids)


def _configured(
    tokenizer: Tokenizer,
    max_length: int,
    stride: int = 0,
    strategy: str = "longest_first",
    direction: str = "right",
) -> Tokenizer:
    """``tokenizer`` set to truncate at ``max_length`` (with ``stride`` for overflow windows; on
    the left to keep a text's last tokens) and not to pad: its one configuration, never changed
    afterwards."""
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length, stride=stride, strategy=strategy, direction=direction)
    return tokenizer


def _windows_of(encoding: Encoding, side: int, length: int, *, pair: bool) -> list[Window]:
    """The windows of one encoding and its overflow: the text is sequence ``side``."""
    windows = []
    for part in (encoding, *encoding.overflowing):
        offsets = [o for o, s in zip(part.offsets, part.sequence_ids, strict=True) if s == side]
        type_ids = _ids(part.type_ids) if pair else None
        if offsets:
            windows.append(Window(offsets[0][0], offsets[-1][1], len(offsets), _ids(part.ids), type_ids))
        elif not windows:  # an empty text: one empty window
            windows.append(Window(0, length, 0, _ids(part.ids), type_ids))
    return windows


#: Makes an int64 array of a shape (``np.empty``, or a view of a pinned host buffer).
Alloc = Callable[[tuple[int, ...]], npt.NDArray[np.int64]]


def pad(
    rows: Sequence[Ids],
    pad_id: int | None,
    *,
    side: str = "right",
    type_rows: Sequence[Ids] | None = None,
    single_type_id: int = 0,
    type_ids: bool = False,
    alloc: Alloc | None = None,
) -> dict[str, npt.NDArray[np.int64]]:
    """Rows of token ids padded to the longest into the model's inputs.

    Args:
        rows: U >= 1 rows, int32 ``[n_u]`` each.
        pad_id: the id of padding positions (None: every row must have the same length).
        side: where padding goes, ``"right"`` or ``"left"``.
        type_rows: each row's token type ids (pairs); None: ``single_type_id`` everywhere.
        type_ids: whether to return ``token_type_ids``.
        alloc: where the arrays are made (``np.empty`` by default; a pinned buffer on a GPU).

    Returns:
        ``input_ids``, ``attention_mask`` (1 on real tokens) and, with ``type_ids``,
        ``token_type_ids``: int64 ``[U, T]``, T the longest row (at least 1).

    Raises:
        ValueError: rows of different lengths and no ``pad_id``.
    """
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    width = max(1, int(lengths.max())) if len(rows) else 1
    make: Alloc = alloc if alloc is not None else (lambda shape: np.empty(shape, dtype=np.int64))
    positions = np.arange(width)
    real = positions >= (width - lengths)[:, None] if side == "left" else positions < lengths[:, None]
    if pad_id is None and not bool(real.all()):
        raise ValueError("the tokenizer has no pad token: rows of different lengths cannot be batched")
    flat = np.concatenate(rows) if len(rows) else _EMPTY
    shape = (len(rows), width)
    ids = make(shape)
    ids.fill(pad_id or 0)
    ids[real] = flat
    mask = make(shape)
    np.copyto(mask, real)
    features = {"input_ids": ids, "attention_mask": mask}
    if type_ids:
        types = make(shape)
        types.fill(0)
        if type_rows is not None:
            types[real] = np.concatenate(type_rows) if len(type_rows) else _EMPTY
        elif single_type_id:
            types[real] = single_type_id
        features["token_type_ids"] = types
    return features
