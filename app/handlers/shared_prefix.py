"""Shared-prefix scoring for decoder-only models: one prefix (an instruction and a query, a
user's history, a context) and N items (documents, candidates, continuations) scored against
it, the prefix's keys and values computed once, each item's result equal to the item scored
alone after the prefix.

A causal model's state at an item token depends only on the tokens before it. Where N items
follow the same prefix, the prefix's keys and values are the same for all N: computed once
(:func:`encode_prefixes`, or taken from :class:`app.handlers.prefix_cache.PrefixCache`), the
items then run against them (:func:`run_items`) with their positions continuing after the
prefix (item token t at position ``len(prefix) + t``) and an attention mask by which each item
sees the whole prefix and itself causally, never another item. What a handler reads comes back
per item (:class:`ItemStates`): the final hidden state at each item token (after the model's
final norm: what an LM head or a classifier's score head reads), at its last real token
(:meth:`ItemStates.last`: a reranker's yes/no, a classifier's logits), and the state that
predicts the item's first token, the prefix's last (:meth:`ItemStates.with_context`,
:func:`item_log_likelihood`: a causal-LM scorer's log P(item token t | prefix, item tokens
before t), the first token included).

Two ways to run the items, both here, both exact (equal to the item scored alone within float
rounding, ``tests/unit/test_shared_prefix.py``):

- **expand** (:func:`item_rows`, :func:`run_items`): the prefix's cache expanded over the batch
  as a broadcast view (``Tensor.expand``, no copy of the stored prefix), the items in rows
  ``[R, W]`` of the longest item's length W, a 4D mask ``[R, 1, W, P + W]``. A row holds one
  item (right-padded), or several short items of one prefix binned together (best fit, each
  masked from the others in its row: the padding mostly goes). Attention work per row is
  ``W x (P + W)``; each layer concatenates the prefix's keys and values before the row's for
  the attention kernel (one transient copy per layer, ``R x P``, freed with the layer: nothing
  of a batch is kept). Requests with different prefixes share one forward (each row's prefix
  gathered, shorter ones masked).
- **packed** (:func:`run_packed`): SGLang's multi-item scoring, one sequence per prefix:
  ``prefix + item_1 + ... + item_N`` with a block mask (each item sees the prefix and itself
  causally) and position ids restarting at ``len(prefix)`` for each item. No padding and no
  separate prefix forward, but its attention is ``L x L`` for ``L = P + sum(T_i)`` with a dense
  mask (PyTorch's SDPA and eager attention skip no masked block; SGLang relies on FlashInfer's
  block-sparse masks), and it cannot reuse a cached prefix.

**expand** with binned rows is the one to serve. Measured by ``benchmarks/shared_prefix.py``
(docs/benchmarks.md): on a CPU the two are about even at 20 items a batch and **packed** falls
behind as the batch grows (its attention grows with the square of the whole batch's tokens, its
mask with it: gigabytes at 500 items), while **expand** keeps each row's attention to its own
tokens and the prefix's, takes a prefix from :class:`app.handlers.prefix_cache.PrefixCache`, and
runs requests with different prefixes in one forward.

What is supported (:func:`unsupported`): transformers' Llama, Mistral, Qwen2, Qwen3 and GPT-2
families with ``sdpa`` or ``eager`` attention, every layer full attention (no sliding window:
a custom mask replaces the model's own), positions that do not depend on the sequence's length
(no dynamic rotary scaling). Model code: transformers 5.x (``Cache`` of ``DynamicLayer``, a 4D
``attention_mask`` taken as given, the ``cache`` keyword, ``past_key_values`` before it).

Source: SGLang's multi-item scoring (``--multi-item-scoring-delimiter``: query and items in one
sequence, items masked from each other; LinkedIn's ranking deployment); transformers'
``DynamicCache`` and its custom 4D masks (``masking_utils._preprocess_mask_arguments``: a 4D
mask is used as given); FlashInfer's shared-prefix ("cascade") attention for the expand layout.
"""

from __future__ import annotations

import bisect
import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from app.handlers.decoder_math import (
    LOG_SOFTMAX_CHUNK_BYTES,
    TokenLogLikelihood,
    last_token_pool,
    token_log_likelihood,
)

