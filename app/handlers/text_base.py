"""What the text handlers share: the tokenizer, the cost model, windows, and the way to the device.

:class:`TextHandler` is the base of every text handler (``SentenceEmbeddingHandler``,
``SequenceClassificationHandler``, the decoder models' ``CausalRerankHandler`` and
``CausalLMHandler``): it holds the
folder's :class:`~app.handlers.tokenizing.TextTokenizer`, the forward's
:class:`~app.handlers.text_cost.CostModel` (``batch_cost``, the length groups), the window
policy and merge rules (it implements :class:`~app.models.windows.Windowed`), and a
:class:`HostStaging` that pads batches into host arrays and moves them
to the device. A subclass says what an item's preparation is (``item_costs`` returns it as
``app.models.base.Priced``; ``preprocess`` pads what ``inputs[PREPARED]`` holds and only
tokenizes where it is absent: warmup, direct calls) and what one window's preparation is
(:meth:`TextHandler.window_parts`). Where ``model.toml`` declares the input
``truncate_prompt_tokens`` (:mod:`app.handlers.text_config`) an item that asks for it is cut to
its last tokens in the same tokenizer pass (:meth:`TextHandler.kept_windows`), priced as cut,
and never split into windows.

The contract a text handler keeps (``app.models.base`` has the server's side):

- an item's preparation (:data:`~app.handlers.tokenizing.Parts`) is a tuple of int32 token rows,
  the same arity for every item of a handler (``wire.to_tensor`` carries it to a sibling as flat
  ids and lengths); it is made from the item's inputs alone, so the same inputs always make the
  same preparation;
- ``item_costs`` of inputs that hold ``PREPARED`` prices them from it and tokenizes nothing;
- ``preprocess`` never tokenizes what ``PREPARED`` holds; items whose preparation is None (a
  request batched from mixed sources) are prepared there (:meth:`TextHandler.item_parts`);
- the tokenizer is shared by every thread and never reconfigured after ``load``.

**Where a text batch's padded arrays are written before they reach the device**
(:class:`HostStaging`). On the CPU the arrays are fresh numpy arrays that torch shares
(``torch.from_numpy``, no copy): reusing them would be unsafe under the staged pipeline, where
batch N+1 is padded while batch N still reads its tensors, and a few kilobytes cost a
microsecond to allocate. On a CUDA device
they are views of **page-locked (pinned) host buffers reused from batch to batch**: only a copy
from pinned memory runs asynchronously with ``non_blocking=True``, and pinning memory per tensor
per batch (``Tensor.pin_memory()``) costs a ``cudaHostAlloc`` each time. Each preparing thread
has a ring of :data:`SLOTS` buffers; a buffer is written again only once the copy that read it
last has finished (a CUDA event recorded after it, waited on by the host), so the copy of one
batch overlaps the padding of the next and never reads a half-written buffer.

Source: PyTorch's "pinned memory buffers" notes (CUDA semantics) and the ``pin_memory`` staging
of its DataLoader; text-embeddings-inference copies its batches from host buffers it keeps.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from app.handlers.decoders import DTYPES
from app.handlers.prefix_cache import PrefixCache
from app.handlers.prefix_sharing import PrefixSharing
from app.handlers.text_config import decode_texts, text_inputs, truncation
from app.handlers.text_cost import CostModel, calibrate
from app.handlers.tokenizing import Alloc, Ids, Parts, TextTokenizer, Window, pad, prepared_array
from app.models import windows as windowing
from app.models.base import PREPARED, Priced
from app.models.text import QUERY, TEXT, TRUNCATE

__all__ = ["SLOTS", "HostStaging", "TextHandler", "max_length", "model_kwargs", "prepared_parts"]

#: Buffers per preparing thread: one being copied while the next is written.
SLOTS = 2
#: A buffer's first size, int64 elements (3 arrays of 32 x 256 tokens).
_FIRST_ELEMENTS = 3 * 32 * 256

#: Writes a batch's arrays with the given allocator: one ``{name: int64 array}`` per part
#: (a length group's inputs, the items' indices...).
Build = Callable[[Alloc], list[dict[str, npt.NDArray[np.int64]]]]


class _Slot:
    """One pinned buffer, grown as needed, and the event of the last copy that read it."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.event: Any = None
        self.used = 0

    def alloc(self, shape: tuple[int, ...]) -> npt.NDArray[np.int64]:
        count = math.prod(shape)
        assert self.buffer is not None
        view = self.buffer[self.used : self.used + count].numpy().reshape(shape)
        self.used += count
        return view

    def reserve(self, elements: int) -> None:
        if self.buffer is None or self.buffer.numel() < elements:
            size = max(elements, _FIRST_ELEMENTS, 2 * (self.buffer.numel() if self.buffer is not None else 0))
            self.buffer = torch.empty(size, dtype=torch.int64, pin_memory=True)
        self.used = 0


