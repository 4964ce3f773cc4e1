"""The worker's own accept loop on gunicorn's listening sockets, and its event loop.

gunicorn's master binds and listens (with its ``backlog`` setting) and every worker inherits
the sockets. aiohttp's ``SockSite`` would call ``listen(128)`` again (resetting the backlog)
and can only be stopped by closing the socket; here the worker watches each socket with
``loop.add_reader``, accepts one connection per readiness event (so it re-checks the
balancing decision between two accepts) and hands it to aiohttp with
``loop.connect_accepted_socket``. Pausing (a busier sibling, nginx's ``accept_mutex`` idea)
removes the reader: the kernel then hands new connections to the siblings that still accept.

**Out of file descriptors.** ``accept`` failing with EMFILE/ENFILE (or ENOBUFS/ENOMEM) leaves
the connection in the kernel's queue, so the socket stays readable: retrying at once would spin
a core and write a warning per try. The listener instead pauses for ``RESOURCE_PAUSE_S``
(doubling while it lasts, up to 1 s), logs the first failure of an episode and, when accepting
works again, how many failed meanwhile (nginx: "accept() failed (24: Too many open files)" and
a pause of ``accept_mutex_delay``; uvicorn likewise sleeps).

**At the end of a drain** (:meth:`Listener.stop` with ``close``) the worker takes every
connection the kernel has already queued, then closes its own copy of the listening sockets:
when the master has closed its copy (a full stop), the last worker's copy is what keeps the
port listening, and connections completed into a queue nobody will accept are reset when the
worker exits, after the client sent its request; closed, the port refuses new connections
at once (the client knows nothing was sent). During a HUP reload or a recycle the master's copy
keeps the port listening for the other workers.

**The event loop** (:func:`new_event_loop`): a stopped process (SIGSTOP, a paused container or
VM, a debugger) sleeping in ``epoll_wait`` gets ``EINTR`` when it resumes (signal(7),
*Interruption of system calls by stop signals*). Python retries the wait with what is left of
its timeout (PEP 475), and when the stop outlasted the timeout it returns no events without
asking the kernel again. The event loop then runs the timers that came due during the stop
before it has seen any socket: aiohttp's keep-alive timer finds a connection idle whose next
request is already in the kernel's buffer, closes it, and the kernel answers the unread request
with a reset (measured: a request sent to a worker stopped for 8 s got ``ECONNRESET`` after
``SIGCONT``).

:class:`ResumingSelector` asks the kernel once more, without waiting, whenever a wait with a
timeout returns nothing: one extra ``epoll_wait(0)`` per timer wakeup without I/O (a few
hundred a second at most here). uvloop (``SCORING_UVLOOP=1``) has libuv's own loop, which
behaves as Python's does, and is not covered.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import selectors
import socket
import ssl
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: While paused for balancing, how often the decision is looked at again, seconds. (Waiting
#: for the worker's tick, 50 ms and more under load, left clients that had just connected in
#: the kernel's queue for up to 150 ms when every worker had paused at once.)
RECHECK_S = 0.005
#: How long a TLS handshake may take, seconds (asyncio's default is 60).
SSL_HANDSHAKE_TIMEOUT_S = 10.0
#: The first pause after ``accept`` ran out of a resource (file descriptors), seconds; doubled
#: while it lasts, up to ``RESOURCE_PAUSE_MAX_S``.
RESOURCE_PAUSE_S = 0.05
RESOURCE_PAUSE_MAX_S = 1.0
#: ``accept`` errors that mean "out of a resource": the connection stays queued meanwhile.
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class Listener:
    """Accept loop over ``sockets`` feeding ``protocol_factory`` (aiohttp's ``web.Server``).

    Args:
        loop: the worker's event loop.
        sockets: listening sockets (gunicorn's wrappers expose the socket as ``.sock``).
        protocol_factory: called once per connection (``runner.server``).
        ssl_context: TLS for every connection, or None.
        may_accept: checked before each accept; False pauses the listener until :meth:`resume`.
        accepted: called after each accept.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sockets: list[Any],
        protocol_factory: Callable[[], asyncio.Protocol],
        ssl_context: ssl.SSLContext | None,
        may_accept: Callable[[], bool],
        accepted: Callable[[], None],
    ) -> None:
        self.loop = loop
        self.sockets: list[socket.socket] = [getattr(s, "sock", s) for s in sockets]
        self.factory = protocol_factory
        self.ssl_context = ssl_context
        self.may_accept = may_accept
        self.accepted = accepted
        self.listening = False
        self.paused = True  # until start()
        self.pauses = 0
        #: ``accept`` calls that failed for want of a resource in the current episode.
        self.starved = 0
        self._starved_pause_s = RESOURCE_PAUSE_S
        self._tasks: set[asyncio.Task[None]] = set()
        self._recheck: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Start accepting."""
        for sock in self.sockets:
            sock.setblocking(False)
        self.listening = True
        self.resume()

    def pause(self) -> None:
        """Stop accepting (connections wait in the kernel's queue or go to siblings)."""
        if not self.paused:
            for sock in self.sockets:
                self.loop.remove_reader(sock.fileno())
            self.paused = True
            self.pauses += 1

    def resume(self) -> None:
        """Accept again."""
        if self._recheck is not None:
            self._recheck.cancel()
            self._recheck = None
        if self.listening and self.paused:
            for sock in self.sockets:
                self.loop.add_reader(sock.fileno(), self._on_readable, sock)
            self.paused = False

    def stop(self, close: bool = False) -> None:
        """Stop accepting for good; with ``close``, first take the connections already queued
        (only if it was accepting: a worker stopped before it listened takes none, they belong
        to the siblings that do) and then close this process's copy of the sockets (module
        docstring)."""
        was_listening = self.listening
        self.pause()
        self.listening = False
        if self._recheck is not None:
            self._recheck.cancel()
            self._recheck = None
        if not close:
            return
        for sock in self.sockets:
            if sock.fileno() < 0:
                continue
            while was_listening and self._accept(sock, final=True):
                pass
            sock.close()

    def _balance_allows(self) -> bool:
        try:
            return self.may_accept()
        except Exception:  # balancing is advisory: never stop serving over it
            log.exception("balancing check failed; accepting")
            return True

    def _on_readable(self, sock: socket.socket) -> None:
        if not self._balance_allows():
            log.debug("balance: a sibling is less loaded, pausing accepts")
            self.pause()
            self._recheck = self.loop.call_later(RECHECK_S, self._look_again)
            return
        self._accept(sock)

    def _accept(self, sock: socket.socket, final: bool = False) -> bool:
        """Accept one connection and hand it to aiohttp; False when there was none (or it could
        not be taken). ``final``: the last accepts of a drain (no pause on failure)."""
        try:
            conn, _ = sock.accept()
        except (BlockingIOError, InterruptedError):
            return False  # a sibling took it
        except OSError as exc:
            if exc.errno in _OUT_OF_RESOURCES and not final:
                self._starve(exc)
            elif not final:
                log.warning("accept failed: %s", exc)
            return False
        if self.starved:
            log.warning("accepting again after %d accept() failures for want of resources", self.starved)
            self.starved, self._starved_pause_s = 0, RESOURCE_PAUSE_S
        conn.setblocking(False)
        if conn.family in (socket.AF_INET, socket.AF_INET6):
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.accepted()
        task = self.loop.create_task(self._connect(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    def _starve(self, exc: OSError) -> None:
        """Out of file descriptors (or buffers): pause, and say so once per episode."""
        if not self.starved:
            log.warning(
                "accept failed (%s): pausing accepts, retrying every %.2f-%.0f s until it works "
                "(connections wait in the kernel's queue; raise the file limit, `ulimit -n`)",
                exc.strerror or exc, RESOURCE_PAUSE_S, RESOURCE_PAUSE_MAX_S,
            )  # fmt: skip
        self.starved += 1
        self.pause()
        self._recheck = self.loop.call_later(self._starved_pause_s, self._look_again)
        self._starved_pause_s = min(RESOURCE_PAUSE_MAX_S, self._starved_pause_s * 2)

    def _look_again(self) -> None:
        """Paused by the balance: resume once it allows, looking every ``RECHECK_S``."""
        self._recheck = None
        if not (self.listening and self.paused):
            return
        if self._balance_allows():
            self.resume()
        else:
            self._recheck = self.loop.call_later(RECHECK_S, self._look_again)

    async def _connect(self, conn: socket.socket) -> None:
        try:
            if self.ssl_context is None:
                await self.loop.connect_accepted_socket(self.factory, conn)
            else:
                await self.loop.connect_accepted_socket(
                    self.factory, conn, ssl=self.ssl_context, ssl_handshake_timeout=SSL_HANDSHAKE_TIMEOUT_S
                )
        except (TimeoutError, OSError, ssl.SSLError) as exc:
            log.debug("connection dropped before it was served: %r", exc)
            conn.close()


def ssl_context(cfg: Any) -> ssl.SSLContext:
    """TLS context from gunicorn's settings (``certfile``, ``keyfile``, ``ssl_version``,
    ``cert_reqs``, ``ca_certs``, ``ciphers``)."""
    context = ssl.SSLContext(cfg.ssl_version)
    context.load_cert_chain(cfg.certfile, cfg.keyfile)
    context.verify_mode = cfg.cert_reqs
    if cfg.ca_certs:
        context.load_verify_locations(cfg.ca_certs)
    if cfg.ciphers:
        context.set_ciphers(cfg.ciphers)
    return context


class ResumingSelector(selectors.DefaultSelector):
    """The platform's default selector; a ``select(timeout)`` that returns no events polls
    once more with timeout 0, so events that arrived while the process was stopped are
    handled before the timers that came due meanwhile."""

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready: list[tuple[selectors.SelectorKey, int]] = super().select(timeout)
        if not ready and timeout != 0:
            ready = super().select(0)
        return ready


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new asyncio event loop on :class:`ResumingSelector`."""
    return asyncio.SelectorEventLoop(ResumingSelector())