__all__ = [
    "FAMILIES",
    "ItemRows",
    "ItemStates",
    "PrefixState",
    "common_prefix_length",
    "distinct_prefixes",
    "encode_prefixes",
    "item_log_likelihood",
    "item_rows",
    "pad_items",
    "run_items",
    "run_packed",
    "unsupported",
]

#: The ``model_type`` values whose model code this module has been checked against.
FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gpt2"})
#: Rotary scalings whose frequencies depend on the length of the forward's sequence: a prefix run
#: alone would be rotated otherwise than the same tokens run with an item after them.
_LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})


def unsupported(model: Any) -> str | None:
    """Why the prefix of ``model`` (a transformers decoder, base model or with a head) cannot be
    shared, or None where it can (module docstring): its family is not one of :data:`FAMILIES`,
    its attention is neither ``sdpa`` nor ``eager`` (flash attention ignores a custom mask), a
    layer attends within a sliding window, or its rotary scaling depends on the length."""
    config = model.config.get_text_config()
    kind = str(getattr(config, "model_type", ""))
    if kind not in FAMILIES:
        return f"model type {kind!r} is not one of {sorted(FAMILIES)}"
    attention = getattr(config, "_attn_implementation", None) or "eager"
    if attention not in ("sdpa", "eager"):
        return f"attention {attention!r} takes no custom mask (sdpa or eager do)"
    layer_types = getattr(config, "layer_types", None) or ()
    sliding = getattr(config, "sliding_window", None) is not None and getattr(
        config, "use_sliding_window", True
    )
    if sliding or any(t != "full_attention" for t in layer_types):
        return "a layer attends within a sliding window"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if rope_type in _LENGTH_DEPENDENT_ROPE:
        return f"rotary scaling {rope_type!r} depends on the sequence's length"
    return None


