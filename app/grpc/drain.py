"""The gRPC half of a worker's drain: the calls in flight finish and the clients move to another
worker, none cut (:class:`AnswerGate`, used by :func:`app.grpc.server.serving_grpc`).

grpcio's server shutdown (``grpc.aio.Server.stop``) sends HTTP/2 GOAWAY on every connection and
gives the calls in flight the grace, but its core also cancels, at once, every call it has
received and not yet handed to Python, and every call that arrives before the client has read
the GOAWAY (grpc/grpc#41785, open in grpcio 1.85). A call waits in the core from its arrival
until the server's next request for one, and a ``grpc.aio`` server makes one request per event
loop turn: on a busy worker a few calls wait there at any moment, and a plain stop ends them
CANCELLED, with no answer from the server.

Clients send their next call when an answer comes (a channel with one call at a time, a load
generator's slot: a closed loop). So before the shutdown the gate holds the answers of the calls
that finish, and the calls that arrive meanwhile, until no call has reached the servicer for
:data:`QUIET_S` and :data:`QUIET_TURNS` loop turns, and for :data:`QUIET_GAPS` times the longest
wait between two calls while holding (everything the core had received has been handed over;
the turns count so that a stalled loop is not taken for a quiet one), at most
:data:`HOLD_MAX_S`. Then the servers shut down (the GOAWAYs go out, nothing is left to cancel),
and only then do the held answers leave, behind the GOAWAY on each connection: a client's next
call goes to a new connection, to another worker, transparently. A client that keeps sending
without waiting for its answers can still lose the calls it sends in the last round trip
before the GOAWAY, and so can one whose call reaches the server more than the quiet time after
it was sent (a machine starved of CPU). An answer is never held past its call's deadline (less
:data:`DEADLINE_MARGIN_S`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

log = logging.getLogger(__name__)

__all__ = [
    "DEADLINE_MARGIN_S", "HOLD_MAX_S", "QUIET_GAPS", "QUIET_S", "QUIET_TURNS", "AnswerGate", "stop_servers",
]  # fmt: skip

#: No call for this long (and :data:`QUIET_TURNS` turns), at least, and the connections are
#: quiet, seconds.
QUIET_S = 0.25
#: ... and for this many times the longest wait for a call seen while holding: the calls the core
#: had received come one after another, as fast as the loop and grpcio's polling thread go.
QUIET_GAPS = 3.0
#: Event-loop turns without a call, besides :data:`QUIET_S`: grpc.aio hands over one waiting call
#: per server every few turns.
QUIET_TURNS = 20
#: The longest the answers are held before the shutdown goes ahead anyway, seconds.
HOLD_MAX_S = 2.0
#: A held answer leaves at the latest this long before its call's deadline, seconds.
DEADLINE_MARGIN_S = 0.01
#: How often the gate looks again, after its first :data:`QUIET_TURNS` turns, seconds.
_RECHECK_S = 0.005
#: Loop turns between starting the servers' shutdowns and releasing the answers: grpcio starts
#: the shutdown (and sends the GOAWAYs) in the first step of ``Server.stop``.
_SHUTDOWN_TURNS = 2

Behavior = Callable[[Any, Any], Awaitable[Any]]


class AnswerGate:
    """Holds a worker's gRPC answers while its servers shut down (module docstring).

    :meth:`wrap` the servers' generic handler; at the stop, :meth:`hold` (close the gate and wait
    until the connections are quiet), shut the servers down, :meth:`release`
    (:func:`stop_servers` does the three). ``calls`` counts the calls that reached the servicer,
    ``waiting`` those waiting for the gate now.
    """

    def __init__(self) -> None:
        self.calls = 0
        self.waiting = 0
        self._open = asyncio.Event()
        self._open.set()

    def wrap(self, handler: grpc.GenericRpcHandler) -> grpc.GenericRpcHandler:
        """``handler``'s RPCs behind the gate (its unary-unary ones; the others unchanged)."""
        return _Gated(handler, self)

    def gated(self, behavior: Behavior) -> Behavior:
        """A unary-unary behaviour that counts its calls and, while the gate is closed, waits for
        it before it starts and before it answers."""

        async def call(request: Any, context: Any) -> Any:
            self.calls += 1
            await self._wait(context)
            reply = await behavior(request, context)
            await self._wait(context)
            return reply

        return call

    async def _wait(self, context: Any) -> None:
        if self._open.is_set():
            return
        remaining = context.time_remaining()  # None: the call has no deadline
        timeout = None if remaining is None else max(0.0, remaining - DEADLINE_MARGIN_S)
        self.waiting += 1
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._open.wait(), timeout)
        finally:
            self.waiting -= 1

    async def hold(self) -> float:
        """Close the gate; return once no call has arrived for :data:`QUIET_TURNS` loop turns and
        :data:`QUIET_S`, or :data:`QUIET_GAPS` times the longest wait between the calls that came
        while holding if longer, or after :data:`HOLD_MAX_S`: the seconds held."""
        self._open.clear()
        loop = asyncio.get_running_loop()
        began = loop.time()
        seen, since, turns, quiet_s = self.calls, began, 0, QUIET_S
        while (now := loop.time()) - began < HOLD_MAX_S:
            if self.calls != seen:  # handed over (or sent) since the last look
                quiet_s = max(quiet_s, QUIET_GAPS * (now - since))
                seen, since, turns = self.calls, now, 0
            elif turns >= QUIET_TURNS and now - since >= quiet_s:
                break
            await asyncio.sleep(0 if turns < QUIET_TURNS else _RECHECK_S)
            turns += 1
        return loop.time() - began

    def release(self) -> None:
        """Open the gate: the held calls go on and answer."""
        self._open.set()


class _Gated(grpc.GenericRpcHandler):  # type: ignore[misc]  # grpcio is untyped
    """A generic handler's method handlers, their unary-unary behaviours behind the gate (made
    once per method served; a method it does not serve is not remembered)."""

    def __init__(self, inner: grpc.GenericRpcHandler, gate: AnswerGate) -> None:
        self._inner, self._gate = inner, gate
        self._handlers: dict[str, Any] = {}

    def service(self, handler_call_details: Any) -> Any:
        method = handler_call_details.method
        handler = self._handlers.get(method)
        if handler is not None:
            return handler
        handler = self._inner.service(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        handler = grpc.unary_unary_rpc_method_handler(
            self._gate.gated(handler.unary_unary),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
        self._handlers[method] = handler
        return handler


async def stop_servers(servers: Sequence[Any], gate: AnswerGate, grace_s: float) -> None:
    """Stop ``servers`` (``grpc.aio.Server``) without cutting a call: hold the answers until the
    connections are quiet, start the shutdowns (GOAWAY; calls in flight get ``grace_s`` seconds,
    then are cancelled), release the answers, wait for the shutdowns (module docstring)."""
    held_s = await gate.hold()
    waiting = gate.waiting
    stops = [asyncio.ensure_future(server.stop(grace_s)) for server in servers]
    for _ in range(_SHUTDOWN_TURNS):
        await asyncio.sleep(0)
    gate.release()
    log.info(
        "worker %d: gRPC stopping: GOAWAY sent once its connections were quiet (%d calls held %.2f s)",
        os.getpid(), waiting, held_s, extra={"event": "grpc_stopping", "held_s": round(held_s, 3)},
    )  # fmt: skip
    await asyncio.gather(*stops)
