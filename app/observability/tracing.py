"""OpenTelemetry tracing, configured by the standard ``OTEL_*`` environment variables; off (and
free: no call on the request path reaches this module) when they configure no exporter.

On when ``OTEL_TRACES_EXPORTER`` names one (``otlp``: OTLP over HTTP/protobuf, the SDK's
``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``, ``_HEADERS``, ``_TIMEOUT``; ``console``) or an OTLP
endpoint is set, and ``OTEL_SDK_DISABLED`` is not true. The SDK reads the rest itself:
``OTEL_SERVICE_NAME`` (default here ``scoring-server``; each worker adds its ``process.pid``),
``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER`` / ``_ARG`` (default ``parentbased_always_on``), ``OTEL_BSP_*`` (the batch
span processor). Each gunicorn worker sets it up after the fork (its exporter thread is its own).

The spans of one inference request, all of one trace (the caller's, from its W3C ``traceparent``
header or gRPC metadata, else a new one):

- the **server span** of the HTTP request or gRPC call (OpenTelemetry's aiohttp-server and gRPC
  instrumentations), with ``scoring.request_id``;
- ``queue``: from the request's admission to the batch it joins;
- ``batch``: one span per batch formed, in the trace of its oldest traced request and **linked**
  to every traced request in it (a batch serves many requests, of many traces: OpenTelemetry's
  batch pattern), with its ``scoring.batch.items``, ``.requests`` and ``.cost``; and under it
  ``forward``, the batch's time on the model's threads (preprocess, predict, postprocess);
- ``encode``: the response encoding.

A request a worker forwards or scatters to a sibling carries its context in the ``traceparent``
header of the internal call, so the sibling's spans join the same trace. Sources: the OpenTelemetry
specification (SDK environment variables, span links for batches), Triton's trace-context
propagation.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # OpenTelemetry is imported only where tracing is on
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, SpanContext

#: The tracer's name in exported spans.
NAME = "scoring-server"


def configured(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the ``OTEL_*`` variables turn tracing on (module docstring)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def _exporter(name: str) -> SpanExporter:
    """The span exporter ``OTEL_TRACES_EXPORTER`` names.

    Raises:
        ValueError: an exporter or OTLP protocol this server does not ship.
    """
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    if name == "console":
        return ConsoleSpanExporter()
    if name != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER={name!r}: this server exports 'otlp' or 'console'")
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
    )
    if protocol != "http/protobuf":
        raise ValueError(f"OTLP protocol {protocol!r}: this server exports OTLP over http/protobuf")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


@dataclass(eq=False)
class RequestTrace:
    """One traced request in a serving unit: its span's context (what the batch links to) and
    its ``queue`` span, open until its first batch forms."""

    context: SpanContext
    queue: Span | None


@dataclass(eq=False)
class BatchTrace:
    """One batch's ``batch`` span, open until the batch has run."""

    tracing: Tracing
    span: Span

    def ran(self, compute_s: float, error: BaseException | None = None) -> None:
        """The batch's model time (``forward``, ``compute_s`` seconds ending now) and its end."""
        trace = self.tracing._trace
        end = time.time_ns()
        forward = self.tracing.tracer.start_span(
            "forward", context=trace.set_span_in_context(self.span), start_time=end - int(compute_s * 1e9)
        )
        if error is not None:
            forward.record_exception(error)
            forward.set_status(trace.Status(trace.StatusCode.ERROR, type(error).__name__))
        forward.end(end_time=end)
        self.span.end(end_time=end)


class Tracing:
    """This worker's tracer provider and the spans of the serving path (module docstring).

    Args:
        provider: the SDK tracer provider (its exporter and sampler configured).
    """

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry import propagate, trace

        self.provider = provider
        self.tracer = provider.get_tracer(NAME)
        self._trace = trace
        self._propagate = propagate

    @classmethod
    def from_environment(cls) -> Tracing:
        """A provider as the ``OTEL_*`` variables say, with the aiohttp-server instrumentation on
        (every ``web.Application`` made after this gets its server-span middleware).

        Raises:
            ValueError: an exporter or protocol this server does not ship.
        """
        from opentelemetry.instrumentation.aiohttp_server import AioHttpServerInstrumentor
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        exporter = _exporter(os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower())
        defaults: dict[str, str | int] = {"process.pid": os.getpid()}
        if not os.environ.get("OTEL_SERVICE_NAME"):
            defaults["service.name"] = NAME
        provider = TracerProvider(resource=Resource.create(defaults))
        provider.add_span_processor(BatchSpanProcessor(exporter))
        instrumentor = AioHttpServerInstrumentor()
        if not instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.instrument(tracer_provider=provider)
        return cls(provider)

    def grpc_interceptors(self) -> list[Any]:
        """The gRPC server interceptors that make a server span per call (from its metadata)."""
        from opentelemetry.instrumentation.grpc import aio_server_interceptor

        return [aio_server_interceptor(tracer_provider=self.provider)]  # type: ignore[no-untyped-call]

    def close(self) -> None:
        """Export what is left and stop (the app's cleanup)."""
        from opentelemetry.instrumentation.aiohttp_server import AioHttpServerInstrumentor

        self.provider.shutdown()
        AioHttpServerInstrumentor().uninstrument()

    # --- the request path -----------------------------------------------------------------------

    def tag(self, request_id: str) -> None:
        """Name the current (server) span's request."""
        self._trace.get_current_span().set_attribute("scoring.request_id", request_id)

    def cached(self, hits: int, items: int) -> None:
        """Mark the current (request) span: ``hits`` of its ``items`` came from the response
        cache."""
        span = self._trace.get_current_span()
        span.set_attribute("scoring.response_cache.hits", hits)
        span.set_attribute("scoring.response_cache.items", items)

    def queued(self) -> RequestTrace | None:
        """The current request entering a queue: its ``queue`` span opens (None when the request
        is not sampled)."""
        context = self._trace.get_current_span().get_span_context()
        if not context.is_valid or not context.trace_flags.sampled:
            return None
        return RequestTrace(context, self.tracer.start_span("queue"))

    def batch(self, requests: list[RequestTrace], items: int, request_count: int, cost: float) -> BatchTrace:
        """A batch formed: the ``queue`` spans of its traced requests (oldest first) close, and its
        ``batch`` span opens in the oldest one's trace, linked to all of them."""
        from opentelemetry.trace import Link

        for request in requests:
            if request.queue is not None:
                request.queue.end()
                request.queue = None
        trace = self._trace
        span = self.tracer.start_span(
            "batch",
            context=trace.set_span_in_context(trace.NonRecordingSpan(requests[0].context)),
            links=[Link(r.context) for r in requests],
            attributes={
                "scoring.batch.items": items,
                "scoring.batch.requests": request_count,
                "scoring.batch.cost": cost,
            },
        )
        return BatchTrace(self, span)

    def encoding(self) -> Any:
        """A context manager: the ``encode`` span of the current request."""
        return self.tracer.start_as_current_span("encode")

    def carrier(self) -> tuple[tuple[str, str], ...]:
        """The current context as W3C header pairs (``traceparent``, ``tracestate``): what a
        request's context (``app.serving.context.RequestContext.trace``) carries to a sibling."""
        headers: dict[str, str] = {}
        self._propagate.inject(headers)
        return tuple(headers.items())


def setup() -> Tracing | None:
    """This worker's tracing, or None when the ``OTEL_*`` variables configure none."""
    return Tracing.from_environment() if configured() else None