@dataclass(frozen=True, eq=False)
class PrefixState:
    """One prefix's keys and values, as the model computed them for its tokens alone.

    ``keys``, ``values``: one tensor per layer, ``[1, kv_heads, P, head_dim]`` in the model's
    dtype on its device (rotary positions already applied: token p at position p); compact (no
    view of a larger batch), never written after they are made, so one state may serve several
    batches and threads at once. ``hidden``: ``[H]``, the final hidden state (after the final
    norm) at the prefix's last token: what predicts an item's first token. ``last_id``: that
    token's id. ``sequence``: ``[P, H]``, the final hidden state at every prefix token, where
    :func:`encode_prefixes` was asked to keep it (a causal-LM scorer lists the prefix's own
    token log-probs in each item's answer); else None."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    hidden: torch.Tensor
    last_id: int
    sequence: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """P: the prefix's tokens."""
        return int(self.keys[0].shape[2])

    @property
    def nbytes(self) -> int:
        """Bytes the state holds on its device (keys, values, ``hidden`` and ``sequence``)."""
        every = () if self.sequence is None else (self.sequence,)
        tensors = (*self.keys, *self.values, self.hidden, *every)
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class ItemStates:
    """What the items of a batch came to, row b for item b (each row right-padded):

    ``hidden`` ``[B, T, H]`` (model dtype): the final hidden state at each item token (after the
    final norm); ``input_ids`` int64 ``[B, T]``; ``attention_mask`` int64 ``[B, T]`` (1 at the
    item's tokens); ``context`` ``[B, H]``: the final hidden state at the last token of the
    item's prefix (what predicts the item's first token); ``context_ids`` int64 ``[B]``: that
    token's id. T is the longest item's length; all on the model's device."""

    hidden: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    context: torch.Tensor
    context_ids: torch.Tensor

    def last(self) -> torch.Tensor:
        """``[B, H]``: each item's final hidden state at its last real token (last-token pooling,
        :func:`app.handlers.decoder_math.last_token_pool`): a reranker's yes/no or a classifier's
        score head reads it."""
        return last_token_pool(self.hidden, self.attention_mask)

    def with_context(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(hidden [B, T + 1, H], input_ids [B, T + 1], attention_mask [B, T + 1])``: each row
        the prefix's last token, then the item's. Their logits through an LM head scored by
        :func:`app.handlers.decoder_math.token_log_likelihood` give each item token's log-prob
        (position t + 1: item token t, the first one predicted from the prefix), as the item's
        tokens score in ``prefix + item`` run whole."""
        ones = torch.ones_like(self.attention_mask[:, :1])
        return (
            torch.cat((self.context.unsqueeze(1), self.hidden), dim=1),
            torch.cat((self.context_ids.unsqueeze(1), self.input_ids), dim=1),
            torch.cat((ones, self.attention_mask), dim=1),
        )


class _PrefixLayer:
    """One layer's cache during an item forward: the prefix's keys and values (a broadcast view
    of a stored state, or gathered per item), to which :meth:`update` puts the items' own after
    them, returning both without keeping them (a batch's keys and values die with the layer's
    attention). Made a subclass of transformers' ``DynamicLayer`` by :func:`_layer_class`."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values = keys, values
        self.device = keys.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat((self.keys, key_states), dim=-2), torch.cat((self.values, value_states), dim=-2)


@functools.cache
def _layer_class() -> type:
    from transformers.cache_utils import DynamicLayer

    return type("PrefixLayer", (_PrefixLayer, DynamicLayer), {"__doc__": _PrefixLayer.__doc__})


def _item_cache(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> Any:
    from transformers.cache_utils import Cache

    layer = _layer_class()
    return Cache(layers=[layer(k, v) for k, v in zip(keys, values, strict=True)])


@functools.cache
def _cache_keyword(forward: Callable[..., Any]) -> str:
    """The keyword a model's forward takes its cache by: ``cache`` (transformers 5.24 names it so,
    ``past_key_values`` being its deprecated alias, which warns), else ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def _forward(base: Any, cache: Any, **features: torch.Tensor) -> torch.Tensor:
    """``base``'s last hidden state ``[B, T, H]`` with ``cache``."""
    keyword = _cache_keyword(type(base).forward)
    return base(**features, **{keyword: cache}, use_cache=False).last_hidden_state  # type: ignore[no-any-return]


def _device(base: Any) -> torch.device:
    return next(base.parameters()).device  # type: ignore[no-any-return]


def pad_items(
    items: Sequence[npt.NDArray[Any]], device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The items' token ids right-padded: ``input_ids`` int64 ``[B, T]`` (padding 0, never
    attended to by a real token) and ``lengths`` int64 ``[B]``, on ``device``. Made on the host
    (a handler's ``preprocess``), copied once.

    Raises:
        ValueError: no item, or an item with no token.
    """
    lengths = np.fromiter((len(i) for i in items), dtype=np.int64, count=len(items))
    if not len(items) or int(lengths.min()) < 1:
        raise ValueError("shared-prefix scoring needs at least one item, each of at least one token")
    ids = np.zeros((len(items), int(lengths.max())), dtype=np.int64)
    for row, item in enumerate(items):
        ids[row, : len(item)] = item
    return torch.from_numpy(ids).to(device), torch.from_numpy(lengths).to(device)


def distinct_prefixes(
    prefixes: Sequence[npt.NDArray[Any]],
) -> tuple[list[npt.NDArray[Any]], npt.NDArray[np.int64]]:
    """The distinct prefixes of a batch's items (one per item, token ids), in order of first
    appearance, and ``owner``: int64 ``[B]``, each item's index among them (what
    :func:`run_items` and :func:`run_packed` take): a batch of requests with the same prefix
    runs it once."""
    index: dict[bytes, int] = {}
    distinct: list[npt.NDArray[Any]] = []
    owner = np.empty(len(prefixes), dtype=np.int64)
    for b, ids in enumerate(prefixes):
        key = np.asarray(ids, dtype=np.int64).tobytes()
        if key not in index:
            index[key] = len(distinct)
            distinct.append(ids)
        owner[b] = index[key]
    return distinct, owner


def common_prefix_length(rows: Sequence[npt.NDArray[Any]]) -> int:
    """The tokens every row begins with, leaving each row at least one of its own: a request's
    texts (one context and N continuations sent whole) split into a prefix and N items. 0 for
    fewer than two rows."""
    if len(rows) < 2:
        return 0
    bound = min(len(r) for r in rows) - 1
    if bound <= 0:
        return 0
    first = np.asarray(rows[0][:bound])
    same = np.ones(bound, dtype=bool)
    for row in rows[1:]:
        same &= np.asarray(row[:bound]) == first
    differs = np.flatnonzero(~same)
    return int(differs[0]) if len(differs) else bound


@torch.inference_mode()
def encode_prefixes(
    base: Any, prefixes: Sequence[npt.NDArray[Any]], *, sequence: bool = False
) -> list[PrefixState]:
    """Each prefix's :class:`PrefixState`, computed in one forward of ``base`` (a transformers
    decoder's base model: ``model.base_model``) over the prefixes right-padded (a real token
    never attends to the padding after it, so each state equals its prefix run alone), token p
    at position p.

    ``prefixes``: token ids, integer ``[P_i]`` each (P_i >= 1), as the model runs them (special
    tokens included). ``sequence``: keep each prefix's final hidden state at every token
    (:attr:`PrefixState.sequence`).

    Raises:
        ValueError: no prefix, or an empty one.
    """
    from transformers.cache_utils import DynamicCache

    device = _device(base)
    input_ids, _ = pad_items(prefixes, device)
    positions = torch.arange(input_ids.shape[1], device=device).expand_as(input_ids)
    cache = DynamicCache()
    hidden = _forward(base, cache, input_ids=input_ids, position_ids=positions)
    states = []
    for row, prefix in enumerate(prefixes):
        length = len(prefix)
        if len(prefixes) == 1:  # the layer's own tensors: already [1, kv_heads, P, head_dim]
            keys = tuple(layer.keys for layer in cache.layers)
            values = tuple(layer.values for layer in cache.layers)
        else:
            keys = tuple(layer.keys[row : row + 1, :, :length].clone() for layer in cache.layers)
            values = tuple(layer.values[row : row + 1, :, :length].clone() for layer in cache.layers)
        last = hidden[row, length - 1].clone()
        every = hidden[row, :length].clone() if sequence else None
        states.append(PrefixState(keys, values, last, int(prefix[-1]), every))
    return states


def _masked(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive mask (0 where allowed, the dtype's lowest value elsewhere): what transformers'
    eager attention adds and SDPA takes alike (a boolean mask would be added as 1 by eager)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


@dataclass(frozen=True)
class ItemRows:
    """A batch's items laid out for :func:`run_items` (:func:`item_rows`), on the device.

    ``input_ids`` int64 ``[R, W]``: rows of one or more items each, right padding (0);
    ``segment`` int64 ``[R, W]``: the item each token belongs to (its index in the batch), -1 for
    padding; ``offset`` int64 ``[R, W]``: the token's place in its item (its position is its
    prefix's length plus this); ``owner`` int64 ``[R]``: each row's prefix (an index into the
    states :func:`run_items` takes; a row's items share it). Per item, int64 ``[B]``: ``row``,
    ``start`` (its first column) and ``lengths``. ``longest``: the longest item's length (on
    the host: reading it from the device would wait for the device)."""

    input_ids: torch.Tensor
    segment: torch.Tensor
    offset: torch.Tensor
    owner: torch.Tensor
    row: torch.Tensor
    start: torch.Tensor
    lengths: torch.Tensor
    longest: int

    @property
    def tokens(self) -> int:
        """The tokens the forward runs: ``R x W``, padding included."""
        return int(self.input_ids.numel())


def _bins(lengths: npt.NDArray[np.int64], capacity: int) -> list[list[int]]:
    """Best fit, longest first: the items (by index) in bins of ``capacity`` tokens, each in
    the fullest bin it fits. Source: best-fit decreasing, the classic bin-packing heuristic
    (Johnson 1973); sequences packed in rows with a mask that keeps them apart are Krell et al.
    2021's "Efficient Sequence Packing without Cross-contamination"."""
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin), sorted
    for item in np.argsort(-lengths, kind="stable").tolist():
        need = int(lengths[item])
        at = bisect.bisect_left(free, (need, -1))
        if at == len(free):
            bins.append([item])
            bisect.insort(free, (capacity - need, len(bins) - 1))
            continue
        room, index = free.pop(at)
        bins[index].append(item)
        bisect.insort(free, (room - need, index))
    return bins


