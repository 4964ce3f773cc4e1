"""The ceiling of grpcio's asyncio server on this machine: a no-op KServe V2 gRPC server, driven
by perf_analyzer exactly as :mod:`benchmarks.protocols` drives the real one.

The no-op server is one process with one ``grpc.aio`` server serving ``GRPCInferenceService``
from the project's generated stubs; ModelInfer returns a fixed response (8 FP32 scores as
``raw_output_contents``) without reading its request. Whatever items/s it reaches is what
grpcio itself allows one worker process, with no decoding, batching or model: the real
server's gRPC figures are read against it (docs/benchmarks.md, *Protocols*).

    python -m benchmarks.grpc_ceiling --out docs/benchmarks/grpc-ceiling-cpu.json

Traffic goes only to 127.0.0.1; every perf_analyzer run is bounded (``--timeout``), and the
no-op server is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks import report
from benchmarks.driver import HOST, free_port, poll
from benchmarks.protocols import PERF_ANALYZER, perf_analyzer_options, rows_table, run_level
from tests.support.gunicorn import ROOT

MODEL = "feed-ranker"


async def serve(port: int, items: int) -> None:
    """Serve the no-op GRPCInferenceService on 127.0.0.1:``port`` until killed. ModelInfer
    answers ``items`` FP32 scores; the metadata and config RPCs answer what perf_analyzer
    reads (the feed-ranker's: FP32 ``features`` [32] in, ``click_probability`` [1] out)."""
    import grpc

    from app.grpc.generated import grpc_service_pb2 as pb
    from app.grpc.generated import grpc_service_pb2_grpc as pb_grpc

    reply = pb.ModelInferResponse(model_name=MODEL, model_version="1")
    out = reply.outputs.add(name="click_probability", datatype="FP32")
    out.shape.extend([items, 1])
    reply.raw_output_contents.append(struct.pack(f"<{items}f", *([0.5] * items)))
    metadata = pb.ModelMetadataResponse(name=MODEL, versions=["1"], platform="pytorch_libtorch")
    metadata.inputs.add(name="features", datatype="FP32", shape=[-1, 32])
    metadata.outputs.add(name="click_probability", datatype="FP32", shape=[-1, 1])
    config = pb.ModelConfigResponse()
    config.config.name, config.config.max_batch_size = MODEL, 256
    config.config.input.add(name="features", data_type=pb.TYPE_FP32, dims=[32])
    config.config.output.add(name="click_probability", data_type=pb.TYPE_FP32, dims=[1])

    class NoOp(pb_grpc.GRPCInferenceServiceServicer):
        async def ServerLive(self, request: Any, context: Any) -> Any:
            return pb.ServerLiveResponse(live=True)

        async def ServerReady(self, request: Any, context: Any) -> Any:
            return pb.ServerReadyResponse(ready=True)

        async def ModelReady(self, request: Any, context: Any) -> Any:
            return pb.ModelReadyResponse(ready=True)

        async def ServerMetadata(self, request: Any, context: Any) -> Any:
            return pb.ServerMetadataResponse(name="no-op", version="0")

        async def ModelMetadata(self, request: Any, context: Any) -> Any:
            return metadata

        async def ModelConfig(self, request: Any, context: Any) -> Any:
            return config

        async def ModelInfer(self, request: Any, context: Any) -> Any:
            return reply

    server = grpc.aio.server()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(NoOp(), server)  # type: ignore[no-untyped-call]
    server.add_insecure_port(f"{HOST}:{port}")
    await server.start()
    await server.wait_for_termination()


def listening(port: int) -> bool:
    """True once something accepts TCP connections on 127.0.0.1:``port``."""
    try:
        socket.create_connection((HOST, port), timeout=1).close()
    except OSError:
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    """Parse arguments; serve (``--serve``) or start the no-op server and measure it."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    perf_analyzer_options(parser, stability=999.0)
    parser.add_argument("--serve", type=int, metavar="PORT", help="run the no-op server on PORT (internal)")
    parser.add_argument("--out", type=Path, help="JSON file for the results")
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(serve(args.serve, args.items))
        return

    subprocess.run([str(PERF_ANALYZER), "--setup"], check=True, stdout=subprocess.DEVNULL)
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.grpc_ceiling", "--serve", str(port), "--items", str(args.items)]
    url = f"{HOST}:{port}"
    rows = []
    with subprocess.Popen(cmd, cwd=ROOT) as proc:
        try:
            poll(lambda: listening(port), timeout_s=60, what=f"no-op gRPC server on {url}")
            for c in args.concurrency:
                row = run_level(url, "grpc", MODEL, c, args)
                print(f"no-op grpc.aio: {row}", flush=True)
                rows.append(row)
        finally:
            proc.kill()
    result = report.record(
        what="no-op grpc.aio KServe V2 server, one process (python -m benchmarks.grpc_ceiling)",
        items_per_request=args.items, interval_ms=args.interval_ms, rows=rows,
    )  # fmt: skip
    print(rows_table({"grpc (no-op server)": rows}))
    report.write_json(args.out, result)


if __name__ == "__main__":
    main()
