"""The queue of a dynamic batcher: requests whose items wait to be taken into batches.

A request is queued as :class:`Chunk` s, ranges ``[start, stop)`` of its items. A batch takes
chunks while they fit (items, input bytes, tokens) and splits the last one, so one request's
items may run in several batches; its outputs are put back in order by :func:`assemble`. A
request that leaves (deadline, client gone, failure) is marked dead and its chunks are dropped
lazily when they reach the head of their queue. :class:`ChunkQueue` keeps the count of items
and of their cost still waiting, which the batcher's admission and memory bound read.

**Batches formed by cost.** A model whose handler prices its items (``item_costs``: tokens for
a text model) has each request's items sorted by cost when it arrives (the permutation is
undone on the way out). Requests queue in arrival order, whole, and a batch takes the oldest
first, as long as it stays within ``max_batch_size`` items, ``max_batch_tokens`` (what the
batch computes, padding included: the handler's ``batch_cost`` of its items' costs, else every
item padded to the longest) and ``max_batch_bytes``; only the last request taken is split,
where it exceeds the batch. No request is ever passed over, and the backlog ahead of a new
request is exactly what admission counts (``app.serving.admission``). Items of different
lengths are kept apart *within* a batch instead: the handler runs them in length groups
(``app.handlers.sentence_embedding.length_groups``: strings sorted by length and cut where a
separate call costs less than the padding it saves), which is where a request mixing titles
and descriptions saves its padding.

Why not queues per length class, with batches of similar lengths taken across requests
(Infinity sorts its queue by length)? Tried here: a request whose longest item was long was
taken only once it was the oldest, while shorter requests that arrived after it filled the
batches; under overload its wait was up to four times what admission expected, so admitted
requests expired (504), and a request split over several batches had parts computed for
nothing when its last part came too late. Source: text-embeddings-inference's
``max_batch_tokens`` (``core/src/queue.rs``).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from app.errors import ClientDisconnected, DeadlineExceeded, ScoringError
from app.serving.admission import ItemCosts

Tensors = dict[str, np.ndarray]


@dataclass(eq=False)
class QueuedRequest:
    """One inference request in the batcher: its inputs ``[B, ...]`` and where its items are.

    ``tokens`` (priced models): int64 ``[B]``, each item's cost, ascending (the items were
    sorted by it; ``order`` is that permutation of the items as sent, None when none was needed).
    """

    inputs: Mapping[str, np.ndarray]
    size: int
    deadline: float  # loop.time() seconds
    arrival: float
    request_id: str
    is_disconnected: Callable[[], bool] | None
    future: asyncio.Future[Tensors]
    costs: ItemCosts | None  # input bytes per item; None without a batch byte bound
    tokens: np.ndarray | None = None
    order: np.ndarray | None = None
    queued: int = 0  # items still waiting in the queue
    queued_cost: int = 0  # their cost
    pending: int = 0  # items not yet computed
    parts: list[tuple[int, Tensors]] = field(default_factory=list)
    dead: bool = False

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


#: Called for a request dropped while queued: (request, the error it gets, the rejection reason
#: to count, or None when the 504 is counted elsewhere).
Drop = Callable[[QueuedRequest, ScoringError, "str | None"], None]


def padded_to_longest(costs: np.ndarray) -> float:
    """A batch's cost when every item is padded to the costliest: ``max * N`` (0 when empty)."""
    return float(costs.max()) * len(costs) if len(costs) else 0.0


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
        costs = request.costs
        if costs is not None and self.bytes != math.inf:
            n = min(n, costs.items_within(start, start + n, self.bytes))
        tokens = request.tokens
        if tokens is not None and self.tokens != math.inf and n > 0:
            # the most items whose batch costs at most the budget (a batch's cost grows with its
            # items): a binary search over how many to take
            fits, low, high = 0, 1, n
            while low <= high:
                k = (low + high) // 2
                if self.batch_cost(np.concatenate([*self.taken, tokens[start : start + k]])) <= self.tokens:
                    fits, low = k, k + 1
                else:
                    high = k - 1
            n = fits
        return n

    def take(self, request: QueuedRequest, start: int, stop: int) -> None:
        """Account for items ``[start, stop)`` of ``request`` joining the batch."""
        self.items -= stop - start
        if request.costs is not None and self.bytes != math.inf:
            self.bytes -= request.costs.between(start, stop)
        if request.tokens is not None:
            self.taken.append(request.tokens[start:stop])


