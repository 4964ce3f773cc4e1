"""Call a gRPC server with one stock client at its defaults; print what it got as JSON.

    python -m tests.support.grpc_clients {triton,triton-aio,kserve,kserve-typed} 127.0.0.1:8081 MODEL INPUTS.json
    python -m tests.support.grpc_clients triton-control-{load,unload,infer} 127.0.0.1:8081 MODEL {INPUTS.json,-}

``INPUTS.json``: ``{"name": {"datatype", "shape", "data"}}`` (BYTES data as strings). Prints
``{"live", "ready", "model_ready", "outputs": {name: {"shape", "data"}}, ...}``.

A separate process per client: tritonclient.grpc's and kserve's generated stubs declare the
same ``inference.*`` protobuf names in protobuf's default pool, so they cannot be imported in
one process (nor in the pytest process beside other tests that import either).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np


def arrays(inputs: dict[str, Any]) -> dict[str, tuple[str, np.ndarray]]:
    out = {}
    for name, spec in inputs.items():
        if spec["datatype"] == "BYTES":
            arr = np.array([s.encode() for s in spec["data"]], dtype=object).reshape(spec["shape"])
        else:
            arr = np.array(spec["data"], dtype=np.float32).reshape(spec["shape"])
        out[name] = (spec["datatype"], arr)
    return out


def as_json(outputs: dict[str, np.ndarray]) -> dict[str, Any]:
    return {n: {"shape": list(a.shape), "data": a.ravel().astype(float).tolist()} for n, a in outputs.items()}


def triton(url: str, model: str, inputs: dict[str, Any]) -> dict[str, Any]:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    tensors = []
    for name, (datatype, arr) in arrays(inputs).items():
        tensor = grpcclient.InferInput(name, list(arr.shape), datatype)
        tensor.set_data_from_numpy(arr)
        tensors.append(tensor)
    # A 60 s deadline (the longest the server grants): these calls are about answers, and a
    # model's own timeout_ms (5 s for MiniLM) can pass on a loaded 2-core machine.
    result = client.infer(model, tensors, request_id="triton-1", client_timeout=60)
    meta = client.get_model_metadata(model)
    config = client.get_model_config(model).config
    stats = client.get_inference_statistics(model)
    index = client.get_model_repository_index()
    response = result.get_response()
    return {
        "live": client.is_server_live(),
        "ready": client.is_server_ready(),
        "model_ready": client.is_model_ready(model),
        "id": response.id,
        "outputs": as_json({o.name: result.as_numpy(o.name) for o in response.outputs}),
        "metadata_inputs": [i.name for i in meta.inputs],
        "config_max_batch_size": config.max_batch_size,
        "stats_models": [s.name for s in stats.model_stats],
        "index": [m.name for m in index.models],
    }


async def triton_aio(url: str, model: str, inputs: dict[str, Any]) -> dict[str, Any]:
    import tritonclient.grpc.aio as grpcclient

    client = grpcclient.InferenceServerClient(url)
    try:
        tensors = []
        for name, (datatype, arr) in arrays(inputs).items():
            tensor = grpcclient.InferInput(name, list(arr.shape), datatype)
            tensor.set_data_from_numpy(arr)
            tensors.append(tensor)
        result = await client.infer(model, tensors)
        response = result.get_response()
        return {
            "live": await client.is_server_live(),
            "ready": await client.is_server_ready(),
            "model_ready": await client.is_model_ready(model),
            "outputs": as_json({o.name: result.as_numpy(o.name) for o in response.outputs}),
            "config_max_batch_size": (await client.get_model_config(model)).config.max_batch_size,
        }
    finally:
        await client.close()


async def kserve(url: str, model: str, inputs: dict[str, Any], typed: bool) -> dict[str, Any]:
    from kserve import InferenceGRPCClient, InferInput, InferRequest

    client = InferenceGRPCClient(url)
    try:
        tensors = []
        for name, (datatype, arr) in arrays(inputs).items():
            data: Any = arr
            if typed:  # a list: sent as typed contents
                data = [v.decode() if isinstance(v, bytes) else v for v in arr.ravel().tolist()]
            tensors.append(InferInput(name, list(arr.shape), datatype, data))
        response = await client.infer(InferRequest(model_name=model, infer_inputs=tensors, request_id="ks-1"))
        return {
            "live": await client.is_server_live(),
            "ready": await client.is_server_ready(),
            "model_ready": await client.is_model_ready(model),
            "id": response.id,
            "outputs": as_json({o.name: o.as_numpy() for o in response.outputs}),
        }
    finally:
        await client.close()


def triton_control(url: str, model: str, action: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """tritonclient.grpc's ``load_model`` / ``unload_model`` (``action``), or for ``infer`` the
    status of one inference: ``{"ok": true}`` or ``{"error", "status"}`` (the gRPC status name)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(url)
    try:
        if action == "load":
            client.load_model(model)
        elif action == "unload":
            client.unload_model(model)
        else:
            tensors = []
            for name, (datatype, arr) in arrays(inputs).items():
                tensor = grpcclient.InferInput(name, list(arr.shape), datatype)
                tensor.set_data_from_numpy(arr)
                tensors.append(tensor)
            client.infer(model, tensors)
    except InferenceServerException as exc:
        return {"error": exc.message(), "status": exc.status()}
    return {"ok": True}


def main() -> None:
    which, url, model, path = sys.argv[1:5]
    if which.startswith("triton-control-"):
        inputs = json.loads(Path(path).read_text()) if path != "-" else {}
        print(json.dumps(triton_control(url, model, which.removeprefix("triton-control-"), inputs)))
        return
    inputs = json.loads(Path(path).read_text())
    if which == "triton":
        got = triton(url, model, inputs)
    elif which == "triton-aio":
        got = asyncio.run(triton_aio(url, model, inputs))
    else:
        got = asyncio.run(kserve(url, model, inputs, typed=which == "kserve-typed"))
    print(json.dumps(got))


if __name__ == "__main__":
    main()
