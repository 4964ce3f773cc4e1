"""The server as an installed package (README.md, "Installing the server as a package"): the
wheel built from this checkout, installed into a fresh virtual environment outside it, serves a
model repository with the ``scoring-server`` console command from a folder outside it.

Built and installed without a network and without reinstalling torch: the wheel goes in with
``--no-deps --no-index``, then a ``.pth`` file appends this interpreter's site-packages folders
(where the dependencies are) to the new environment's ``sys.path``, after its own. A plain path
line does not run the ``.pth`` files of the folder it adds, so an editable install of the
checkout found there stays inactive: the test checks that ``app`` is the wheel's. Loopback only; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np
import pytest
import torch

from tests.support.fake_gpus import write_unavailable
from tests.support.gunicorn import HOST, ROOT, free_port, http, poll
from tests.support.toy_models import write_tensor_model

pytestmark = pytest.mark.e2e

#: What ``pip wheel .`` reads from the checkout (setup.py: the packages, README.md as the long
#: description); the build runs on a copy, so that no stale ``build/`` of the checkout leaks in
#: and the checkout stays untouched.
PACKAGING_INPUTS = ("setup.py", "pyproject.toml", "README.md", "app", "gpu_stat")
#: Environment a launched server does not inherit.
_SERVER_ENV_PREFIXES = ("SCORING_", "GPU_STAT_", "PROMETHEUS_", "GUNICORN_")
_TIMEOUT_S = 120


def _run(args: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    """Run a command to its end (bounded); its stdout. AssertionError unless it exits 0."""
    done = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False
    )
    assert done.returncode == 0, f"{args}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@dataclass
class Installed:
    """A fresh virtual environment with the wheel installed."""

    venv: Path
    site_packages: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def command(self) -> Path:
        return self.venv / "bin" / "scoring-server"


def _clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(_SERVER_ENV_PREFIXES) and k not in ("PYTHONPATH", "CUDA_VISIBLE_DEVICES")
    }
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return {**env, **extra}


def dependencies() -> list[str]:
    """This interpreter's site-packages folders, in ``sys.path`` order (those its own ``.pth``
    files added included): where the server's dependencies are installed. Never the checkout's
    source folder itself; a virtual environment inside the checkout (``scripts/install``'s
    ``.venv``) is a site-packages folder like any other."""
    return [
        path
        for path in dict.fromkeys(
            [*sys.path, sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
        )
        if path and Path(path).name in ("site-packages", "dist-packages") and Path(path).is_dir()
    ]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in PACKAGING_INPUTS:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    out = tmp_path_factory.mktemp("dist")
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", str(out), str(src)],
        env=_clean_env(),
    )  # fmt: skip
    (found,) = out.glob("scoring_server-*.whl")
    return found


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    venv = tmp_path_factory.mktemp("venv")
    assert not venv.resolve().is_relative_to(ROOT.resolve()), "the environment must be outside the checkout"
    _run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    # This interpreter's pip, run by the new environment's Python (pip --python): it installs
    # there, and the console script's first line names that Python. The environment is still
    # empty, so pip finds no other scoring-server installed.
    _run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
         str(wheel)],
        env=_clean_env(),
    )  # fmt: skip
    site = Path(
        _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    )
    (site / "zz_dependencies.pth").write_text(
        "".join(f"{path}\n" for path in dependencies()), encoding="utf-8"
    )
    return Installed(venv, site)


def test_the_wheel_holds_the_server_and_its_data(installed: Installed, tmp_path: Path) -> None:
    probe = (
        "import app, gpu_stat, app.server.cli, app.server.gunicorn_config as c, importlib.resources as r;"
        "print(app.__file__); print(gpu_stat.__file__);"
        "print(r.files('app').joinpath('openapi.json').is_file())"
    )
    env = _clean_env(
        SCORING_RUN_DIR=str(tmp_path / "run"),
        GPU_STAT_FAKE_NVML=str(write_unavailable(tmp_path / "nvml.json")),
    )
    app_file, gpu_stat_file, openapi = _run(
        [str(installed.python), "-c", probe], cwd=tmp_path, env=env
    ).split()
    for module in (app_file, gpu_stat_file):
        assert Path(module).is_relative_to(installed.site_packages), f"{module}: not the wheel's"
    assert openapi == "True"
    assert installed.command.read_text().startswith(f"#!{installed.python}")
    usage = _run([str(installed.command), "--help"], cwd=tmp_path, env=env)
    assert usage.startswith("usage: scoring-server [OPTIONS] [APP_MODULE]")


def test_the_console_command_serves_a_model_repository(installed: Installed, tmp_path: Path) -> None:
    repo = tmp_path / "models"
    model = write_tensor_model(repo, "ranker", "torch_export")
    work = tmp_path / "work"  # the working directory: outside the checkout
    work.mkdir()
    port = free_port()
    env = _clean_env(
        SCORING_MODEL_REPOSITORY=str(repo),
        SCORING_HOST=HOST,
        SCORING_PORT=str(port),
        SCORING_GRPC_PORT=str(free_port()),
        SCORING_RUN_DIR=str(tmp_path / "run"),
        SCORING_WORKERS="1",
        SCORING_TORCH_THREADS="1",
        SCORING_DEVICE="cpu",
        GPU_STAT_FAKE_NVML=str(write_unavailable(tmp_path / "nvml.json")),  # CPU mode on any machine
        HF_HUB_OFFLINE="1",
    )
    log_path = tmp_path / "server.log"
    url = f"http://{HOST}:{port}"
    with log_path.open("wb") as log, _server([str(installed.command)], work, env, log) as proc:

        def log_tail() -> str:
            return log_path.read_text(errors="replace")[-6000:]

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"scoring-server exited {proc.returncode}:\n{log_tail()}")
            with contextlib.suppress(OSError):
                return http("GET", f"{url}/v2/health/ready", timeout=5)[0] == 200
            return False

        poll(ready, 60, "GET /v2/health/ready 200", interval_s=0.1, diagnostics=log_tail)
        features = np.arange(8, dtype=np.float32).reshape(2, 4) / 8
        body = {
            "inputs": [
                {"name": "features", "shape": [2, 4], "datatype": "FP32", "data": features.ravel().tolist()}
            ]
        }
        status, _, answer = http("POST", f"{url}/v2/models/ranker/infer", body)
        assert status == 200, (answer, log_tail())
        (output,) = answer["outputs"]
        assert output["name"] == "probability" and output["shape"] == [2, 1]
        with torch.no_grad():
            expected = model(torch.from_numpy(features)).numpy().ravel()
        np.testing.assert_allclose(output["data"], expected, rtol=1e-5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log_tail()


@contextlib.contextmanager
def _server(
    args: list[str], cwd: Path, env: dict[str, str], log: IO[bytes]
) -> Iterator[subprocess.Popen[bytes]]:
    """The server as a child process, killed if still running when the block ends."""
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
