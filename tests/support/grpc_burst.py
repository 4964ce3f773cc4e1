"""A burst of gRPC calls from a process of its own, sent when the test says so.

``python -m tests.support.grpc_burst <port> <calls>`` opens ``calls`` channels to
``127.0.0.1:<port>`` (a connection each), prints ``ready`` once each has connected, waits for a
line on stdin, starts one ModelInfer of the scale toy model on every channel at once, prints
``sent``, and once every call has ended prints one JSON line: per call, its status code name and
whether the server answered it (its ``x-request-id`` trailer).
"""

from __future__ import annotations

import json
import sys

import grpc

from app.grpc.errors import REQUEST_ID_KEY
from app.grpc.generated import grpc_service_pb2_grpc as pb_grpc
from tests.support.messages import scale_request


def main(port: int, calls: int) -> None:
    channels = [
        grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(calls)
    ]
    for channel in channels:
        grpc.channel_ready_future(channel).result(timeout=30)
    print("ready", flush=True)
    sys.stdin.readline()
    stubs = [pb_grpc.GRPCInferenceServiceStub(channel) for channel in channels]
    futures = [stub.ModelInfer.future(scale_request([[1.0, 2.0]], [b"burst"]), timeout=30) for stub in stubs]
    print("sent", flush=True)
    ended = []
    for future in futures:
        trailer = dict(future.trailing_metadata() or ())  # waits for the call's end
        ended.append({"code": future.code().name, "served": REQUEST_ID_KEY in trailer})
    print(json.dumps(ended), flush=True)
    for channel in channels:
        channel.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
