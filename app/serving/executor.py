"""The executor of one model version: runs its batches, and its requests' pricing, on the
model's threads.

**Where a batch runs.** Inline, all three stages on the model's inference thread
(:meth:`BatchExecutor.run` awaits ``run_batch``: the CPU default, where stages would only share
the same cores), or through the **staged pipeline** (a CUDA device's default): ``preprocess`` on
a prepare thread, ``predict`` on the inference thread, ``postprocess`` on a finish thread, so
that while batch N runs on the device, batch N+1 is prepared and batch N-1 copied back and
finished. One batch at a time is prepared ahead of the one predicting, so batches still grow
under load. A batch whose stage fails, or that runs out of device memory, runs again inline on
the inference thread, where out-of-memory halves it and a handler's failure on a batch of
several requests is retried per request (``ModelRunner.run_batch``).

**Pricing.** A model whose handler prices its items (``item_costs``: tokens) has each request
priced on a prepare thread before it is queued (:meth:`BatchExecutor.price`).

**Threads.** :class:`InferenceThread` is a ``concurrent.futures.Executor`` of daemon threads:
``ThreadPoolExecutor`` joins its threads when the interpreter exits, so a worker whose model
never returns could never exit, and only a SIGKILL would free its GPU; with a daemon thread the
worker drains, exits and is replaced, and the stuck call dies with the process.

Source: Infinity's staged model worker (tokenise, forward, postprocess on three threads) and
text-embeddings-inference's tokenisation workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from app.models.base import Segment
from app.serving.queue import Chunk, QueuedRequest, Tensors, padded_to_longest

log = logging.getLogger(__name__)
T = TypeVar("T")
_Work = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class Batch:
    """One batch formed from ``chunks`` at loop time ``formed_at``: its inputs (``[items, ...]``
    per input name; no copy for a batch that is one whole request), its requests and their item
    ranges within it (``groups``), its size and its cost (for a priced model ``batch_cost`` of
    its items' costs: the padded tokens it computes; else its items)."""

    __slots__ = (
        "chunks", "cost", "formed_at", "groups", "inputs", "items", "queue_s", "real_tokens",
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
            self.inputs = {
                n: np.concatenate([c.request.inputs[n][c.start : c.stop] for c in chunks])
                for n in first.request.inputs
            }
        self.requests = {id(c.request): c.request for c in chunks}
        self.queue_s = formed_at - min(r.arrival for r in self.requests.values())
        sizes = [c.stop - c.start for c in chunks]
        self.items = sum(sizes)
        self.groups = list(itertools.pairwise(np.cumsum([0, *sizes]).tolist()))
        priced = [c.request.tokens[c.start : c.stop] for c in chunks if c.request.tokens is not None]
        self.real_tokens = sum(int(t.sum()) for t in priced)
        self.cost = batch_cost(np.concatenate(priced)) if priced else float(self.items)
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


class InferenceThread(Executor):
    """Runs submitted calls on ``threads`` daemon threads, in order of submission (one thread:
    one at a time, in order).

    Args:
        name: the thread's name (shows in py-spy dumps and logs); ``name-<i>`` with several.
        initializer: called once on each thread before any work, like ``ThreadPoolExecutor``'s;
            if it raises, every call submitted raises that exception.
        threads: how many threads take calls from the queue.
    """

    def __init__(
        self, name: str = "inference", initializer: Callable[[], None] | None = None, threads: int = 1
    ) -> None:
        self._initializer = initializer
        self._queue: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._shutdown = False
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, name=name if threads == 1 else f"{name}-{i}", daemon=True)
            for i in range(max(1, threads))
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Queue ``fn(*args, **kwargs)``; raises RuntimeError after ``shutdown``."""
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new calls after shutdown")
            future: Future[T] = Future()
            self._queue.put((future, fn, args, kwargs))
            return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking calls; ``wait`` joins the threads (never when a call may be stuck)."""
        with self._lock:
            self._shutdown = True
            if cancel_futures:
                while True:
                    try:
                        work = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if work is not None:
                        work[0].cancel()
            for _ in self._threads:
                self._queue.put(None)
        if wait:
            for thread in self._threads:
                thread.join()

    @property
    def alive(self) -> bool:
        """True while a thread runs (they end after ``shutdown`` and the queued calls)."""
        return any(thread.is_alive() for thread in self._threads)

    def _run(self) -> None:
        failure: BaseException | None = None
        if self._initializer is not None:
            try:
                self._initializer()
            except BaseException as exc:
                failure = exc
        while True:
            work = self._queue.get()
            if work is None:
                return
            future, fn, args, kwargs = work
            if not future.set_running_or_notify_cancel():
                continue
            if failure is not None:
                future.set_exception(failure)
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)


@dataclass(frozen=True)
class Threads:
    """The threads of one model version: its inference thread, and for the staged pipeline and
    item pricing a prepare pool and a finish thread (None: the inference thread does that)."""

    inference: Executor
    prepare: Executor | None = None
    finish: Executor | None = None

    def shutdown(self, wait: bool) -> None:
        """Shut every thread down (``wait=False`` and the queued calls cancelled: a call may be
        stuck)."""
        for pool in {id(p): p for p in (self.inference, self.prepare, self.finish) if p is not None}.values():
            pool.shutdown(wait=wait, cancel_futures=not wait)


class BatchRunner(Protocol):
    """What an executor runs (``app.models.runner.ModelRunner``): one batch inline, with
    out-of-memory halving and per-request retries (``groups``: each request's items)."""

    def run_batch(
        self, inputs: Mapping[str, np.ndarray], groups: Sequence[tuple[int, int]] = ()
    ) -> list[Segment]: ...


