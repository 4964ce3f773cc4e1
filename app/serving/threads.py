"""The threads of one model version: its inference thread, and the prepare pool and finish thread
of the staged pipeline and of pricing.

:class:`InferenceThread` is a ``concurrent.futures.Executor`` of daemon threads:
``ThreadPoolExecutor`` joins its threads when the interpreter exits, so a worker whose model
never returns could never exit, and only a SIGKILL would free its GPU; with a daemon thread the
worker drains, exits and is replaced, and the stuck call dies with the process.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
_Work = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


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
