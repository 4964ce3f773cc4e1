"""A text handler's side of shared-prefix scoring: the switch and the prefix cache of one loaded
model version, what a shared prefix makes an item cost, and a batch laid out and run with each
distinct prefix computed once (:mod:`app.handlers.shared_prefix` has the model's side).

An item's preparation says where its shared prefix ends (its **split**: the prefix is the first
``split`` tokens of the item's ids, the rest is the item's own; 0: no shared prefix). Who sets it:
the causal reranker (the system turn, the instruction and the query: every item), a decoder
classifier given a ``prefix`` input (the tokenizer's leading special tokens and the prefix), the
causal-LM scorer (the tokens a request's texts all begin with, where they share at least
:data:`MIN_FOUND_TOKENS`). The same ids run whole where sharing is off, so an answer is the
same either way (within float rounding: 1e-5 in float32).

A batch (:func:`lay_out`) runs its items without a split as the handler always has (length
groups, each padded to its longest), and the others in **calls** of one forward each: items of
similar lengths (the cost model's length groups of the items' own tokens), several short items
of one prefix to a row (:func:`app.handlers.shared_prefix.item_rows`), against the keys and
values of their prefixes, each distinct prefix of the batch computed once in one forward, or
taken from the prefix cache (:meth:`PrefixSharing.run`).

**Pricing** (:meth:`PrefixSharing.costs`, in a handler's ``item_costs``, once per request): an
item after a shared prefix costs its own tokens and its share of the prefix's (the prefix's
tokens spread over the request's items that share it), nothing of a prefix the cache holds when
the request is priced. A request's costs then add up to the tokens it makes the model run: the
prefix once and every item's own, which is what ``batch_cost``, ``max_batch_tokens`` and
admission count. Two requests with the same prefix in one batch are each priced with it (it runs
once): the estimate errs by one prefix on the safe side. The items' attention over the prefix is
priced as their own length's (the cost model's ``knee`` term is of the item's length).

``[parameters]`` (:data:`PARAMETERS`): ``shared_prefix`` (bool, default true: false runs each
item whole, as before; the figures without sharing) and ``prefix_cache_bytes``
(:mod:`app.handlers.prefix_cache`). A model whose code cannot share a prefix
(:func:`app.handlers.shared_prefix.unsupported`: a sliding window, flash attention...) runs each
item whole, and its load says why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from app.handlers.prefix_cache import PrefixCache
from app.handlers.shared_prefix import (
    ItemRows,
    ItemStates,
    PrefixState,
    distinct_prefixes,
    encode_prefixes,
    item_rows,
    run_items,
    unsupported,
)

__all__ = [
    "MIN_FOUND_TOKENS",
    "PARAMETERS",
    "SWITCH",
    "Call",
    "Layout",
    "PrefixSharing",
    "SharedRun",
    "lay_out",
    "split_row",
]

log = logging.getLogger(__name__)

#: The ``[parameters]`` switch: false runs every item whole (each its prefix again).
SWITCH = "shared_prefix"
#: The ``[parameters]`` of a handler that shares prefixes.
PARAMETERS = (SWITCH, "prefix_cache_bytes")
#: The fewest tokens a request's texts must all begin with for the causal-LM scorer to run them
#: once (a BOS token or a first word is not worth a forward call of its own).
MIN_FOUND_TOKENS = 16


def split_row(split: int) -> npt.NDArray[np.int32]:
    """An item's split as a row of its preparation: int32 ``[1]``."""
    return np.array([split], dtype=np.int32)


@dataclass(frozen=True)
class Call:
    """One forward of items after their prefixes: ``items`` (int64 ``[n]``, on the host: the
    items of the shared run, in the order of the call's results), ``prefixes`` (the run's
    distinct prefixes this call's rows use, ``rows.owner`` indexing this list) and ``rows``
    (their layout on the device)."""

    items: npt.NDArray[np.int64]
    prefixes: list[int]
    rows: ItemRows


@dataclass(frozen=True)
class SharedRun:
    """The items of a batch that run after a shared prefix: ``prefixes``, the batch's distinct
    prefixes (token ids), and the ``calls``; on the host, int64 ``[n]`` each: ``owner`` (each
    item's prefix), ``splits`` (its prefix's length) and ``lengths`` (its own tokens)."""

    prefixes: list[npt.NDArray[Any]]
    calls: list[Call]
    owner: npt.NDArray[np.int64]
    splits: npt.NDArray[np.int64]
    lengths: npt.NDArray[np.int64]


@dataclass(frozen=True)
class Layout:
    """A batch laid out (:func:`lay_out`): ``groups`` (the items without a shared prefix, padded
    in length groups on the device, as the handler pads them), ``shared`` (the others; None:
    none) and ``position`` (int64 ``[B]`` on the device: item b's row in the groups' results
    then the calls', concatenated)."""

    groups: list[dict[str, torch.Tensor]]
    shared: SharedRun | None
    position: torch.Tensor


