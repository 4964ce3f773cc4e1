"""API keys: no key, wrong key, right key (both headers), open health probes, /metrics by
setting, rotation through the key file; the startup warning for an exposed address."""

from __future__ import annotations

import logging
import os
import runpy
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import ClientResponse
from pydantic import ValidationError

from app.http.state import CORE
from app.serving.auth import KEY_FILE_RECHECK_S, ApiKeys, read_key_file
from app.settings import Settings
from tests.support.fake_gpus import write_unavailable
from tests.support.fixtures import MakeClient
from tests.support.gunicorn import ROOT

V2 = "/v2/models/scale/infer"
BODY = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}


class FakeClock:
    """A monotonic clock that moves only when told (starts where the key file may be re-checked)."""

    def __init__(self) -> None:
        self.now = time.monotonic() + KEY_FILE_RECHECK_S

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


async def assert_unauthorized(resp: ClientResponse) -> None:
    assert resp.status == 401
    assert await resp.json() == {"error": "unauthorized"}
    assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    assert resp.headers["X-Request-Id"]


async def test_no_key_wrong_key_right_key(make_client: MakeClient, scale_repo: Path) -> None:
    client = await make_client(scale_repo, api_keys="k-one, k-two")
    await assert_unauthorized(await client.post(V2, json=BODY))
    await assert_unauthorized(await client.post(V2, json=BODY, headers={"Authorization": "Bearer k-three"}))
    await assert_unauthorized(await client.post(V2, json=BODY, headers={"X-API-Key": "k-on"}))
    await assert_unauthorized(await client.post(V2, json=BODY, headers={"Authorization": "Basic k-one"}))
    await assert_unauthorized(await client.get("/v2/models/scale"))
    await assert_unauthorized(await client.get("/v2/models/missing"))  # no hint that it is missing
    await assert_unauthorized(await client.get("/openapi.json"))
    for headers in (
        {"Authorization": "Bearer k-one"},
        {"authorization": "bearer k-two"},
        {"X-API-Key": "k-two"},
    ):
        resp = await client.post(V2, json=BODY, headers=headers)
        assert resp.status == 200, (headers, await resp.text())
    assert (await client.get("/v1/models", headers={"X-API-Key": "k-one"})).status == 200


async def test_health_is_open_and_metrics_follow_the_setting(make_client: MakeClient, scale_repo: Path) -> None:
    protected = await make_client(scale_repo, api_keys="secret")
    assert (await protected.get("/v2/health/live")).status == 200
    assert (await protected.get("/v2/health/ready")).status == 200
    await assert_unauthorized(await protected.get("/metrics"))
    assert (await protected.get("/metrics", headers={"X-API-Key": "secret"})).status == 200
    # What a Prometheus ServiceMonitor's bearer authorization sends.
    assert (await protected.get("/metrics", headers={"Authorization": "Bearer secret"})).status == 200
    scraped = await make_client(scale_repo, api_keys="secret", metrics_auth=False)
    assert (await scraped.get("/metrics")).status == 200
    await assert_unauthorized(await scraped.get("/v2"))


async def test_no_keys_means_no_auth(make_client: MakeClient, scale_repo: Path) -> None:
    client = await make_client(scale_repo)
    assert (await client.post(V2, json=BODY)).status == 200


