"""A model's inference thread, as a ``concurrent.futures.Executor`` (one per model per worker,
created by ``app.serving.lifecycle``), and its prepare and finish threads (the same class with
``threads`` daemon threads).

Like ``ThreadPoolExecutor(max_workers=threads)``, with one difference that matters when a
model hangs: the threads are *daemons*. ``ThreadPoolExecutor`` joins its threads when the
interpreter exits, so a worker whose model never returns could never exit, and only a
SIGKILL would free its GPU. With a daemon thread the worker drains, exits and is replaced,
and the stuck call dies with the process.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")

_Work = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class InferenceThread(Executor):
    """Runs submitted calls one at a time, in order, on one daemon thread.

    Args:
        name: the thread's name (shows in py-spy dumps and logs); ``name-<i>`` with several.
        initializer: called once on each thread before any work, like
            ``ThreadPoolExecutor``'s; if it raises, every call submitted raises that exception.
        threads: how many threads take calls from the queue (1: calls run in order, one at
            a time; more: in order of submission, several at once).
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
        """Stop taking calls; ``wait`` joins the thread (never use it when a call may be stuck)."""
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