def item_rows(
    items: Sequence[npt.NDArray[Any]],
    owner: Sequence[int] | npt.NDArray[np.int64] | None = None,
    *,
    pack: bool = True,
    device: torch.device | str = "cpu",
) -> ItemRows:
    """Lay out a batch's items (token ids, B of them) for :func:`run_items`, on the host (a
    handler's ``preprocess``), copied to ``device`` once. ``owner``: each item's prefix (index
    into the states); None: one prefix for all.

    ``pack``: several items share a row where they fit in the longest item's length together
    (best fit, longest first; only items of one prefix), each masked from the others (it sees
    its prefix and itself): the batch's padding mostly goes, and the attention per row stays
    ``W x (P + W)``. False: one item a row, right-padded to the longest.

    Raises:
        ValueError: no item, an item with no token, an owner missing or negative.
    """
    lengths = np.fromiter((len(i) for i in items), dtype=np.int64, count=len(items))
    if not len(items) or int(lengths.min()) < 1:
        raise ValueError("shared-prefix scoring needs at least one item, each of at least one token")
    owners = np.zeros(len(items), dtype=np.int64) if owner is None else np.asarray(owner, dtype=np.int64)
    if owners.shape != lengths.shape or int(owners.min()) < 0:
        raise ValueError(f"owner must give each of the {len(items)} items the index of its prefix")
    width = int(lengths.max())
    rows: list[list[int]] = []
    for group in np.unique(owners).tolist():
        indices = np.flatnonzero(owners == group).tolist()
        if pack:
            rows += [[indices[i] for i in row] for row in _bins(lengths[indices], width)]
        else:
            rows += [[b] for b in indices]
    shape = (len(rows), width)
    input_ids, segment, offset = (
        np.zeros(shape, np.int64),
        np.full(shape, -1, np.int64),
        np.zeros(shape, np.int64),
    )
    row_of, start = np.zeros(len(items), np.int64), np.zeros(len(items), np.int64)
    for r, members in enumerate(rows):
        column = 0
        for b in members:
            end = column + int(lengths[b])
            input_ids[r, column:end] = items[b]
            segment[r, column:end] = b
            offset[r, column:end] = np.arange(end - column)
            row_of[b], start[b], column = r, column, end
    row_owner = np.array([owners[members[0]] for members in rows], dtype=np.int64)
    on = [
        torch.from_numpy(a).to(device)
        for a in (input_ids, segment, offset, row_owner, row_of, start, lengths)
    ]
    return ItemRows(on[0], on[1], on[2], on[3], on[4], on[5], on[6], longest=width)


