"""Shards between sibling workers: each worker's internal endpoint on a Unix socket in the run
directory, and the client that sends shards to it.

The endpoint (``POST /internal/shard``, msgpack: the wire format below; ``POST /internal/models``,
model control; ``GET /internal/stats``, the worker's statistics as JSON) is served by a second
``AppRunner`` on a ``UnixSite`` at ``<run dir>/peers/<pid>.sock`` (directory mode 0700), never
on the TCP listener. It runs the shard through :meth:`app.serving.dataplane.DataPlane.run` under
the sender's request context (``app.serving.context``) marked forwarded (a shard is never split
or forwarded again): its request id, priority, remaining deadline (sent relative, anchored again
on arrival) and trace context (the ``traceparent`` header); API keys were
checked by the worker that received the request. The sender's call is the shard's client: when
the sender closes it (its own client left, ``app.server.router``), the shard's items still queued
here are dropped. The messages are :mod:`app.server.wire`'s (msgpack, no pickle). Imported by
the worker only (it imports the serving layer, hence torch).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np
from aiohttp import web

from app import errors
from app.server.wire import (
    ControlRequest,
    ControlResponse,
    ShardRequest,
    ShardResponse,
    decode_request,
    decode_response,
    encode,
    from_tensor,
    raise_error,
    to_tensor,
)
from app.serving.context import RequestContext
from app.serving.core import ServingCore
from app.settings import PEER_KEEPALIVE_S

log = logging.getLogger(__name__)

PEERS_DIR = "peers"
PATH = "/internal/shard"
#: Model control changes between workers (``app.serving.control``).
CONTROL_PATH = "/internal/models"
#: A worker's Triton statistics, for a sibling answering the server's (``app.serving.dataplane``).
STATS_PATH = "/internal/stats"
#: How long a worker waits for a sibling's statistics before answering without them, seconds.
STATS_TIMEOUT_S = 2.0
#: How long a worker waits for a sibling to apply a model control change (a load may take
#: minutes on a busy CPU), seconds.
CONTROL_TIMEOUT_S = 600.0
#: Beyond the shard's deadline, how long the sender waits for the sibling's own 504, seconds.
REPLY_GRACE_S = 0.25
#: The W3C trace context headers a shard's context keeps.
TRACE_HEADERS = ("traceparent", "tracestate")
#: The worker's serving core on the internal endpoint's app.
CORE = web.AppKey("peer-core", ServingCore)


def socket_path(run_dir: str | os.PathLike[str], pid: int) -> Path:
    """Where worker ``pid`` serves its internal endpoint."""
    return Path(run_dir) / PEERS_DIR / f"{pid}.sock"


def internal_app(core: ServingCore) -> web.Application:
    """The internal endpoint's app, serving shards, model control changes and this worker's
    statistics with ``core``'s models (the core under :data:`CORE`)."""
    app = web.Application(client_max_size=core.settings.max_request_bytes * 2)
    app[CORE] = core
    app.router.add_post(PATH, _handle_shard)
    app.router.add_post(CONTROL_PATH, _handle_control)
    app.router.add_get(STATS_PATH, _handle_stats)
    return app


class InternalEndpoint:
    """This worker's internal endpoint, serving (:func:`internal_app`) on
    ``<run dir>/peers/<pid>.sock``; made by :meth:`start` once the worker's core exists."""

    def __init__(self, runner: web.AppRunner, path: Path) -> None:
        self.runner = runner
        self.path = path

    @classmethod
    async def start(cls, core: ServingCore, run_dir: str | os.PathLike[str], pid: int) -> InternalEndpoint:
        """Serve ``core`` at worker ``pid``'s socket path (a stale socket file is replaced);
        ``<run dir>/peers`` must exist and be private (``app.server.rundir.private_subdir``)."""
        path = socket_path(run_dir, pid)
        path.unlink(missing_ok=True)
        runner = web.AppRunner(internal_app(core), access_log=None)
        await runner.setup()
        await web.UnixSite(runner, str(path)).start()
        return cls(runner, path)

    async def close(self) -> None:
        """Stop serving (requests under way finish within aiohttp's shutdown) and remove the
        socket file."""
        await self.runner.cleanup()
        self.path.unlink(missing_ok=True)


def shard_context(
    shard: ShardRequest,
    now: float,
    headers: Mapping[str, str],
    is_disconnected: Callable[[], bool] | None = None,
) -> RequestContext:
    """The context a shard runs under here, received at ``now`` (loop time) with ``headers``:
    the sender's id, priority and trace, its deadline anchored on ``now``, forwarded; its client
    gone once ``is_disconnected`` says the sender's call closed.

    Raises:
        InvalidInput: a negative priority.
    """
    if shard.priority < 0:
        raise errors.InvalidInput(f"shard priority {shard.priority} < 0")
    trace = tuple((name, headers[name]) for name in TRACE_HEADERS if name in headers)
    return RequestContext(
        shard.request_id, now + shard.timeout_s, shard.priority, trace, forwarded=True,
        is_disconnected=is_disconnected, arrival=now,
    )  # fmt: skip


def _call_closed(request: web.Request) -> Callable[[], bool]:
    """True once the sender of ``request`` closed its call (it gave the shard up)."""
    transport = request.transport
    return lambda: transport is None or transport.is_closing()


