"""A batch and its parts: a request as queued (:class:`QueuedRequest`), a range of its items
(:class:`Chunk`), what a forming batch may still hold (:class:`Budget`), a priced request's own
order and batches (:func:`price`), the batch formed (:class:`Batch`) and its outputs handed back
to each request in the order its items were sent (:func:`outputs_between`, :func:`assemble`).

A priced request's items travel sorted by cost, each input reordered alike: the items'
preparations (``PREPARED``, from :class:`app.models.base.Priced`) are one more input to every
step here (sorting, slicing into chunks, concatenation into a batch), so ``preprocess`` gets each
item's own. They count in no byte bound (:func:`app.serving.admission.check_item_bounds`).
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from app.models.base import PREPARED, Priced, Segment
from app.protocols.tensors import ItemBytes
from app.serving.context import RequestContext

Tensors = dict[str, np.ndarray]


@dataclass(eq=False)
class QueuedRequest:
    """One inference request in a model version's queue: its inputs ``[B, ...]``, its context
    (id, deadline, ...: ``app.serving.context``), arrival (``loop.time()`` seconds), priority
    ``level`` (0 = the highest), and where its items are. ``tokens`` (priced models): int64
    ``[B]``, each item's cost, ascending (``order`` is that permutation of the items as sent,
    None when none was needed)."""

    inputs: Mapping[str, np.ndarray]
    size: int
    context: RequestContext
    arrival: float
    future: asyncio.Future[Tensors]
    item_bytes: ItemBytes | None  # input bytes per item; None without a batch byte bound
    tokens: np.ndarray | None = None
    order: np.ndarray | None = None
    level: int = 0
    trace: Any = None  # its OpenTelemetry context; None when not traced
    queued: int = 0  # items still waiting
    queued_cost: int = 0  # their cost
    pending: int = 0  # items not yet computed
    parts: list[tuple[int, Tensors]] = field(default_factory=list)
    dead: bool = False

    @property
    def deadline(self) -> float:
        """When its outputs are due, ``loop.time()`` seconds."""
        return self.context.deadline

    @property
    def request_id(self) -> str:
        """Its id (errors, logs)."""
        return self.context.request_id

    @property
    def is_disconnected(self) -> Callable[[], bool] | None:
        """True once its client has gone; None: never asked."""
        return self.context.is_disconnected

    @property
    def cost(self) -> int:
        """The request's cost: its tokens (priced models), else its items."""
        return int(self.tokens.sum()) if self.tokens is not None else self.size

    def cost_between(self, start: int, stop: int) -> int:
        """The cost of items ``[start, stop)``."""
        return int(self.tokens[start:stop].sum()) if self.tokens is not None else stop - start


@dataclass(eq=False)
class Chunk:
    """Items ``[start, stop)`` of ``request``."""

    request: QueuedRequest
    start: int
    stop: int


def padded_to_longest(costs: np.ndarray) -> float:
    """A batch's cost when every item is padded to the costliest: ``max * N`` (0 when empty)."""
    return float(costs.max()) * len(costs) if len(costs) else 0.0


def most_within(cost_of: Callable[[int], float], n: int, limit: float) -> int:
    """The largest ``k <= n`` with ``cost_of(k) <= limit`` (0 when none), by binary search:
    ``cost_of`` (a batch's cost with ``k`` more items) grows with ``k``. All ``n`` are tried
    first: they fit in the common case (one call of ``cost_of`` instead of about log2 n)."""
    if n > 0 and cost_of(n) <= limit:
        return n
    fits, low, high = 0, 1, n - 1
    while low <= high:
        k = (low + high) // 2
        if cost_of(k) <= limit:
            fits, low = k, k + 1
        else:
            high = k - 1
    return fits


