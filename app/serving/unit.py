"""One model version in one worker: its serving unit, three parts and the path between them.

- the **queue** (:mod:`app.serving.queue`): requests waiting with their budgets, by priority
  level, and the batches formed from them (dynamic batching);
- the **admission policy** (:mod:`app.serving.admission`): whether one more request is taken now,
  and what it learns from each batch;
- the **executor** (:mod:`app.serving.executor`): the version's threads, running each batch inline
  or staged (prepare -> predict -> finish) through the runner (:mod:`app.serving.runner`), and
  pricing requests.

:meth:`ServingUnit.infer` takes one request's validated arrays and absolute deadline (the event
loop's clock), prices it, asks admission, queues it and waits for its outputs; the unit's task
forms batches, hands them to the executor and delivers each request its rows. :meth:`start`
once warm (``app.serving.lifecycle`` loads and frees the model); :meth:`drain` lets what was
routed here finish while new requests go elsewhere; :meth:`stop` fails the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from functools import partial
from typing import Protocol

import numpy as np

from app.errors import (
    DeadlineExceeded,
    InferenceFailed,
    InsufficientStorage,
    InvalidInput,
    QueueFull,
    ScoringError,
)
from app.models.base import PREPARED, Priced, Segment
from app.models.repository import ModelConfig
from app.observability.metrics import ModelObserver, ModelStats
from app.observability.tracing import RequestTrace, Tracing
from app.serving.admission import AdmissionPolicy, policy
from app.serving.context import RequestContext
from app.serving.executor import BatchExecutor, BatchRunner, RunningBatch, Threads, price
from app.serving.queue import (
    Batch,
    Chunk,
    QueuedRequest,
    RequestQueue,
    Tensors,
    assemble,
    check_item_bounds,
    outputs_between,
    padded_to_longest,
)

log = logging.getLogger(__name__)

#: Seconds before a serving loop that stopped on a failure starts again (doubled at each failure
#: in a row, at most :data:`RESTART_MAX_S`; a loop that formed a batch since starts from here).
RESTART_S = 1.0
RESTART_MAX_S = 30.0


def expire(future: asyncio.Future[Tensors]) -> None:
    """Fail a request's ``future`` with :class:`TimeoutError` when its deadline passes before its
    outputs are set (a loop timer: ``loop.call_at(deadline, expire, future)``); a done one stays."""
    if not future.done():
        future.set_exception(TimeoutError())


class UnitObserver(Protocol):
    """Receives a unit's events (``app.observability.metrics.ModelObserver``)."""

    def batch_done(self, items: int, requests: int, queue_s: float, compute_s: float) -> None: ...
    def padding(self, real_tokens: int, padded_tokens: int) -> None: ...
    def rejected(self, reason: str) -> None: ...
    def restarted(self) -> None: ...
    def queue_depth(self, items: int) -> None: ...
    def prioritized(self, level: int, outcome: str, waited_s: float | None = None) -> None: ...


