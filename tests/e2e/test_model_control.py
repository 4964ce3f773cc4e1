"""Model control on a real server (2 workers): a new version swapped in under steady load with
nothing failed, on every worker; unload and load again; a broken version that leaves the old one
serving; a worker killed after a change comes back with the current model set; poll mode;
through tritonclient's HTTP and gRPC clients (the gRPC one in a process of its own:
tests/support/grpc_clients.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support.gunicorn import ROOT, Gunicorn, wait_for
from tests.support.load import SteadyLoad, on_new_connections, post_json
from tests.support.toy_models import write_scale_model

pytestmark = pytest.mark.e2e

RANKER = "/v2/models/feed-ranker/infer"
SCALE = "/v2/models/scale/infer"
FEATURES = {"inputs": [{"name": "features", "shape": [1, 32], "datatype": "FP32", "data": [0.1] * 32}]}
X = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1.0, 2.0]}]}


def ranker_version(repo: Path, version: str, *, broken: bool = False) -> Path:
    """The demo feed-ranker as folder ``feed-ranker-<version>`` of ``repo``, declaring
    ``version``; ``broken``: its weights truncated."""
    source = ROOT / "model_repository" / "feed-ranker"
    folder = repo / f"feed-ranker-{version}"
    folder.mkdir()
    toml = (source / "model.toml").read_text().replace('version = "1"', f'version = "{version}"')
    (folder / "model.toml").write_text(toml)
    weights = (source / "model.pt2").read_bytes()
    (folder / "model.pt2").write_bytes(weights[: len(weights) // 3] if broken else weights)
    return folder


def grpc_control(srv: Gunicorn, action: str, model: str, inputs: Path | None = None) -> dict[str, Any]:
    """tritonclient.grpc's ``load_model``/``unload_model``/``infer`` in a process of its own."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.grpc_clients", f"triton-control-{action}", srv.grpc_url, model,
         str(inputs or "-")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def versions_by_worker(srv: Gunicorn, path: str, body: dict[str, Any]) -> dict[int, tuple[int, str]]:
    """pid -> (status, model_version or error) of one request on a new connection, every worker."""

    def ask(connection: Any) -> tuple[int, str]:
        status, answer = post_json(connection, path, body)
        return status, answer.get("model_version") or answer.get("error", "")

    return on_new_connections(srv.port, ask, 2)


def rss(pids: list[int]) -> dict[int, int]:
    return {pid: psutil.Process(pid).memory_info().rss for pid in pids}


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repository = tmp_path / "repo"
    repository.mkdir()
    ranker_version(repository, "1")
    write_scale_model(repository, "scale")
    return repository


def test_explicit_model_control_on_every_worker(tmp_path: Path, repo: Path) -> None:
    env = {
        "SCORING_MODEL_REPOSITORY": str(repo),
        "SCORING_WORKERS": "2",
        "SCORING_MODEL_CONTROL_MODE": "explicit",
    }
    with Gunicorn(tmp_path, env) as srv:
        srv.wait_ready(120, count=2)
        client = httpclient.InferenceServerClient(f"127.0.0.1:{srv.port}", network_timeout=300)
        pids = sorted(w.pid for w in srv.workers())
        before = rss(pids)

        # 1. a new version swapped in under 16 connections of load: nothing fails
        with SteadyLoad(srv.port, RANKER, FEATURES) as load:
            load.wait_for_more(100)
            ranker_version(repo, "2")
            client.load_model("feed-ranker")
            load.wait_for_more(200)
        assert set(load.statuses) == {200}, (load.statuses, load.errors)
        assert set(load.versions) == {"1", "2"}
        assert versions_by_worker(srv, RANKER, FEATURES) == {pid: (200, "2") for pid in pids}
        index = {(m["name"], m["version"]): m["state"] for m in client.get_model_repository_index()}
        assert index == {("feed-ranker", "2"): "READY", ("scale", "1"): "READY"}
        after = rss(pids)
        assert all(after[pid] <= 1.10 * before[pid] for pid in pids), (before, after)

        # 2. unloaded through gRPC: 404 on every worker (UNAVAILABLE on gRPC); the other model serves
        inputs = tmp_path / "features.json"
        inputs.write_text(
            json.dumps({"features": {"datatype": "FP32", "shape": [1, 32], "data": [0.1] * 32}})
        )
        with SteadyLoad(srv.port, SCALE, X) as load:
            assert grpc_control(srv, "unload", "feed-ranker") == {"ok": True}
            gone = versions_by_worker(srv, RANKER, FEATURES)
            assert all(status == 404 and "not loaded" in why for status, why in gone.values()), gone
            answer = grpc_control(srv, "infer", "feed-ranker", inputs)
            assert answer["status"] == "StatusCode.UNAVAILABLE", answer
            assert grpc_control(srv, "load", "feed-ranker") == {"ok": True}
            load.wait_for_more(100)
        assert set(load.statuses) == {200}, (load.statuses, load.errors)
        assert versions_by_worker(srv, RANKER, FEATURES) == {pid: (200, "2") for pid in pids}

        # 3. a broken version 3: the call names it, version 2 keeps serving, the index says why
        ranker_version(repo, "3", broken=True)
        with SteadyLoad(srv.port, RANKER, FEATURES) as load:
            with pytest.raises(InferenceServerException, match="version 3") as failed:
                client.load_model("feed-ranker")
            load.wait_for_more(100)
        assert all(f"worker {pid}" in str(failed.value) for pid in pids)
        assert set(load.statuses) == {200} and set(load.versions) == {"2"}, (load.statuses, load.errors)
        rows = [m for m in client.get_model_repository_index() if m["name"] == "feed-ranker"]
        states = {m["version"]: (m["state"], m.get("reason", "")) for m in rows}
        assert states["2"] == ("READY", "") and states["3"][0] == "UNAVAILABLE" and states["3"][1]
        shutil.rmtree(repo / "feed-ranker-3")

        # 4. a worker killed after a change comes back with the current model set
        client.unload_model("scale")
        victim = pids[0]
        os.kill(victim, signal.SIGKILL)
        wait_for(
            lambda: victim not in srv.ready_workers() and len(srv.ready_workers()) == 2,
            120,
            "a new worker",
            srv,
        )
        new_pids = sorted(srv.ready_workers())
        answers = {pid: answer for pid, answer in versions_by_worker(srv, SCALE, X).items()}
        assert set(answers) == set(new_pids) and all(s == 404 for s, _ in answers.values()), answers
        assert versions_by_worker(srv, RANKER, FEATURES) == {pid: (200, "2") for pid in new_pids}
        assert not client.is_model_ready("scale")


