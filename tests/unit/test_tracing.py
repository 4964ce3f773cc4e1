"""Tracing (app.observability.tracing) in process: when the OTEL_* variables turn it on, and the
spans of one request (server span, queue, batch linked to its requests, forward, encode) through
an in-memory exporter; off, nothing of OpenTelemetry is imported."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from app.observability import tracing
from app.observability.tracing import Tracing, configured
from tests.support.fixtures import Client, MakeClient
from tests.support.gunicorn import ROOT
from tests.support.toy_models import write_scale_model

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


@pytest.mark.parametrize(
    ("environ", "on"),
    [
        ({}, False),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"}, False),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}, False),
    ],
)
def test_the_standard_variables_turn_tracing_on(environ: dict[str, str], on: bool) -> None:
    assert configured(environ) is on


def test_off_the_server_imports_nothing_of_opentelemetry() -> None:
    code = "import sys, app.main, app.serving.unit; print(any(m.startswith('opentelemetry') for m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


@pytest.fixture
def memory(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """Tracing on for apps made now, exporting to memory (the OTLP path: tests/e2e)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    def setup() -> Tracing:
        from opentelemetry.instrumentation.aiohttp_server import AioHttpServerInstrumentor

        AioHttpServerInstrumentor().instrument(tracer_provider=provider)
        return Tracing(provider)

    monkeypatch.setattr(tracing, "setup", setup)
    monkeypatch.setattr("app.main.setup_tracing", setup)
    yield exporter
    from opentelemetry.instrumentation.aiohttp_server import AioHttpServerInstrumentor

    if AioHttpServerInstrumentor().is_instrumented_by_opentelemetry:  # the app's cleanup does it
        AioHttpServerInstrumentor().uninstrument()


def by_name(spans: Any) -> dict[str, Any]:
    return {s.name: s for s in spans}


async def test_one_request_is_a_server_span_with_queue_batch_forward_and_encode(
    memory: InMemorySpanExporter, make_client: MakeClient, scale_repo: Path
) -> None:
    client: Client = await make_client(scale_repo)
    body = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1.0, 2.0]}]}
    headers = {"traceparent": TRACEPARENT, "X-Request-Id": "traced-1"}
    assert (await client.post("/v2/models/scale/infer", json=body, headers=headers)).status == 200
    spans = [s for s in memory.get_finished_spans() if f"{s.context.trace_id:032x}" == TRACE_ID]
    named = by_name(spans)
    server = next(s for s in spans if s.kind.name == "SERVER")
    assert {"queue", "batch", "forward", "encode"} <= set(named)
    assert server.parent is not None and f"{server.parent.span_id:016x}" == "00f067aa0ba902b7"  # continued
    assert server.attributes is not None and server.attributes["scoring.request_id"] == "traced-1"
    for child in ("queue", "encode"):
        assert named[child].parent.span_id == server.context.span_id
    batch = named["batch"]
    assert [link.context.span_id for link in batch.links] == [server.context.span_id]
    assert batch.attributes == {
        "scoring.batch.items": 1,
        "scoring.batch.requests": 1,
        "scoring.batch.cost": 1.0,
    }
    assert named["forward"].parent.span_id == batch.context.span_id
    assert named["forward"].end_time <= batch.end_time


async def test_a_batch_of_two_traced_requests_is_linked_from_both(
    memory: InMemorySpanExporter, make_client: MakeClient, tmp_path: Path
) -> None:
    write_scale_model(tmp_path, "scale", max_queue_delay_ms=200.0)  # both join one batch
    client: Client = await make_client(tmp_path)
    body = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1.0, 2.0]}]}
    other = "0af7651916cd43dd8448eb211c80319c"
    answers = await asyncio.gather(
        client.post("/v2/models/scale/infer", json=body, headers={"traceparent": TRACEPARENT}),
        client.post(
            "/v2/models/scale/infer", json=body, headers={"traceparent": f"00-{other}-b7ad6b7169203331-01"}
        ),
    )
    assert [a.status for a in answers] == [200, 200]
    batches = [s for s in memory.get_finished_spans() if s.name == "batch"]
    assert len(batches) == 1 and (batches[0].attributes or {}).get("scoring.batch.requests") == 2
    assert {f"{link.context.trace_id:032x}" for link in batches[0].links} == {TRACE_ID, other}


async def test_cached_items_are_marked_on_the_request_span_and_skip_the_queue(
    memory: InMemorySpanExporter, make_client: MakeClient, tmp_path: Path
) -> None:
    write_scale_model(tmp_path / "repo", "scale", response_cache=True)
    client: Client = await make_client(
        tmp_path / "repo", response_cache_path=tmp_path / "cache", response_cache_lookup_timeout_ms=60_000
    )  # a lookup bound no loaded machine reaches: a test of hits, not of timing
    body = {"inputs": [{"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [1.0, 1.0, 2.0, 2.0]}]}
    for attempt in ("computed", "cached"):
        memory.clear()
        answer = await client.post("/v2/models/scale/infer", json=body, headers={"traceparent": TRACEPARENT})
        assert answer.status == 200
        spans = [s for s in memory.get_finished_spans() if f"{s.context.trace_id:032x}" == TRACE_ID]
        server = next(s for s in spans if s.kind.name == "SERVER")
        hits = 0 if attempt == "computed" else 2
        attributes = server.attributes
        assert attributes is not None
        assert attributes["scoring.response_cache.hits"] == hits, attempt
        assert attributes["scoring.response_cache.items"] == 2
        assert ("batch" in by_name(spans)) == (attempt == "computed")
