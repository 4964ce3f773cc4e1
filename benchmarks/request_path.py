"""The server's source files one inference request runs through, from the accept to the answer.

Starts gunicorn (2 workers, the demo feed-ranker) under ``benchmarks/request_path_conf.py``,
which records every call each worker makes in a file under ``app/`` or ``gpu_stat/`` while
recording is on (the workers' periodic tasks left out). After warm-up requests, for each
protocol it turns recording on in every worker, sends ONE inference request on a new
connection (a V2 JSON POST of one feed-ranker item; a gRPC ModelInfer on a new channel), turns
recording off and prints the files (and functions) that ran, in every worker together: the
accept, the edge's checks, decoding, the data plane, the model version's queue and executor,
the model, encoding, the keep-alive policy.

    python -m benchmarks.request_path [--out path.json]

Traffic goes only to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import payloads, server
from benchmarks.driver import HOST, poll

CONFIG = Path(__file__).with_name("request_path_conf.py")
#: One feed-ranker item (32 features) as a V2 JSON body.
ITEM = payloads.v2_bodies(server.DEMO_REPOSITORY, server.RANKER, 1, 1)[0]


def _signal_all(srv: Any, out: Path, suffix: str) -> None:
    pids = [w.pid for w in srv.workers()]
    for pid in pids:
        (out / f"{pid}{suffix}").unlink(missing_ok=True)
        os.kill(pid, signal.SIGUSR2)
    poll(lambda: all((out / f"{pid}{suffix}").exists() for pid in pids), 10, f"{suffix} from every worker")


def record(srv: Any, out: Path, request: Callable[[], None]) -> dict[str, list[str]]:
    """Files -> functions that ran in any worker while ``request()`` ran (module docstring)."""
    _signal_all(srv, out, ".recording")
    request()
    _signal_all(srv, out, ".json")
    files: dict[str, set[str]] = {}
    for dump in out.glob("*.json"):
        for filename, function in json.loads(dump.read_text()):
            files.setdefault(filename, set()).add(function)
        dump.unlink()
    return {name: sorted(functions) for name, functions in sorted(files.items())}


def http_request(port: int) -> None:
    """One V2 JSON inference on a new connection."""
    connection = http.client.HTTPConnection(HOST, port, timeout=30)
    try:
        connection.request(
            "POST", f"/v2/models/{server.RANKER}/infer", ITEM, {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        response.read()
        assert response.status == 200, response.status
    finally:
        connection.close()


def grpc_request(target: str) -> None:
    """One ModelInfer on a new gRPC channel."""
    import grpc

    from app.grpc.generated import grpc_service_pb2_grpc as pb_grpc

    tensors = payloads.tensors(payloads.inputs_of(server.DEMO_REPOSITORY, server.RANKER), 1, random.Random(0))
    message = payloads.grpc_request(server.RANKER, tensors)
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        stub.ModelInfer(message, timeout=30)


def measure() -> dict[str, dict[str, list[str]]]:
    """Per protocol ("http", "grpc"): file -> the functions of it that ran for one request."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "path"
        out.mkdir()
        env = {"REQUEST_PATH_OUT": str(out)}
        with server.start(Path(tmp), server.DEMO_REPOSITORY, server.RANKER, 2, env, config=CONFIG) as srv:
            srv.wait_ready(300, count=2)
            for _ in range(8):  # every worker warm, on both protocols
                http_request(srv.port)
                grpc_request(srv.grpc_url)
            return {
                "http": record(srv, out, lambda: http_request(srv.port)),
                "grpc": record(srv, out, lambda: grpc_request(srv.grpc_url)),
            }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="JSON file for the file lists")
    args = parser.parse_args(argv)
    paths = measure()
    for protocol, files in paths.items():
        print(f"{protocol}: {len(files)} files, {sum(map(len, files.values()))} functions")
        for name, functions in files.items():
            print(f"  {name}: {', '.join(functions)}")
    if args.out is not None:
        args.out.write_text(json.dumps(paths, indent=1) + "\n")


if __name__ == "__main__":
    main()
