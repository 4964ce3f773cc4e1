"""Shards between sibling workers: each worker's internal endpoint on a Unix socket in the run
directory, and the client that sends shards to it.

The endpoint (``POST /internal/shard``, msgpack per :mod:`app.server.wire`) is served by a
second ``AppRunner`` on a ``UnixSite`` at ``<run dir>/peers/<pid>.sock`` (directory mode 0700),
never on the TCP listener. It runs the shard through :meth:`app.serving.dataplane.DataPlane.run` with
``forwarded=True`` (a shard is never split or forwarded again) and the sender's request id and
remaining deadline; API keys were checked by the worker that received the request.
Imported by the worker only (it imports the serving layer, hence torch).
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import aiohttp
import numpy as np
from aiohttp import web

from app import errors
from app.server import wire
from app.serving.dataplane import DATAPLANE
from app.serving.state import SETTINGS

log = logging.getLogger(__name__)

PEERS_DIR = "peers"
PATH = "/internal/shard"
#: Beyond the shard's deadline, how long the sender waits for the sibling's own 504, seconds.
REPLY_GRACE_S = 0.25
_MAIN = web.AppKey("main_app", web.Application)


def socket_path(run_dir: str | os.PathLike[str], pid: int) -> Path:
    """Where worker ``pid`` serves its internal endpoint."""
    return Path(run_dir) / PEERS_DIR / f"{pid}.sock"


def internal_app(main: web.Application) -> web.Application:
    """The internal endpoint's app, serving shards with ``main``'s models."""
    app = web.Application(client_max_size=main[SETTINGS].max_request_bytes * 2)
    app[_MAIN] = main
    app.router.add_post(PATH, _handle_shard)
    return app


async def _handle_shard(request: web.Request) -> web.Response:
    try:
        shard = wire.decode_request(await request.read())
        inputs = {name: wire.from_tensor(t) for name, t in shard.inputs.items()}
        plane = request.app[_MAIN][DATAPLANE]
        entry = plane.registry.get(shard.model, shard.version)
        outputs = await plane.run(
            entry, inputs, timeout_s=shard.timeout_s, request_id=shard.request_id, forwarded=True
        )
        reply = wire.ShardResponse(outputs={name: wire.to_tensor(a) for name, a in outputs.items()})
    except errors.ScoringError as exc:
        reply = wire.ShardResponse(
            error=type(exc).__name__, message=exc.message, retry_after_s=exc.retry_after_s
        )
    except Exception as exc:  # the model raised something unmapped: report, do not 500 the socket
        log.exception("shard %s failed", request.headers.get("X-Request-Id", "?"))
        reply = wire.ShardResponse(error="InferenceFailed", message=f"sibling worker: {exc!r}")
    return web.Response(body=wire.encode(reply), content_type="application/msgpack")


class PeerUnavailable(Exception):
    """The sibling could not be reached, or went away before it answered."""


class PeerClient:
    """Sends shards to siblings' internal endpoints (one keep-alive session per sibling).

    Args:
        run_dir: the server's run directory.
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = Path(run_dir)
        self._sessions: dict[int, aiohttp.ClientSession] = {}

    def _session(self, pid: int) -> aiohttp.ClientSession:
        session = self._sessions.get(pid)
        if session is None or session.closed:
            connector = aiohttp.UnixConnector(path=str(socket_path(self.run_dir, pid)))
            session = aiohttp.ClientSession(connector=connector)
            self._sessions[pid] = session
        return session

    async def infer(
        self,
        pid: int,
        model: str,
        version: str,
        inputs: dict[str, np.ndarray],
        *,
        timeout_s: float,
        request_id: str,
    ) -> dict[str, np.ndarray]:
        """Run a shard on sibling ``pid``; outputs ``[b, ...]`` per name.

        Raises:
            PeerUnavailable: the sibling refused the connection or broke it (nothing ran there
                that this worker must wait for: the caller may run the shard itself).
            DeadlineExceeded: no answer within ``timeout_s`` (a stalled sibling).
            ScoringError: the error the sibling's own run raised (same class).
        """
        body = wire.encode(
            wire.ShardRequest(
                model, version, request_id, timeout_s, {name: wire.to_tensor(a) for name, a in inputs.items()}
            )
        )
        timeout = aiohttp.ClientTimeout(total=timeout_s + REPLY_GRACE_S)
        try:
            async with self._session(pid).post(
                f"http://peer{PATH}", data=body, timeout=timeout, headers={"X-Request-Id": request_id}
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
        reply = wire.decode_response(raw)
        wire.raise_error(reply)
        assert reply.outputs is not None
        return {name: wire.from_tensor(t) for name, t in reply.outputs.items()}

    def _forget(self, pid: int) -> None:
        session = self._sessions.pop(pid, None)
        if session is not None:
            asyncio.get_running_loop().create_task(session.close())

    async def close(self) -> None:
        """Close every session."""
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            await session.close()
