"""Model control in one worker (app.serving.control): version policies, load, reload, unload,
a broken version, the modes, polling; in process, with the toy scale model (y = factor * x)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

from app.errors import ModelLoadError
from app.http.state import CORE
from app.models.repository import Scan, VersionPolicy, read_config, serving
from tests.support.fixtures import Client, MakeClient, eventually
from tests.support.toy_models import write_scale_model

LOAD, UNLOAD = "/v2/repository/models/scale/load", "/v2/repository/models/scale/unload"


def v2(x: float = 1.0, version: str | None = None) -> tuple[str, dict[str, Any]]:
    path = "/v2/models/scale" + (f"/versions/{version}" if version else "") + "/infer"
    return path, {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [x, x]}]}


async def infer(client: Client, version: str | None = None) -> tuple[int, Any]:
    path, body = v2(1.0, version)
    resp = await client.post(path, json=body)
    return resp.status, await resp.json()


async def index(client: Client) -> list[tuple[str, str, str]]:
    rows = await (await client.post("/v2/repository/index")).json()
    return [(r["name"], r["version"], r["state"]) for r in rows]


def test_version_policies_select_what_serves(tmp_path: Path) -> None:
    assert VersionPolicy(latest=1).select(["1", "10", "2"]) == ["10"]
    assert VersionPolicy(latest=2).select(["1", "10", "2"]) == ["2", "10"]
    assert VersionPolicy(specific=["1", "3"]).select(["1", "2", "3"]) == ["1", "3"]
    assert VersionPolicy(all=True).select(["2", "1"]) == ["1", "2"]
    for folder, version in (("v1", "1"), ("v2", "2"), ("v3", "3")):
        write_scale_model(tmp_path, "scale", version=version, folder_name=folder)
    configs = [read_config(tmp_path / f) for f in ("v1", "v2", "v3")]
    assert [c.version for c in serving(Scan(configs, [])).configs] == ["3"]  # the default: latest 1
    toml = tmp_path / "v3" / "model.toml"  # the highest version's policy rules
    toml.write_text("version_policy = { latest = 2 }\n" + toml.read_text())
    configs = [read_config(tmp_path / f) for f in ("v1", "v2", "v3")]
    assert [c.version for c in serving(Scan(configs, [])).configs] == ["2", "3"]
    toml.write_text(toml.read_text().replace("{ latest = 2 }", "{ latest = 2, all = true }"))
    with pytest.raises(ModelLoadError, match="exactly one of"):
        read_config(tmp_path / "v3")


async def test_explicit_load_swaps_a_new_version_in_and_the_old_one_out(
    make_client: MakeClient, tmp_path: Path
) -> None:
    write_scale_model(tmp_path, "scale", version="1", folder_name="scale-1", factor=2)
    client: Client = await make_client(tmp_path, model_control_mode="explicit")
    assert (await infer(client))[1]["outputs"][0]["data"] == [2.0, 2.0]
    write_scale_model(tmp_path, "scale", version="2", folder_name="scale-2", factor=3)
    resp = await client.post(LOAD, json={})
    assert resp.status == 200, await resp.text()
    status, body = await infer(client)
    assert status == 200 and body["model_version"] == "2" and body["outputs"][0]["data"] == [3.0, 3.0]
    assert await index(client) == [("scale", "2", "READY")]
    assert (await infer(client, "1"))[0] == 404
    # the same version with changed files: reloaded beside the old copy
    write_scale_model(tmp_path, "scale", version="2", folder_name="scale-2", factor=5)
    assert (await client.post(LOAD)).status == 200
    assert (await infer(client))[1]["outputs"][0]["data"] == [5.0, 5.0]
    # nothing changed: nothing reloads
    unit = client.app[CORE].registry.get("scale").unit
    assert (await client.post(LOAD)).status == 200
    assert client.app[CORE].registry.get("scale").unit is unit


async def test_unload_then_load_again(make_client: MakeClient, tmp_path: Path) -> None:
    write_scale_model(tmp_path, "scale")
    write_scale_model(tmp_path, "other")
    client: Client = await make_client(tmp_path, model_control_mode="explicit")
    assert (await client.post(UNLOAD)).status == 200
    status, body = await infer(client)
    assert status == 404 and "not loaded (unloaded)" in body["error"]
    assert ("scale", "", "UNAVAILABLE") in await index(client)
    assert (await client.post("/v2/models/other/infer", json=v2()[1])).status == 200
    assert (await client.post(UNLOAD)).status == 200  # unloading an unloaded model: nothing to do
    assert (await client.post(LOAD)).status == 200
    assert (await infer(client))[0] == 200
    resp = await client.post("/v2/repository/models/nowhere/load")
    assert resp.status == 400 and "in no folder of the repository" in (await resp.json())["error"]


async def test_a_broken_new_version_leaves_the_old_one_serving(
    make_client: MakeClient, tmp_path: Path
) -> None:
    write_scale_model(tmp_path, "scale", version="2", folder_name="scale-2")
    client: Client = await make_client(tmp_path, model_control_mode="explicit")
    marker = tmp_path / "broken"
    marker.touch()
    write_scale_model(tmp_path, "scale", version="3", folder_name="scale-3", fail_load_if_exists=str(marker))
    resp = await client.post(LOAD)
    error = (await resp.json())["error"]
    assert resp.status == 400 and "version 3" in error and "simulated load failure" in error
    status, body = await infer(client)
    assert status == 200 and body["model_version"] == "2"
    rows = await (await client.post("/v2/repository/index")).json()
    v3 = next(r for r in rows if r["version"] == "3")
    assert v3["state"] == "UNAVAILABLE" and "simulated load failure" in v3["reason"]
    assert str(tmp_path) not in v3["reason"]  # no absolute paths
    marker.unlink()  # fixed: the next load takes v3 and lets v2 go
    assert (await client.post(LOAD)).status == 200
    assert await index(client) == [("scale", "3", "READY")]


async def test_out_of_memory_during_a_load_is_a_failed_load_not_a_dead_worker(
    make_client: MakeClient, tmp_path: Path
) -> None:
    """A new version that runs out of device memory while loading fails that load: the old
    version keeps serving, the index and the call's answer give the reason."""
    write_scale_model(tmp_path, "scale", version="2", folder_name="scale-2")
    client: Client = await make_client(tmp_path, model_control_mode="explicit")
    write_scale_model(tmp_path, "scale", version="3", folder_name="scale-3", oom_on_load="yes")
    resp = await client.post(LOAD)
    error = (await resp.json())["error"]
    assert resp.status == 400 and "version 3" in error and "OutOfMemoryError" in error
    status, body = await infer(client)
    assert status == 200 and body["model_version"] == "2"
    rows = await (await client.post("/v2/repository/index")).json()
    v3 = next(r for r in rows if r["version"] == "3")
    assert v3["state"] == "UNAVAILABLE" and "out of memory" in v3["reason"]