@torch.inference_mode()
def run_items(base: Any, states: Sequence[PrefixState], rows: ItemRows) -> ItemStates:
    """Run the items against their prefixes' keys and values (the **expand** way, module
    docstring) in one forward of ``base`` (``model.base_model``).

    Args:
        base: the base model the states were made by.
        states: the distinct prefixes of the batch (G of them), as ``rows.owner`` indexes them.
        rows: the items' layout (:func:`item_rows`), on the model's device.

    Returns:
        :class:`ItemStates`: item b's hidden state at its token t equals that of token
        ``P + t`` of ``prefix + item`` run alone (float rounding apart).

    Raises:
        ValueError: no state.
    """
    if not states:
        raise ValueError("run_items needs the items' prefix states")
    device, (count, width) = rows.input_ids.device, rows.input_ids.shape
    dtype = states[0].keys[0].dtype
    segment = rows.segment
    # within a row: causal, and only within the token's own item (padding sees itself)
    causal = torch.ones((width, width), dtype=torch.bool, device=device).tril_()
    own = (segment.unsqueeze(2) == segment.unsqueeze(1)) & causal
    own &= (segment != -1).unsqueeze(1) | torch.eye(width, dtype=torch.bool, device=device)
    if len(states) == 1:
        state = states[0]
        prefix_length = torch.full((count,), state.length, dtype=torch.int64, device=device)
        keys = [k.expand(count, -1, -1, -1) for k in state.keys]  # views: nothing copied
        values = [v.expand(count, -1, -1, -1) for v in state.values]
        seen = torch.ones((1, 1, state.length), dtype=torch.bool, device=device).expand(count, width, -1)
    else:
        longest = max(s.length for s in states)
        prefix_length = torch.tensor([s.length for s in states], device=device)[rows.owner]

        def gathered(per_state: list[torch.Tensor]) -> torch.Tensor:
            """One layer's keys or values per row ``[R, kv_heads, Pmax, head_dim]``, zero past
            a prefix's end (masked)."""
            first = per_state[0]
            stacked = first.new_zeros((len(states), first.shape[1], longest, first.shape[3]))
            for g, tensor in enumerate(per_state):
                stacked[g, :, : tensor.shape[2]] = tensor[0]
            return stacked.index_select(0, rows.owner)

        layers = range(len(states[0].keys))
        keys = [gathered([s.keys[layer] for s in states]) for layer in layers]
        values = [gathered([s.values[layer] for s in states]) for layer in layers]
        seen = torch.arange(longest, device=device) < prefix_length.unsqueeze(1)  # [R, Pmax]
        seen = seen.unsqueeze(1).expand(count, width, longest)
    allowed = torch.cat((seen, own), dim=-1).unsqueeze(1)  # [R, 1, W, P + W]
    positions = torch.where(segment != -1, prefix_length.unsqueeze(1) + rows.offset, 0)
    hidden = _forward(
        base,
        _item_cache(keys, values),
        input_ids=rows.input_ids,
        position_ids=positions,
        attention_mask=_masked(allowed, dtype),
    )
    steps = torch.arange(rows.longest, device=device)
    real = steps.unsqueeze(0) < rows.lengths.unsqueeze(1)
    columns = torch.where(real, rows.start.unsqueeze(1) + steps, 0)
    where = (rows.row.unsqueeze(1), columns)
    item_owner = rows.owner[rows.row]
    context = torch.stack([s.hidden for s in states])[item_owner]
    context_ids = torch.tensor([s.last_id for s in states], dtype=torch.int64, device=device)[item_owner]
    input_ids = torch.where(real, rows.input_ids[where], 0)
    return ItemStates(hidden[where], input_ids, real.long(), context, context_ids)