class HostStaging:
    """Pads a batch into host arrays and moves them to ``device`` (module docstring). Safe to use
    from several threads at once (each has its own buffers).

    Args:
        device: where the model runs.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._local = threading.local()

    def to_device(self, build: Build, elements: int) -> list[dict[str, torch.Tensor]]:
        """``build(alloc)`` writes the batch's int64 arrays (made by ``alloc``, at most
        ``elements`` int64 values in all); returns them as tensors on the device, part by part
        (on a GPU copied on the current stream, asynchronously)."""
        if not self.pinned:
            return [{k: torch.from_numpy(v) for k, v in part.items()} for part in build(_fresh)]
        slot = self._next_slot()
        if slot.event is not None:
            slot.event.synchronize()  # the copy that read this buffer last has finished
        slot.reserve(elements)
        parts = build(slot.alloc)
        out = [
            {k: torch.from_numpy(v).to(self.device, non_blocking=True) for k, v in part.items()}
            for part in parts
        ]
        slot.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        slot.event.record(torch.cuda.current_stream(self.device))
        return out

    def _next_slot(self) -> _Slot:
        ring: list[_Slot] | None = getattr(self._local, "ring", None)
        if ring is None:
            ring = self._local.ring = [_Slot() for _ in range(SLOTS)]
            self._local.turn = 0
        turn: int = (self._local.turn + 1) % SLOTS
        self._local.turn = turn
        return ring[turn]


def _fresh(shape: tuple[int, ...]) -> npt.NDArray[np.int64]:
    return np.empty(shape, dtype=np.int64)


log = logging.getLogger(__name__)

#: ``[parameters]`` names of the cost model (:mod:`app.handlers.text_cost`), and its fields.
_COST_PARAMETERS = {"call_overhead_tokens": "overhead", "attention_knee_tokens": "knee"}


def prepared_parts(inputs: Mapping[str, npt.NDArray[Any]]) -> list[Parts | None] | None:
    """The items' preparations in ``inputs[PREPARED]`` (None: absent)."""
    prepared = inputs.get(PREPARED)
    return None if prepared is None else list(np.asarray(prepared, dtype=object).reshape(-1))


