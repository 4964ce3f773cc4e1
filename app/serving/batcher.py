"""Dynamic batching of inference requests across clients, per model per worker.

Requests put their items (rows along axis 0) on a bounded queue. A batch closes
when it holds ``max_batch_size`` items or when ``max_queue_delay`` has passed
since the *first item of that batch* arrived; a request's items may be split
across batches and are reassembled in order. Batches run one at a time on the
model's own inference thread, never on the event loop.

Backpressure: the queue holds at most ``queue_capacity`` items; a request that
does not fit fails at once with :class:`~app.errors.QueueFull` (503 +
Retry-After). Deadlines: a request whose deadline passes gets
:class:`~app.errors.DeadlineExceeded` (504) and its queued items are dropped;
so are the items of a client that disconnected, before any compute is spent.

Admission by time (:mod:`app.serving.admission`): a request whose expected wait plus
service, at the model's measured rate, does not fit its deadline is refused at once with
``QueueFull`` (503 + Retry-After = the backlog in seconds). Batch cost: a batch holds at most
``max_batch_bytes`` of input, so one batch of huge items cannot hold the model for tens of
seconds; an item that alone exceeds it is refused (413).

Source: Triton's dynamic batcher (``max_queue_delay_microseconds``,
``preferred_batch_size``) and TorchServe's ``batch_size``/``max_batch_delay``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Executor

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
from app.serving.chunks import Chunk, ChunkQueue, QueuedRequest, Tensors, assemble, concat
from app.serving.observer import BatchObserver, NullObserver, RunningBatch

log = logging.getLogger(__name__)

#: Admit a request only if it is expected to finish within this share of its deadline: the
#: rate is measured on past batches, and the next ones may be slower (a burst of requests to
#: refuse takes CPU, another model computes at the same time).
ADMISSION_HEADROOM = 0.8
#: Requests whose sizes :meth:`DynamicBatcher.refuse_early` remembers.
_RECENT_REQUESTS = 32

#: Runs one batch on the inference thread: inputs [B, ...] -> result segments.
BatchFn = Callable[[Mapping[str, np.ndarray]], list[Segment]]


class DynamicBatcher:
    """The dynamic batcher of one model in one worker.

    Args:
        model: name used in messages and logs.
        run_batch: called on ``executor`` with inputs [B, ...] per input name.
        executor: the model's inference thread.
        max_batch_size: most items in one batch.
        max_queue_delay_ms: longest wait for more items after a batch's first item arrived, ms.
        queue_capacity: most items queued (not yet in a running batch): the memory bound.
        max_batch_bytes: most input bytes in one batch (the batch cost bound); None = no bound.
        observer: receives batch and rejection events.
    """

    def __init__(
        self,
        model: str,
        run_batch: BatchFn,
        executor: Executor,
        *,
        max_batch_size: int,
        max_queue_delay_ms: float,
        queue_capacity: int,
        max_batch_bytes: int | None = None,
        observer: BatchObserver | None = None,
    ) -> None:
        if max_batch_size < 1 or queue_capacity < max_batch_size or max_queue_delay_ms < 0:
            raise ValueError("need max_batch_size >= 1, queue_capacity >= max_batch_size, delay >= 0")
        self.model = model
        self._run_batch = run_batch
        self._executor = executor
        self.max_batch_size = max_batch_size
        self.max_queue_delay_s = max_queue_delay_ms / 1000.0
        self.queue_capacity = queue_capacity
        self.max_batch_bytes = max_batch_bytes
        self.rate = ServiceRate()
        self._recent_sizes: deque[int] = deque(maxlen=_RECENT_REQUESTS)
        self._observer: BatchObserver = observer or NullObserver()
        self._queue = ChunkQueue()
        self._reported_depth = 0
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        #: True while a batch is open, waiting up to the max queue delay for more items.
        self.holding = False
        # (loop.time() at start, items, requests) of the batch running now; read by the
        # hung-inference watchdog (app.serving.lifecycle), so the hot path only stores a tuple.
        self._running: tuple[float, int, dict[int, QueuedRequest]] | None = None

    @property
    def running_batch(self) -> RunningBatch | None:
        """The batch this model is running on the inference thread, or None."""
        running = self._running
        if running is None:
            return None
        started, items, requests = running
        return RunningBatch(started, items, tuple(r.request_id for r in requests.values()))

    @property
    def queued_items(self) -> int:
        """Items waiting in the queue (excludes the batch now running)."""
        return self._queue.items

    def start(self) -> None:
        """Start the batch-forming task on the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"batcher:{self.model}")

    async def stop(self) -> None:
        """Stop forming batches; requests still queued fail with 503."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for request in self._queue.requests():
            self._fail(request, QueueFull(f"model {self.model} is unloading"))

    def backlog_s(self, now: float, more: int = 0) -> float:
        """Expected seconds until the work already here, and ``more`` items after it, is done
        at the measured batch cost: the rest of the running batch, the queued items (and
        ``more``) in full batches of ``max_batch_size``, and one max queue delay. ``now`` is
        ``loop.time()``."""
        rest = 0.0
        if self._running is not None:
            started, items, _ = self._running
            rest = max(0.0, started + self.rate.seconds_for(items) - now)
        queued = self._queue.items + more
        return rest + self.rate.seconds_for(queued, math.ceil(queued / self.max_batch_size)) + (
            self.max_queue_delay_s
        )

    def refuse_early(self, timeout_s: float) -> QueueFull | None:
        """The refusal a request would get whatever its size, judged before its body is
        decoded (so a refusal under overload costs no decoding), or None.

        Its size is not known yet: it is taken as the smallest of the last requests (a model
        under a storm of 64-item requests refuses the next one as if it had 64 items; one
        smaller request lowers the bar for those after it). With less than a full batch queued
        there is no storm to refuse cheaply (decoding what waits costs at most one batch): the
        full admission after decoding judges the request.
        """
        if not self.backlogged:
            return None
        return self._refusal(min(self._recent_sizes, default=1), timeout_s, "another request")

    @property
    def backlogged(self) -> bool:
        """A full batch (``max_batch_size`` items) or more is queued: the only state in which
        :meth:`refuse_early` refuses anything."""
        return self._queue.items >= self.max_batch_size

    def _refusal(self, size: int, timeout_s: float, what: str) -> QueueFull | None:
        """The 503 for ``size`` more items due within ``timeout_s`` (counted), or None."""
        now = asyncio.get_running_loop().time()
        if self._queue.items + size > self.queue_capacity:
            reason = "queue_full"
            message = f"model {self.model} queue is full ({self._queue.items}/{self.queue_capacity} items)"
        else:
            expected_s = self.backlog_s(now, more=size)
            if expected_s <= ADMISSION_HEADROOM * timeout_s:
                return None
            reason = "admission"
            message = (
                f"model {self.model} cannot take {what} within its deadline ({timeout_s * 1000:.0f} ms; "
                f"expected {expected_s * 1000:.0f} ms at {self.rate.items_per_s or 0:.0f} items/s and "
                f"{self.rate.overhead_s * 1000:.1f} ms per batch)"
            )
        self._observer.rejected(reason)
        return QueueFull(message, retry_after_s=self.retry_after_s(now))

    def retry_after_s(self, now: float) -> int:
        """Seconds a rejected client should wait: the backlog, rounded up, at least 1."""
        return max(1, math.ceil(self.backlog_s(now)))

    async def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        *,
        timeout_s: float,
        request_id: str = "-",
        is_disconnected: Callable[[], bool] | None = None,
    ) -> Tensors:
        """Queue one request's items and wait for its outputs.

        Args:
            inputs: one array per model input, all with the same axis-0 length B >= 1.
            timeout_s: deadline from now, seconds.
            request_id: echoed in error messages and logs.
            is_disconnected: polled before the request's items join a batch;
                True drops them.

        Returns:
            One array per model output, axis 0 = the request's B items in order.

        Raises:
            InvalidInput: B is 0 or more than the queue capacity.
            PayloadTooLarge: one item alone is over ``max_batch_bytes`` (413).
            QueueFull: the queue cannot take B more items, or the expected wait plus service
                at the measured rate does not fit ``ADMISSION_HEADROOM * timeout_s``
                (503 + Retry-After).
            DeadlineExceeded: ``timeout_s`` passed first (504).
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
        self._recent_sizes.append(size)
        costs: ItemCosts | None = None
        if self.max_batch_bytes is not None:
            costs = ItemCosts(inputs)
            largest = costs.largest()
            if largest > self.max_batch_bytes:
                raise PayloadTooLarge(
                    f"an item of request {request_id} has {largest} bytes of input; model "
                    f"{self.model} runs at most {self.max_batch_bytes} bytes in one batch "
                    "(model.toml max_batch_bytes, SCORING_MAX_BATCH_BYTES)"
                )
        refusal = self._refusal(size, timeout_s, f"request {request_id}")
        if refusal is not None:
            raise refusal
        loop = asyncio.get_running_loop()
        now = loop.time()
        request = QueuedRequest(
            inputs=inputs,
            size=size,
            deadline=now + timeout_s,
            arrival=now,
            request_id=request_id,
            is_disconnected=is_disconnected,
            future=loop.create_future(),
            costs=costs,
            queued=size,
            pending=size,
        )
        self._queue.put(request)
        if self._queue.items - self._reported_depth >= self.max_batch_size:
            self._report_depth()  # a backlog builds up behind a running batch
        self._wakeup.set()
        try:
            # A timer, not a Task: asyncio.timeout cancels this coroutine's await at the
            # deadline. The 504 is counted here only, once per request, whoever saw it first.
            async with asyncio.timeout_at(request.deadline):
                return await request.future
        except (TimeoutError, DeadlineExceeded):
            self._observer.rejected("deadline")
            raise DeadlineExceeded(
                f"model {self.model}: request {request_id} did not finish within {timeout_s * 1000:.0f} ms"
            ) from None
        finally:
            if not request.future.done():
                request.future.cancel()
            self._discard(request)

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
        taken = self._queue.take(now, self.max_batch_size, self.max_batch_bytes, self._drop)
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
            head = self._queue.head()
            if head is None:
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
            self.holding = False
            now = loop.time()
            chunks = self._take(now)
            if not chunks:
                continue
            await self._execute(chunks, now)

    async def _execute(self, chunks: list[Chunk], formed_at: float) -> None:
        loop = asyncio.get_running_loop()
        inputs = concat(chunks)
        items = sum(c.stop - c.start for c in chunks)
        requests = {id(c.request): c.request for c in chunks}
        queue_s = formed_at - min(r.arrival for r in requests.values())
        start = time.perf_counter()
        self._running = (loop.time(), items, requests)
        try:
            segments = await loop.run_in_executor(self._executor, self._run_batch, inputs)
        except Exception as exc:
            ids = ", ".join(r.request_id for r in requests.values())
            log.exception("model %s failed on a batch of %d items (requests %s)", self.model, items, ids)
            for r in requests.values():
                self._fail(
                    r,
                    InferenceFailed(
                        f"model {self.model} failed on the batch holding request {r.request_id}: "
                        f"{type(exc).__name__}"
                    ),
                )
            return
        finally:
            self._running = None
        compute_s = time.perf_counter() - start
        self.rate.observe(items, compute_s)
        self._observer.batch_done(items, len(requests), queue_s, compute_s)
        offset = 0
        for chunk in chunks:
            size = chunk.stop - chunk.start
            self._deliver(chunk, outputs_between(segments, offset, offset + size))
            offset += size

    def _deliver(self, chunk: Chunk, outputs: Tensors | None) -> None:
        request = chunk.request
        if request.future.done():
            return
        if outputs is None:
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
            request.future.set_result(assemble(request.parts))