class PrefixSharing:
    """Shared-prefix scoring for one loaded model version (module docstring).

    Args:
        model: the transformers model (its ``base_model`` runs the prefixes and items).
        identity: the model version's identity, the prefix cache's key with the tokens.
        cache: the prefix cache (None: every prefix computed once per batch).
        sequence: keep each prefix's final hidden state at every token
            (:attr:`app.handlers.shared_prefix.PrefixState.sequence`: the causal-LM scorer's).
    """

    def __init__(
        self, model: Any, identity: Hashable, cache: PrefixCache | None, *, sequence: bool = False
    ) -> None:
        self.base = model.base_model
        self.identity, self.cache, self.sequence = identity, cache, sequence

    @classmethod
    def from_parameters(
        cls,
        model: Any,
        parameters: Mapping[str, Any],
        identity: Hashable,
        name: str,
        *,
        sequence: bool = False,
    ) -> PrefixSharing | None:
        """Sharing as ``[parameters]`` ask (:data:`PARAMETERS`); None where ``shared_prefix`` is
        false or the model's code cannot share (logged, with why).

        Raises:
            ValueError: ``shared_prefix`` not a bool; ``prefix_cache_bytes`` not an integer >= 0.
        """
        switch = parameters.get(SWITCH, True)
        if not isinstance(switch, bool):
            raise ValueError(f"parameters.{SWITCH} must be true or false, got {switch!r}")
        cache = PrefixCache.from_parameters(parameters)
        if not switch:
            return None
        why = unsupported(model)
        if why is not None:
            log.info("%s: each item runs with its whole prefix (%s)", name, why)
            return None
        return cls(model, identity, cache, sequence=sequence)

    def costs(self, ids: Sequence[npt.NDArray[Any]], splits: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """What each item of one request makes the model run, int64 ``[B]`` (module docstring):
        an item without a split its ids' length; one after a shared prefix its own tokens and its
        share of the prefix's, none of a prefix the cache holds now."""
        split = np.asarray(splits, dtype=np.int64).reshape(-1)
        costs = np.fromiter((len(i) for i in ids), dtype=np.int64, count=len(ids))
        shared = np.flatnonzero(split > 0)
        if not len(shared):
            return costs
        costs[shared] -= split[shared]
        prefixes, owner = distinct_prefixes([ids[b][: split[b]] for b in shared.tolist()])
        for g, prefix in enumerate(prefixes):
            members = shared[owner == g]
            if self.cache is not None and self.cache.holds(self.identity, prefix):
                continue
            share, extra = divmod(len(prefix), len(members))
            costs[members] += share
            costs[members[:extra]] += 1
        return costs

    def layout(
        self,
        ids: Sequence[npt.NDArray[Any]],
        splits: npt.ArrayLike,
        groups: Callable[[npt.NDArray[np.int64]], list[npt.NDArray[np.int64]]],
        device: torch.device,
    ) -> SharedRun:
        """Items after shared prefixes (token ids whole, each with its split >= 1) in calls:
        ``groups`` (the cost model's length groups) cuts them by their own lengths; each call's
        rows on ``device``. On the host (a handler's ``preprocess``)."""
        split = np.asarray(splits, dtype=np.int64).reshape(-1)
        prefixes, owner = distinct_prefixes([row[:s] for row, s in zip(ids, split.tolist(), strict=True)])
        items = [row[s:] for row, s in zip(ids, split.tolist(), strict=True)]
        lengths = np.fromiter((len(i) for i in items), dtype=np.int64, count=len(items))
        calls = []
        for group in groups(lengths):
            used, local = np.unique(owner[group], return_inverse=True)
            rows = item_rows([items[i] for i in group], local.reshape(-1), device=device)
            calls.append(Call(np.asarray(group, dtype=np.int64), used.tolist(), rows))
        return SharedRun(prefixes, calls, owner, split, lengths)

    def states(self, prefixes: Sequence[npt.NDArray[Any]]) -> list[PrefixState]:
        """Each prefix's keys and values: from the cache where it holds them, the others computed
        in one forward (and kept). The inference thread's."""

        def compute(missing: list[npt.NDArray[Any]]) -> list[PrefixState]:
            return encode_prefixes(self.base, missing, sequence=self.sequence)

        if self.cache is None:
            return compute(list(prefixes))
        return self.cache.states(self.identity, prefixes, compute)

    @torch.inference_mode()
    def run(self, shared: SharedRun) -> tuple[list[PrefixState], list[ItemStates]]:
        """The run's prefixes' states and, per call, its items' states (in ``call.items``
        order). The inference thread's (a handler's ``predict``)."""
        states = self.states(shared.prefixes)
        return states, [
            run_items(self.base, [states[g] for g in call.prefixes], call.rows) for call in shared.calls
        ]

    def close(self) -> None:
        """Drop the cached prefixes (the model version is going)."""
        if self.cache is not None:
            self.cache.clear()


def lay_out(
    sharing: PrefixSharing,
    ids: Sequence[npt.NDArray[Any]],
    splits: npt.ArrayLike,
    groups: Callable[[npt.NDArray[np.int64]], list[npt.NDArray[np.int64]]],
    pad: Callable[[list[list[Any]], dict[str, npt.NDArray[np.int64]]], list[dict[str, torch.Tensor]]],
    device: torch.device,
) -> Layout:
    """A batch's items (token ids whole, B of them) laid out (:class:`Layout`): those of split 0
    in length groups (``groups``: the cost model's; ``pad``: the handler's ``features``, which
    pads rows on the device and places ``indices`` after them), the others in calls
    (:meth:`PrefixSharing.layout`). On the host (a handler's ``preprocess``)."""
    split = np.asarray(splits, dtype=np.int64).reshape(-1)
    plain, after = np.flatnonzero(split == 0), np.flatnonzero(split > 0)
    orders: list[npt.NDArray[np.int64]] = []
    rows: list[list[Any]] = []
    if len(plain):
        lengths = np.fromiter((len(ids[b]) for b in plain.tolist()), dtype=np.int64, count=len(plain))
        for group in groups(lengths):
            orders.append(plain[group])
            rows.append([ids[b] for b in plain[group].tolist()])
    shared = None
    if len(after):
        shared = sharing.layout([ids[b] for b in after.tolist()], split[after], groups, device)
        orders += [after[call.items] for call in shared.calls]
    position = np.empty(len(split), dtype=np.int64)
    position[np.concatenate(orders)] = np.arange(len(split))
    *padded, placed = pad(rows, {"position": position})
    return Layout(padded, shared, placed["position"])