@dataclass(frozen=True)
class RunningBatch:
    """A batch on the model's threads: when it started (``loop.time()``), its size and cost,
    and its requests' ids (read by the hung-inference watchdog and by admission)."""

    started: float
    items: int
    cost: float
    request_ids: tuple[str, ...]


#: What the executor hands back per batch: (batch, its segments, compute seconds) or, when the
#: whole batch failed, (batch, the exception).
Done = Callable[[Batch, list[Segment], float], None]
Failed = Callable[[Batch, BaseException], None]


class BatchExecutor:
    """Runs one model version's batches, inline or staged (module docstring).

    Args:
        name: the model, in messages.
        runner: the loaded model (``app.models.runner.ModelRunner``); for the staged pipeline
            it also has ``prepare``, ``predict`` and ``finish``.
        threads: its threads; an ``Executor`` alone is taken as the inference thread.
        staged: run batches through the staged pipeline (``threads`` then needs prepare and
            finish threads).
        item_costs: prices one request's items on a prepare thread (int64 ``[B]``), None when
            the model does not price them.
    """

    def __init__(
        self,
        name: str,
        runner: BatchRunner,
        threads: Threads | Executor,
        *,
        staged: bool = False,
        item_costs: Callable[[Mapping[str, np.ndarray]], np.ndarray | None] | None = None,
    ) -> None:
        self.name = name
        self.runner = runner
        self.threads = threads if isinstance(threads, Threads) else Threads(threads)
        if staged and (self.threads.prepare is None or self.threads.finish is None):
            raise ValueError("the staged pipeline needs prepare and finish threads")
        self.staged = staged
        self._item_costs = item_costs
        #: The batches running, oldest first (the hot path only appends and removes one each).
        self.running: deque[RunningBatch] = deque()
        self._ahead = asyncio.Semaphore(1)  # one batch prepared ahead of the one predicting
        self._in_flight = asyncio.Semaphore(3)  # the pipeline's three stages
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def prices(self) -> bool:
        """Whether requests are priced (``item_costs``) before they queue."""
        return self._item_costs is not None

    def price(self, inputs: Mapping[str, np.ndarray]) -> Awaitable[np.ndarray | None]:
        """One request's item costs, computed on a prepare thread (int64 ``[B]``)."""
        assert self._item_costs is not None
        return asyncio.get_running_loop().run_in_executor(self.threads.prepare, self._item_costs, inputs)

    async def room(self) -> None:
        """Wait until the pipeline can take another batch (inline: at once)."""
        if self.staged:
            await self._in_flight.acquire()
            await self._ahead.acquire()

    def no_batch(self) -> None:
        """Give back the room taken by :meth:`room` when no batch was formed."""
        if self.staged:
            self._ahead.release()
            self._in_flight.release()

    async def run(self, batch: Batch, done: Done, failed: Failed) -> None:
        """Run ``batch`` and report it to ``done`` or ``failed``: inline, this returns once it
        has run; staged, once it is handed to the inference thread (the rest goes on in a task)."""
        if not self.staged:
            await self._inline(batch, done, failed)
            return
        task = asyncio.get_running_loop().create_task(self._staged(batch, done, failed))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _start(self, batch: Batch) -> RunningBatch:
        running = RunningBatch(
            asyncio.get_running_loop().time(),
            batch.items,
            batch.cost,
            tuple(r.request_id for r in batch.requests.values()),
        )
        self.running.append(running)
        return running

    async def _inline(self, batch: Batch, done: Done, failed: Failed) -> None:
        loop = asyncio.get_running_loop()
        running = self._start(batch)
        start = time.perf_counter()
        try:
            segments = await loop.run_in_executor(
                self.threads.inference, self.runner.run_batch, batch.inputs, batch.groups
            )
        except Exception as exc:
            failed(batch, exc)
            return
        finally:
            self.running.remove(running)
        done(batch, segments, time.perf_counter() - start)

    async def _staged(self, batch: Batch, done: Done, failed: Failed) -> None:
        """Prepare (prepare thread), predict (inference thread, in batch order: the next batch
        forms only once this one is handed to it), finish (finish thread); on any failure, run
        it inline instead."""
        runner: Any = self.runner
        threads = self.threads
        loop = asyncio.get_running_loop()
        released = False
        running = None
        try:
            start = time.perf_counter()
            try:
                prepared = await loop.run_in_executor(threads.prepare, runner.prepare, batch.inputs)
                running = self._start(batch)
                predicting = loop.run_in_executor(threads.inference, runner.predict, prepared)
                self._ahead.release()
                released = True
                predicted = await predicting
                outputs = await loop.run_in_executor(threads.finish, runner.finish, predicted)
            except Exception as exc:
                if running is not None:
                    self.running.remove(running)
                    running = None
                if not released:
                    self._ahead.release()
                    released = True
                log.info("model %s: a pipelined batch failed (%r); running it inline", self.name, exc)
                await self._inline(batch, done, failed)
                return
            done(batch, [Segment(0, batch.items, outputs)], time.perf_counter() - start)
        except asyncio.CancelledError as exc:  # the unit stops: its requests fail
            failed(batch, exc)
            raise
        finally:
            if running is not None:
                self.running.remove(running)
            if not released:
                self._ahead.release()
            self._in_flight.release()

    async def stop(self) -> None:
        """Cancel the staged batches in flight (each reported to its ``failed``)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
