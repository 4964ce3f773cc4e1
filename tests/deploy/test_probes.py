"""What the manifests' probes rely on (docs/deploy.md, *Kubernetes*, Probes): readiness and
liveness do not look at queues or admission, so a pod that refuses requests for overload
(503 + Retry-After) still answers both probes 200 and stays in its Service."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from aiohttp import ClientResponse

from tests.support.fixtures import Client, MakeClient, eventually
from tests.support.toy_models import ScaleHandler, write_scale_model

V2 = "/v2/models/scale/infer"


async def test_an_overloaded_pod_answers_its_probes(make_client: MakeClient, tmp_path: Path) -> None:
    gate = threading.Event()
    ScaleHandler.GATES["probes"] = gate
    write_scale_model(tmp_path, "scale", hang_on=7.0, hang_gate="probes")
    client: Client = await make_client(tmp_path, max_request_timeout_ms=200, hung_inference_s=0)
    stuck = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [7.0, 7.0]}]}
    one = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1.0, 2.0]}]}
    held = asyncio.create_task(client.post(V2, json=stuck))  # holds the inference thread
    try:
        async def refused_for_load() -> ClientResponse | None:  # the model is far behind its deadlines
            resp = await client.post(V2, json=one)
            return resp if resp.status == 503 else None

        refused = await eventually(refused_for_load, 10.0)
        assert int(refused.headers["Retry-After"]) >= 1
        assert "unavailable" not in await refused.text(), "refused for load, not a missing model"
        assert (await client.get("/v2/health/ready")).status == 200
        assert (await client.get("/v2/health/live")).status == 200
    finally:
        gate.set()
        (await held).release()