def test_poll_mode_serves_a_new_version_on_every_worker_with_nothing_failed(
    tmp_path: Path, repo: Path
) -> None:
    poll_s = 1.0
    env = {
        "SCORING_MODEL_REPOSITORY": str(repo), "SCORING_WORKERS": "2", "SCORING_MODEL_CONTROL_MODE": "poll",
        "SCORING_REPOSITORY_POLL_S": str(poll_s),
    }  # fmt: skip
    with Gunicorn(tmp_path, env) as srv:
        srv.wait_ready(120, count=2)
        pids = sorted(w.pid for w in srv.workers())
        with SteadyLoad(srv.port, RANKER, FEATURES) as load:
            load.wait_for_more(100)
            ranker_version(repo, "2")

            def everywhere() -> bool:
                return versions_by_worker(srv, RANKER, FEATURES) == {pid: (200, "2") for pid in pids}

            wait_for(everywhere, poll_s + 60, "version 2 on every worker", srv)
            load.wait_for_more(100)
        assert set(load.statuses) == {200}, (load.statuses, load.errors)
        client = httpclient.InferenceServerClient(f"127.0.0.1:{srv.port}")
        with pytest.raises(InferenceServerException, match="mode is 'poll'"):
            client.load_model("feed-ranker")


def test_workers_agree_after_a_load_that_answers_200_when_the_only_model_was_unloaded(tmp_path: Path) -> None:
    """The only model of the server unloaded leaves both workers with nothing ready (published
    "loading", not "ready"): model control still reaches both. Load v2 (200), a broken v3
    (400, v2 serves), unload, load while the broken v3 is the latest (400 naming both workers),
    remove v3, load again (200): both workers serve v2, under load, nothing answers 503."""
    repo = tmp_path / "repo"
    write_scale_model(repo, "scale", version="1", folder_name="scale-1")
    marker = tmp_path / "v3-is-broken"
    marker.touch()
    env = {"SCORING_MODEL_REPOSITORY": str(repo), "SCORING_WORKERS": "2", "SCORING_MODEL_CONTROL_MODE": "explicit"}
    load_path, unload_path = "/v2/repository/models/scale/load", "/v2/repository/models/scale/unload"
    with Gunicorn(tmp_path, env) as srv:
        srv.wait_ready(120, count=2)
        pids = sorted(w.pid for w in srv.workers())
        write_scale_model(repo, "scale", version="2", folder_name="scale-2")
        assert srv.post(load_path, {})[0] == 200
        assert versions_by_worker(srv, SCALE, X) == {pid: (200, "2") for pid in pids}
        write_scale_model(repo, "scale", version="3", folder_name="scale-3", fail_load_if_exists=str(marker))
        status, _, answer = srv.post(load_path, {})
        assert status == 400 and "version 3" in answer["error"], answer
        assert versions_by_worker(srv, SCALE, X) == {pid: (200, "2") for pid in pids}
        assert srv.post(unload_path, {})[0] == 200
        status, _, answer = srv.post(load_path, {})  # v3, the latest, still broken
        assert status == 400 and all(f"worker {pid}" in answer["error"] for pid in pids), answer
        shutil.rmtree(repo / "scale-3")
        with SteadyLoad(srv.port, SCALE, X) as load:
            status, _, answer = srv.post(load_path, {})
            assert status == 200, answer
            load.wait_for_more(100)
            mark = Counter(load.statuses)
            load.wait_for_more(200)
        after = load.statuses - mark
        assert set(after) == {200}, (after, load.errors[-3:])
        assert versions_by_worker(srv, SCALE, X) == {pid: (200, "2") for pid in pids}
        index = {(m["version"], m["state"]) for m in srv.post("/v2/repository/index", {})[2]}
        assert index == {("2", "READY")}, index