@torch.inference_mode()
def run_packed(
    base: Any, prefixes: Sequence[npt.NDArray[Any]], items: Sequence[npt.NDArray[Any]], owner: Sequence[int]
) -> ItemStates:
    """Run prefixes and items in one forward of ``base``, the **packed** way (SGLang's
    multi-item scoring, module docstring): one row per prefix, ``prefix + its items``, a block
    mask ``[G, 1, L, L]`` by which each item sees its prefix and itself causally, positions
    restarting at ``len(prefix)`` for each item.

    Args:
        base: the base model (``model.base_model``).
        prefixes: G prefixes' token ids (>= 1 token each).
        items: B items' token ids (>= 1 token each).
        owner: B indices into ``prefixes``.

    Returns:
        :class:`ItemStates`, as :func:`run_items` returns them.

    Raises:
        ValueError: an empty prefix or item, an owner out of range.
    """
    owners = np.asarray(owner, dtype=np.int64)
    if len(owners) != len(items) or (len(owners) and not 0 <= owners.min() <= owners.max() < len(prefixes)):
        raise ValueError(f"owner must give each of the {len(items)} items a prefix of {len(prefixes)}")
    if any(len(p) < 1 for p in prefixes) or any(len(i) < 1 for i in items):
        raise ValueError("shared-prefix scoring needs prefixes and items of at least one token")
    device = _device(base)
    rows: list[list[npt.NDArray[Any]]] = [[np.asarray(p)] for p in prefixes]
    segment: list[list[npt.NDArray[np.int64]]] = [[np.zeros(len(p), dtype=np.int64)] for p in prefixes]
    position: list[list[npt.NDArray[np.int64]]] = [[np.arange(len(p))] for p in prefixes]
    start = np.zeros(len(items), dtype=np.int64)  # each item's first column in its row
    filled = [len(p) for p in prefixes]
    for b, (item, g) in enumerate(zip(items, owners.tolist(), strict=True)):
        start[b], filled[g] = filled[g], filled[g] + len(item)
        rows[g].append(np.asarray(item))
        segment[g].append(np.full(len(item), b + 1, dtype=np.int64))
        position[g].append(len(prefixes[g]) + np.arange(len(item)))
    width = max(filled)

    def padded(parts: list[list[npt.NDArray[Any]]], fill: int) -> torch.Tensor:
        out = np.full((len(parts), width), fill, dtype=np.int64)
        for g, row in enumerate(parts):
            joined = np.concatenate(row)
            out[g, : len(joined)] = joined
        return torch.from_numpy(out).to(device)

    input_ids, segments, positions = padded(rows, 0), padded(segment, -1), padded(position, 0)
    query, key = segments.unsqueeze(2), segments.unsqueeze(1)  # [G, L, 1], [G, 1, L]
    causal = torch.ones((width, width), dtype=torch.bool, device=device).tril_()
    # padding sees itself only, so that no row of the mask is empty (an empty row is NaN)
    allowed = (causal & (key != -1) & ((key == 0) | (key == query))) | torch.eye(
        width, dtype=torch.bool, device=device
    )
    dtype = next(base.parameters()).dtype
    hidden = _forward(
        base,
        None,
        input_ids=input_ids,
        position_ids=positions,
        attention_mask=_masked(allowed.unsqueeze(1), dtype),
    )
    ids, lengths = pad_items(items, device)
    own = torch.from_numpy(owners).to(device)
    steps = torch.arange(ids.shape[1], device=device)
    real = steps.unsqueeze(0) < lengths.unsqueeze(1)
    columns = torch.where(real, torch.from_numpy(start).to(device).unsqueeze(1) + steps, 0)
    item_hidden = hidden[own.unsqueeze(1), columns]
    last = torch.tensor([len(p) - 1 for p in prefixes], device=device)
    context = hidden[torch.arange(len(prefixes), device=device), last][own]
    context_ids = input_ids[torch.arange(len(prefixes), device=device), last][own]
    return ItemStates(item_hidden, ids, real.long(), context, context_ids)


