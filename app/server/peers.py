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
here are dropped. Imported by the worker only (it imports the
serving layer, hence torch).

**Wire format**: msgpack (msgspec), no pickle. A numeric tensor travels as its dtype string
(``"<f4"``), shape and raw bytes; a BYTES tensor (a numpy object array of ``bytes``/``str``) as
its shape and the list of its elements; the items' token ids a text handler made
(``app.models.base.PREPARED``, ragged) as their ids end to end and their lengths. Decoding
accepts numeric dtypes only for raw buffers (never ``object``), checks the buffer size against
the shape, and copies into a writable array.
The messages only ever gain fields, each with a default, and ignore fields they do not know: a
HUP that upgrades the code leaves old and new workers side by side for a while, and each must
understand what the other sends (protobuf's rule for unknown fields).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np
from aiohttp import web

from app import errors
from app.http.state import CORE
from app.serving.context import RequestContext
from app.serving.core import ServingCore

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


#: numpy dtype kinds a raw buffer may carry: bool, signed, unsigned, float, complex.
_RAW_KINDS = frozenset("biufc")


class Tensor(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One array: ``dtype`` (numpy ``dtype.str``, or ``"object"``), ``shape``, and either
    ``data`` (raw little/big-endian bytes) or ``items`` (object arrays, row-major)."""

    dtype: str
    shape: list[int]
    data: bytes | None = None
    items: list[Any] | None = None  # bytes or str, or a ragged tensor's lengths (checked when decoded)


class ShardRequest(msgspec.Struct):
    """A shard of an inference request sent to a sibling's internal endpoint, with the request's
    context (``app.serving.context.RequestContext``).

    ``timeout_s``: what is left of the original deadline when sent, seconds (the one place a
    deadline travels relative: two processes' loop clocks need not agree). ``priority``:
    Triton's request priority (0 = the model's default level). The request's trace context
    travels in the call's ``traceparent`` header (``app.observability.tracing``).
    """

    model: str
    version: str
    request_id: str
    timeout_s: float
    inputs: dict[str, Tensor]
    priority: int = 0


class ControlRequest(msgspec.Struct):
    """A model control change for a sibling to apply here: ``action`` (``load``, ``unload``)."""

    action: str
    model: str


class ControlResponse(msgspec.Struct):
    """Why the change failed on the sibling, or None when it applied."""

    error: str | None = None


class ShardResponse(msgspec.Struct):
    """The outputs of a shard, or the name and message of the :mod:`app.errors` class it raised."""

    outputs: dict[str, Tensor] | None = None
    error: str | None = None
    message: str = ""
    retry_after_s: float | None = None


#: The errors a shard may report back, by class name (anything else is InferenceFailed).
ERRORS: dict[str, type[errors.ScoringError]] = {
    cls.__name__: cls
    for cls in (
        errors.InvalidInput, errors.ModelNotFound, errors.PayloadTooLarge, errors.ClientDisconnected,
        errors.InferenceFailed, errors.ServiceUnavailable, errors.ModelNotReady, errors.QueueFull,
        errors.DeadlineExceeded, errors.InsufficientStorage,
    )
}  # fmt: skip

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(ShardRequest)
_response_decoder = msgspec.msgpack.Decoder(ShardResponse)


def to_tensor(array: np.ndarray) -> Tensor:
    """Encode ``array`` (any shape; numeric, or object of bytes/str; or a ragged object array:
    see :func:`_ragged`)."""
    shape = list(array.shape)
    if array.dtype == object:
        items = list(array.ravel())
        if items and isinstance(items[0], np.ndarray | tuple):
            return _ragged(array)
        return Tensor("object", shape, items=items)
    return Tensor(array.dtype.str, shape, data=np.ascontiguousarray(array).tobytes())


def _ragged(array: np.ndarray) -> Tensor:
    """An object array ``[B]`` of 1-D integer arrays, or of tuples of P of them (an item's token
    rows: ``app.models.base.PREPARED``), as ``dtype`` ``"ragged/<ids dtype>/P"`` (P = 0: bare
    arrays), ``shape`` ``[B]``, ``data`` the rows' ids end to end and ``items`` their lengths
    (``B * max(P, 1)`` integers, row-major), so that a sibling need not tokenize them again and no
    pickle is needed."""
    elements = list(array.ravel())
    arity = 0 if isinstance(elements[0], np.ndarray) else len(elements[0])
    rows = [np.asarray(e) for e in elements] if arity == 0 else [np.asarray(r) for e in elements for r in e]
    dtype = np.result_type(*rows) if rows else np.dtype(np.int32)
    flat = np.concatenate(rows).astype(dtype, copy=False) if rows else np.zeros(0, dtype)
    return Tensor(
        f"ragged/{dtype.str}/{arity}", list(array.shape), data=flat.tobytes(), items=[len(r) for r in rows]
    )


def _from_ragged(tensor: Tensor) -> np.ndarray:
    """Decode :func:`_ragged`'s form, checking every length and size against the data.

    Raises:
        InvalidInput: a malformed dtype, lengths that are not non-negative integers matching the
            shape and arity, or ids that do not fill the data.
    """
    try:
        _, name, arity_text = tensor.dtype.split("/")
        dtype, arity = np.dtype(name), int(arity_text)
    except (TypeError, ValueError) as exc:
        raise errors.InvalidInput(f"bad ragged tensor dtype {tensor.dtype!r}") from exc
    count = math.prod(tensor.shape)
    lengths = tensor.items
    if (
        dtype.kind not in "iu"
        or not 0 <= arity <= 16
        or lengths is None
        or len(lengths) != count * max(arity, 1)
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in lengths)
        or tensor.data is None
        or len(tensor.data) != sum(lengths) * dtype.itemsize
    ):
        raise errors.InvalidInput("ragged tensor: lengths do not match its shape or data")
    flat = np.frombuffer(tensor.data, dtype=dtype)
    rows = np.split(flat.copy(), np.cumsum(lengths)[:-1]) if lengths else []
    out = np.empty(count, dtype=object)
    for i in range(count):
        out[i] = rows[i] if arity == 0 else tuple(rows[i * arity : (i + 1) * arity])
    return out.reshape(tensor.shape)


def from_tensor(tensor: Tensor) -> np.ndarray:
    """Decode a :class:`Tensor`.

    Raises:
        InvalidInput: an unknown or object dtype for raw data, or a size that does not match.
    """
    if any(d < 0 for d in tensor.shape):
        raise errors.InvalidInput(f"negative dimension in shape {tensor.shape}")
    count = math.prod(tensor.shape)
    if tensor.dtype.startswith("ragged/"):
        return _from_ragged(tensor)
    if tensor.dtype == "object":
        items = tensor.items
        if items is None or len(items) != count or not all(isinstance(i, (bytes, str)) for i in items):
            raise errors.InvalidInput("object tensor: items are not bytes/str matching its shape")
        out = np.empty(count, dtype=object)
        out[:] = items
        return out.reshape(tensor.shape)
    try:
        dtype = np.dtype(tensor.dtype)
    except TypeError as exc:
        raise errors.InvalidInput(f"unknown dtype {tensor.dtype!r}") from exc
    if dtype.kind not in _RAW_KINDS or tensor.data is None or len(tensor.data) != count * dtype.itemsize:
        raise errors.InvalidInput(f"tensor of dtype {tensor.dtype!r} does not match its shape or data")
    return np.frombuffer(tensor.data, dtype=dtype).reshape(tensor.shape).copy()


def encode(message: ShardRequest | ShardResponse) -> bytes:
    """msgpack bytes of a request or response."""
    return _encoder.encode(message)


def decode_request(body: bytes) -> ShardRequest:
    """Raises InvalidInput on anything but a well-formed :class:`ShardRequest`."""
    try:
        return _request_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise errors.InvalidInput(f"bad shard request: {exc}") from exc


def decode_response(body: bytes) -> ShardResponse:
    """Raises InferenceFailed on anything but a well-formed :class:`ShardResponse`."""
    try:
        return _response_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise errors.InferenceFailed(f"bad shard response from a sibling worker: {exc}") from exc


def raise_error(response: ShardResponse) -> None:
    """Re-raise the error a sibling reported, as the same :mod:`app.errors` class."""
    if response.error is not None:
        cls = ERRORS.get(response.error, errors.InferenceFailed)
        raise cls(response.message, retry_after_s=response.retry_after_s)


def socket_path(run_dir: str | os.PathLike[str], pid: int) -> Path:
    """Where worker ``pid`` serves its internal endpoint."""
    return Path(run_dir) / PEERS_DIR / f"{pid}.sock"


def internal_app(core: ServingCore) -> web.Application:
    """The internal endpoint's app, serving shards, model control changes and this worker's
    statistics with ``core``'s models (the core under the same key, :data:`app.http.state.CORE`,
    as on the main app)."""
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
        model = plane.version(shard.model, shard.version)
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
    return web.Response(body=_encoder.encode(ControlResponse(error)), content_type="application/msgpack")


async def _handle_stats(request: web.Request) -> web.Response:
    stats = request.app[CORE].dataplane.local_statistics()
    return web.Response(body=msgspec.json.encode(stats), content_type="application/json")


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
        body = _encoder.encode(ControlRequest(action, model))
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