async def test_a_new_version_whose_model_toml_fails_validation_fails_the_call(
    make_client: MakeClient, tmp_path: Path
) -> None:
    """A new version folder whose ``model.toml`` declares the model but fails validation: the
    load answers 400 with the reason, the index shows it, and version 2 keeps serving."""
    write_scale_model(tmp_path, "scale", version="2", folder_name="scale-2")
    client: Client = await make_client(tmp_path, model_control_mode="explicit")
    toml = write_scale_model(tmp_path, "scale", version="3", folder_name="scale-3") / "model.toml"
    toml.write_text(toml.read_text().replace("max_batch_size = 8", "max_batch_size = -1"))
    resp = await client.post(LOAD)
    error = (await resp.json())["error"]
    assert resp.status == 400 and "scale-3/model.toml" in error and "max_batch_size" in error
    assert str(tmp_path) not in error
    status, body = await infer(client)
    assert status == 200 and body["model_version"] == "2"
    assert ("scale", "2", "READY") in await index(client) and ("scale", "", "UNAVAILABLE") in await index(client)
    toml.write_text(toml.read_text().replace("max_batch_size = -1", "max_batch_size = 8"))
    assert (await client.post(LOAD)).status == 200  # fixed: v3 serves
    assert await index(client) == [("scale", "3", "READY")]


