"""The stress run's clients: an HTTP/1.1 keep-alive connection that behaves like a pooling
client library and reports what happened on the wire, the faulty clients of the schedule
(gone mid-request, slow readers), and a gRPC channel of its own.

Blocking code on the standard library's sockets: under locust (gevent's monkey-patching) each
call yields to the other users while it waits. Traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import http.client
import select
import socket
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from benchmarks.stress.apis import Call, Reply

HOST = "127.0.0.1"
REQUEST_ID = "x-request-id"


class WireError(Exception):
    """No complete answer came: ``kind`` (the exception's name), whether it failed ``before``
    any byte of the answer arrived, the connection's ``local_port``, whether the connection was
    ``reused`` (kept alive from an earlier answer), how long it had been ``idle_s`` before, and
    the status of that earlier answer (``previous``, 0 when none)."""

    def __init__(
        self, kind: str, *, before: bool, local_port: int, reused: bool, idle_s: float, previous: int = 0
    ) -> None:
        super().__init__(kind)
        self.kind, self.before, self.local_port = kind, before, local_port
        self.reused, self.idle_s, self.previous = reused, idle_s, previous


@dataclass(frozen=True)
class Trip:
    """How an answer travelled: the client end's ``local_port`` and whether the connection was
    ``reused``."""

    local_port: int
    reused: bool


class _Socket(http.client.HTTPConnection):
    """``http.client.HTTPConnection`` with a receive buffer of ``rcvbuf`` bytes (a slow reader)."""

    def __init__(self, host: str, port: int, timeout: float, rcvbuf: int | None) -> None:
        super().__init__(host, port, timeout=timeout)
        self.rcvbuf = rcvbuf

    def connect(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if self.rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self.timeout)
        try:
            sock.connect((self.host, self.port))
        except OSError:
            sock.close()
            raise
        self.sock = sock


class Connection:
    """One HTTP/1.1 keep-alive connection to ``127.0.0.1:port``, used as urllib3, aiohttp and
    httpx use a pooled one: reused while open, replaced after ``Connection: close`` or once the
    server has closed it (EOF seen before sending), never retried here.

    ``timeout_s``: each socket operation's limit (a request unanswered that long is a
    :class:`WireError` of kind ``TimeoutError``). ``rcvbuf``, ``read_chunk`` and ``read_pause_s``
    make a slow reader: a small receive buffer, the body read ``read_chunk`` bytes at a time with a
    pause between reads.
    """

    def __init__(
        self,
        port: int,
        *,
        timeout_s: float = 90.0,
        rcvbuf: int | None = None,
        read_chunk: int = 0,
        read_pause_s: float = 0.0,
    ) -> None:
        self.port, self.timeout_s, self.rcvbuf = port, timeout_s, rcvbuf
        self.read_chunk, self.read_pause_s = read_chunk, read_pause_s
        self._conn: _Socket | None = None
        self._answered_at = 0.0
        self._previous = 0

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _usable(self) -> bool:
        sock = self._conn.sock if self._conn is not None else None
        if sock is None:
            return False
        readable, _, _ = select.select([sock], [], [], 0)
        return not readable  # an idle keep-alive connection is readable only once the server closed it

    def request(self, call: Call, extra: Mapping[str, str] | None = None) -> tuple[Reply, Trip]:
        """Send ``call`` (POST) and read the whole answer.

        Raises:
            WireError: no complete answer (reset, EOF, timeout); the connection is closed.
        """
        reused = self._usable()
        if not reused:
            self.close()
            self._conn = _Socket(HOST, self.port, self.timeout_s, self.rcvbuf)
        conn = self._conn
        assert conn is not None
        idle_s = time.monotonic() - self._answered_at if reused else 0.0
        previous = self._previous if reused else 0
        port, before = 0, True
        try:
            if conn.sock is None:
                conn.connect()
            port = conn.sock.getsockname()[1]
            conn.request("POST", call.path, call.body, {**dict(call.headers), **(extra or {})})
            response = conn.getresponse()
            before = False
            body = self._read(response)
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            raise WireError(
                type(exc).__name__,
                before=before,
                local_port=port,
                reused=reused,
                idle_s=idle_s,
                previous=previous,
            ) from exc
        self._answered_at, self._previous = time.monotonic(), response.status
        if response.will_close:
            self.close()
        headers = {name.lower(): value for name, value in response.getheaders()}
        return Reply(response.status, headers, body), Trip(port, reused)

    def _read(self, response: http.client.HTTPResponse) -> bytes:
        if not self.read_chunk:
            return response.read()
        chunks = []
        while chunk := response.read(self.read_chunk):
            chunks.append(chunk)
            time.sleep(self.read_pause_s)
        return b"".join(chunks)


def gone_mid_request(port: int, call: Call, mode: str, after_s: float = 0.0) -> None:
    """A client that vanishes: ``mode`` "mid-body" sends the head and half the body, "unread"
    the whole request; then, after ``after_s``, the connection is reset (``SO_LINGER`` 0: RST,
    as a killed process's socket is)."""
    head = (
        f"POST {call.path} HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
        + "".join(f"{name}: {value}\r\n" for name, value in call.headers)
        + f"Content-Length: {len(call.body)}\r\n\r\n"
    ).encode()
    body = call.body[: len(call.body) // 2] if mode == "mid-body" else call.body
    with socket.create_connection((HOST, port), timeout=30) as sock:
        sock.sendall(head + body)
        time.sleep(after_s)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class GrpcClient:
    """A gRPC channel of its own to ``127.0.0.1:port`` (its own connection: a local subchannel
    pool) that sends :class:`Call` bodies as they are, and answers as a :class:`Reply` with an
    HTTP-like status (:func:`grpc_status`)."""

    def __init__(self, port: int) -> None:
        import grpc

        self._grpc = grpc
        self.channel = grpc.insecure_channel(
            f"{HOST}:{port}", options=[("grpc.use_local_subchannel_pool", 1)]
        )

    def close(self) -> None:
        self.channel.close()

    def request(self, call: Call, timeout_s: float = 90.0, cancel_after_s: float | None = None) -> Reply:
        """One unary call. A cancelled call is a :class:`Reply` of status 499.

        Raises:
            WireError: the transport failed (UNAVAILABLE or DEADLINE_EXCEEDED that the server did
                not send: no ``x-request-id`` in the trailers).
        """
        method = self.channel.unary_unary(call.path)
        if cancel_after_s is not None:
            future = method.future(call.body, timeout=timeout_s)
            time.sleep(cancel_after_s)
            future.cancel()
            try:
                return Reply(200, {}, future.result())
            except self._grpc.FutureCancelledError:
                return Reply(499, {"grpc-status": "CANCELLED"}, b"")
            except self._grpc.RpcError as exc:
                return self._failed(exc)
        try:
            body, rpc = method.with_call(call.body, timeout=timeout_s)
        except self._grpc.RpcError as exc:
            return self._failed(exc)
        return Reply(200, dict(rpc.trailing_metadata() or ()), body)

    def _failed(self, exc: Any) -> Reply:
        trailers = {str(k): str(v) for k, v in (exc.trailing_metadata() or ())}
        code, details = exc.code().name, str(exc.details())
        status = grpc_status(code, details, served=REQUEST_ID in trailers)
        if status == 0:
            raise WireError(f"{code}: {details[:160]}", before=True, local_port=0, reused=True, idle_s=0.0)
        return Reply(status, {"grpc-status": code, "grpc-message": details, **trailers}, b"")


#: gRPC status -> the HTTP status of the same outcome (app/grpc/errors.py's table).
GRPC_TO_HTTP = {
    "OK": 200,
    "INVALID_ARGUMENT": 400,
    "UNAUTHENTICATED": 401,
    "NOT_FOUND": 404,
    "RESOURCE_EXHAUSTED": 413,
    "CANCELLED": 499,
    "INTERNAL": 500,
    "UNKNOWN": 500,
    "UNIMPLEMENTED": 501,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}


def grpc_status(code: str, details: str, *, served: bool) -> int:
    """The HTTP status of a gRPC outcome; 0 where the server sent none (``served`` false: no
    ``x-request-id`` trailer) and the transport or the client's own deadline ended the call.
    UNAVAILABLE for a model that is not loaded is 404, as over HTTP."""
    if code in ("UNAVAILABLE", "DEADLINE_EXCEEDED") and not served:
        return 0
    if code == "UNAVAILABLE" and "not loaded" in details:
        return 404
    return GRPC_TO_HTTP.get(code, 500)
