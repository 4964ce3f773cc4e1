"""An OTLP/HTTP trace receiver on 127.0.0.1 for tests: it decodes the real OTLP protobufs
(``ExportTraceServiceRequest``) that a server's exporter posts to ``/v1/traces`` and keeps every
span, with the service and pid of the process that sent it."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


@dataclass(frozen=True)
class Span:
    """One exported span: ids as hex, its name, kind, parent, links' (trace, span) ids,
    attributes, and the pid and service of the worker that made it."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int
    links: tuple[tuple[str, str], ...]
    attributes: dict[str, Any]
    pid: int
    service: str


def _value(value: Any) -> Any:
    return getattr(value, value.WhichOneof("value")) if value.WhichOneof("value") else None


class Receiver:
    """``with Receiver() as receiver:`` serves ``receiver.endpoint``; ``receiver.spans`` fills up."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver._add(ExportTraceServiceRequest.FromString(body))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _add(self, request: ExportTraceServiceRequest) -> None:
        found = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    found.append(
                        Span(
                            span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(), span.name,
                            span.kind, tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links),
                            {a.key: _value(a.value) for a in span.attributes},
                            int(resource.get("process.pid", 0)), str(resource.get("service.name", "")),
                        )
                    )  # fmt: skip
        with self._lock:
            self.spans.extend(found)

    def of_trace(self, trace_id: str) -> list[Span]:
        """The spans received so far of trace ``trace_id`` (hex)."""
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def __enter__(self) -> Receiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
