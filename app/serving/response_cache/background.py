"""The response cache's I/O off the event loop: a lookup runs on a thread of its tier and is
waited for until a bound, past which the request goes on without it (its items computed);
writes (stores, second-chance stamps, evictions) leave the request path for a writer thread fed
by a bounded queue, and a write the queue cannot take is dropped and counted by its caller.

A thread per tier and per direction, so that a tier that stalls (a stopped Redis, a store whose
write lock another process holds) stalls only its own thread: the host store's lookups are
lock-free readers and never wait for its writer.

The host store (LMDB) has no asynchronous interface, so it needs threads. The Redis tier uses
redis-py's blocking client on threads of its own too: the lookup is one ``MGET`` after the host
store's answer (one thread hop per request either way), the writes share the writer's queue
discipline and drop accounting, and the tier's socket timeout and 5-second pause
(``app.serving.redis_tier``) bound what a stopped Redis holds of its threads.

Source: write-behind caching with a bounded queue (Ehcache's write-behind,
``writeBehindMaxQueueSize``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class Reader:
    """One thread for one tier's lookups, waited for until a deadline.

    Args:
        name: the thread's name (``response-cache-<tier>``).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._pool: ThreadPoolExecutor | None = None

    async def call(self, fn: Callable[..., T], *args: object, until: float) -> T | None:
        """``fn(*args)`` on this reader's thread; None when it has not returned by ``until``
        (loop time, seconds: it then runs on, or never starts if still queued, and its answer
        is dropped). What ``fn`` raises is raised."""
        if self._pool is None:  # made in the worker that uses it: threads do not cross a fork
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=self.name)
        future = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        try:
            async with asyncio.timeout_at(until):
                return await future
        except TimeoutError:
            return None

    def close(self) -> None:
        """Stop the thread once its current lookup returns; queued lookups never start."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


class Writer:
    """One daemon thread that runs write jobs in order from a queue of at most ``capacity``
    entries.

    Args:
        name: the thread's name.
        capacity: most entries queued and being written; a job that would pass it is refused.
    """

    def __init__(self, name: str, capacity: int) -> None:
        self.name, self.capacity = name, capacity
        self._jobs: deque[tuple[int, Callable[[], None]]] = deque()
        self._held = 0  # entries queued or being written
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False

    def submit(self, entries: int, job: Callable[[], None]) -> bool:
        """Queue ``job`` (it writes ``entries`` entries); False, and nothing queued, when the
        queue is full or the writer closed (the caller counts the entries dropped)."""
        with self._cond:
            if self._closing or self._held + entries > self.capacity:
                return False
            self._held += entries
            self._jobs.append((entries, job))
            if self._thread is None:  # started in the worker that uses it
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify()
        return True

    def flush(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until every job queued so far is written; whether it was."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._held, timeout_s)

    def close(self, timeout_s: float) -> None:
        """Write what is queued (at most ``timeout_s``), then stop the thread; later jobs are
        refused."""
        self.flush(timeout_s)
        with self._cond:
            self._closing = True
            self._jobs.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closing)
                if not self._jobs:
                    return
                entries, job = self._jobs.popleft()
            try:
                job()
            except Exception:  # a failing write must not end the writer: the next may succeed
                log.exception("response cache writer %s: a write failed", self.name)
            finally:
                with self._cond:
                    self._held -= entries
                    self._cond.notify_all()
