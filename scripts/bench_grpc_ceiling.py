"""The ceiling of grpcio's asyncio server on this machine: a no-op KServe V2 gRPC server, driven
by perf_analyzer exactly as ``scripts/bench_protocols.py`` drives the real one.

The no-op server is one process with one ``grpc.aio`` server serving ``GRPCInferenceService``
from the project's generated stubs; ModelInfer returns a fixed response (8 FP32 scores as
``raw_output_contents``) without reading its request. Whatever items/s it reaches is what
grpcio itself allows one worker process, with no decoding, batching or model: the real
server's gRPC figures are read against it (docs/benchmarks.md, *Protocols*).

    python scripts/bench_grpc_ceiling.py --out docs/benchmarks/grpc-ceiling-cpu.json

Traffic goes only to 127.0.0.1; every perf_analyzer run is bounded (``--timeout``), and the
no-op server is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts import harness  # noqa: E402
from scripts.bench_protocols import PERF_ANALYZER, run_level  # noqa: E402

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
    server.add_insecure_port(f"{harness.HOST}:{port}")
    await server.start()
    await server.wait_for_termination()


def listening(port: int) -> bool:
    """True once something accepts TCP connections on 127.0.0.1:``port``."""
    try:
        socket.create_connection((harness.HOST, port), timeout=1).close()
    except OSError:
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    """Parse arguments; serve (``--serve``) or start the no-op server and measure it."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--items", type=int, default=8, help="items (rows) per request: perf_analyzer -b")
    parser.add_argument("--concurrency", default="1,8,64")
    parser.add_argument("--interval-ms", type=int, default=5000, help="perf_analyzer --measurement-interval")
    parser.add_argument("--stability", type=float, default=999.0, help="perf_analyzer --stability-percentage")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per perf_analyzer run")
    parser.add_argument("--serve", type=int, metavar="PORT", help="run the no-op server on PORT (internal)")
    parser.add_argument("--out", type=Path, help="JSON file for the results")
    parser.add_argument("--machine", default=f"{platform.node()} ({os.cpu_count()} CPUs, no GPU)")
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(serve(args.serve, args.items))
        return

    subprocess.run([str(PERF_ANALYZER), "--setup"], check=True, stdout=subprocess.DEVNULL)
    port = harness.free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, __file__, "--serve", str(port), "--items", str(args.items)]
    proc = subprocess.Popen(cmd, env=env)
    url = f"{harness.HOST}:{port}"
    rows = []
    try:
        harness.poll(lambda: listening(port), timeout_s=60, what=f"no-op gRPC server on {url}")
        for c in (int(c) for c in args.concurrency.split(",")):
            row = run_level(url, "grpc", MODEL, args.items, c, args)
            print(f"no-op grpc.aio: {row}", flush=True)
            rows.append(row)
    finally:
        proc.kill()
        proc.wait()
    result = {
        "what": "no-op grpc.aio KServe V2 server, one process (scripts/bench_grpc_ceiling.py)",
        "machine": args.machine,
        "items_per_request": args.items,
        "interval_ms": args.interval_ms,
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