async def _handle_shard(request: web.Request) -> web.Response:
    try:
        shard = decode_request(await request.read())
        context = shard_context(
            shard, asyncio.get_running_loop().time(), request.headers, _call_closed(request)
        )
        inputs = {name: from_tensor(t) for name, t in shard.inputs.items()}
        plane = request.app[CORE].dataplane
        model = plane.get_model(shard.model, shard.version)
        outputs = await plane.run(model, inputs, context)
        reply = ShardResponse(outputs={name: to_tensor(a) for name, a in outputs.items()})
    except errors.ScoringError as exc:
        reply = ShardResponse(error=type(exc).__name__, message=exc.message, retry_after_s=exc.retry_after_s)
    except Exception as exc:  # the model raised something unmapped: report, do not 500 the socket
        log.exception("shard %s failed", request.headers.get("X-Request-Id", "?"))
        reply = ShardResponse(error="InferenceFailed", message=f"sibling worker: {exc!r}")
    return web.Response(body=encode(reply), content_type="application/msgpack")


async def _handle_control(request: web.Request) -> web.Response:
    try:
        change = msgspec.msgpack.decode(await request.read(), type=ControlRequest)
        error = await request.app[CORE].control.apply(change.action, change.model)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        error = f"bad model control request: {exc}"
    return web.Response(
        body=msgspec.msgpack.encode(ControlResponse(error)), content_type="application/msgpack"
    )


async def _handle_stats(request: web.Request) -> web.Response:
    stats = request.app[CORE].dataplane.local_statistics()
    return web.Response(body=msgspec.json.encode(stats), content_type="application/json")


class PeerUnavailable(Exception):
    """The sibling could not be reached, or went away before it answered."""


class PeerClient:
    """Sends shards to siblings' internal endpoints (one keep-alive session per sibling).

    Args:
        run_dir: the server's run directory.
        keepalive_s: how long an idle connection to a sibling stays open (``SCORING_PEER_KEEPALIVE_S``).
    """

    def __init__(self, run_dir: str | os.PathLike[str], keepalive_s: float = PEER_KEEPALIVE_S) -> None:
        self.run_dir = Path(run_dir)
        self.keepalive_s = keepalive_s
        self._sessions: dict[int, aiohttp.ClientSession] = {}

    def _session(self, pid: int) -> aiohttp.ClientSession:
        session = self._sessions.get(pid)
        if session is None or session.closed:
            path = str(socket_path(self.run_dir, pid))
            connector = aiohttp.UnixConnector(path=path, keepalive_timeout=self.keepalive_s)
            session = aiohttp.ClientSession(connector=connector)
            self._sessions[pid] = session
        return session

    async def infer(
        self,
        pid: int,
        model: str,
        version: str,
        inputs: dict[str, np.ndarray],
        context: RequestContext,
    ) -> dict[str, np.ndarray]:
        """Run a shard on sibling ``pid`` under the request's ``context`` (by its deadline, loop
        time; at its priority; in its trace); outputs ``[b, ...]`` per name.

        Raises:
            PeerUnavailable: the sibling refused the connection or broke it (nothing ran there
                that this worker must wait for: the caller may run the shard itself).
            DeadlineExceeded: no answer by ``deadline`` (a stalled sibling).
            ScoringError: the error the sibling's own run raised (same class).
        """
        request_id = context.request_id
        timeout_s = max(0.0, context.deadline - asyncio.get_running_loop().time())
        tensors = {name: to_tensor(a) for name, a in inputs.items()}
        body = encode(ShardRequest(model, version, request_id, timeout_s, tensors, context.priority))
        timeout = aiohttp.ClientTimeout(total=timeout_s + REPLY_GRACE_S)
        headers = {"X-Request-Id": request_id, **dict(context.trace)}
        try:
            async with self._session(pid).post(
                f"http://peer{PATH}", data=body, timeout=timeout, headers=headers
            ) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise errors.InferenceFailed(f"sibling worker {pid} answered HTTP {resp.status}")
        except TimeoutError as exc:
            raise errors.DeadlineExceeded(
                f"request {request_id}: sibling worker {pid} did not answer its shard in time"
            ) from exc
        except aiohttp.ClientError as exc:
            self._forget(pid)
            raise PeerUnavailable(f"sibling worker {pid}: {exc}") from exc
        reply = decode_response(raw)
        raise_error(reply)
        assert reply.outputs is not None
        return {name: from_tensor(t) for name, t in reply.outputs.items()}

    async def control(self, pid: int, action: str, model: str) -> str | None:
        """Have sibling ``pid`` apply a model control change; why it failed there, or None."""
        timeout = aiohttp.ClientTimeout(total=CONTROL_TIMEOUT_S)
        body = msgspec.msgpack.encode(ControlRequest(action, model))
        try:
            async with self._session(pid).post(
                f"http://peer{CONTROL_PATH}", data=body, timeout=timeout
            ) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    return f"answered HTTP {resp.status}"
            return msgspec.msgpack.decode(raw, type=ControlResponse).error
        except TimeoutError:
            return f"did not answer within {CONTROL_TIMEOUT_S:.0f} s"
        except aiohttp.ClientError as exc:
            self._forget(pid)
            return f"unreachable ({exc})"
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return f"answered something else than a model control response ({exc})"

    async def statistics(self, pid: int) -> list[dict[str, Any]] | None:
        """Sibling ``pid``'s Triton statistics of its model versions (``$model_stat`` objects),
        or None when it did not answer them within :data:`STATS_TIMEOUT_S`."""
        timeout = aiohttp.ClientTimeout(total=STATS_TIMEOUT_S)
        try:
            async with self._session(pid).get(f"http://peer{STATS_PATH}", timeout=timeout) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    return None
            return msgspec.json.decode(raw, type=list[dict[str, Any]])
        except TimeoutError:
            return None
        except aiohttp.ClientError:
            self._forget(pid)
            return None
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None

    def _forget(self, pid: int) -> None:
        session = self._sessions.pop(pid, None)
        if session is not None:
            asyncio.get_running_loop().create_task(session.close())

    async def close(self) -> None:
        """Close every session."""
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            await session.close()
