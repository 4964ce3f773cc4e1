"""The queue of a dynamic batcher: requests whose items wait to be taken into batches.

A request is queued as :class:`Chunk` s, ranges ``[start, stop)`` of its items. A batch takes
chunks while they fit (items, input bytes, tokens) and splits the last one, so one request's
items may run in several batches; its outputs are put back in order by :func:`assemble`. A
request that leaves (deadline, client gone, failure) is marked dead and its chunks are dropped
lazily when they reach the head of their queue. :class:`ChunkQueue` keeps the count of items
and of their cost still waiting, which the batcher's admission and memory bound read.

**Batches formed by cost.** A model whose handler prices its items (``item_costs``: tokens for
a text model) has each request's items sorted by cost when it arrives (the permutation is
undone on the way out) and cut into chunks by *length class* (``class_width`` tokens each), one
FIFO queue per class. A batch is anchored on the oldest waiting chunk: it takes that chunk's
class first (oldest first), then fills up from the shorter classes (which pad up to the
batch's longest item at no extra length) and last from the longer ones, as long as the batch
stays within ``max_batch_size`` items, ``max_batch_tokens`` (items x the longest item's tokens:
what a padded batch computes) and ``max_batch_bytes``. So a deep queue runs in batches of
similar lengths (little padding), a shallow one in one batch as before, and no request is
passed over for long: every batch takes the oldest chunk, so a chunk waits at most for the
batches that take the chunks queued before it. Models that do not price their items queue in
one class: plain FIFO. Source: text-embeddings-inference's ``max_batch_tokens``
(``core/src/queue.rs``) and Infinity's length-sorted batches (``inference/queue.py``).
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterator, Mapping
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
    """Items ``[start, stop)`` of ``request``, in length class ``cls``; ``seq`` orders chunks by
    arrival (the oldest waiting chunk anchors the next batch)."""

    request: QueuedRequest
    start: int
    stop: int
    cls: int = 0
    seq: int = 0


#: Called for a request dropped while queued: (request, the error it gets, the rejection reason
#: to count, or None when the 504 is counted elsewhere).
Drop = Callable[[QueuedRequest, ScoringError, "str | None"], None]


@dataclass
class Budget:
    """What one batch may still hold: items, input bytes, tokens (padding included)."""

    items: int
    bytes: float = math.inf
    tokens: float = math.inf
    longest: int = 0  # the longest item's cost taken so far (priced models)
    count: int = 0

    def fit(self, request: QueuedRequest, start: int, stop: int) -> int:
        """How many of ``request``'s items from ``start`` (at most ``stop - start``) fit."""
        n = min(stop - start, self.items)
        costs = request.costs
        if costs is not None and self.bytes != math.inf:
            n = min(n, costs.items_within(start, start + n, self.bytes))
        tokens = request.tokens
        if tokens is not None and self.tokens != math.inf and n > 0:
            # tokens ascend within a request: taking k items makes the batch k items longer and
            # its longest item max(longest, tokens[start + k - 1])
            k = np.arange(1, n + 1)
            padded = (self.count + k) * np.maximum(self.longest, tokens[start : start + n])
            n = int(np.searchsorted(padded > self.tokens, True))
        return n

    def take(self, request: QueuedRequest, start: int, stop: int) -> None:
        """Account for items ``[start, stop)`` of ``request`` joining the batch."""
        self.items -= stop - start
        self.count += stop - start
        if request.costs is not None and self.bytes != math.inf:
            self.bytes -= request.costs.between(start, stop)
        if request.tokens is not None:
            self.longest = max(self.longest, int(request.tokens[stop - 1]))


class ChunkQueue:
    """The waiting chunks of one model, by length class, oldest first.

    Args:
        class_width: tokens per length class for priced models (module docstring).
    """

    def __init__(self, class_width: int = 16) -> None:
        self.class_width = max(1, class_width)
        self._classes: dict[int, deque[Chunk]] = {0: deque()}
        self._seq = 0
        #: Items waiting (excludes the batch running and the items of dead requests).
        self.items = 0
        #: Their cost (tokens for priced models, else items).
        self.cost = 0

    def put(self, request: QueuedRequest) -> None:
        """Queue all of ``request``'s items (its ``tokens`` already sorted ascending)."""
        request.queued, request.queued_cost = request.size, request.cost
        self.items += request.size
        self.cost += request.queued_cost
        tokens = request.tokens
        if tokens is None:
            self._append(Chunk(request, 0, request.size))
            return
        classes = (tokens - 1) // self.class_width
        bounds = np.flatnonzero(np.diff(classes)) + 1
        edges = [0, *bounds.tolist(), request.size]
        # the longest class first: it anchors the request's first batch (the rest pad up to it)
        for start, stop in reversed(list(itertools.pairwise(edges))):
            self._append(Chunk(request, start, stop, int(classes[start])))

    def _append(self, chunk: Chunk) -> None:
        chunk.seq = self._seq
        self._seq += 1
        self._classes.setdefault(chunk.cls, deque()).append(chunk)

    def forget(self, request: QueuedRequest) -> bool:
        """Mark ``request`` dead; True when some of its items were still waiting (they no
        longer count; their chunks are dropped when they reach the head of their class)."""
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
        best: Chunk | None = None
        for chunks in self._classes.values():
            while chunks and chunks[0].request.dead:
                chunks.popleft()
            if chunks and (best is None or chunks[0].seq < best.seq):
                best = chunks[0]
        return best

    def requests(self) -> list[QueuedRequest]:
        """Every request with a chunk queued, emptying the queue (the batcher stops)."""
        out = {id(c.request): c.request for chunks in self._classes.values() for c in chunks}
        for chunks in self._classes.values():
            chunks.clear()
        return list(out.values())

    def take(self, now: float, budget: Budget, drop: Drop) -> list[Chunk]:
        """A batch: chunks of live requests within ``budget``, anchored on the oldest (module
        docstring), splitting the last one taken from a class. Requests whose client left or
        whose deadline passed (``now``, loop seconds) are dropped on the way with ``drop``."""
        taken: list[Chunk] = []
        while (anchor := self.head()) is not None and _expired(anchor.request, now, drop):
            continue
        if anchor is None:
            return taken
        for cls in self._visit_order(anchor.cls):
            chunks = self._classes[cls]
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
                    part = Chunk(request, chunk.start, chunk.start + n, chunk.cls, chunk.seq)
                    chunk.start += n
                budget.take(request, part.start, part.stop)
                taken.append(part)
                cost = request.cost_between(part.start, part.stop)
                request.queued -= n
                request.queued_cost -= cost
                self.items -= n
                self.cost -= cost
            if budget.items <= 0:
                break
        return taken

    def _visit_order(self, anchor: int) -> Iterator[int]:
        """The anchor's class, then the shorter classes (longest first), then the longer ones."""
        known = sorted(self._classes)
        yield anchor
        yield from (c for c in reversed(known) if c < anchor)
        yield from (c for c in known if c > anchor)


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