async def test_keys_rotate_through_the_file_without_restart(
    make_client: MakeClient, scale_repo: Path, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# rotated monthly\nold-key\n\n  spare-key  # the spare\n")
    client = await make_client(scale_repo, api_keys_file=keys, api_keys="env-key")
    clock = FakeClock()
    served = client.app[CORE].keys
    assert served is not None
    served.clock = clock  # the file is looked at once per recheck_s at most
    for key in ("old-key", "spare-key", "env-key"):
        assert (await client.post(V2, json=BODY, headers={"X-API-Key": key})).status == 200, key
    await assert_unauthorized(await client.post(V2, json=BODY, headers={"X-API-Key": "# rotated monthly"}))
    # Rotate the way an operator (or a Kubernetes Secret volume) does: new file, rename over.
    fresh = tmp_path / "keys.new"
    fresh.write_text("new-key\n")
    os.replace(fresh, keys)
    assert (await client.post(V2, json=BODY, headers={"X-API-Key": "old-key"})).status == 200  # not seen yet
    clock.advance(KEY_FILE_RECHECK_S)
    assert (await client.post(V2, json=BODY, headers={"Authorization": "Bearer new-key"})).status == 200
    await assert_unauthorized(await client.post(V2, json=BODY, headers={"X-API-Key": "old-key"}))
    assert (await client.post(V2, json=BODY, headers={"X-API-Key": "env-key"})).status == 200
    keys.unlink()  # an unreadable file gives no key, the environment's still count
    clock.advance(KEY_FILE_RECHECK_S)
    await assert_unauthorized(await client.post(V2, json=BODY, headers={"X-API-Key": "new-key"}))
    assert (await client.post(V2, json=BODY, headers={"X-API-Key": "env-key"})).status == 200
    keys.write_text("back-key\n")
    clock.advance(KEY_FILE_RECHECK_S)
    assert (await client.post(V2, json=BODY, headers={"X-API-Key": "back-key"})).status == 200


def test_the_key_file_is_looked_at_once_per_recheck_interval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "keys"
    path.write_text("one\n")
    clock = FakeClock()
    keys = ApiKeys(path=path, recheck_s=5.0, clock=clock)
    stats: list[object] = []
    real_stat = os.stat

    def counted_stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        stats.append(path)
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", counted_stat)
    assert all(keys.check("one") for _ in range(100))
    assert stats == []  # not once per request: the next look is due in 5 s
    path.write_text("two\n")
    clock.advance(5.0)
    assert keys.check("two") and not keys.check("one")


def test_api_keys_checks_every_key_and_hides_them(tmp_path: Path) -> None:
    keys = ApiKeys(("a", "b"))
    assert keys.enabled and keys.check("a") and keys.check("b")
    assert not keys.check("") and not keys.check(None) and not keys.check("ab")
    assert not ApiKeys().enabled
    assert ApiKeys(path=tmp_path / "missing").enabled  # configured but unreadable: fail closed
    settings = Settings(api_keys="top-secret")
    assert "top-secret" not in repr(settings) and settings.api_key_list == ("top-secret",)
    (tmp_path / "k").write_text("x # y\n#z\n\n w \n")
    assert read_key_file(tmp_path / "k") == ["x", "w"]


def test_tls_settings_go_together(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="SCORING_CERTFILE and SCORING_KEYFILE"):
        Settings(certfile=tmp_path / "cert.pem")


@pytest.mark.parametrize(
    ("host", "keys", "warned"),
    [
        ("127.0.0.1", "", False),
        ("::1", "", False),
        ("0.0.0.0", "", True),
        ("::", "", True),
        ("0.0.0.0", "k", False),
    ],
)
def test_exposed_address_without_keys_is_a_startup_warning(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    host: str,
    keys: str,
    warned: bool,
) -> None:
    monkeypatch.setenv("SCORING_HOST", host)
    monkeypatch.setenv("SCORING_API_KEYS", keys)
    monkeypatch.setenv("SCORING_RUN_DIR", str(tmp_path / "run"))
    write_unavailable(tmp_path / "nvml.json")
    monkeypatch.setenv("GPU_STAT_FAKE_NVML", str(tmp_path / "nvml.json"))
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "metrics"))
    conf = runpy.run_path(str(ROOT / "gunicorn.conf.py"))
    address = [(h.strip("[]"), int(p)) for h, _, p in (b.rpartition(":") for b in conf["bind"])]
    server = SimpleNamespace(
        cfg=SimpleNamespace(workers=1, address=address), log=logging.getLogger("test.gunicorn")
    )
    with caplog.at_level(logging.WARNING, logger="test.gunicorn"):
        conf["on_starting"](server)
    assert ("without API keys" in caplog.text) is warned
