"""The executor: runs one model version's batches on its threads, inline or through the staged
pipeline, and prices its requests on a prepare thread.

**Where a batch runs.** Inline, all three stages on the model's inference thread
(:meth:`BatchExecutor.run` awaits ``run_batch``: the CPU default, where stages would only share
the same cores), or through the **staged pipeline** (a CUDA device's default): ``preprocess`` on
a prepare thread, ``predict`` on the inference thread, ``postprocess`` on a finish thread, so
that while batch N runs on the device, batch N+1 is prepared and batch N-1 copied back and
finished. One batch at a time is prepared ahead of the one predicting, so batches still grow
under load. A batch whose stage fails, or that runs out of device memory, runs again inline on
the inference thread, where out-of-memory halves it and a handler's failure on a batch of
several requests is retried per request (:meth:`app.serving.runner.ModelRunner.run_batch`).

**Pricing.** A model whose handler prices its items (``item_costs``: tokens) has each request
priced on a prepare thread before it is queued (:meth:`BatchExecutor.price`): the handler's
costs, the items sorted by them and the request's own batches (:func:`price`).

**Threads.** A version's threads (:class:`Threads`) are :class:`InferenceThread` s, a
``concurrent.futures.Executor`` of daemon threads: ``ThreadPoolExecutor`` joins its threads when
the interpreter exits, so a worker whose model never returns could never exit, and only a
SIGKILL would free its GPU; with a daemon thread the worker drains, exits and is replaced, and
the stuck call dies with the process.

The executor keeps the batches running (:attr:`BatchExecutor.running`), which admission and the
hung-inference watchdog read. Sources: Infinity's staged model worker (tokenise, forward,
postprocess on three threads) and text-embeddings-inference's tokenisation workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, TypeVar

import numpy as np

from app.models.base import PREPARED, Priced, Segment
from app.serving.queue import Batch, most_within

log = logging.getLogger(__name__)
T = TypeVar("T")
_Work = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


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
    """What an executor runs (``app.serving.runner.ModelRunner``): one batch inline, with out-of-memory
    halving and per-request retries (``groups``: each request's items)."""

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
        runner: the loaded model (``app.serving.runner.ModelRunner``); for the staged pipeline it also has
            ``prepare``, ``predict`` and ``finish``.
        threads: its threads; an ``Executor`` alone is taken as the inference thread.
        staged: run batches through the staged pipeline (``threads`` then needs prepare and
            finish threads).
        pricing: prices one request on a prepare thread (:class:`Pricing`),
            None when the model does not price its items.
    """

    def __init__(
        self,
        name: str,
        runner: BatchRunner,
        threads: Threads | Executor,
        *,
        staged: bool = False,
        pricing: Callable[[Mapping[str, np.ndarray]], Pricing | None] | None = None,
    ) -> None:
        self.name = name
        self.runner = runner
        self.threads = threads if isinstance(threads, Threads) else Threads(threads)
        if staged and (self.threads.prepare is None or self.threads.finish is None):
            raise ValueError("the staged pipeline needs prepare and finish threads")
        self.staged = staged
        self._pricing = pricing
        #: The batches running, oldest first (the hot path only appends and removes one each).
        self.running: deque[RunningBatch] = deque()
        self._ahead = asyncio.Semaphore(1)  # one batch prepared ahead of the one predicting
        self._in_flight = asyncio.Semaphore(3)  # the pipeline's three stages
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def prices(self) -> bool:
        """Whether requests are priced (``item_costs``) before they queue."""
        return self._pricing is not None

    def price(self, inputs: Mapping[str, np.ndarray]) -> Awaitable[Pricing | None]:
        """One request priced on a prepare thread (:class:`Pricing`; None:
        its handler priced nothing)."""
        assert self._pricing is not None
        return asyncio.get_running_loop().run_in_executor(self.threads.prepare, self._pricing, inputs)

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
