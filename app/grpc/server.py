"""The gRPC server of one worker: ``grpc.aio`` on the worker's own event loop, beside HTTP.

Every worker runs its own listeners on ``grpc_host:grpc_port`` (``grpc_servers`` of them,
see :func:`serving_grpc`) with ``SO_REUSEPORT`` (``grpc.so_reuseport``, which is also grpcio's
default on Linux), so the kernel hands each new connection to one of the workers, as
gunicorn's shared socket does for HTTP. A gRPC
channel is one long-lived HTTP/2 connection, so all calls of one channel reach one worker;
:meth:`app.serving.dataplane.DataPlane.infer` (which every ModelInfer awaits) is where work is
balanced among sibling workers, for gRPC as for HTTP.

Nothing here runs in the gunicorn master: ``app.main`` (which imports this module, and so
grpc) is imported by each worker after the fork, and the server is created on the worker's
loop by :func:`serving_grpc`. grpcio's threads and file descriptors therefore never cross a fork.

Lifecycle: :func:`serving_grpc` starts the server after the models' context (so a replacement
worker that waits for its models before listening does so for gRPC too; a worker stopped
before that never listens) and stops it first on cleanup, before the serving units stop:
clients get HTTP/2 GOAWAY and reconnect to a sibling worker, in-flight calls get
``grpc_grace_s`` seconds to finish, and no call is cut by the shutdown itself
(:class:`AnswerGate`, :func:`stop_servers`). Readiness (ServerReady) is false from the start
of the drain, as for HTTP.

The gRPC half of a worker's drain: the calls in flight finish and the clients move to another
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
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import grpc

from app.grpc.servicer import InferenceServicer, generic_handler
from app.serving.core import ServingCore
from app.settings import Settings

log = logging.getLogger(__name__)

#: Share of the streams a client resets that grpcio answers with a PING (its default: 1).
PING_ON_RST_STREAM_PERCENT = 10
#: How long a PING may go unanswered before grpcio closes the connection, ms (its default:
#: 1 minute). A client's gRPC library answers PINGs in its transport, whatever its load.
PING_TIMEOUT_MS = 5000


def server_options(settings: Settings) -> list[tuple[str, Any]]:
    """grpcio channel arguments of the server:

    - ``grpc.so_reuseport``: every worker listens on the port (the kernel spreads connections);
    - ``grpc.max_receive_message_length`` = ``max_request_bytes`` (RESOURCE_EXHAUSTED above,
      from grpcio itself, before the message reaches Python);
    - ``grpc.max_concurrent_streams`` = ``grpc_max_concurrent_streams``: the most calls one
      connection may have open at once (announced in HTTP/2 SETTINGS; a client queues the
      rest). It bounds what one connection can hold in memory (streams opened and never
      finished, or whose answers the client never reads) and arms grpcio's own defences
      against HTTP/2 rapid reset (CVE-2023-44487), which work against that bound;
    - ``grpc.http2.ping_on_rst_stream_percent`` = :data:`PING_ON_RST_STREAM_PERCENT` and
      ``grpc.http2.ping_timeout_ms`` = :data:`PING_TIMEOUT_MS`: grpcio answers a share of the
      streams a client resets with a PING (gRPC core's rapid-reset defence, grpc/grpc#34637),
      and closes a connection whose PING goes unanswered for the timeout: a rapid-reset flood
      that never reads its socket (grpcio soon stops reading it too) is disconnected. One
      that reads and answers stays connected, at a cost in CPU that docs/reliability.md
      measures;
    - ``grpc.max_connection_age_ms``: a connection is asked to reconnect after a while (gRPC's
      ``MAX_CONNECTION_AGE``, the gRPC load-balancing guide's advice for long-lived connections
      behind an L4 balancer), so the kernel places it again. Its calls in flight finish
      however long they take (no ``grpc.max_connection_age_grace_ms``: gRFC A9's default, no
      limit): each inference call ends by its deadline, which the data plane caps at the
      model's ``max_timeout_ms`` or ``max_request_timeout_ms``, and a grace shorter than that
      cut queued calls with UNAVAILABLE, which a client cannot tell from a lost server.
    """
    options: list[tuple[str, Any]] = [
        ("grpc.so_reuseport", 1),
        ("grpc.max_receive_message_length", settings.max_request_bytes),
        ("grpc.max_send_message_length", -1),
        ("grpc.max_concurrent_streams", settings.grpc_max_concurrent_streams),
        ("grpc.http2.ping_on_rst_stream_percent", PING_ON_RST_STREAM_PERCENT),
        ("grpc.http2.ping_timeout_ms", PING_TIMEOUT_MS),
    ]
    if settings.grpc_max_connection_age_s > 0:
        options.append(("grpc.max_connection_age_ms", int(settings.grpc_max_connection_age_s * 1000)))
    return options


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


async def start_server(
    core: ServingCore, host: str, port: int, gate: AnswerGate | None = None
) -> tuple[Any, int]:
    """Create, bind and start a ``grpc.aio`` server over ``core`` on the running loop, its calls
    behind ``gate`` when given (:class:`AnswerGate`).

    Serves TLS when the settings give ``certfile``/``keyfile`` (the HTTP certificate), and
    requires a client certificate signed by ``client_ca_file`` when that is set (mutual TLS,
    as ``ca_certs`` + ``CERT_REQUIRED`` do on the HTTP side).

    Returns:
        (the ``grpc.aio.Server``, the port bound: ``port``, or the one chosen for 0).

    Raises:
        RuntimeError: the address cannot be bound.
        OSError: the certificate or key cannot be read.
    """
    settings, tracing = core.settings, core.tracing
    interceptors = tracing.grpc_interceptors() if tracing is not None else None
    server = grpc.aio.server(options=server_options(settings), interceptors=interceptors)
    handler = generic_handler(InferenceServicer(core))
    server.add_generic_rpc_handlers((gate.wrap(handler) if gate is not None else handler,))
    address = _address(host, port)
    if settings.certfile is not None and settings.keyfile is not None:
        client_ca = settings.client_ca_file
        credentials = grpc.ssl_server_credentials(
            [(settings.keyfile.read_bytes(), settings.certfile.read_bytes())],
            root_certificates=client_ca.read_bytes() if client_ca is not None else None,
            require_client_auth=client_ca is not None,
        )
        bound = server.add_secure_port(address, credentials)
    else:
        bound = server.add_insecure_port(address)
    if not bound:
        raise RuntimeError(f"gRPC: cannot bind {address}")
    await server.start()
    return server, int(bound)


@asynccontextmanager
async def serving_grpc(core: ServingCore) -> AsyncIterator[None]:
    """Serve gRPC on ``grpc_host:grpc_port`` in this worker (not when the port is 0, nor once
    the worker drains: stopped before its models were warm, it never listens) from
    ``grpc_servers`` servers on that port; on cleanup stop them without cutting a call
    (:func:`app.grpc.server.stop_servers`), giving in-flight calls ``grpc_grace_s`` seconds.

    Why several: a ``grpc.aio`` server takes new calls from the gRPC core one at a time, one
    per turn of the event loop (it awaits each ``request_call`` before asking for the next),
    so under load a worker's calls reach the queue one by one however many wait in the core.
    Each server asks on its own, and connections are spread over every server of every worker
    by ``SO_REUSEPORT`` (the figures that chose the default: docs/benchmarks.md, *Figures behind
    the code's choices*).
    """
    settings, registry = core.settings, core.registry
    if settings.grpc_port == 0 or registry.draining:
        yield
        return
    gate = AnswerGate()
    server, port = await start_server(core, settings.grpc_host, settings.grpc_port, gate)
    servers = [server]
    try:
        for _ in range(settings.grpc_servers - 1):  # on the port the first one bound
            servers.append((await start_server(core, settings.grpc_host, port, gate))[0])
    except BaseException:
        await asyncio.gather(*(s.stop(None) for s in servers))
        raise
    if registry.draining:  # stopped while the servers started: none has taken a call
        await asyncio.gather(*(s.stop(None) for s in servers))
        yield
        return
    log.info(
        "worker %d: gRPC listening on %s", os.getpid(), _address(settings.grpc_host, port),
        extra={"event": "grpc_listening", "port": port},
    )  # fmt: skip
    try:
        yield
    finally:
        await stop_servers(servers, gate, settings.grpc_grace_s)



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