@torch.inference_mode()
def item_log_likelihood(
    head: Callable[[torch.Tensor], torch.Tensor],
    items: ItemStates,
    *,
    per_token: bool = False,
    chunk_bytes: int = LOG_SOFTMAX_CHUNK_BYTES,
) -> TokenLogLikelihood:
    """Each item's token log-likelihood after its prefix: ``head`` (an LM head: hidden ``[n, T,
    H]`` -> logits ``[n, T, V]``) over :meth:`ItemStates.with_context`, reduced by
    :func:`app.handlers.decoder_math.token_log_likelihood` in chunks of rows of at most
    ``chunk_bytes`` of float32 logits. Every item token is scored, the first one from the
    prefix's last token: ``count`` is each item's length; with ``per_token``,
    ``token_logprobs`` ``[B, T + 1]`` holds item token t's log-prob at position t + 1 (position
    0, the prefix's token, is 0)."""
    hidden, input_ids, mask = items.with_context()
    rows, length = input_ids.shape
    step = max(1, chunk_bytes // max(1, length * int(head(hidden[:1, :1]).shape[-1]) * 4))
    parts = []
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        parts.append(
            token_log_likelihood(
                head(hidden[start:stop]),
                input_ids[start:stop],
                mask[start:stop],
                per_token=per_token,
                chunk_bytes=chunk_bytes,
            )
        )
    if len(parts) == 1:
        return parts[0]
    logprobs = [p.token_logprobs for p in parts]
    return TokenLogLikelihood(
        total=torch.cat([p.total for p in parts]),
        count=torch.cat([p.count for p in parts]),
        mean=torch.cat([p.mean for p in parts]),
        perplexity=torch.cat([p.perplexity for p in parts]),
        token_logprobs=torch.cat(logprobs) if per_token and all(t is not None for t in logprobs) else None,  # type: ignore[arg-type]
        scored=torch.cat([p.scored for p in parts]),
    )