@dataclass
class Budget:
    """What one batch may still hold: items, input bytes, and tokens as ``batch_cost`` counts
    them (padding included) over every priced item taken."""

    items: int
    bytes: float = math.inf
    tokens: float = math.inf
    batch_cost: Callable[[np.ndarray], float] = padded_to_longest
    taken: list[np.ndarray] = field(default_factory=list)  # the costs of the items taken

    def fit(self, request: QueuedRequest, start: int, stop: int) -> int:
        """How many of ``request``'s items from ``start`` (at most ``stop - start``) fit."""
        n = min(stop - start, self.items)
        item_bytes = request.item_bytes
        if item_bytes is not None and self.bytes != math.inf:
            n = min(n, item_bytes.items_within(start, start + n, self.bytes))
        tokens = request.tokens
        if tokens is not None and self.tokens != math.inf and n > 0:
            taken, cost = self.taken, self.batch_cost
            n = most_within(
                lambda k: cost(np.concatenate([*taken, tokens[start : start + k]])), n, self.tokens
            )
        return n

    def take(self, request: QueuedRequest, start: int, stop: int) -> None:
        """Account for items ``[start, stop)`` of ``request`` joining the batch."""
        self.items -= stop - start
        if request.item_bytes is not None and self.bytes != math.inf:
            self.bytes -= request.item_bytes.between(start, stop)
        if request.tokens is not None:
            self.taken.append(request.tokens[start:stop])


def sort_by_cost(
    inputs: Mapping[str, np.ndarray], tokens: np.ndarray
) -> tuple[Mapping[str, np.ndarray], np.ndarray, np.ndarray | None]:
    """A request's inputs and costs with its items sorted by cost (ascending, stable), and the
    permutation (None when they already were)."""
    if len(tokens) < 2 or bool((tokens[1:] >= tokens[:-1]).all()):
        return inputs, tokens, None
    order = np.argsort(tokens, kind="stable")
    return {k: v[order] for k, v in inputs.items()}, tokens[order], order


@dataclass(frozen=True)
class Pricing:
    """One request of a priced model, priced: its ``inputs`` with the items sorted by cost
    (``PREPARED`` among them where the handler returned :class:`~app.models.base.Priced`), their
    costs ``tokens`` int64 ``[B]`` ascending, ``order`` (the permutation, None when none was
    needed), and what it computes alone: ``alone_cost`` (``batch_cost`` summed over the batches
    the queue would cut it into, padding included) in ``alone_batches`` batches."""

    inputs: Mapping[str, np.ndarray]
    tokens: np.ndarray
    order: np.ndarray | None
    alone_cost: float
    alone_batches: int

    def unpacked(
        self,
    ) -> tuple[Mapping[str, np.ndarray], np.ndarray, np.ndarray | None, tuple[float, int]]:
        """``(inputs, tokens, order, (alone_cost, alone_batches))``."""
        return self.inputs, self.tokens, self.order, (self.alone_cost, self.alone_batches)


def price(
    inputs: Mapping[str, np.ndarray],
    *,
    item_costs: Callable[[Mapping[str, np.ndarray]], np.ndarray | Priced | None],
    batch_cost: Callable[[np.ndarray], float],
    max_batch_size: int,
    max_batch_tokens: int | None,
) -> Pricing | None:
    """One request priced, on a prepare thread: what ``item_costs`` returns for its items
    (int64 ``[B]`` costs, or :class:`~app.models.base.Priced`; None: nothing priced, None
    returned), its items sorted by cost, and its own batches, at most ``max_batch_size`` items
    and ``max_batch_tokens`` of ``batch_cost`` each (an item over the token bound alone is a
    batch of its own).

    Raises:
        What ``item_costs`` raises (``app.serving.runner.ModelRunner.item_costs``).
    """
    priced = item_costs(inputs)
    if priced is None:
        return None
    if isinstance(priced, Priced):
        inputs = {**inputs, PREPARED: priced.prepared}
        priced = priced.costs
    inputs, tokens, order = sort_by_cost(inputs, priced)
    cost, batches = own_batches(tokens, batch_cost, max_batch_size, max_batch_tokens)
    return Pricing(inputs, tokens, order, cost, batches)


def own_batches(
    tokens: np.ndarray,
    batch_cost: Callable[[np.ndarray], float],
    max_batch_size: int,
    max_batch_tokens: int | None,
) -> tuple[float, int]:
    """What items costing ``tokens`` (int64 ``[B]``, ascending) compute alone, and in how many
    batches: cut in order into batches of at most ``max_batch_size`` items and
    ``max_batch_tokens`` of ``batch_cost`` (an item over it alone is a batch of its own), as the
    queue cuts a request that waits behind no other."""
    cost, batches, start = 0.0, 0, 0
    while start < len(tokens):
        rest = tokens[start : start + max_batch_size]
        n = len(rest)
        if max_batch_tokens is not None:
            n = max(1, most_within(partial(_first_cost, rest, batch_cost), n, max_batch_tokens))
        cost += batch_cost(rest[:n])
        batches, start = batches + 1, start + n
    return cost, batches


