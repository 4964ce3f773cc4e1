"""Hostile HTTP/2 peers against the gRPC service of a real gunicorn worker: rapid reset
(streams opened and cancelled at once) and streams opened and never finished, on a worker an
honest client shares; the stream cap per connection the server announces. Every attack is
bounded and on 127.0.0.1 (tests.support.h2_peer)."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from tests.support.gunicorn import Gunicorn, wait_for
from tests.support.h2_peer import H2Peer, Outcome, flood
from tests.support.toy_models import write_scale_model

pytestmark = pytest.mark.e2e

INFER = "/inference.GRPCInferenceService/ModelInfer"


def honest_latencies(srv: Gunicorn, stop: threading.Event, out: list[tuple[float, float]]) -> None:
    """An honest gRPC client (grpcio, the server's own generated stubs: tritonclient's declare
    the same protobuf names and cannot share the pytest process) calling back to back until
    ``stop``: for each call, when it began (``time.time()``) and its seconds, or -1 where it
    failed."""
    import grpc

    from app.grpc.generated import grpc_service_pb2 as pb
    from app.grpc.generated import grpc_service_pb2_grpc as pb_grpc

    request = pb.ModelInferRequest(model_name="scale")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 2])
    request.raw_input_contents.append(np.ones((1, 2), dtype=np.float32).tobytes())
    with grpc.insecure_channel(srv.grpc_url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        while not stop.is_set():
            began, start = time.time(), time.perf_counter()
            try:
                reply = stub.ModelInfer(request, timeout=10)
                y = np.frombuffer(reply.raw_output_contents[0], dtype=np.float32)
                assert y.tolist() == [2.0, 2.0]
                out.append((began, time.perf_counter() - start))
            except (grpc.RpcError, AssertionError, IndexError):
                out.append((began, -1.0))


def serve(tmp_path: Path, **env: str) -> Gunicorn:
    repo = tmp_path / "repo"
    write_scale_model(repo, "scale", max_queue_delay_ms=0.0)
    return Gunicorn(tmp_path, {"SCORING_MODEL_REPOSITORY": str(repo), "SCORING_WORKERS": "1", **env})


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gunicorn]:
    """One server (the default stream cap) for the floods: each test checks that its flood
    left the worker serving, so the next one starts from a worker in the same state."""
    with serve(tmp_path_factory.mktemp("grpc-hostile")) as server:
        server.wait_ready(60)
        yield server


def floods_beside_honest(
    srv: Gunicorn, seconds: float, read: bool
) -> tuple[list[tuple[Outcome, float, float]], list[float]]:
    """Two rapid-reset peers (:func:`tests.support.h2_peer.flood`), each in a spawned process
    of its own for ``seconds``, beside an honest client: the peers' results and the seconds
    of each honest call that began while they ran (-1 where it failed)."""
    stop, calls = threading.Event(), list[tuple[float, float]]()
    honest = threading.Thread(target=honest_latencies, args=(srv, stop, calls))
    honest.start()
    spawn = multiprocessing.get_context("spawn")
    try:
        with ProcessPoolExecutor(2, mp_context=spawn) as pool:
            floods = [pool.submit(flood, srv.grpc_port, INFER, seconds, read) for _ in range(2)]
            results = [f.result(timeout=120) for f in floods]
    finally:
        stop.set()
        honest.join(30)
    began, ended = min(r[1] for r in results), max(r[2] for r in results)
    return results, [s for t, s in calls if began <= t <= ended]


def honest_calls_beside_floods(
    srv: Gunicorn, seconds: float, *, read: bool, at_least: int
) -> tuple[list[tuple[Outcome, float, float]], list[float], list[int]]:
    """:func:`floods_beside_honest`, checked: every honest call during the floods succeeded, more
    than ``at_least`` of them. Returns the floods' results, the honest calls' times (ms) and the
    streams each flood opened."""
    results, during = floods_beside_honest(srv, seconds, read=read)
    ok = [s for s in during if s >= 0]
    assert len(ok) == len(during) > at_least, (len(ok), len(during))
    return results, [s * 1000 for s in ok], [outcome.streams_opened for outcome, _, _ in results]


@pytest.mark.alone  # a latency bound: not beside other tests (tests/conftest.py)
def test_a_rapid_reset_flood_is_cut_off_and_an_honest_client_keeps_its_p99(srv: Gunicorn) -> None:
    """Two peers, each in a process of its own, open and cancel streams as fast as they can
    (CVE-2023-44487) without ever reading, on the worker an honest client uses: grpcio stops
    reading them, and each is disconnected once a PING of the server goes unanswered
    (``app.grpc.server.PING_TIMEOUT_MS``); every honest call meanwhile succeeds, p99 < 50 ms."""
    (worker,) = srv.workers()
    results, ok_ms, opened = honest_calls_beside_floods(srv, 9.0, read=False, at_least=50)
    p99 = float(np.percentile(ok_ms, 99))
    assert p99 < 50, f"honest p99 {p99:.1f} ms while the floods opened {opened} streams"
    for outcome, start, end in results:
        assert outcome.closed, outcome
        assert end - start < 8.5, f"cut off only after {end - start:.1f} s"  # the flood ran 9 s
    assert srv.proc.poll() is None and [w.pid for w in srv.workers()] == [worker.pid]


@pytest.mark.alone  # a latency bound: not beside other tests (tests/conftest.py)
def test_a_rapid_reset_peer_that_answers_pings_leaves_an_honest_client_served(srv: Gunicorn) -> None:
    """Two peers that read and answer the server's PINGs (so no timeout cuts them off), each in
    a process of its own, open and cancel streams as fast as they can on the worker an honest
    client uses: every honest call succeeds and its median stays far below what it was
    without the stream cap and the PING options (0.3–0.8 s)."""
    (worker,) = srv.workers()
    _, ok_ms, opened = honest_calls_beside_floods(srv, 6.0, read=True, at_least=20)
    p50 = float(np.percentile(ok_ms, 50))
    assert p50 < 100, f"honest p50 {p50:.1f} ms while the peers reset {opened} streams"
    assert srv.proc.poll() is None and [w.pid for w in srv.workers()] == [worker.pid]


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
            stop, calls = threading.Event(), list[tuple[float, float]]()
            honest = threading.Thread(target=honest_latencies, args=(srv, stop, calls))
            honest.start()
            wait_for(lambda: len(calls) >= 20 or None, 30, "20 honest calls beside the held streams", srv)
            stop.set()
            honest.join(30)
            grown = worker.memory_info().rss - before
        finally:
            peer.close()
        assert outcome.max_concurrent_streams == 50, outcome
        assert calls and all(s >= 0 for _, s in calls), calls
        assert grown < 64 * 1024 * 1024, f"worker grew {grown / 2**20:.0f} MiB"
