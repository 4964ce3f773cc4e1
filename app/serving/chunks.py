"""The queue of a dynamic batcher: requests whose items wait, in arrival order, to be taken
into batches.

A request is queued whole as one :class:`Chunk` (items ``[0, B)``); a batch takes whole
chunks while they fit and splits the last one, so one request's items may run in several
batches (their outputs are put back in order by :func:`assemble`). A request that leaves
(deadline, client gone, failure) is marked dead and its chunks are dropped lazily when they
reach the head of the queue. :class:`ChunkQueue` keeps the count of items still waiting,
which the batcher's admission and memory bound read.
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
    """One inference request in the batcher: its inputs ``[B, ...]`` and where its items are."""

    inputs: Mapping[str, np.ndarray]
    size: int
    deadline: float  # loop.time() seconds
    arrival: float
    request_id: str
    is_disconnected: Callable[[], bool] | None
    future: asyncio.Future[Tensors]
    costs: ItemCosts | None  # input bytes per item; None without a batch cost bound
    queued: int = 0  # items still waiting in the queue
    pending: int = 0  # items not yet computed
    parts: list[tuple[int, Tensors]] = field(default_factory=list)
    dead: bool = False


@dataclass(eq=False)
class Chunk:
    """Items ``[start, stop)`` of ``request``."""

    request: QueuedRequest
    start: int
    stop: int


#: Called for a request dropped while queued: (request, the error it gets, the rejection reason
#: to count, or None when the 504 is counted elsewhere).
Drop = Callable[[QueuedRequest, ScoringError, "str | None"], None]


class ChunkQueue:
    """The waiting chunks of one model, oldest first, and the count of their items."""

    def __init__(self) -> None:
        self._chunks: deque[Chunk] = deque()
        #: Items waiting (excludes the batch running and the items of dead requests).
        self.items = 0

    def put(self, request: QueuedRequest) -> None:
        """Queue all of ``request``'s items."""
        self._chunks.append(Chunk(request, 0, request.size))
        self.items += request.size

    def forget(self, request: QueuedRequest) -> bool:
        """Mark ``request`` dead; True when some of its items were still waiting (they no
        longer count; their chunks are dropped when they reach the head)."""
        if request.dead:
            return False
        request.dead = True
        if not request.queued:
            return False
        self.items -= request.queued
        request.queued = 0
        return True

    def head(self) -> Chunk | None:
        """The oldest chunk of a live request, or None."""
        chunks = self._chunks
        while chunks and chunks[0].request.dead:
            chunks.popleft()
        return chunks[0] if chunks else None

    def requests(self) -> list[QueuedRequest]:
        """Every request with a chunk queued, emptying the queue (the batcher stops)."""
        out = [c.request for c in self._chunks]
        self._chunks.clear()
        return out

    def take(self, now: float, room: int, max_bytes: int | None, drop: Drop) -> list[Chunk]:
        """Up to ``room`` items and ``max_bytes`` of input (None: no bound) of live requests,
        oldest first, splitting the last chunk. Requests whose client left or whose deadline
        passed (``now``, loop seconds) are dropped on the way with ``drop``."""
        taken: list[Chunk] = []
        budget = float(max_bytes) if max_bytes is not None else math.inf
        while room > 0 and (chunk := self.head()) is not None:
            request = chunk.request
            if request.is_disconnected is not None and request.is_disconnected():
                left = ClientDisconnected(f"client of request {request.request_id} left")
                drop(request, left, "disconnected")
                continue
            if now >= request.deadline:
                # Counted by the waiting request itself, which answers the 504.
                drop(request, DeadlineExceeded(f"request {request.request_id} expired in queue"), None)
                continue
            size = min(chunk.stop - chunk.start, room)
            costs = request.costs
            if costs is not None and budget != math.inf:
                size = min(size, costs.items_within(chunk.start, chunk.stop, budget))
                if size == 0 and taken:
                    break  # the next item would take the batch over its cost bound
                size = max(size, 1)  # admission refuses an item over the bound alone
                budget -= costs.between(chunk.start, chunk.start + size)
            if size == chunk.stop - chunk.start:
                self._chunks.popleft()
                part = chunk
            else:
                part = Chunk(request, chunk.start, chunk.start + size)
                chunk.start += size
            taken.append(part)
            room -= size
            request.queued -= size
            self.items -= size
        return taken


def concat(chunks: list[Chunk]) -> Tensors:
    """The inputs of a batch, ``[sum of chunk sizes, ...]`` per input name (no copy for a
    batch that is one whole request)."""
    first = chunks[0]
    if len(chunks) == 1 and first.start == 0 and first.stop == first.request.size:
        return dict(first.request.inputs)
    names = first.request.inputs.keys()
    return {n: np.concatenate([c.request.inputs[n][c.start : c.stop] for c in chunks]) for n in names}


def assemble(parts: list[tuple[int, Tensors]]) -> Tensors:
    """A request's outputs from its parts ``(first item, outputs)``, in item order."""
    if len(parts) == 1:
        return parts[0][1]
    ordered = sorted(parts, key=lambda p: p[0])
    return {k: np.concatenate([p[1][k] for p in ordered]) for k in ordered[0][1]}