@pytest.mark.parametrize("mode", ["none", "poll"])
async def test_the_api_is_refused_outside_explicit_mode(
    make_client: MakeClient, tmp_path: Path, mode: str
) -> None:
    write_scale_model(tmp_path, "scale")
    client: Client = await make_client(tmp_path, model_control_mode=mode)
    for path in (LOAD, UNLOAD):
        resp = await client.post(path)
        assert resp.status == 400 and f"model control mode is '{mode}'" in (await resp.json())["error"]
    assert (await infer(client))[0] == 200


async def test_poll_mode_loads_new_versions_and_unloads_removed_models(
    make_client: MakeClient, tmp_path: Path
) -> None:
    write_scale_model(tmp_path, "scale", version="1", folder_name="scale-1")
    client: Client = await make_client(tmp_path, model_control_mode="poll", repository_poll_s=0.05)
    write_scale_model(tmp_path, "scale", version="2", folder_name="scale-2", factor=4)
    await eventually(lambda: client.app[CORE].registry.get("scale").config.version == "2")
    status, body = await infer(client)
    assert status == 200 and body["outputs"][0]["data"] == [4.0, 4.0]
    await eventually(lambda: "1" not in client.app[CORE].registry.versions["scale"])
    shutil.rmtree(tmp_path / "scale-1")
    shutil.rmtree(tmp_path / "scale-2")
    write_scale_model(tmp_path, "other")
    await eventually(
        lambda: "scale" in client.app[CORE].registry.unloaded and "other" in client.app[CORE].registry.versions
    )
    assert (await infer(client))[0] == 404


async def test_poll_mode_forgets_a_broken_folder_once_it_is_removed(make_client: MakeClient, tmp_path: Path) -> None:
    """A model.toml that cannot be read keeps strict readiness at 503; removing its folder from
    the repository is noticed by the poll, and the server turns ready."""
    write_scale_model(tmp_path, "scale")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "model.toml").write_text("name = \n")
    client: Client = await make_client(tmp_path, wait=False, model_control_mode="poll", repository_poll_s=0.05)
    await eventually(lambda: all(e.ready for e in client.app[CORE].registry.entries()) or None)
    assert "broken" in client.app[CORE].registry.unavailable
    assert (await client.get("/v2/health/ready")).status == 503
    shutil.rmtree(tmp_path / "broken")
    await eventually(lambda: "broken" not in client.app[CORE].registry.unavailable)
    assert (await client.get("/v2/health/ready")).status == 200


async def test_a_failed_new_version_beside_a_serving_one_keeps_strict_readiness(
    make_client: MakeClient, tmp_path: Path
) -> None:
    """Strict readiness (the default) asks that every model serves: a new version that fails to
    load while the old one serves does not take the pod out of its Service (every pod would
    leave at once, since the load goes to all of them); a model with no serving version does."""
    write_scale_model(tmp_path, "scale", version="1", folder_name="scale-1")
    client: Client = await make_client(tmp_path, model_control_mode="explicit")
    marker = tmp_path / "break"
    marker.touch()
    write_scale_model(tmp_path, "scale", version="2", folder_name="scale-2", fail_load_if_exists=str(marker))
    assert (await client.post(LOAD)).status == 400
    assert client.app[CORE].registry.versions["scale"]["2"].error is not None
    assert (await client.get("/v2/health/ready")).status == 200
    status, body = await infer(client)
    assert status == 200 and body["model_version"] == "1"


async def test_requests_queued_on_the_old_copy_finish_there(make_client: MakeClient, tmp_path: Path) -> None:
    """A reload swaps units: a request already queued on the old one is answered by it (the old
    factor), the ones after the swap by the new."""
    write_scale_model(tmp_path, "scale", version="1", folder_name="scale-1", factor=2, delay_ms=300)
    client: Client = await make_client(tmp_path, model_control_mode="explicit", max_request_timeout_ms=30_000)
    path, body = v2()
    first = asyncio.create_task(client.post(path, json=body))
    old = client.app[CORE].registry.get("scale").unit
    assert old is not None
    await eventually(lambda: old.running_batch is not None)
    write_scale_model(tmp_path, "scale", version="1", folder_name="scale-1", factor=7)
    assert (await client.post(LOAD)).status == 200
    assert (await (await first).json())["outputs"][0]["data"] == [2.0, 2.0]
    assert (await infer(client))[1]["outputs"][0]["data"] == [7.0, 7.0]
    assert client.app[CORE].control.mode == "explicit"
