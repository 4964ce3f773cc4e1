"""The keep-alive policy: the one place that decides which responses close their connection
(:func:`setup_connections`), and which hold an impatient client's refusal. A response carries
``Connection: close`` (and the server closes the connection after it) when

- the error it answers says so (a 408: the body came too slowly, the rest of it may still
  arrive and cannot be told from a next request);
- the worker is draining: clients move to another worker *after* a complete response,
  instead of finding their idle keep-alive connection closed under them when the
  worker stops (the race in which a client sends on a connection the server is
  closing, and sees a reset);
- the connection has served ``max_requests_per_connection`` requests (nginx's
  ``keepalive_requests``): long-lived clients spread over workers again, and no
  connection lives forever;
- it is a 503 to a client that ignored the ``Retry-After`` of the previous 503 on the same
  connection, and ``impatient_hold_ms`` is 0 (then an impatient client pays a reconnect for
  each further try);
- the balance among sibling workers says a less-loaded sibling should take this connection
  (``app.http.state.SHEDDING``: ``app.server.balance.WorkerConnections``).

The idle timeout of a keep-alive connection is gunicorn's ``keepalive``
(``SCORING_KEEPALIVE_S``). The policy runs as an ``on_response_prepare`` signal, so it sees every
response the app produces, error responses included; it also counts them for the
worker's ``max_requests`` recycling (``app.server.worker``).

**Holding impatient clients.** Under overload a client that resends at once after a 503
costs the server a whole request (its body read, its refusal written) every round trip,
thousands a second, and that takes the CPU the models need. By default such a 503 (the
client came back on the same connection before the previous 503's ``Retry-After`` had
passed) is *held* for ``impatient_hold_ms`` (35 ms) before it is sent, and the connection
stays open: a held refusal costs an idle timer, not CPU, and it bounds each such connection
to one refusal per hold, which a reconnect did not (a fresh connection's first 503 is never
held, so closing halved the effect). A client that keeps doing it has each further 503 in a
row held twice as long, up to ``impatient_hold_max_ms`` (280 ms: 35, 70, 140, 280, 280 ...),
the exponential backoff it was asked for and did not do; the streak ends when the connection
gets any other answer or the client waits as asked. The first 503 on a connection, and every
503 to a client that waits as asked, is sent at once. Source: the tarpit idea (delay, not
refuse harder), as in nginx's ``limit_req ... delay``, with gRPC's retry backoff (doubling
up to a cap). Measured in docs/reliability.md (overload).
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref

from aiohttp import web

from app.http.state import CORE, SHEDDING

#: Requests answered per connection, keyed by its transport (gone with the connection).
_PER_CONNECTION = web.AppKey("requests_per_connection", weakref.WeakKeyDictionary)
#: Per connection, the loop time until which its last 503 asked the client to wait.
_RETRY_AFTER = web.AppKey("retry_after_per_connection", weakref.WeakKeyDictionary)
#: Per connection, how many 503s in a row answered a client that came back too early.
_STREAK = web.AppKey("impatient_streak_per_connection", weakref.WeakKeyDictionary)


def setup_connections(app: web.Application) -> None:
    """Install the keep-alive policy on ``app``."""
    app[_PER_CONNECTION] = weakref.WeakKeyDictionary[asyncio.BaseTransport, int]()
    app[_RETRY_AFTER] = weakref.WeakKeyDictionary[asyncio.BaseTransport, float]()
    app[_STREAK] = weakref.WeakKeyDictionary[asyncio.BaseTransport, int]()
    app.on_response_prepare.append(_on_response_prepare)


async def _on_response_prepare(request: web.Request, response: web.StreamResponse) -> None:
    app = request.app
    app[CORE].health.responses += 1
    if response.headers.get("Connection") == "close" or app[CORE].registry.draining:
        _close_after(response)
        return
    transport = request.transport
    if transport is not None:
        hold_s = _impatient_hold_s(app, transport, response)
        if hold_s is not None:
            if hold_s:
                await asyncio.sleep(hold_s)
            else:
                _close_after(response)
            return
    cap = app[CORE].settings.max_requests_per_connection
    if cap and transport is not None:
        counts = app[_PER_CONNECTION]
        served = counts.get(transport, 0) + 1
        counts[transport] = served
        if served >= cap:
            _close_after(response)
            return
    if app[SHEDDING].should_shed():
        _close_after(response)


def _impatient_hold_s(
    app: web.Application, transport: asyncio.BaseTransport, response: web.StreamResponse
) -> float | None:
    """How long to hold this response, seconds: None unless it is a 503 to a client that came
    back before the ``Retry-After`` of the previous 503 on its connection; else
    ``impatient_hold_ms`` doubled for each such 503 before it in a row, at most
    ``impatient_hold_max_ms`` (0 = no hold: close instead). Records this 503's
    ``Retry-After`` and the streak; any other answer ends the streak."""
    streaks = app[_STREAK]
    retry_after = response.headers.get("Retry-After") if response.status == 503 else None
    if retry_after is None:
        if streaks:
            streaks.pop(transport, None)
        return None
    now = asyncio.get_running_loop().time()
    waits = app[_RETRY_AFTER]
    impatient = now < waits.get(transport, 0.0)
    with contextlib.suppress(ValueError):
        waits[transport] = now + float(retry_after)
    if not impatient:
        streaks.pop(transport, None)
        return None
    streak = streaks.get(transport, 0)
    streaks[transport] = streak + 1
    settings = app[CORE].settings
    base_ms = settings.impatient_hold_ms
    hold_ms = min(base_ms * 2 ** min(streak, 16), max(base_ms, settings.impatient_hold_max_ms))
    return float(hold_ms) / 1000


def _close_after(response: web.StreamResponse) -> None:
    # The headers were computed before this signal: say it, and make aiohttp do it.
    response.headers["Connection"] = "close"
    response.force_close()