class ServingUnit:
    """One model version's queue, admission policy and executor (module docstring).

    Args:
        config: the version's ``model.toml`` (``app.models.repository.ModelConfig``, whose
            defaults are the only ones): its name and version (in messages), batch and queue
            bounds (``max_batch_size``, ``queue_capacity``, ``max_queue_delay_ms``,
            ``gather_turns``, ``gather_max_ms``, ``max_batch_tokens``), admission policy and
            headroom, Triton's priority levels (``priority_levels``, ``default_priority_level``,
            ``priority_aging``, ``priority_fill``) and ``scatter``.
        runner: ``app.serving.runner.ModelRunner`` or a test double; ``threads`` its threads (an
            ``Executor`` alone: the inference thread); ``staged``: the staged pipeline. Its
            ``padded_tokens`` (costs -> tokens), where it has one, counts the padding metric's.
        max_batch_bytes: the server's bound on a batch's input bytes, for a model whose config
            names none (None: no bound).
        item_costs: one request's items -> int64 ``[B]`` (the handler's cost unit, tokens) or
            ``app.models.base.Priced`` (costs and each item's preparation, kept in the request's
            inputs under ``PREPARED``); None: not priced. ``batch_cost``: int64 ``[N]`` -> a
            batch's cost.
        observer: receives batches and refusals; ``tracing``: the requests' spans.

    Raises:
        ValueError: bounds that contradict each other, or an unknown ``admission``.
    """

    def __init__(
        self,
        config: ModelConfig,
        runner: BatchRunner,
        threads: Threads | Executor,
        *,
        max_batch_bytes: int | None = None,
        item_costs: Callable[[Mapping[str, np.ndarray]], np.ndarray | Priced | None] | None = None,
        batch_cost: Callable[[np.ndarray], float] | None = None,
        staged: bool = False,
        observer: UnitObserver | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        max_batch_size, queue_capacity = config.max_batch_size, config.queue_capacity
        if max_batch_size < 1 or queue_capacity < max_batch_size or config.max_queue_delay_ms < 0:
            raise ValueError("need max_batch_size >= 1, queue_capacity >= max_batch_size, delay >= 0")
        name = config.name
        self.name, self.version, self.scatter = name, config.version, config.scatter
        self.max_batch_size = max_batch_size
        self.max_queue_delay_s = config.max_queue_delay_ms / 1000.0
        self.queue_capacity = queue_capacity
        self.max_batch_bytes = config.max_batch_bytes or max_batch_bytes
        self.max_batch_tokens = config.max_batch_tokens
        #: Whether requests are priced (``item_costs``): costs are then tokens.
        self.priced = item_costs is not None
        levels, fill = config.priority_levels, config.priority_fill
        self.default_level = max(0, (config.default_priority_level or levels or 1) - 1)
        self._levels = levels > 0  # per-level metrics only for a model with levels
        self._level_count = max(1, levels)
        self.queue = RequestQueue(
            max_batch_size=max_batch_size,
            max_queue_delay_s=self.max_queue_delay_s,
            gather_turns=config.gather_turns,
            gather_max_s=config.gather_max_ms / 1000.0,
            max_batch_bytes=self.max_batch_bytes,
            max_batch_tokens=self.max_batch_tokens,
            batch_cost=batch_cost or padded_to_longest,
            levels=max(1, levels),
            aging=config.priority_aging,
            fill=lambda cost: self.admission.fill_limit(cost, fill),
            margin=lambda: self.longest_batch_s,
        )
        pricing = None if item_costs is None else partial(
            price, item_costs=item_costs, batch_cost=self.queue.batch_cost, max_batch_size=max_batch_size,
            max_batch_tokens=self.max_batch_tokens,
        )  # fmt: skip
        self.executor = BatchExecutor(name, runner, threads, staged=staged, pricing=pricing)
        #: A batch's padded tokens (else its cost): a cost model's ``batch_cost`` is time.
        self.padded_tokens: Callable[[np.ndarray], int] | None = getattr(runner, "padded_tokens", None)
        self.queued: Callable[[int | None], tuple[int, float]] = self.queue.queued
        self.running: deque[RunningBatch] = self.executor.running
        self.admission: AdmissionPolicy = policy(config.admission, self, config.admission_headroom)
        self.observer: UnitObserver = observer or ModelObserver(ModelStats(), None, name, config.version)
        self.tracing = tracing
        #: The longest recent batch, seconds: a longer one replaces it; it decays 10 % a batch.
        self.longest_batch_s = 0.0
        self._reported_depth, self._stopped = 0, False
        self._task: asyncio.Task[None] | None = None
        self._active = 0  # infer() calls in progress (drain waits for none)
        self._idle: asyncio.Event | None = None
        #: Whether an input has a variable (-1) dimension: requests then batch together only
        #: when their items' shapes match (:class:`app.serving.queue.Budget`).
        self._variable = any(-1 in spec.shape for spec in config.inputs)
        #: The requests waiting for their outputs (queued, or in a batch): the ones a serving
        #: loop that stops answers at once.
        self._live: set[QueuedRequest] = set()
        #: Why the serving loop stopped, while it waits to start again (the version is not
        #: ready meanwhile); None while it runs.
        self.broken: str | None = None
        self._failures = 0  # loop failures in a row (the restart's backoff doubles each)
        self._restart: asyncio.TimerHandle | None = None

    # --- what admission reads (app.serving.admission.Backlog) ------------------------------
    # ``queued(level)``: (items, cost) waiting at ``level`` and above (None: all), the queue's
    # own method; ``running``: the batches running, oldest first, the executor's own deque.

    @property
    def running_batch(self) -> RunningBatch | None:
        """The oldest batch running, or None (the hung-inference watchdog reads it)."""
        return self.executor.running[0] if self.executor.running else None

    def expected_wait_s(self, now: float) -> float:
        """Expected seconds before a request sent now would start computing (0 when unknown)."""
        return max(0.0, self.admission.backlog_s(now) - self.max_queue_delay_s)

    # --- lifecycle --------------------------------------------------------------------------

    @property
    def serving(self) -> bool:
        """True while its serving loop forms batches: started, not stopped, and not waiting to
        start again after a failure (the model version's readiness reads it)."""
        return self._task is not None and self.broken is None and not self._stopped

    def start(self) -> None:
        """Start forming batches on the running event loop (the serving loop, supervised:
        :meth:`_loop_ended`)."""
        if self._task is None and not self._stopped:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"unit:{self.name}")
            self._task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        """The serving loop ended without :meth:`stop`: whatever ended it, every request still
        waiting here is answered at once (503 + Retry-After: a retry may find the loop running
        again), the version reports not ready, and the loop starts again after a backoff
        (:data:`RESTART_S`, doubled at each failure in a row, at most :data:`RESTART_MAX_S`)."""
        if self._stopped or task is not self._task:
            return
        self._task = None
        cause = "it was cancelled" if task.cancelled() else repr(task.exception())
        self._failures += 1
        delay_s = min(RESTART_S * 2 ** (self._failures - 1), RESTART_MAX_S)
        self.broken = f"its serving loop stopped ({cause}); it starts again in {delay_s:g} s"
        if task.cancelled():  # by something else than stop(): an event loop that closes, say
            log.warning("model %s v%s: %s", self.name, self.version, self.broken)
        else:
            log.error("model %s v%s: %s", self.name, self.version, self.broken, exc_info=task.exception())
        self.observer.restarted()
        retry_after_s = max(1, math.ceil(delay_s))
        self.queue.requests()  # emptied: their chunks go with them
        for request in list(self._live):
            self._fail(request, QueueFull(f"model {self.name}: {self.broken}", retry_after_s=retry_after_s))
        self._report_depth()
        self._restart = asyncio.get_running_loop().call_later(delay_s, self._start_again)

    def _start_again(self) -> None:
        self._restart = None
        if self._stopped:
            return
        self.broken = None
        self.start()
        log.info("model %s v%s: its serving loop started again", self.name, self.version)

    async def drain(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until every request routed here has its answer; new
        requests should go elsewhere meanwhile. True when it emptied in time."""
        if self._active:
            self._idle = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._idle.wait()
        return self._active == 0

    async def stop(self) -> None:
        """Stop forming batches; requests still queued or in a batch fail with 503."""
        self._stopped = True
        if self._restart is not None:
            self._restart.cancel()
            self._restart = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.executor.stop()
        for request in self.queue.requests():
            self._fail(request, QueueFull(f"model {self.name} is unloading", retry_after_s=1))

    # --- a request --------------------------------------------------------------------------

    def refuse_early(self, deadline: float) -> ScoringError | None:
        """The refusal a request would get whatever its size (counted), judged before its body is
        decoded, or None (``app.serving.admission.AdmissionPolicy.refuse_early``)."""
        now = asyncio.get_running_loop().time()
        # its priority is in the body: judged at the highest level (admission after decoding: its own)
        refusal = self.admission.refuse_early(deadline - now, now, 0 if self._levels else None)
        if refusal is None:
            return None
        self.observer.rejected(refusal.reason)
        return refusal.error

    def level(self, priority: int | None) -> int:
        """The queue level (0 = the highest) of Triton's request ``priority`` (1 = the highest;
        0 or None: the model's default level; ignored with one level). One above the levels is
        the lowest (the data plane refuses those first: ``parameters_priority`` there;
        a sibling's shard may come from a version with more)."""
        if not priority or not self._levels:
            return self.default_level
        return min(priority, self._level_count) - 1

    async def infer(
        self, inputs: Mapping[str, np.ndarray], context: RequestContext, *, trace: RequestTrace | None = None
    ) -> Tensors:
        """Price and queue one request's items and wait for its outputs.

        Args: ``inputs``, one array per model input with the same axis-0 length B >= 1;
        ``context``, the request's (``app.serving.context``): its ``deadline`` (the ``loop.time()``
        by which the outputs are due), ``request_id`` (in errors and logs), ``priority`` (its
        queue level: :meth:`level`) and ``is_disconnected`` (polled before its items join a
        batch; True drops them); ``trace``, its spans here (``app.observability.tracing``).

        Returns:
            One array per model output, axis 0 = the request's B items in order.

        Raises:
            InvalidInput: B is 0, or the model refused an item.
            PayloadTooLarge: one item alone is over ``max_batch_bytes`` or ``max_batch_tokens``.
            QueueFull: refused by admission, or the unit is unloading (503 + Retry-After).
            DeadlineExceeded: the deadline passed first, or even alone it could not finish (504).
            InferenceFailed: the model raised on a batch holding these items (500).
            InsufficientStorage: an item does not fit in device memory alone (507).
        """
        size = len(next(iter(inputs.values())))
        if size < 1:
            raise InvalidInput("a request needs at least one item")
        deadline, request_id = context.deadline, context.request_id
        level = self.level(context.priority)
        if self.broken is not None:
            raise QueueFull(f"model {self.name}: {self.broken}", retry_after_s=1)
        loop = asyncio.get_running_loop()
        arrival = loop.time()
        request: QueuedRequest | None = None
        self._active += 1
        try:
            # Timers, not Tasks, end the waits at the deadline; the 504 is counted here, once.
            pricing = None
            if self.priced:
                if self.queue.items:
                    self._admit(size, 0.0, level, deadline, request_id)  # hopeless: no pricing
                async with asyncio.timeout_at(deadline):  # the pricing, on a prepare thread
                    pricing = await self.executor.price(inputs)
            inputs, tokens, order, alone = pricing.unpacked() if pricing else (inputs, None, None, None)
            item_bytes = check_item_bounds(self.name, request_id, inputs, tokens, self.max_batch_bytes,
                                           self.max_batch_tokens)  # fmt: skip
            cost = int(tokens.sum()) if tokens is not None else size
            if self._stopped:
                raise QueueFull(f"model {self.name} is unloading", retry_after_s=1)
            self._admit(size, cost, level, deadline, request_id, alone)
            request = QueuedRequest(inputs, size, context, arrival, loop.create_future(), item_bytes, tokens,
                                    order, level, trace, pending=size)  # fmt: skip
            self._put(request)
            expiry = loop.call_at(deadline, expire, request.future)  # a timer: cheaper than a Task
            try:
                return await request.future
            finally:
                expiry.cancel()
        except TimeoutError:
            self.observer.rejected("deadline")
            budget_s = deadline - (arrival if context.arrival is None else context.arrival)
            raise DeadlineExceeded(
                f"model {self.name}: request {request_id} did not finish within {budget_s * 1000:.0f} ms"
            ) from None
        except DeadlineExceeded:
            if request is not None:
                self.observer.rejected("deadline")
            raise
        finally:
            if request is not None:
                if not request.future.done():
                    request.future.cancel()
                self._discard(request)
                self._live.discard(request)
            if trace is not None and trace.queue is not None:  # refused, or left before a batch
                trace.queue.end()
            self._active -= 1
            if not self._active and self._idle is not None:
                self._idle.set()

    def _put(self, request: QueuedRequest) -> None:
        """Queue ``request`` (its item shape noted where the model has a variable dimension)."""
        if self._variable:
            request.shape = tuple(a.shape[1:] for n, a in request.inputs.items() if n != PREPARED)
        self._live.add(request)
        self.queue.put(request)
        if self.queue.items - self._reported_depth >= self.max_batch_size:
            self._report_depth()  # a backlog builds up behind a running batch

    def _admit(
        self, size: int, cost: float, level: int, deadline: float, request_id: str,
        alone: tuple[float, int] | None = None,
    ) -> None:  # fmt: skip
        """Ask admission (``cost`` 0: before pricing, a certain refusal only; ``alone``: the
        request's own batches, cost and count); raise its refusal."""
        now = asyncio.get_running_loop().time()
        what = f"request {request_id}"
        refusal = self.admission.refusal(size, cost, level, deadline - now, now, what, alone)
        if refusal is None and not cost:
            return
        if self._levels:
            self.observer.prioritized(level, "admitted" if refusal is None else "refused")
        if refusal is not None:
            self.observer.rejected(refusal.reason)
            raise refusal.error

    # --- batches ----------------------------------------------------------------------------

    async def _loop(self) -> None:
        """Form batches and hand them to the executor, for ever. A failure while forming or
        answering one batch fails that batch's requests and the loop goes on; anything else
        that ends it is :meth:`_loop_ended`'s."""
        executor, queue = self.executor, self.queue
        while True:
            await executor.room()
            handed = False
            try:
                chunks, formed_at = await queue.next_batch(self._drop)
                self._report_depth()
                if not chunks:
                    continue
                self._failures = 0  # it forms batches again: the next failure waits the least
                if self._levels:
                    for chunk in chunks:
                        if chunk.start == 0:  # the request's first batch
                            waited = formed_at - chunk.request.arrival
                            self.observer.prioritized(chunk.request.level, "", waited)
                try:
                    batch = Batch(chunks, formed_at, queue.batch_cost)
                except Exception as exc:  # its requests fail, the loop goes on
                    self._failed_to_form(chunks, exc)
                    continue
                if self.tracing is not None:
                    traced = [r.trace for r in batch.requests.values() if r.trace is not None]
                    if traced:
                        batch.trace = self.tracing.batch(traced, batch.items, len(batch.requests), batch.cost)
                handed = True
                await executor.run(batch, self._done, self._failed)
            finally:
                if not handed:
                    executor.no_batch()

    def _failed_to_form(self, chunks: list[Chunk], exc: BaseException) -> None:
        """A batch could not be formed from ``chunks`` (its inputs would not stack): its
        requests fail with 500, the others wait on."""
        requests = {id(c.request): c.request for c in chunks}.values()
        log.error("model %s: a batch of %d requests could not be formed", self.name, len(requests),
                  exc_info=exc)  # fmt: skip
        for r in requests:
            why = f"model {self.name} could not form a batch with request {r.request_id}"
            self._fail(r, InferenceFailed(f"{why}: {type(exc).__name__}"))

    def _done(self, batch: Batch, segments: list[Segment], compute_s: float) -> None:
        try:
            self._delivered(batch, segments, compute_s)
        except Exception as exc:  # outputs not handed back: the batch fails
            self._failed(batch, exc)

    def _delivered(self, batch: Batch, segments: list[Segment], compute_s: float) -> None:
        if batch.trace is not None:
            batch.trace.ran(compute_s)
        self.admission.observe(batch.cost, compute_s, batch.real_tokens)
        self.longest_batch_s = max(compute_s, 0.9 * self.longest_batch_s)
        if batch.real_tokens and batch.costs is not None:
            padded = self.padded_tokens(batch.costs) if self.padded_tokens else int(batch.cost)
            self.observer.padding(batch.real_tokens, padded)
        self.observer.batch_done(batch.items, len(batch.requests), batch.queue_s, compute_s)
        offset = 0
        for chunk in batch.chunks:
            size = chunk.stop - chunk.start
            self._deliver(chunk, outputs_between(segments, offset, offset + size))
            offset += size

    def _failed(self, batch: Batch, exc: BaseException) -> None:
        if batch.trace is not None:
            batch.trace.ran(0.0, exc)
        if isinstance(exc, asyncio.CancelledError):
            for request in batch.requests.values():
                self._fail(request, QueueFull(f"model {self.name} is unloading", retry_after_s=1))
            return
        ids = ", ".join(r.request_id for r in batch.requests.values())
        log.error("model %s failed on a batch of %d items (requests %s)", self.name, batch.items, ids,
                  exc_info=exc)  # fmt: skip
        for r in batch.requests.values():
            why = f"model {self.name} failed on a batch holding request {r.request_id}: {type(exc).__name__}"
            self._fail(r, InferenceFailed(why))

    def _deliver(self, chunk: Chunk, outputs: Tensors | Segment) -> None:
        request = chunk.request
        if request.future.done():
            return
        if isinstance(outputs, Segment):
            if outputs.error is not None:
                error = outputs.error
                self._fail(request, type(error)(f"{error.message} (request {request.request_id})"))
                return
            self.observer.rejected("out_of_memory")
            why = f"model {self.name}: an item of request {request.request_id} does not fit in device memory"
            self._fail(request, InsufficientStorage(why + " even alone"))
            return
        request.parts.append((chunk.start, outputs))
        request.pending -= chunk.stop - chunk.start
        if request.pending == 0:
            request.future.set_result(assemble(request))

    def _discard(self, request: QueuedRequest) -> None:
        """Forget a request: its queued items no longer count."""
        if self.queue.forget(request):  # it expired or its client left while queued
            self._report_depth()

    def _fail(self, request: QueuedRequest, error: ScoringError) -> None:
        if not request.future.done():
            request.future.set_exception(error)
        self._discard(request)

    def _drop(self, request: QueuedRequest, error: ScoringError, reason: str | None) -> None:
        if reason is not None:
            self.observer.rejected(reason)
        self._fail(request, error)

    def _report_depth(self) -> None:
        """Tell the observer the queue depth: once per batch formed, when items leave early, and
        when it has grown by a whole batch since (the gauge is a shared-memory write)."""
        self._reported_depth = self.queue.items
        self.observer.queue_depth(self.queue.items)
