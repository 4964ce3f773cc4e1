"""Hostile HTTP/2 peers against the gRPC service of a real gunicorn worker: rapid reset
(streams opened and cancelled at once) and streams opened and never finished, on a worker an
honest client shares; the stream cap per connection the server announces. Every attack is
bounded and on 127.0.0.1 (tests.support.h2_peer)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.support.gunicorn import Gunicorn
from tests.support.h2_peer import H2Peer
from tests.toy_models import write_scale_model

pytestmark = pytest.mark.e2e

INFER = "/inference.GRPCInferenceService/ModelInfer"


def honest_latencies(srv: Gunicorn, stop: threading.Event, out: list[float]) -> None:
    """An honest tritonclient.grpc client calling back to back until ``stop``: each call's
    seconds, or -1 for a call that failed."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(srv.grpc_url)
    x = grpcclient.InferInput("x", [1, 2], "FP32")
    x.set_data_from_numpy(np.ones((1, 2), dtype=np.float32))
    try:
        while not stop.is_set():
            start = time.perf_counter()
            try:
                result = client.infer("scale", [x], client_timeout=10)
                assert result.as_numpy("y").tolist() == [[2.0, 2.0]]
                out.append(time.perf_counter() - start)
            except Exception:
                out.append(-1.0)
    finally:
        client.close()


def serve(tmp_path: Path, **env: str) -> Gunicorn:
    repo = tmp_path / "repo"
    write_scale_model(repo, "scale", max_queue_delay_ms=0.0)
    return Gunicorn(tmp_path, {"SCORING_MODEL_REPOSITORY": str(repo), "SCORING_WORKERS": "1", **env})


def test_a_rapid_reset_flood_leaves_an_honest_client_served(tmp_path: Path) -> None:
    """Four connections open and cancel streams as fast as they can (CVE-2023-44487) on the
    worker an honest client uses: every honest call succeeds and its median stays low."""
    with serve(tmp_path) as srv:
        srv.wait_ready(60)
        stop, latencies = threading.Event(), list[float]()
        honest = threading.Thread(target=honest_latencies, args=(srv, stop, latencies))
        honest.start()
        peers = [H2Peer(srv.grpc_port, INFER) for _ in range(4)]
        try:
            attacks = [threading.Thread(target=p.rapid_reset, args=(1_000_000, 6.0)) for p in peers]
            for attack in attacks:
                attack.start()
            for attack in attacks:
                attack.join(30)
        finally:
            stop.set()
            honest.join(30)
            for peer in peers:
                peer.close()
        opened = sum(p.outcome.streams_opened for p in peers)
        ok = [s for s in latencies if s >= 0]
        assert len(ok) == len(latencies) > 20, (len(ok), len(latencies))
        p50 = float(np.percentile(ok, 50)) * 1000
        assert p50 < 50, f"honest p50 {p50:.1f} ms while {opened} streams were reset"
        assert srv.proc.poll() is None and len(srv.workers()) == 1


def test_streams_per_connection_are_capped(tmp_path: Path) -> None:
    """The server announces its cap on concurrent streams (SETTINGS_MAX_CONCURRENT_STREAMS);
    a peer that opens many more and never finishes them, on a connection that lets nothing
    be sent back (window 0), costs the worker no more than the cap, and an honest client on
    another connection is served."""
    with serve(tmp_path, SCORING_GRPC_MAX_CONCURRENT_STREAMS="50") as srv:
        srv.wait_ready(60)
        (worker,) = srv.workers()
        before = worker.memory_info().rss
        peer = H2Peer(srv.grpc_port, INFER, window=0)
        try:
            outcome = peer.open_and_hold(2_000, 2.0)
            stop, latencies = threading.Event(), list[float]()
            honest = threading.Thread(target=honest_latencies, args=(srv, stop, latencies))
            honest.start()
            time.sleep(1.0)  # a second of honest calls beside the held streams
            stop.set()
            honest.join(30)
            grown = worker.memory_info().rss - before
        finally:
            peer.close()
        assert outcome.max_concurrent_streams == 50, outcome
        assert latencies and all(s >= 0 for s in latencies), latencies
        assert grown < 64 * 1024 * 1024, f"worker grew {grown / 2**20:.0f} MiB"