class TextHandler(windowing.Windowed):
    """The part of a text handler that does not depend on its model (module docstring)."""

    #: The handler's name in messages.
    kind = "TextHandler"

    def __init__(self) -> None:
        self._device = torch.device("cpu")
        self._tokenizer: TextTokenizer | None = None
        #: The transformers model (a subclass's ``load`` sets it).
        self._model: Any = None
        #: What a forward call costs (``batch_cost``, length groups); measured at load.
        self.cost = CostModel()
        #: What the model does with long texts.
        self.policy = windowing.WindowPolicy("truncate", 512, 0)
        #: How each output of a text's windows becomes one (:data:`app.models.windows.MERGES`).
        self.merge_rules: dict[str, str] = {}
        #: Whether the model takes ``token_type_ids``.
        self.type_ids = False
        #: Whether ``model.toml`` declares ``truncate_prompt_tokens`` (the tokenizer then cuts).
        self.truncates = False
        #: Whether each preparation ends with the item's span in its text (int32 ``[start,
        #: stop)``, characters): for a handler that returns per-window results (``pieces``).
        self.spans = False
        self.staging = HostStaging(self._device)
        #: Shared-prefix scoring, where a decoder handler sets it up at load
        #: (:mod:`app.handlers.prefix_sharing`); None: each item runs whole.
        self.sharing: PrefixSharing | None = None

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The model's prefix cache (``app.models.base``: the server reports its work); None
        without shared-prefix scoring."""
        return self.sharing.cache if self.sharing is not None else None

    # --- the Windowed interface ---------------------------------------------------------------

    @property
    def window_policy(self) -> windowing.WindowPolicy:
        """What the model does with long texts (:mod:`app.models.windows`)."""
        return self.policy

    @property
    def window_merges(self) -> Mapping[str, str]:
        """Each output's rule for putting a text's windows together."""
        return self.merge_rules

    def may_need_windows(self, inputs: Mapping[str, npt.NDArray[Any]]) -> bool:
        """Whether a text of the request may need more than one window (on the event loop, a
        bound, no tokenizing): one whose UTF-8 bytes (plus its query's and 4 special tokens) fit
        in ``max_seq_length`` cannot have more tokens than that with a WordPiece or byte-level
        BPE tokenizer."""
        texts = inputs.get(TEXT)
        if texts is None:
            return False
        sizes = np.fromiter((len(t) for t in texts.reshape(-1)), np.int64, len(texts))
        queries = inputs.get(QUERY)
        if queries is not None:
            sizes += np.fromiter((len(q) for q in queries.reshape(-1)), np.int64, len(queries))
        return int(sizes.max()) + 4 > self.policy.max_length

    def window_items(
        self, inputs: Mapping[str, npt.NDArray[Any]]
    ) -> tuple[dict[str, npt.NDArray[Any]], windowing.WindowPlan | None]:
        """The request's texts split (:meth:`split_windows`), on a thread of the window stage:
        each window an item carrying its slice of the text as its ``text`` input (every other
        input repeated for it: the response cache keys on them, a sibling worker may run it) and
        its own token ids as its preparation; texts that fit in one window carry theirs too.

        Raises:
            ValueError: invalid UTF-8; a text too long for ``truncation = "error"``; a query too
                long for a window. PayloadTooLarge: as :meth:`split_windows`.
        """
        text_array = inputs[TEXT]
        query_array = inputs.get(QUERY)
        texts = decode_texts(TEXT, text_array)
        queries = decode_texts(QUERY, query_array) if query_array is not None else None
        windows = self.split_windows(texts, queries, inputs.get(TRUNCATE))
        counts = np.array([len(w) for w in windows], dtype=np.int64)
        spans = [s for w in windows for s in w]
        prepared = prepared_array([s.prepared for s in spans])
        if int(counts.max()) == 1:
            return {**inputs, PREPARED: prepared}, None
        owner = np.repeat(np.arange(len(texts)), counts)
        items = {key: array[owner] for key, array in inputs.items()}
        pieces = np.empty(len(spans), dtype=object)
        pieces[:] = [texts[i][s.start : s.stop].encode() for i, w in enumerate(windows) for s in w]
        items[TEXT] = pieces.reshape((-1, *text_array.shape[1:]))
        items[PREPARED] = prepared
        weights = np.array([s.tokens for s in spans], dtype=np.int64)
        return items, windowing.WindowPlan(counts, weights, dict(self.window_merges))

    def split_windows(
        self,
        texts: Sequence[str],
        queries: Sequence[str] | None,
        truncate: npt.NDArray[np.int64] | None = None,
    ) -> list[list[windowing.Span]]:
        """Each text's windows as items, each with its own token ids as its preparation
        (:func:`app.models.windows.split`; :meth:`window_parts`); a text whose ``truncate``
        (``truncate_prompt_tokens`` per item) asks to be cut is one item, cut
        (:meth:`kept_windows`). Thread-safe.

        Raises:
            ValueError, PayloadTooLarge: as :func:`app.models.windows.split`; as
                :meth:`kept_windows`.
        """
        keep = self.keep({TRUNCATE: truncate} if truncate is not None else {}, len(texts))
        cut = self.kept_windows(texts, queries, keep)
        rest = [i for i in range(len(texts)) if i not in cut]
        paired = self.window_queries(queries)
        split = windowing.split(
            self.tokenizer,
            [texts[i] for i in rest],
            [paired[i] for i in rest] if paired else None,
            self.policy,
        )
        windows = dict(zip(rest, split, strict=True)) | {i: [w] for i, w in cut.items()}
        extra = self.query_parts(queries, len(texts))
        return [
            [windowing.Span(w.start, w.stop, w.tokens, self._spanned(self.window_parts(w, extra[i]), w))
             for w in windows[i]]
            for i in range(len(texts))
        ]  # fmt: skip

    def _spanned(self, parts: Parts, window: Window) -> Parts:
        """``parts`` with the window's span as their last row, where :attr:`spans` asks."""
        return (*parts, np.array([window.start, window.stop], dtype=np.int32)) if self.spans else parts

    # --- truncate_prompt_tokens ---------------------------------------------------------------

    def keep(self, inputs: Mapping[str, npt.NDArray[Any]], count: int) -> list[int] | None:
        """Each of ``count`` items' ``truncate_prompt_tokens`` as tokens to keep (0: not asked),
        where the model declares it; None where nothing is asked
        (:func:`app.handlers.text_config.truncation`, which raises ValueError)."""
        return truncation(inputs, count, self.tokenizer.max_length) if self.truncates else None

    def kept_windows(
        self, texts: Sequence[str], queries: Sequence[str] | None, keep: Sequence[int] | None
    ) -> dict[int, Window]:
        """The items whose ``keep`` asks, each cut to its last ``keep`` tokens as one window (with
        its query where :meth:`window_queries` pairs it: the text cut, the query whole), by index.

        Raises:
            ValueError: as :meth:`app.handlers.tokenizing.TextTokenizer.keep_last`.
        """
        items = [i for i, k in enumerate(keep or ()) if k]
        if not items or keep is None:
            return {}
        paired = self.window_queries(queries)
        windows = self.tokenizer.keep_last(
            [texts[i] for i in items],
            [keep[i] for i in items],
            [paired[i] for i in items] if paired else None,
        )
        return dict(zip(items, windows, strict=True))

    def window_queries(self, queries: Sequence[str] | None) -> Sequence[str] | None:
        """The queries that go into a window beside its text (a cross-encoder's pairs): all, by
        default; None where the model takes the text alone."""
        return queries

    def query_parts(self, queries: Sequence[str] | None, count: int) -> list[Ids | None]:
        """Per text, what a window's preparation adds beside the window's ids (none here)."""
        return [None] * count

    def window_parts(self, window: Window, extra: Ids | None) -> Parts:
        """One window's preparation, as ``item_costs`` would make it for the window's item."""
        raise NotImplementedError

    def prepare_texts(
        self, texts: Sequence[str], queries: Sequence[str], keep: Sequence[int] | None
    ) -> list[Parts]:
        """Each item's preparation from its ``text`` and ``query`` ("" for none), tokenized here
        (``keep``: as :meth:`keep` gives it)."""
        raise NotImplementedError

    def item_parts(self, inputs: Mapping[str, npt.NDArray[Any]]) -> list[Parts]:
        """The items' preparations: ``inputs[PREPARED]`` where given, the missing ones (None)
        and all without it made by :meth:`prepare_texts`.

        Raises:
            ValueError: as :func:`app.handlers.text_config.text_inputs` and :meth:`keep`, where
                items are tokenized here.
        """
        given = prepared_parts(inputs)
        if given is not None and all(p is not None for p in given):
            return given  # type: ignore[return-value]
        texts, queries = text_inputs(inputs)
        keep = self.keep(inputs, len(texts))
        missing = list(range(len(texts))) if given is None else [i for i, p in enumerate(given) if p is None]
        # a whole item is its text; in pieces, its one piece (its words, not the space around them)
        pieces = self.policy.truncation == "pieces"
        bounds = [
            windowing.piece_bounds(texts[i]) if pieces and not (keep and keep[i]) else (0, len(texts[i]))
            for i in missing
        ]
        made = self.prepare_texts(
            [texts[i][a:b] for i, (a, b) in zip(missing, bounds, strict=True)], [queries[i] for i in missing],
            [keep[i] for i in missing] if keep is not None else None,
        )  # fmt: skip
        if self.spans:
            made = [
                self._spanned(p, Window(a, b, 0, p[0])) for (a, b), p in zip(bounds, made, strict=True)
            ]
        if given is None:
            return made
        found = iter(made)
        return [p if p is not None else next(found) for p in given]

    def item_costs(self, inputs: Mapping[str, npt.NDArray[Any]]) -> Priced:
        """Tokens each item makes the model run, int64 ``[B]`` (its first token row: special
        tokens, a pair's query, a prompt included), with each item's preparation (from
        ``inputs[PREPARED]`` where the window stage made it; else tokenized here).

        Raises:
            ValueError: invalid UTF-8, a wrong shape, a ``query`` of another length.
        """
        parts = self.item_parts(inputs)
        costs = np.fromiter((len(p[0]) for p in parts), dtype=np.int64, count=len(parts))
        return Priced(costs, prepared_array(parts))

    # --- cost ---------------------------------------------------------------------------------

    @property
    def call_overhead_tokens(self) -> float:
        """What one forward call costs beyond its tokens, in tokens (``inf``: one call a batch)."""
        return self.cost.overhead

    @call_overhead_tokens.setter
    def call_overhead_tokens(self, value: float) -> None:
        self.cost = CostModel(float(value), self.cost.knee)

    def batch_cost(self, costs: npt.NDArray[np.int64]) -> int:
        """What a batch of items costing ``costs`` (``item_costs``, int64 ``[N]``) computes, in
        short tokens' time, padding included: its length groups' calls
        (:meth:`app.handlers.text_cost.CostModel.batch`), proportional to their time across
        lengths."""
        return self.cost.batch(costs)

    def padded_tokens(self, costs: npt.NDArray[np.int64]) -> int:
        """The tokens a batch of items costing ``costs`` computes, padding included."""
        return self.cost.padded(costs)

    def calibrate(
        self, parameters: Mapping[str, Any], encode: Callable[[dict[str, torch.Tensor]], Any]
    ) -> None:
        """Set :attr:`cost`: ``call_overhead_tokens`` / ``attention_knee_tokens`` from
        ``parameters`` where given, the rest measured (:func:`app.handlers.text_cost.calibrate`)
        by timing ``encode`` on synthetic token ids up to ``max_seq_length``."""
        fixed = {
            field: float(parameters[key]) for key, field in _COST_PARAMETERS.items() if key in parameters
        }
        if len(fixed) < len(_COST_PARAMETERS):
            measured = calibrate(self._timer(encode), self.tokenizer.max_length)
            log.info(
                "%s: a forward call costs %.1f tokens beyond its tokens; attention doubles a "
                "token's cost at %.0f tokens", self.kind, measured.overhead, measured.knee,
            )  # fmt: skip
            fixed = {"overhead": measured.overhead, "knee": measured.knee, **fixed}
        self.cost = CostModel(fixed["overhead"], fixed["knee"])

    def _timer(self, encode: Callable[[dict[str, torch.Tensor]], Any]) -> Callable[[int, int], None]:
        token = self.tokenizer.encode(["word"])[0]
        filler = int(token[len(token) // 2]) if len(token) else 0

        def run(strings: int, tokens: int) -> None:
            rows = [np.full(tokens, filler, dtype=np.int32)] * strings
            (features,) = self.features([rows])
            with torch.inference_mode():
                encode(features)
            if self._device.type == "cuda":
                torch.cuda.synchronize(self._device)

        return run

    # --- to the device ------------------------------------------------------------------------

    @property
    def model(self) -> Any:
        """The loaded transformers model."""
        if self._model is None:
            raise RuntimeError(f"{self.kind}.load() has not been called")
        return self._model

    @property
    def tokenizer(self) -> TextTokenizer:
        """The folder's tokenizer."""
        if self._tokenizer is None:
            raise RuntimeError(f"{self.kind}.load() has not been called")
        return self._tokenizer

    def close(self) -> None:
        """Free what the model holds, once its last batch has run (``app.models.base``): drop
        the model, the tokenizer, the cached prefixes and the pinned host buffers (the runner
        then collects and gives the freed C heap back: ``app.serving.runner.collect_freed``)."""
        if self.sharing is not None:
            self.sharing.close()
        self._model = self._tokenizer = self.sharing = None
        self.staging = HostStaging(torch.device("cpu"))

    def set_device(self, device: torch.device) -> None:
        """Where the model runs (and its host staging)."""
        self._device = device
        self.staging = HostStaging(device)

    def features(
        self,
        groups: Sequence[Sequence[Ids]],
        type_groups: Sequence[Sequence[Ids] | None] | None = None,
        indices: Mapping[str, npt.NDArray[np.int64]] | None = None,
    ) -> list[dict[str, torch.Tensor]]:
        """Each group of token rows (int32 ``[n]`` each; ``type_groups``: their token type ids,
        None for single strings) padded into the model's inputs (``input_ids``,
        ``attention_mask``, ``token_type_ids`` where the model takes them: int64 ``[U_g, T_g]``),
        on the device (through :class:`~app.handlers.text_base.HostStaging`), and after them
        ``indices`` (int64 ``[B]`` each) as one more part.

        Raises:
            ValueError: rows of different lengths and no pad token (:func:`app.handlers.tokenizing.pad`).
        """
        tokenizer = self.tokenizer
        types = type_groups if type_groups is not None else [None] * len(groups)
        widths = [max((len(r) for r in rows), default=1) for rows in groups]
        elements = 3 * sum(max(1, w) * len(rows) for w, rows in zip(widths, groups, strict=True))
        elements += sum(len(v) for v in (indices or {}).values())

        def build(alloc: Any) -> list[dict[str, npt.NDArray[np.int64]]]:
            parts = [
                pad(rows, tokenizer.pad_id, side=tokenizer.padding_side, type_rows=type_rows,
                    single_type_id=tokenizer.single_type_id, type_ids=self.type_ids, alloc=alloc)
                for rows, type_rows in zip(groups, types, strict=True)
            ]  # fmt: skip
            if indices is not None:
                placed = {}
                for name, values in indices.items():
                    placed[name] = alloc((len(values),))
                    placed[name][:] = values
                parts.append(placed)
            return parts

        return self.staging.to_device(build, elements)

    def length_grouped(
        self, rows: Sequence[Ids], type_rows: Sequence[Ids] | None = None
    ) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
        """Rows of token ids (int32 ``[n]`` each, B of them; ``type_rows``: their token type ids)
        padded in the cost model's length groups (:meth:`app.handlers.text_cost.CostModel.groups`,
        one forward call each, its rows in ascending length), on the device, and ``position``,
        int64 ``[B]`` on the device: row b's place in the groups' rows, concatenated (so
        ``torch.cat(per_group)[position]`` is in row order).

        Raises:
            ValueError: as :meth:`features`.
        """
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        groups = self.cost.groups(lengths)
        position = np.empty(len(lengths), dtype=np.int64)
        position[np.concatenate(groups)] = np.arange(len(lengths))
        grouped_types = [[type_rows[i] for i in g] for g in groups] if type_rows is not None else None
        *encoded, index = self.features(
            [[rows[i] for i in g] for g in groups], grouped_types, indices={"position": position}
        )
        return encoded, index["position"]


def max_length(
    parameters: Mapping[str, Any], default: int | None, limit: int | None, minimum: int = 1
) -> int:
    """``parameters.max_seq_length``, else ``default`` capped by ``limit`` (512 when neither).

    Raises:
        ValueError: not an integer >= ``minimum``, or over the model's ``limit``.
    """
    value = parameters.get("max_seq_length")
    if value is None:
        candidates = [v for v in (default, limit) if v]
        return min(candidates) if candidates else 512
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"parameters.max_seq_length must be an integer >= {minimum}, got {value!r}")
    if limit is not None and value > limit:
        raise ValueError(f"max_seq_length {value} exceeds the model's {limit} tokens")
    return value


def model_kwargs(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """What ``from_pretrained`` (or our own encoders' loaders) takes of the shared ``[parameters]``
    (:mod:`app.handlers.text_config`): ``dtype`` (a ``torch.dtype``; float32 by default) and
    ``attn_implementation`` where given."""
    kwargs: dict[str, Any] = {"dtype": DTYPES[parameters.get("dtype", "float32")]}
    if "attn_implementation" in parameters:
        kwargs["attn_implementation"] = parameters["attn_implementation"]
    return kwargs