class ChunkQueue:
    """The waiting requests of one model (as chunks), oldest first."""

    def __init__(self) -> None:
        self._chunks: deque[Chunk] = deque()
        #: Items waiting (excludes the batch running and the items of dead requests).
        self.items = 0
        #: Their cost (tokens for priced models, else items).
        self.cost = 0

    def put(self, request: QueuedRequest) -> None:
        """Queue all of ``request``'s items (its ``tokens``, if priced, sorted ascending)."""
        request.queued, request.queued_cost = request.size, request.cost
        self.items += request.size
        self.cost += request.queued_cost
        self._chunks.append(Chunk(request, 0, request.size))

    def forget(self, request: QueuedRequest) -> bool:
        """Mark ``request`` dead; True when some of its items were still waiting (they no
        longer count; its chunk is dropped when it reaches the head of the queue)."""
        if request.dead:
            return False
        request.dead = True
        if not request.queued:
            return False
        self.items -= request.queued
        self.cost -= request.queued_cost
        request.queued = request.queued_cost = 0
        return True

    def head(self) -> Chunk | None:
        """The oldest chunk of a live request, or None."""
        chunks = self._chunks
        while chunks and chunks[0].request.dead:
            chunks.popleft()
        return chunks[0] if chunks else None

    def requests(self) -> list[QueuedRequest]:
        """Every request with a chunk queued, emptying the queue (the batcher stops)."""
        out = {id(c.request): c.request for c in self._chunks}
        self._chunks.clear()
        return list(out.values())

    def take(self, now: float, budget: Budget, drop: Drop) -> list[Chunk]:
        """A batch: the oldest chunks of live requests within ``budget``, splitting the last one
        taken where it exceeds it. Requests whose client left or whose deadline passed (``now``,
        loop seconds) are dropped on the way with ``drop``."""
        taken: list[Chunk] = []
        chunks = self._chunks
        while budget.items > 0 and chunks:
            chunk = chunks[0]
            request = chunk.request
            if request.dead or _expired(request, now, drop):
                chunks.popleft()
                continue
            n = budget.fit(request, chunk.start, chunk.stop)
            if n == 0 and not taken:
                n = 1  # an item over a budget alone still runs (admission refuses it first)
            if n == 0:
                break  # the next item would take the batch over a budget
            if n == chunk.stop - chunk.start:
                chunks.popleft()
                part = chunk
            else:
                part = Chunk(request, chunk.start, chunk.start + n)
                chunk.start += n
            budget.take(request, part.start, part.stop)
            taken.append(part)
            cost = request.cost_between(part.start, part.stop)
            request.queued -= n
            request.queued_cost -= cost
            self.items -= n
            self.cost -= cost
        return taken


def _expired(request: QueuedRequest, now: float, drop: Drop) -> bool:
    """Drop ``request`` (True) if its client left or its deadline passed."""
    if request.dead:
        return True
    if request.is_disconnected is not None and request.is_disconnected():
        drop(request, ClientDisconnected(f"client of request {request.request_id} left"), "disconnected")
        return True
    if now >= request.deadline:
        # Counted by the waiting request itself, which answers the 504.
        drop(request, DeadlineExceeded(f"request {request.request_id} expired in queue"), None)
        return True
    return False


def concat(chunks: list[Chunk]) -> Tensors:
    """The inputs of a batch, ``[sum of chunk sizes, ...]`` per input name (no copy for a
    batch that is one whole request)."""
    first = chunks[0]
    if len(chunks) == 1 and first.start == 0 and first.stop == first.request.size:
        return dict(first.request.inputs)
    names = first.request.inputs.keys()
    return {n: np.concatenate([c.request.inputs[n][c.start : c.stop] for c in chunks]) for n in names}


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


def sort_by_cost(
    inputs: Mapping[str, np.ndarray], tokens: np.ndarray
) -> tuple[Mapping[str, np.ndarray], np.ndarray, np.ndarray | None]:
    """A request's inputs and costs with its items sorted by cost (ascending, stable), and the
    permutation (None when they already were)."""
    if len(tokens) < 2 or bool((tokens[1:] >= tokens[:-1]).all()):
        return inputs, tokens, None
    order = np.argsort(tokens, kind="stable")
    return {k: v[order] for k, v in inputs.items()}, tokens[order], order
