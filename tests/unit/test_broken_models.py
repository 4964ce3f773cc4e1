"""One broken model never takes down what others are using: a repository with a good model
beside models broken in every way an operator can break one serves the good one, and reports
each broken one as unavailable with its reason (no absolute paths), in process. Under gunicorn,
where no worker restarts: tests/e2e/test_broken_models.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from app.http.state import CORE
from tests.support.fixtures import Client, MakeClient, eventually
from tests.support.toy_models import assert_no_absolute_paths, write_broken_models, write_scale_model

V2 = "/v2/models/{}/infer"
BODY = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1.0, 2.0]}]}


async def test_a_repository_with_broken_models_serves_the_good_one(make_client: MakeClient, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_scale_model(repo, "good")
    expected = write_broken_models(repo)
    client: Client = await make_client(repo, wait=False, strict_readiness=False)

    async def settled() -> dict[str, Any] | None:
        resp = await client.get("/v2/health/ready")
        body: dict[str, Any] = await resp.json()
        return body if resp.status == 200 else None

    ready = await eventually(settled, 60)
    assert ready["ready"] is True
    assert set(ready["unavailable"]) == set(expected), ready
    for name, reason in expected.items():
        assert reason in ready["unavailable"][name], (name, ready["unavailable"][name])
    assert_no_absolute_paths(json.dumps(ready), repo)

    good = await client.post(V2.format("good"), json=BODY)
    assert good.status == 200 and (await good.json())["outputs"][0]["data"] == [2.0, 4.0]
    assert (await client.get("/v2/models/good/ready")).status == 200
    for name in ("syntax", "no-import", "missing-weights", "twin"):
        resp = await client.post(V2.format(name), json=BODY)
        text = await resp.text()
        assert resp.status == 503 and "unavailable" in text, (name, resp.status, text)
        assert_no_absolute_paths(text, repo)

    index = await (await client.post("/v2/repository/index")).json()
    states = {(m["name"], m["version"]): m["state"] for m in index}
    assert states[("good", "1")] == "READY" and states[("no-import", "1")] == "UNAVAILABLE"
    assert states[("syntax", "")] == "UNAVAILABLE"
    assert_no_absolute_paths(json.dumps(index), repo)


async def test_readiness_is_strict_by_default_and_needs_every_model(make_client: MakeClient, tmp_path: Path) -> None:
    """Default settings (as deployed): a broken model keeps the server unready (Triton's
    --strict-readiness), while the good model serves."""
    repo = tmp_path / "repo"
    write_scale_model(repo, "good")
    write_broken_models(repo)
    client: Client = await make_client(repo, wait=False)
    assert client.app[CORE].registry.strict is True
    await eventually(lambda: _settled(client), 60)
    resp = await client.get("/v2/health/ready")
    assert resp.status == 503 and (await resp.json())["ready"] is False
    assert (await client.post(V2.format("good"), json=BODY)).status == 200


def _settled(client: Client) -> bool:
    registry = client.app[CORE].registry
    return all(e.ready or e.error is not None for e in registry.entries())
