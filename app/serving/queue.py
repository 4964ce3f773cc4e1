"""The queue of one model version: requests waiting with their budgets, by priority level, and
the batches formed from them (dynamic batching).

A request is queued as :class:`Chunk` s, ranges ``[start, stop)`` of its items, in the deque of
its **priority level** (Triton's ``priority_levels``: level 1 is the highest). A batch is taken
(:meth:`RequestQueue.take`) from the highest level first, oldest first within a level, within
``max_batch_size`` items, ``max_batch_tokens`` (the handler's ``batch_cost`` of its items'
costs, padding included) and ``max_batch_bytes``; only the last chunk taken is split, so one
request may run in several batches. A request that leaves (deadline, client gone, failure) is
marked dead; its chunks are dropped when they reach the head of their deque.

**When a batch closes** (:meth:`RequestQueue.next_batch`): at ``max_batch_size`` items, or once
``max_queue_delay`` has passed since the oldest waiting item arrived and the event loop has gone
round up to ``gather_turns`` more times (requests already on their way join). Triton's rule:
``max_queue_delay = 0`` still batches under load and adds no wait when idle.

**No level starves** (aging): a lower-level request goes before every level once it has waited
``priority_aging`` of its time to deadline (default three quarters: past admission's one half,
so only requests pushed back by higher levels age) or has two of the longest recent batches left
(the one running, its own). ``priority_aging = 1`` turns both rules off: strict priority, as
Triton's, where a lower level waits while higher levels have items (and may time out). **Fill**:
lower levels join a batch holding higher-level items only
while they add at most ``priority_fill`` to its expected time (``fill``, the measured rate).

Requests of a priced model arrive with their items sorted by cost (``app.serving.batch.price``) and are
never passed over within a level, so the backlog ahead of a request is what admission counts
(docs/architecture.md: why not a queue sorted by length). Source: text-embeddings-inference's
``max_batch_tokens`` (``core/src/queue.rs``), Triton's dynamic batcher and priority queue.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable

import numpy as np

from app.errors import ClientDisconnected, DeadlineExceeded, InvalidInput, ScoringError
from app.serving.batch import Budget, Chunk, QueuedRequest, padded_to_longest

#: Gathering stops after this many event-loop turns in a row that queued no request (an idle
#: loop turns in ~3 µs: one client alone waits ~10 µs).
GATHER_IDLE_TURNS = 4


#: Drops a queued request: (request, its error, the rejection to count; None: its own 504).
Drop = Callable[[QueuedRequest, ScoringError, "str | None"], None]


class RequestQueue:
    """The waiting requests of one model version, by priority level, and the batches formed
    from them (module docstring).

    Args:
        max_batch_size: most items in one batch.
        max_queue_delay_s: longest wait for more items after the oldest waiting item arrived.
        gather_turns: event-loop turns a partial batch may wait after that for requests already
            on their way (:meth:`_gather`); 0 = none.
        gather_max_s: the longest gathering, seconds.
        max_batch_bytes: most input bytes in one batch; None = no bound.
        max_batch_tokens: most tokens (the handler's cost unit, padding included); None = none.
        batch_cost: what a batch of priced items computes (``[N]`` costs -> cost).
        levels: priority levels (at least 1).
        aging: after this share of its time to deadline a lower-level request goes first; 1:
            never (strict priority, the margin rule off too).
        margin: the longest recent batch, seconds (aging keeps two before a deadline); None: 0.
        fill: with levels, the most a batch may cost (``batch_cost``, or items unpriced) once
            it holds the items of its highest level, costing the argument; None: no bound.
    """

    def __init__(
        self,
        *,
        max_batch_size: int,
        max_queue_delay_s: float,
        gather_turns: int,
        gather_max_s: float,
        max_batch_bytes: int | None = None,
        max_batch_tokens: int | None = None,
        batch_cost: Callable[[np.ndarray], float] = padded_to_longest,
        levels: int = 1,
        aging: float,
        fill: Callable[[float], float] | None = None,
        margin: Callable[[], float] | None = None,
    ) -> None:
        self.max_batch_size, self.max_queue_delay_s = max_batch_size, max_queue_delay_s
        self.gather_turns, self.gather_max_s = max(0, gather_turns), gather_max_s
        self.max_batch_bytes, self.max_batch_tokens = max_batch_bytes, max_batch_tokens
        self.batch_cost, self.aging = batch_cost, aging
        self.fill, self.margin, self._margin_s = (fill, margin, 0.0) if levels > 1 else (None, None, 0.0)
        self._levels: list[deque[Chunk]] = [deque() for _ in range(max(1, levels))]
        #: Items waiting (excludes the batches running and the items of dead requests), and
        #: their cost (tokens for priced models, else items); per level below.
        self.items, self.cost = 0, 0
        self._level_items, self._level_cost = [0] * len(self._levels), [0] * len(self._levels)
        #: True while a batch is open, waiting up to the max queue delay for more items.
        self.holding = False
        self._wakeup = asyncio.Event()

    def level(self, priority: int | None, default: int) -> int:
        """The level (0 = the highest) of Triton's request ``priority`` (1 = the highest; 0 or
        None: ``default``; ignored with one level).

        Raises:
            InvalidInput: a priority above the levels.
        """
        levels = len(self._levels)
        if not priority or levels == 1:
            return default
        if priority > levels:
            raise InvalidInput(f"priority {priority}: the model has priority levels 1..{levels}")
        return priority - 1

    def queued(self, level: int | None = None) -> tuple[int, float]:
        """(items, cost) waiting at ``level`` (0 = the highest) and above; None: at every level."""
        if level is None or len(self._levels) == 1:
            return self.items, self.cost
        return sum(self._level_items[: level + 1]), sum(self._level_cost[: level + 1])

    def put(self, request: QueuedRequest) -> None:
        """Queue all of ``request``'s items at its level and wake the forming of batches."""
        request.queued, request.queued_cost = request.size, request.cost
        self._count(request.level, request.size, request.queued_cost)
        self._levels[request.level].append(Chunk(request, 0, request.size))
        self._wakeup.set()

    def _count(self, level: int, items: int, cost: int) -> None:
        self.items, self.cost = self.items + items, self.cost + cost
        self._level_items[level] += items
        self._level_cost[level] += cost

    def forget(self, request: QueuedRequest) -> bool:
        """Mark ``request`` dead; True when some of its items were still waiting (they no longer
        count; its chunks are dropped when they reach the head of their deque)."""
        if request.dead:
            return False
        request.dead = True
        if not request.queued:
            return False
        self._count(request.level, -request.queued, -request.queued_cost)
        request.queued = request.queued_cost = 0
        return True

    def oldest_arrival(self) -> float | None:
        """When the oldest item of a live request still waiting arrived (loop time), or None."""
        oldest = None
        for chunks in self._levels:
            while chunks and chunks[0].request.dead:
                chunks.popleft()
            if chunks and (oldest is None or chunks[0].request.arrival < oldest):
                oldest = chunks[0].request.arrival
        return oldest

    def requests(self) -> list[QueuedRequest]:
        """Every request with a chunk queued, emptying the queue (the unit stops)."""
        out = {id(c.request): c.request for chunks in self._levels for c in chunks}
        for chunks in self._levels:
            chunks.clear()
        return list(out.values())

    async def next_batch(self, drop: Drop) -> tuple[list[Chunk], float]:
        """Wait for the next batch and take it (module docstring): its chunks (none when every
        request waiting was dropped meanwhile; ``drop``: see :meth:`take`) and the loop time."""
        loop = asyncio.get_running_loop()
        while (oldest := self.oldest_arrival()) is None:
            self._wakeup.clear()
            await self._wakeup.wait()
        close_at = oldest + self.max_queue_delay_s
        self.holding = True
        while self.items < self.max_batch_size:
            remaining = close_at - loop.time()
            if remaining <= 0:
                break
            self._wakeup.clear()
            try:
                async with asyncio.timeout(remaining):
                    await self._wakeup.wait()
            except TimeoutError:
                break
        if self.gather_turns:
            await self._gather(loop)
        self.holding = False
        now = loop.time()
        return self.take(now, drop), now

    async def _gather(self, loop: asyncio.AbstractEventLoop) -> None:
        """Before a partial batch closes, let the event loop go round up to ``gather_turns``
        times so that requests already on their way join it: stop at a full batch, after
        :data:`GATHER_IDLE_TURNS` turns in a row that queued nothing, or ``gather_max_s`` after
        it began. grpc.aio takes one new call from the gRPC core per loop turn, so without
        gathering a busy worker's gRPC calls reached the queue one at a time and ran as batches
        of 1.2 requests (docs/benchmarks.md, *Protocols*)."""
        give_up = loop.time() + self.gather_max_s
        turns = idle = 0
        while (
            turns < self.gather_turns
            and idle < GATHER_IDLE_TURNS
            and self.items < self.max_batch_size
            and loop.time() < give_up
        ):
            seen = self.items
            await asyncio.sleep(0)
            turns += 1
            idle = 0 if self.items > seen else idle + 1

    def take(self, now: float, drop: Drop) -> list[Chunk]:
        """A batch's chunks: first the aged requests of lower levels (oldest first), then each
        level from the highest, oldest first, within the batch's budget; the last chunk taken is
        split where it exceeds it. Requests whose client left or whose deadline passed (``now``,
        loop seconds) are dropped on the way with ``drop``."""
        budget = Budget(
            self.max_batch_size,
            float(self.max_batch_bytes) if self.max_batch_bytes is not None else math.inf,
            float(self.max_batch_tokens) if self.max_batch_tokens is not None else math.inf,
            self.batch_cost,
        )
        taken: list[Chunk] = []
        if len(self._levels) > 1:
            self._margin_s = 2 * self.margin() if self.margin else 0.0
            for chunks in self._aged(now):
                if not self._take_from(chunks, budget, now, drop, taken, aged_only=True):
                    return taken
        capped = self.fill is None
        for chunks in self._levels:
            if not self._take_from(chunks, budget, now, drop, taken):
                break
            if taken and not capped:  # lower levels fill only what ``fill`` leaves
                capped = self._cap(budget, taken)
        return taken

    def _cap(self, budget: Budget, taken: list[Chunk]) -> bool:
        assert self.fill is not None  # the items ``taken`` cap what the lower levels may add
        if budget.taken:  # priced: by cost, padding included
            budget.tokens = min(budget.tokens, self.fill(budget.batch_cost(np.concatenate(budget.taken))))
        else:
            items = sum(c.stop - c.start for c in taken)
            budget.items = max(0, min(budget.items, int(min(self.fill(items), 1e9)) - items))
        return True

    def _aged(self, now: float) -> list[deque[Chunk]]:
        """The lower levels whose head request has waited its aging share, oldest head first."""
        heads = []
        for chunks in self._levels[1:]:
            if chunks and self._is_aged(chunks[0].request, now):
                heads.append((chunks[0].request.arrival, id(chunks), chunks))
        return [chunks for _, _, chunks in sorted(heads)]

    def _is_aged(self, request: QueuedRequest, now: float) -> bool:
        span = request.deadline - request.arrival
        if self.aging >= 1:  # strict priority (Triton's): a lower level waits, and may time out
            return False
        return request.deadline - now <= self._margin_s or now - request.arrival >= self.aging * span

    def _take_from(
        self,
        chunks: deque[Chunk],
        budget: Budget,
        now: float,
        drop: Drop,
        taken: list[Chunk],
        aged_only: bool = False,
    ) -> bool:
        """Take ``chunks`` into the batch while they fit; False once the batch is full."""
        while budget.items > 0 and chunks:
            chunk = chunks[0]
            request = chunk.request
            if request.dead or _expired(request, now, drop):
                chunks.popleft()
                continue
            if aged_only and not self._is_aged(request, now):
                return True
            n = budget.fit(request, chunk.start, chunk.stop)
            if n == 0 and not taken:
                n = 1  # an item over a budget alone still runs (admission refuses it first)
            if n == 0:
                return False  # the next item would take the batch over a budget
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
            self._count(request.level, -n, -cost)
        return budget.items > 0


def _expired(request: QueuedRequest, now: float, drop: Drop) -> bool:
    """Drop ``request`` (True) if its client left or its deadline passed."""
    if request.is_disconnected is not None and request.is_disconnected():
        drop(request, ClientDisconnected(f"client of request {request.request_id} left"), "disconnected")
        return True
    if now >= request.deadline:
        # Counted by the waiting request itself, which answers the 504.
        drop(request, DeadlineExceeded(f"request {request.request_id} expired in queue"), None)
        return True
    return False