def _first_cost(tokens: np.ndarray, batch_cost: Callable[[np.ndarray], float], k: int) -> float:
    return batch_cost(tokens[:k])


class Batch:
    """One batch formed from ``chunks`` at loop time ``formed_at``: its inputs (``[items, ...]``
    per input name; no copy for a batch that is one whole request), its requests and their item
    ranges within it (``groups``), its size and its cost (for a priced model ``batch_cost`` of
    its items' costs, ``costs`` int64 ``[N]``: what it computes, padding included; else its
    items, and ``costs`` None). The items' preparations
    (``PREPARED``) are concatenated like any input when every request of the batch has them,
    else left out (``preprocess`` then prepares the batch itself, as at warmup)."""

    __slots__ = (
        "chunks", "cost", "costs", "formed_at", "groups", "inputs", "items", "queue_s", "real_tokens",
        "requests", "trace",
    )  # fmt: skip

    def __init__(
        self,
        chunks: list[Chunk],
        formed_at: float,
        batch_cost: Callable[[np.ndarray], float] = padded_to_longest,
    ) -> None:
        self.chunks = chunks
        self.formed_at = formed_at
        first = chunks[0]
        if len(chunks) == 1 and first.start == 0 and first.stop == first.request.size:
            self.inputs = dict(first.request.inputs)
        else:
            names = list(first.request.inputs)
            if PREPARED in names and not all(PREPARED in c.request.inputs for c in chunks):
                names.remove(PREPARED)
            self.inputs = {
                n: np.concatenate([c.request.inputs[n][c.start : c.stop] for c in chunks]) for n in names
            }
        self.requests = {id(c.request): c.request for c in chunks}
        self.queue_s = formed_at - min(r.arrival for r in self.requests.values())
        sizes = [c.stop - c.start for c in chunks]
        self.items = sum(sizes)
        self.groups = list(itertools.pairwise(np.cumsum([0, *sizes]).tolist()))
        priced = [c.request.tokens[c.start : c.stop] for c in chunks if c.request.tokens is not None]
        self.real_tokens = sum(int(t.sum()) for t in priced)
        self.costs = np.concatenate(priced) if priced else None
        self.cost = batch_cost(self.costs) if self.costs is not None else float(self.items)
        #: Its ``batch`` span (``app.observability.tracing``), when a request in it is traced.
        self.trace: Any = None


def assemble(request: QueuedRequest) -> Tensors:
    """A request's outputs from its parts ``(first item, outputs)``, in the order its items
    were sent (the sort by cost undone)."""
    parts = request.parts
    if len(parts) == 1:
        out = parts[0][1]
    else:
        ordered = sorted(parts, key=lambda p: p[0])
        out = {k: np.concatenate([p[1][k] for p in ordered]) for k in ordered[0][1]}
    order = request.order
    if order is None:
        return out
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    return {k: v[inverse] for k, v in out.items()}


def outputs_between(segments: list[Segment], start: int, stop: int) -> Tensors | Segment:
    """Outputs for batch items ``[start, stop)`` across a batch's segments, or the first failed
    segment among them."""
    pieces: list[Tensors] = []
    for seg in segments:
        lo, hi = max(start, seg.start), min(stop, seg.stop)
        if lo >= hi:
            continue
        if seg.outputs is None:
            return seg
        pieces.append({k: v[lo - seg.start : hi - seg.start] for k, v in seg.outputs.items()})
    if len(pieces) == 1:
        return pieces[0]
    return {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]}


def expire(future: asyncio.Future[Tensors]) -> None:
    """Fail a request's ``future`` with :class:`TimeoutError` when its deadline passes before its
    outputs are set (a loop timer: ``loop.call_at(deadline, expire, future)``); a done one stays."""
    if not future.done():
        future.set_exception(TimeoutError())
