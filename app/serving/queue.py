"""The queue of one model version: requests waiting with their budgets, by priority level, and
the batches formed from them (dynamic batching); the batch and its parts live here too, as in
text-embeddings-inference's ``core/src/queue.rs``: a request as queued (:class:`QueuedRequest`),
a range of its items (:class:`Chunk`), what a forming batch may still hold (:class:`Budget`,
with each request's input bytes per item, :class:`ItemBytes`), the batch formed (:class:`Batch`)
and its outputs handed back to each request in the order its items were sent
(:func:`outputs_between`, :func:`assemble`).

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

Requests of a priced model arrive with their items sorted by cost (``app.serving.executor.price``) and are
never passed over within a level, so the backlog ahead of a request is what admission counts
(docs/architecture.md: why not a queue sorted by length). Source: text-embeddings-inference's
``max_batch_tokens`` (``core/src/queue.rs``), Triton's dynamic batcher and priority queue.

A priced request's items travel sorted by cost, each input reordered alike: the items'
preparations (``PREPARED``, from :class:`app.models.base.Priced`) are one more input to every
step here (sorting, slicing into chunks, concatenation into a batch), so ``preprocess`` gets each
item's own. They count in no byte bound (:func:`check_item_bounds`).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.errors import ClientDisconnected, DeadlineExceeded, PayloadTooLarge, ScoringError
from app.models.base import PREPARED, Segment
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
    #: Its items' shape (``item_shape`` of each input) for a model with a variable (-1)
    #: dimension: only requests of the same shape share a batch; None: every shape is the same.
    shape: tuple[tuple[int, ...], ...] | None = None

    #: From its context, read once (the queue reads them of every request it looks at): when its
    #: outputs are due (``loop.time()`` seconds), its id (errors, logs), and what says its
    #: client has gone (None: never asked).
    deadline: float = field(init=False)
    request_id: str = field(init=False)
    is_disconnected: Callable[[], bool] | None = field(init=False)
    #: The request's cost: its tokens (priced models), else its items.
    cost: int = field(init=False)

    def __post_init__(self) -> None:
        context = self.context
        self.deadline, self.request_id = context.deadline, context.request_id
        self.is_disconnected = context.is_disconnected
        self.cost = int(self.tokens.sum()) if self.tokens is not None else self.size

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
    #: The item shape of the requests taken (:attr:`QueuedRequest.shape`); None: none taken yet,
    #: or no variable dimension.
    shape: tuple[tuple[int, ...], ...] | None = None

    def fit(self, request: QueuedRequest, start: int, stop: int) -> int:
        """How many of ``request``'s items from ``start`` (at most ``stop - start``) fit: none of
        a request whose item shape differs from the batch's (Triton's dynamic batcher: requests
        of a variable-shape input batch together only when their shapes match)."""
        if request.shape is not None and self.shape is not None and request.shape != self.shape:
            return 0
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
        if request.shape is not None:
            self.shape = request.shape
        if request.item_bytes is not None and self.bytes != math.inf:
            self.bytes -= request.item_bytes.between(start, stop)
        if request.tokens is not None:
            self.taken.append(request.tokens[start:stop])


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


class ItemBytes:
    """The input bytes of each item of one request, for the batch byte bound.

    All-numeric inputs cost the same per item (``nbytes / B`` summed over inputs): one integer,
    no per-item array (the hot path of small numeric requests). With a BYTES input the cost
    varies per item and is kept cumulatively: ``B + 1`` ints, ``[0] = 0``, so items ``[i, j)``
    cost ``c[j] - c[i]`` bytes (an element's cost: its length). In plain Python: for a request's
    few items a numpy call costs more than the arithmetic (docs/benchmarks.md, *Figures behind
    the code's choices*).

    Args:
        inputs: one array per model input, ``[B, ...]``, B >= 1.
    """

    __slots__ = ("_largest", "cumulative", "each")

    def __init__(self, inputs: Mapping[str, np.ndarray]) -> None:
        #: Bytes per item when every input is numeric, else None.
        self.each: int | None = None
        #: Cumulative bytes, ``B + 1`` ints, when some input is BYTES, else None.
        self.cumulative: list[int] | None = None
        size = len(next(iter(inputs.values())))
        if any(arr.dtype.hasobject for arr in inputs.values()):
            per_item = [0] * size
            for arr in inputs.values():
                if not arr.dtype.hasobject:
                    fixed = arr.nbytes // max(1, size)
                    per_item = [n + fixed for n in per_item]
                elif arr.size == size:  # one element an item (a text)
                    per_item = [n + len(v) for n, v in zip(per_item, arr.reshape(-1).tolist(), strict=True)]
                else:
                    rows = arr.reshape(size, -1).tolist()
                    per_item = [n + sum(map(len, row)) for n, row in zip(per_item, rows, strict=True)]
            self._largest = max(per_item, default=0)
            self.cumulative = list(itertools.accumulate(per_item, initial=0))
        else:
            self.each = sum(arr.nbytes for arr in inputs.values()) // max(1, size)
            self._largest = self.each

    def largest(self) -> int:
        """The bytes of the costliest item."""
        return self._largest

    def between(self, start: int, stop: int) -> int:
        """The bytes of items ``[start, stop)``."""
        if self.cumulative is None:
            return (stop - start) * (self.each or 0)
        return self.cumulative[stop] - self.cumulative[start]

    def items_within(self, start: int, stop: int, budget: float) -> int:
        """How many items from ``start`` (at most ``stop - start``) fit within ``budget`` bytes."""
        if self.cumulative is None:
            fit = int(budget // self.each) if self.each else stop - start
            return max(0, min(fit, stop - start))
        c = self.cumulative
        end = bisect.bisect_right(c, c[start] + budget) - 1
        return max(0, min(end, stop) - start)


def check_item_bounds(
    model: str,
    request_id: str,
    inputs: Mapping[str, np.ndarray],
    tokens: np.ndarray | None,
    max_batch_bytes: int | None,
    max_batch_tokens: int | None,
) -> ItemBytes | None:
    """Refuse a request whose costliest item alone exceeds a batch's bytes or tokens (its
    ``tokens`` sorted ascending); returns its :class:`ItemBytes` (None without a byte bound).

    Raises:
        PayloadTooLarge: 413, naming the bound.
    """
    if tokens is not None and max_batch_tokens is not None and int(tokens[-1]) > max_batch_tokens:
        raise PayloadTooLarge(
            f"an item of request {request_id} costs {int(tokens[-1])} tokens; model {model} runs at "
            f"most {max_batch_tokens} in one batch (model.toml max_batch_tokens)"
        )
    if max_batch_bytes is None:
        return None
    if PREPARED in inputs:  # the handler's own preparations are not the client's bytes
        inputs = {name: array for name, array in inputs.items() if name != PREPARED}
    item_bytes = ItemBytes(inputs)
    largest = item_bytes.largest()
    if largest > max_batch_bytes:
        raise PayloadTooLarge(
            f"an item of request {request_id} has {largest} bytes of input; model {model} runs at "
            f"most {max_batch_bytes} bytes in one batch (model.toml max_batch_bytes, SCORING_MAX_BATCH_BYTES)"
        )
    return item_bytes


#: Gathering stops after this many event-loop turns in a row that queued no request (an idle
#: loop turns in microseconds: one client alone waits a few of them).
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
