"""A model's inference thread, as a ``concurrent.futures.Executor`` (one per model per worker,
created by ``app.serving.lifecycle``).

Like ``ThreadPoolExecutor(max_workers=1)``, with one difference that matters when a model
hangs: the thread is a *daemon*. ``ThreadPoolExecutor`` joins its threads when the
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
        name: the thread's name (shows in py-spy dumps and logs).
        initializer: called once on the thread before any work, like
            ``ThreadPoolExecutor``'s; if it raises, every call submitted raises that exception.
    """

    def __init__(self, name: str = "inference", initializer: Callable[[], None] | None = None) -> None:
        self._initializer = initializer
        self._queue: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._shutdown = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

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
            self._queue.put(None)
        if wait:
            self._thread.join()

    @property
    def alive(self) -> bool:
        """True while the thread runs (it ends after ``shutdown`` and the queued calls)."""
        return self._thread.is_alive()

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
