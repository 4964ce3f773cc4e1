"""The server's source files one inference request runs through, from the accept to the answer,
and how often it goes back to a file it had already left.

Starts gunicorn (2 workers, the demo feed-ranker and all-MiniLM-L6-v2) under
``benchmarks/request_path_conf.py``, which records every call each worker makes in a file under
``app/`` or ``gpu_stat/`` while recording is on (the workers' periodic tasks left out), and per
thread the order in which it entered those files. After warm-up requests, for each path it turns
recording on in every worker, sends ONE request on a new connection (a V2 JSON POST of one
feed-ranker item with its user's features; a gRPC ModelInfer of it on a new channel; a
``/v1/embeddings`` POST of one
short text to MiniLM), turns recording off and prints, in every worker together: the files, the
moves between files (a thread's call into a function of another file than its last call's) and
the **returns** (moves into a file that thread had already entered before), then the functions
of each file that ran.

    python -m benchmarks.request_path [--out path.json] [--table]

``--table`` prints the Markdown table of docs/architecture.md (*One request, file by file*)
instead. Traffic goes only to 127.0.0.1.
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

from app.models.repository import read_config
from benchmarks import payloads, server
from benchmarks.driver import HOST, poll

CONFIG = Path(__file__).with_name("request_path_conf.py")
#: One feed-ranker item (32 features) as a V2 JSON body.
#: The feed-ranker's inputs, every one it declares (its user's features too, optional): a request
#: that leaves an optional input out also runs the filling of it.
RANKER_INPUTS = read_config(server.DEMO_REPOSITORY / server.RANKER).inputs
#: One feed-ranker item (32 features) and its user's (32) as a V2 JSON body.
ITEM = payloads.v2_json(payloads.tensors(RANKER_INPUTS, 1, random.Random(0)))


def _signal_all(srv: Any, out: Path, suffix: str) -> None:
    pids = [w.pid for w in srv.workers()]
    for pid in pids:
        (out / f"{pid}{suffix}").unlink(missing_ok=True)
        os.kill(pid, signal.SIGUSR2)
    poll(lambda: all((out / f"{pid}{suffix}").exists() for pid in pids), 10, f"{suffix} from every worker")


def moves(paths: list[list[str]]) -> tuple[int, int]:
    """(moves, returns) of the threads' ``paths`` (each the files one thread entered, in order,
    no file twice in a row): every step is a move; a return is a step into a file that thread
    had been in before."""
    total = back = 0
    for path in paths:
        seen: set[str] = set()
        for i, name in enumerate(path):
            if i:
                total += 1
                back += name in seen
            seen.add(name)
    return total, back


def record(srv: Any, out: Path, request: Callable[[], None]) -> dict[str, Any]:
    """What ran in any worker while ``request()`` ran (module docstring): ``files`` (file ->
    its functions that ran), ``moves`` and ``returns`` (:func:`moves`)."""
    _signal_all(srv, out, ".recording")
    request()
    _signal_all(srv, out, ".json")
    files: dict[str, set[str]] = {}
    paths: list[list[str]] = []
    for dump in out.glob("*.json"):
        recorded = json.loads(dump.read_text())
        for filename, function in recorded["functions"]:
            files.setdefault(filename, set()).add(function)
        paths += recorded["paths"]
        dump.unlink()
    total, back = moves(paths)
    functions = {name: sorted(found) for name, found in sorted(files.items())}
    return {"files": functions, "moves": total, "returns": back, "paths": paths}


def post(port: int, path: str, body: bytes) -> None:
    """One JSON POST of ``body`` to ``path`` on a new connection; it must answer 200."""
    connection = http.client.HTTPConnection(HOST, port, timeout=30)
    try:
        connection.request("POST", path, body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        response.read()
        assert response.status == 200, response.status
    finally:
        connection.close()


def http_request(port: int) -> None:
    """One V2 JSON inference on a new connection."""
    post(port, f"/v2/models/{server.RANKER}/infer", ITEM)


def embeddings_request(port: int) -> None:
    """One ``/v1/embeddings`` of one short text to MiniLM, on a new connection."""
    body = json.dumps({"model": server.MINILM, "input": "A man is eating food."}).encode()
    post(port, "/v1/embeddings", body)


def grpc_request(target: str) -> None:
    """One ModelInfer on a new gRPC channel."""
    import grpc

    from app.grpc.generated import grpc_service_pb2_grpc as pb_grpc

    tensors = payloads.tensors(RANKER_INPUTS, 1, random.Random(0))
    message = payloads.grpc_request(server.RANKER, tensors)
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        stub.ModelInfer(message, timeout=30)


#: The paths measured: name -> what the request is (the table's first column).
PATHS = {
    "http": "V2 HTTP JSON, one feed-ranker item",
    "grpc": "KServe V2 gRPC ModelInfer, one feed-ranker item",
    "embeddings": "`/v1/embeddings`, one short text to all-MiniLM-L6-v2",
}


def measure() -> dict[str, dict[str, Any]]:
    """Per path (:data:`PATHS`): what :func:`record` returns for one request."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "path"
        out.mkdir()
        env = {"REQUEST_PATH_OUT": str(out)}
        models = f"{server.RANKER},{server.MINILM}"
        with server.start(Path(tmp), server.DEMO_REPOSITORY, models, 2, env, config=CONFIG) as srv:
            srv.wait_ready(300, count=2)
            for _ in range(8):  # every worker warm, on every path
                http_request(srv.port)
                grpc_request(srv.grpc_url)
                embeddings_request(srv.port)
            return {
                "http": record(srv, out, lambda: http_request(srv.port)),
                "grpc": record(srv, out, lambda: grpc_request(srv.grpc_url)),
                "embeddings": record(srv, out, lambda: embeddings_request(srv.port)),
            }


def table(paths: dict[str, dict[str, Any]]) -> str:
    """The Markdown table of docs/architecture.md: per path, its files, moves and returns."""
    rows = ["| request | files | moves between files | returns to a file already left |",
            "| --- | --- | --- | --- |"]  # fmt: skip
    for name, found in paths.items():
        rows.append(f"| {PATHS[name]} | {len(found['files'])} | {found['moves']} | {found['returns']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="JSON file for the file lists")
    parser.add_argument("--table", action="store_true", help="print docs/architecture.md's table only")
    args = parser.parse_args(argv)
    paths = measure()
    if args.table:
        print(table(paths))
    else:
        for name, found in paths.items():
            files = found["files"]
            print(f"{name}: {len(files)} files, {sum(map(len, files.values()))} functions, "
                  f"{found['moves']} moves between files, {found['returns']} of them returns")  # fmt: skip
            for filename, functions in files.items():
                print(f"  {filename}: {', '.join(functions)}")
    if args.out is not None:
        args.out.write_text(json.dumps(paths, indent=1) + "\n")


if __name__ == "__main__":
    main()
