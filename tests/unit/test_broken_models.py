"""One broken model never takes down what others are using: a repository with a good model
beside models broken in every way an operator can break one serves the good one, and reports
each broken one as unavailable with its reason (no absolute paths), in process. Under gunicorn,
where no worker restarts: tests/e2e/test_broken_models.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.http.state import CORE
from app.serving import lifecycle
from app.serving.registry import ModelState
from tests.support.fixtures import Client, MakeClient, eventually, settled_readiness
from tests.support.toy_models import (
    ScaleHandler,
    assert_no_absolute_paths,
    write_broken_models,
    write_scale_model,
)

V2 = "/v2/models/{}/infer"
BODY = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1.0, 2.0]}]}


async def test_a_repository_with_broken_models_serves_the_good_one(
    make_client: MakeClient, tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    write_scale_model(repo, "good")
    expected = write_broken_models(repo)
    client: Client = await make_client(repo, wait=False, strict_readiness=False)
    ready = await settled_readiness(client)
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


async def test_readiness_is_strict_by_default_and_needs_every_model(
    make_client: MakeClient, tmp_path: Path
) -> None:
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


async def test_a_load_refused_on_the_models_own_files_is_tried_again_only_once_they_change(
    make_client: MakeClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model whose handler refuses its config (a ValueError, as for labels that do not fit the
    outputs or a tokenizer without a pad token) fails the same way at every load: beside a model
    whose load fails on something that may pass (retried with the back-off), it is not loaded
    again while its files stay as they are; once its model.toml changes it is read again and
    loads."""
    monkeypatch.setattr(lifecycle, "FIRST_RETRY_S", 0.02)
    repo = tmp_path / "repo"
    marker = tmp_path / "transient-cause"
    marker.touch()
    write_scale_model(repo, "refused", refuse="labels do not fit the outputs")
    write_scale_model(repo, "flaky", fail_load_if_exists=str(marker))
    for name in ("refused", "flaky"):
        ScaleHandler.LOADS.pop(name, None)
    client: Client = await make_client(repo, wait=False, model_load_retry_max_s=0.05)
    registry = client.app[CORE].registry
    await eventually(lambda: ScaleHandler.LOADS.get("flaky", 0) >= 4, 60)
    refused = registry.get("refused")
    assert ScaleHandler.LOADS["refused"] == 1
    assert refused.state == ModelState.UNAVAILABLE and "labels do not fit the outputs" in (
        refused.error or ""
    )
    write_scale_model(repo, "refused")  # the operator mends its model.toml
    await eventually(lambda: registry.get("refused").ready, 60)
    assert ScaleHandler.LOADS["refused"] == 2


async def test_requests_for_an_unavailable_model_are_counted_under_its_name(
    make_client: MakeClient, tmp_path: Path
) -> None:
    """Whether the path or the body names it, a request for a model of the repository that
    cannot serve (a failed load, an unreadable model.toml) counts under that model's name in the
    request metrics; one for a model nobody knows, under ""."""
    repo = tmp_path / "repo"
    write_scale_model(repo, "good")
    write_scale_model(repo, "refused", refuse="labels do not fit the outputs")
    write_broken_models(repo)  # "syntax": a model.toml that cannot be read
    client: Client = await make_client(repo, wait=False, strict_readiness=False)
    await eventually(lambda: _settled(client), 60)
    assert (await client.post(V2.format("refused"), json=BODY)).status == 503
    assert (await client.post(V2.format("syntax"), json=BODY)).status == 503
    assert (await client.post("/v1/embeddings", json={"model": "refused", "input": "a"})).status == 503
    assert (await client.post("/v1/embeddings", json={"model": "nobody", "input": "a"})).status == 404
    text = await (await client.get("/metrics")).text()
    counted = {
        (labels["model"], labels["version"], labels["protocol"], labels["code"]): value
        for labels, value in _samples(text, "scoring_requests_total")
    }
    assert counted[("refused", "1", "v2", "503")] == 1
    assert counted[("syntax", "", "v2", "503")] == 1
    assert counted[("refused", "1", "openai", "503")] == 1
    assert counted[("", "", "openai", "404")] == 1


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples of ``name`` in a Prometheus text exposition: (labels, value) each."""
    out = []
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1 :].rsplit("} ", 1)
            pairs = (pair.split("=", 1) for pair in labels.split('",') if pair)
            out.append(({k: v.strip('"') for k, v in pairs}, float(value)))
    return out
