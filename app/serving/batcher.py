"""Dynamic batching of inference requests across clients, per model per worker.

Requests put their items (rows along axis 0) on a bounded queue. A batch closes
when it holds ``max_batch_size`` items (or as many tokens as ``max_batch_tokens``
allows, for a model that prices its items) or when ``max_queue_delay`` has passed
since the *first item of that batch* arrived and the event loop has gone round a few
times more (``gather_turns``: the requests already on their way join it, a wait that
is microseconds on an idle worker and grows with its load); a request's items may be split
across batches and are reassembled in order. How a deep queue is cut into batches
of similar cost, and why no request waits long for it: :mod:`app.serving.chunks`.

**Where a batch runs.** Serially, all three stages on the model's inference thread
(``run_batch``: the CPU default, where stages would only share the same cores), or
through the **staged pipeline** (a CUDA device's default): ``preprocess`` on a prepare
thread, ``predict`` on the inference thread, ``postprocess`` on a finish thread, so that
while batch N runs on the device, batch N+1 is prepared and batch N-1 copied back and
finished. One batch at a time is prepared ahead of the one running, so batches still
grow under load (items wait for the next batch while one runs). A batch whose stage
fails, or that runs out of device memory, runs again serially on the inference thread,
where out-of-memory halves it and a handler's failure on a batch of several requests
is retried per request (``ModelRunner.run_batch``): one request's bad items fail that
request only.

**Pricing.** A model whose handler prices its items (``item_costs``: tokens) has each
request priced on a prepare thread before its items join the queue; a handler that
refuses an item fails that request alone (400) before it can share a batch.

Backpressure: the queue holds at most ``queue_capacity`` items; a request that
does not fit fails at once with :class:`~app.errors.QueueFull` (503 +
Retry-After). Deadlines: a request whose deadline passes gets
:class:`~app.errors.DeadlineExceeded` (504) and its queued items are dropped;
so are the items of a client that disconnected, before any compute is spent.

Admission by time (:mod:`app.serving.admission`), in the model's own cost unit (tokens
for a priced model, padding included, else items): a request whose expected wait plus
service, at the measured rate, does not fit its deadline is refused at once with
``QueueFull`` (503 + Retry-After = the backlog in seconds), unless it could not finish
even on an idle model (then 504 at once: retrying would not help). An idle model admits
every request: a rate measured under a past overload never keeps refusing once the load
has gone. Batch byte bound: a batch holds at most ``max_batch_bytes`` of input; an item
that alone exceeds it is refused (413).

Source: Triton's dynamic batcher (``max_queue_delay_microseconds``,
``preferred_batch_size``), TorchServe's ``batch_size``/``max_batch_delay``,
text-embeddings-inference's token budget and Infinity's staged model worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from app.errors import (
    DeadlineExceeded,
    InferenceFailed,
    InsufficientStorage,
    InvalidInput,
    PayloadTooLarge,
    QueueFull,
    ScoringError,
)
from app.models.segment import Segment, outputs_between
from app.serving.admission import ItemCosts, ServiceRate
from app.serving.chunks import (
    Budget,
    Chunk,
    ChunkQueue,
    QueuedRequest,
    Tensors,
    assemble,
    concat,
    padded_to_longest,
    sort_by_cost,
)
from app.serving.observer import BatchObserver, NullObserver, RunningBatch

log = logging.getLogger(__name__)

#: Admit a request only if it is expected to finish within this share of its deadline: the
#: rate is measured on past batches, and the next ones may be slower (a burst of requests to
#: refuse takes CPU, another model computes at the same time). Measured at the onset of an
#: overload, load generator on the same two cores: the same batches 1.6 times slower, before
#: the rate can see it. With 0.6, three 504s in the mixed-length overload; with 0.4, goodput
#: 0.63 of capacity in the uniform one (a shorter queue parks fewer clients, and the others
#: spend the CPU on refusals); 0.5 gave neither (docs/reliability.md, *Overload figures*).
ADMISSION_HEADROOM = 0.5
#: How far past its expected time a running batch may be before what waits behind it is
#: stretched (:meth:`DynamicBatcher.backlog_s`): a thread waiting for the interpreter lock
#: waits 5 ms switch intervals, so a fast model's 0.5 ms batch can take 10 ms beside a busy
#: event loop. Stretching by that ratio (20x) refused the feed-ranker at 64 gRPC connections
#: with 512 items queued (expected 520 ms at 36,444 items/s).
OVERDUE_SLACK_S = 0.02
#: Gathering (:meth:`DynamicBatcher._gather`) stops after this many event-loop turns in a row
#: that queued no request (an idle loop turns in ~3 µs: one client alone waits ~10 µs) ...
GATHER_IDLE_TURNS = 4
#: ... and this long after it began, seconds, whatever the load.
GATHER_MAX_S = 0.002
#: Requests whose sizes :meth:`DynamicBatcher.refuse_early` remembers.
_RECENT_REQUESTS = 32
#: Batches formed and not yet finished, at most (staged pipeline): one preparing, one
#: running, one finishing.
_IN_FLIGHT = 3


class BatchRunner(Protocol):
    """What the batcher runs (``app.models.runner.ModelRunner``): one batch serially, with
    out-of-memory halving and per-request retries (``groups``: each request's items)."""

    def run_batch(
        self, inputs: Mapping[str, np.ndarray], groups: Sequence[tuple[int, int]] = ()
    ) -> list[Segment]: ...


class StagedRunner(BatchRunner, Protocol):
    """A runner whose batches can go through the staged pipeline."""

    def prepare(self, inputs: Mapping[str, np.ndarray]) -> Any: ...

    def predict(self, prepared: Any) -> Any: ...

    def finish(self, predicted: Any) -> dict[str, np.ndarray]: ...


@dataclass(frozen=True)
class Threads:
    """The threads of one model: its inference thread, and for the staged pipeline and item
    pricing a prepare pool and a finish thread (None: the inference thread does that work)."""

    inference: Executor
    prepare: Executor | None = None
    finish: Executor | None = None


class DynamicBatcher:
    """The dynamic batcher of one model in one worker.

    Args:
        model: name used in messages and logs.
        runner: runs batches (``app.models.runner.ModelRunner``).
        threads: the model's inference thread (an ``Executor`` alone is taken as it) and, for
            the pipeline and pricing, its prepare and finish threads.
        max_batch_size: most items in one batch.
        max_queue_delay_ms: longest wait for more items after a batch's first item arrived, ms.
        gather_turns: event-loop turns a partial batch may wait after that for requests
            already on their way (:meth:`_gather`); 0 = none.
        queue_capacity: most items queued (not yet in a running batch): the memory bound.
        max_batch_bytes: most input bytes in one batch (the batch cost bound); None = no bound.
        max_batch_tokens: most tokens in one batch, padding included (priced models); None =
            no bound.
        item_costs: prices one request's items (int64 ``[B]``; raises ``InvalidInput`` for an
            item the model cannot take); None = the model does not price its items.
        batch_cost: what a batch of priced items computes, padding included, from their
            costs (int64 ``[N]``); None = the costliest item times N.
        pipelined: run batches through the staged pipeline (``runner`` must be staged and
            ``threads`` must have prepare and finish threads).
        observer: receives batch and rejection events.
    """

    def __init__(
        self,
        model: str,
        runner: BatchRunner,
        threads: Threads | Executor,
        *,
        max_batch_size: int,
        max_queue_delay_ms: float,
        queue_capacity: int,
        max_batch_bytes: int | None = None,
        max_batch_tokens: int | None = None,
        item_costs: Callable[[Mapping[str, np.ndarray]], np.ndarray | None] | None = None,
        batch_cost: Callable[[np.ndarray], float] | None = None,
        pipelined: bool = False,
        observer: BatchObserver | None = None,
        gather_turns: int = 0,
    ) -> None:
        if max_batch_size < 1 or queue_capacity < max_batch_size or max_queue_delay_ms < 0:
            raise ValueError("need max_batch_size >= 1, queue_capacity >= max_batch_size, delay >= 0")
        self.model = model
        self._runner = runner
        self._threads = threads if isinstance(threads, Threads) else Threads(threads)
        if pipelined and (self._threads.prepare is None or self._threads.finish is None):
            raise ValueError("the staged pipeline needs prepare and finish threads")
        self.pipelined = pipelined
        self.max_batch_size = max_batch_size
        self.max_queue_delay_s = max_queue_delay_ms / 1000.0
        self.gather_turns = max(0, gather_turns)
        self.queue_capacity = queue_capacity
        self.max_batch_bytes = max_batch_bytes
        self.max_batch_tokens = max_batch_tokens
        self._item_costs = item_costs
        self._batch_cost = batch_cost or padded_to_longest
        #: The model's batch cost, per cost unit (tokens for a priced model, else items).
        self.rate = ServiceRate()
        #: Padded / real tokens of recent batches (a priced model's padding waste; 1 = none).
        self.padding = 1.0
        self._recent: deque[tuple[int, int]] = deque(maxlen=_RECENT_REQUESTS)  # (items, cost)
        self._observer: BatchObserver = observer or NullObserver()
        self._queue = ChunkQueue()
        self._reported_depth = 0
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self._batches: set[asyncio.Task[None]] = set()
        self._ahead = asyncio.Semaphore(1)  # one batch prepared ahead of the one running
        self._in_flight = asyncio.Semaphore(_IN_FLIGHT)
        #: True while a batch is open, waiting up to the max queue delay for more items.
        self.holding = False
        # (loop.time() at start, items, cost, requests) of the batches on the inference thread,
        # oldest first; read by the hung-inference watchdog (app.serving.lifecycle) and
        # admission, so the hot path only appends and pops a tuple.
        self._running: deque[tuple[float, int, float, dict[int, QueuedRequest]]] = deque()

    @property
    def running_batch(self) -> RunningBatch | None:
        """The oldest batch this model is running on the inference thread, or None."""
        if not self._running:
            return None
        started, items, _, requests = self._running[0]
        return RunningBatch(started, items, tuple(r.request_id for r in requests.values()))

    @property
    def queued_items(self) -> int:
        """Items waiting in the queue (excludes the batches running)."""
        return self._queue.items

    def start(self) -> None:
        """Start the batch-forming task on the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"batcher:{self.model}")

    async def stop(self) -> None:
        """Stop forming batches; requests still queued or in a batch fail with 503."""
        self._stopped = True
        tasks = [t for t in (self._task, *self._batches) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._task = None
        for request in self._queue.requests():
            self._fail(request, QueueFull(f"model {self.model} is unloading"))

    # --- admission -------------------------------------------------------------------

    def backlog_s(self, now: float, more_items: int = 0, more_cost: float = 0.0) -> float:
        """Expected seconds until the work already here, and ``more_items`` items costing
        ``more_cost`` after it, is done at the measured rate: the rest of the running batches,
        the queued items (and the new ones) in full batches, padded as recent batches were,
        and one max queue delay. A batch running longer than expected (beyond
        :data:`OVERDUE_SLACK_S`) stretches what waits behind it by the same factor (the
        slowdown an overload brings shows there a batch before :attr:`ServiceRate.lag` can see
        it), and is itself taken to need as much again as it has overrun. ``now`` is
        ``loop.time()``."""
        rest, overdue = 0.0, 1.0
        for i, (started, _, running_cost, _) in enumerate(self._running):
            expected_s = self.rate.seconds_for(running_cost)
            if i == 0:  # the one on the device now; the others wait behind it
                elapsed_s = now - started
                # past its time it is taken to need as much again as it has overrun
                rest = abs(expected_s - elapsed_s)
                # slower than expected so far: so will the rest be
                overdue = max(1.0, elapsed_s / (expected_s + OVERDUE_SLACK_S))
            else:
                rest += expected_s * overdue
        items = self._queue.items + more_items
        cost = (self._queue.cost + more_cost) * self.padding
        batches = math.ceil(items / self.max_batch_size)
        if self.max_batch_tokens and self._item_costs is not None:
            batches = max(batches, math.ceil(cost / self.max_batch_tokens))
        return rest + overdue * self.rate.seconds_for(cost, batches) + self.max_queue_delay_s

    def refuse_early(self, timeout_s: float) -> ScoringError | None:
        """The refusal (503, or 504 when even alone it could not finish) a request would get
        whatever its size, judged before its body is decoded (so a refusal under overload
        costs no decoding), or None.

        Its size is not known yet: it is taken as the smallest of the last requests (a model
        under a storm of 64-item requests refuses the next one as if it had 64 items; one
        smaller request lowers the bar for those after it). With less than a full batch queued
        there is no storm to refuse cheaply (decoding what waits costs at most one batch): the
        full admission after decoding judges the request.
        """
        if not self.backlogged:
            return None
        items, cost = min(self._recent, default=(1, 1))
        return self._refusal(items, cost, timeout_s, "another request")

    @property
    def backlogged(self) -> bool:
        """A full batch (``max_batch_size`` items) or more is queued: the only state in which
        :meth:`refuse_early` refuses anything."""
        return self._queue.items >= self.max_batch_size

    def _refusal(self, items: int, cost: float, timeout_s: float, what: str) -> ScoringError | None:
        """The refusal of ``items`` more items costing ``cost``, due within ``timeout_s`` (counted):
        503 when the queue is full or the backlog would not let them finish in time, 504 when
        they could not finish even alone; None = admitted."""
        now = asyncio.get_running_loop().time()
        if self._queue.items + items > self.queue_capacity:
            self._observer.rejected("queue_full")
            message = f"model {self.model} queue is full ({self._queue.items}/{self.queue_capacity} items)"
            return QueueFull(message, retry_after_s=self.retry_after_s(now))
        if not self._queue.items and not self._running:
            return None  # idle: nothing to wait for, and a stale rate must not refuse
        budget_s = ADMISSION_HEADROOM * timeout_s
        expected_s = self.backlog_s(now, more_items=items, more_cost=cost)
        if expected_s <= budget_s:
            return None
        alone_s = self.rate.seconds_for(cost * self.padding)
        unit = "tokens" if self._item_costs is not None else "items"
        if alone_s > budget_s:
            self._observer.rejected("deadline")
            return DeadlineExceeded(
                f"model {self.model} cannot finish {what} within its deadline ({timeout_s * 1000:.0f} ms) "
                f"even alone (expected {alone_s * 1000:.0f} ms for {cost:.0f} {unit})"
            )
        self._observer.rejected("admission")
        per_s = 1 / self.rate.item_s if self.rate.item_s else 0
        return QueueFull(
            f"model {self.model} cannot take {what} within its deadline ({timeout_s * 1000:.0f} ms; "
            f"expected {expected_s * 1000:.0f} ms at {per_s:.0f} {unit}/s and "
            f"{self.rate.overhead_s * 1000:.1f} ms per batch)",
            retry_after_s=self.retry_after_s(now),
        )

    def retry_after_s(self, now: float) -> int:
        """Seconds a rejected client should wait: the backlog, rounded up, at least 1."""
        return max(1, math.ceil(self.backlog_s(now)))

    # --- a request -------------------------------------------------------------------

    async def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        *,
        timeout_s: float,
        request_id: str = "-",
        is_disconnected: Callable[[], bool] | None = None,
    ) -> Tensors:
        """Price and queue one request's items and wait for its outputs.

        Args:
            inputs: one array per model input, all with the same axis-0 length B >= 1.
            timeout_s: deadline from now, seconds.
            request_id: echoed in error messages and logs.
            is_disconnected: polled before the request's items join a batch;
                True drops them.

        Returns:
            One array per model output, axis 0 = the request's B items in order.

        Raises:
            InvalidInput: B is 0 or more than the queue capacity, or the model refused an item
                (its ``item_costs``).
            PayloadTooLarge: one item alone is over ``max_batch_bytes`` or ``max_batch_tokens``
                (413).
            QueueFull: the queue cannot take B more items, or the expected wait plus service
                at the measured rate does not fit ``ADMISSION_HEADROOM * timeout_s``
                (503 + Retry-After).
            DeadlineExceeded: ``timeout_s`` passed first, or the request could not finish in
                time even on an idle model (504).
            InferenceFailed: the model raised on a batch holding these items (500).
            InsufficientStorage: an item does not fit in device memory alone (507).
        """
        size = len(next(iter(inputs.values())))
        if size < 1:
            raise InvalidInput("a request needs at least one item")
        if size > self.queue_capacity:
            raise InvalidInput(
                f"request has {size} items; model {self.model} accepts at most "
                f"{self.queue_capacity} per request"
            )
        loop = asyncio.get_running_loop()
        arrival = loop.time()
        deadline = arrival + timeout_s
        request: QueuedRequest | None = None
        try:
            # A timer, not a Task: asyncio.timeout cancels this coroutine's await at the
            # deadline. The 504 is counted here only, once per request, whoever saw it first.
            async with asyncio.timeout_at(deadline):
                tokens = None
                if self._item_costs is not None:
                    tokens = await loop.run_in_executor(self._threads.prepare, self._item_costs, inputs)
                if tokens is not None:
                    inputs, tokens, order = sort_by_cost(inputs, tokens)
                    self._check_tokens(tokens, request_id)
                else:
                    order = None
                costs = self._check_bytes(inputs, request_id)
                cost = int(tokens.sum()) if tokens is not None else size
                self._recent.append((size, cost))
                if self._stopped:
                    raise QueueFull(f"model {self.model} is unloading")
                refusal = self._refusal(size, cost, timeout_s, f"request {request_id}")
                if refusal is not None:
                    raise refusal
                request = QueuedRequest(
                    inputs=inputs,
                    size=size,
                    deadline=deadline,
                    arrival=arrival,
                    request_id=request_id,
                    is_disconnected=is_disconnected,
                    future=loop.create_future(),
                    costs=costs,
                    tokens=tokens,
                    order=order,
                    pending=size,
                )
                self._queue.put(request)
                if self._queue.items - self._reported_depth >= self.max_batch_size:
                    self._report_depth()  # a backlog builds up behind a running batch
                self._wakeup.set()
                return await request.future
        except TimeoutError:
            self._observer.rejected("deadline")
            raise DeadlineExceeded(
                f"model {self.model}: request {request_id} did not finish within {timeout_s * 1000:.0f} ms"
            ) from None
        except DeadlineExceeded:
            if request is not None:
                self._observer.rejected("deadline")
            raise
        finally:
            if request is not None:
                if not request.future.done():
                    request.future.cancel()
                self._discard(request)

    def _check_bytes(self, inputs: Mapping[str, np.ndarray], request_id: str) -> ItemCosts | None:
        if self.max_batch_bytes is None:
            return None
        costs = ItemCosts(inputs)
        largest = costs.largest()
        if largest > self.max_batch_bytes:
            raise PayloadTooLarge(
                f"an item of request {request_id} has {largest} bytes of input; model "
                f"{self.model} runs at most {self.max_batch_bytes} bytes in one batch "
                "(model.toml max_batch_bytes, SCORING_MAX_BATCH_BYTES)"
            )
        return costs

    def _check_tokens(self, tokens: np.ndarray, request_id: str) -> None:
        if self.max_batch_tokens is not None and int(tokens[-1]) > self.max_batch_tokens:
            raise PayloadTooLarge(
                f"an item of request {request_id} costs {int(tokens[-1])} tokens; model {self.model} "
                f"runs at most {self.max_batch_tokens} in one batch (model.toml max_batch_tokens)"
            )

    # --- internals -----------------------------------------------------------

    def _discard(self, request: QueuedRequest) -> None:
        """Forget a request: its queued items no longer count."""
        if self._queue.forget(request):  # it expired or its client left while queued
            self._report_depth()

    def _fail(self, request: QueuedRequest, error: ScoringError) -> None:
        if not request.future.done():
            request.future.set_exception(error)
        self._discard(request)

    def _drop(self, request: QueuedRequest, error: ScoringError, reason: str | None) -> None:
        if reason is not None:
            self._observer.rejected(reason)
        self._fail(request, error)

    def _take(self, now: float) -> list[Chunk]:
        budget = Budget(
            self.max_batch_size,
            float(self.max_batch_bytes) if self.max_batch_bytes is not None else math.inf,
            float(self.max_batch_tokens) if self.max_batch_tokens is not None else math.inf,
            self._batch_cost,
        )
        taken = self._queue.take(now, budget, self._drop)
        self._report_depth()
        return taken

    def _report_depth(self) -> None:
        """Tell the observer the queue depth: once per batch formed, when items leave it early,
        and when it has grown by a whole batch since (not on every request: the gauge is a
        shared-memory write in multiprocess mode)."""
        self._reported_depth = self._queue.items
        self._observer.queue_depth(self._queue.items)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self.pipelined:
                await self._in_flight.acquire()
                await self._ahead.acquire()
            head = self._queue.head()
            if head is None:
                if self.pipelined:
                    self._ahead.release()
                    self._in_flight.release()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            # The delay runs from the arrival of the batch's first item, not from now.
            close_at = head.request.arrival + self.max_queue_delay_s
            self.holding = True
            while self._queue.items < self.max_batch_size:
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
            chunks = self._take(now)
            if not self.pipelined:
                if chunks:
                    await self._execute(Batch(chunks, now, self._batch_cost))
                continue
            if not chunks:
                self._ahead.release()
                self._in_flight.release()
                continue
            task = loop.create_task(self._staged(Batch(chunks, now, self._batch_cost)))
            self._batches.add(task)
            task.add_done_callback(self._batches.discard)

    async def _gather(self, loop: asyncio.AbstractEventLoop) -> None:
        """Before a partial batch closes, let the event loop go round up to
        :attr:`gather_turns` times so that requests already on their way join it: stop at a
        full batch, after :data:`GATHER_IDLE_TURNS` turns in a row that queued nothing, or
        :data:`GATHER_MAX_S` after it began.

        A turn costs a few microseconds on an idle loop, so one client alone waits ~10 µs;
        under load a turn is the time the loop takes to run what is ready (decoding other
        requests, answering others), so the wait grows with the load, and so do the batches.
        grpc.aio takes one new call from the gRPC core per loop turn (its server awaits each
        ``request_call`` in turn), so without gathering a busy worker's gRPC calls reached the
        queue one at a time and ran as batches of 1.2 requests (docs/benchmarks.md, *Protocols*).
        """
        give_up = loop.time() + GATHER_MAX_S
        turns = idle = 0
        while (
            turns < self.gather_turns
            and idle < GATHER_IDLE_TURNS
            and self._queue.items < self.max_batch_size
            and loop.time() < give_up
        ):
            seen = self._queue.items
            await asyncio.sleep(0)
            turns += 1
            idle = 0 if self._queue.items > seen else idle + 1

    async def _execute(self, batch: Batch) -> None:
        """Run ``batch`` serially on the inference thread (out-of-memory halving, per-request
        retries) and deliver its outputs."""
        loop = asyncio.get_running_loop()
        entry = (loop.time(), batch.items, batch.cost, batch.requests)
        self._running.append(entry)
        start = time.perf_counter()
        try:
            segments = await loop.run_in_executor(
                self._threads.inference, self._runner.run_batch, batch.inputs, batch.groups
            )
        except Exception as exc:
            self._fail_batch(batch, exc)
            return
        finally:
            self._running.remove(entry)
        self._done(batch, segments, time.perf_counter() - start)

    async def _staged(self, batch: Batch) -> None:
        """Run ``batch`` through the staged pipeline: prepare (prepare thread), predict (the
        inference thread, in batch order: the next batch forms only once this one is handed to
        it), finish (finish thread); on any failure, run it serially instead."""
        runner: Any = self._runner
        threads = self._threads
        loop = asyncio.get_running_loop()
        released = False
        entry = None
        try:
            start = time.perf_counter()
            try:
                prepared = await loop.run_in_executor(threads.prepare, runner.prepare, batch.inputs)
                entry = (loop.time(), batch.items, batch.cost, batch.requests)
                self._running.append(entry)
                predicting = loop.run_in_executor(threads.inference, runner.predict, prepared)
                self._ahead.release()
                released = True
                predicted = await predicting
                outputs = await loop.run_in_executor(threads.finish, runner.finish, predicted)
            except Exception as exc:
                if entry is not None:
                    self._running.remove(entry)
                    entry = None
                if not released:
                    self._ahead.release()
                    released = True
                log.info("model %s: a pipelined batch failed (%r); running it serially", self.model, exc)
                await self._execute(batch)
                return
            self._done(batch, [Segment(0, batch.items, outputs)], time.perf_counter() - start)
        except asyncio.CancelledError:
            for request in batch.requests.values():
                self._fail(request, QueueFull(f"model {self.model} is unloading"))
            raise
        finally:
            if entry is not None:
                self._running.remove(entry)
            if not released:
                self._ahead.release()
            self._in_flight.release()

    def _fail_batch(self, batch: Batch, exc: Exception) -> None:
        ids = ", ".join(r.request_id for r in batch.requests.values())
        log.exception("model %s failed on a batch of %d items (requests %s)", self.model, batch.items, ids)
        for r in batch.requests.values():
            self._fail(
                r,
                InferenceFailed(
                    f"model {self.model} failed on the batch holding request {r.request_id}: "
                    f"{type(exc).__name__}"
                ),
            )

    def _done(self, batch: Batch, segments: list[Segment], compute_s: float) -> None:
        self.rate.observe(batch.cost, compute_s)
        if batch.real_tokens:
            self.padding += 0.2 * (batch.cost / batch.real_tokens - self.padding)
            self._observer.padding(batch.real_tokens, int(batch.cost))
        self._observer.batch_done(batch.items, len(batch.requests), batch.queue_s, compute_s)
        offset = 0
        for chunk in batch.chunks:
            size = chunk.stop - chunk.start
            self._deliver(chunk, outputs_between(segments, offset, offset + size))
            offset += size

    def _deliver(self, chunk: Chunk, outputs: Tensors | Segment) -> None:
        request = chunk.request
        if request.future.done():
            return
        if isinstance(outputs, Segment):
            error = outputs.error
            if error is not None:
                self._fail(request, type(error)(f"{error.message} (request {request.request_id})"))
                return
            self._observer.rejected("out_of_memory")
            self._fail(
                request,
                InsufficientStorage(
                    f"model {self.model}: an item of request {request.request_id} does not fit "
                    "in device memory even alone"
                ),
            )
            return
        request.parts.append((chunk.start, outputs))
        request.pending -= chunk.stop - chunk.start
        if request.pending == 0:
            request.future.set_result(assemble(request))


class Batch:
    """One batch formed from ``chunks`` at loop time ``formed_at``: its inputs, its requests and
    their item ranges within it, its size and cost (for a priced model ``batch_cost`` of its
    items' costs: the padded tokens it computes; else its items)."""

    __slots__ = ("chunks", "cost", "groups", "inputs", "items", "queue_s", "real_tokens", "requests")

    def __init__(
        self,
        chunks: list[Chunk],
        formed_at: float,
        batch_cost: Callable[[np.ndarray], float] = padded_to_longest,
    ) -> None:
        self.chunks = chunks
        self.inputs = concat(chunks)
        self.requests = {id(c.request): c.request for c in chunks}
        self.queue_s = formed_at - min(r.arrival for r in self.requests.values())
        sizes = [c.stop - c.start for c in chunks]
        self.items = sum(sizes)
        edges = np.cumsum([0, *sizes]).tolist()
        self.groups = list(itertools.pairwise(edges))
        priced = [c.request.tokens[c.start : c.stop] for c in chunks if c.request.tokens is not None]
        self.real_tokens = sum(int(t.sum()) for t in priced)
        self.cost = batch_cost(np.concatenate(priced)) if priced else float(self.items)
