"""The gunicorn configuration read both ways: the checkout's thin ``gunicorn.conf.py`` and the
packaged module (``-c python:app.server.gunicorn_config``, what ``scoring-server`` passes) give
gunicorn the same settings and hooks, and a reload (what gunicorn does at SIGHUP) reads either
afresh. Each form is read by gunicorn's own ``WSGIApplication`` in a child Python process (the
configuration sets environment variables and counts GPUs at import), without torch.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from app.server import cli
from tests.support.fake_gpus import write_unavailable
from tests.support.gunicorn import ROOT
from tests.unit.test_memory import LLAMA_7B

FORMS = ("gunicorn.conf.py", cli.CONFIG)

#: Run in the child: read the configuration as gunicorn does at start, then "reload" twice with
#: another SCORING_WORKERS each time, calling the hooks the arbiter calls in between.
CHILD = r"""
import json, logging, os, sys, types
from gunicorn.app.wsgiapp import WSGIApplication

def shown(value):
    if callable(value):
        return f"{value.__module__}.{value.__qualname__}"
    return repr(value)

sys.argv = ["gunicorn", "-c", sys.argv[1]]
os.environ["SCORING_WORKERS"] = "1"
app = WSGIApplication("%(prog)s [OPTIONS] [APP_MODULE]")
settings = {k: shown(s.get()) for k, s in app.cfg.settings.items() if k != "config"}
server = types.SimpleNamespace(cfg=app.cfg, log=logging.getLogger("test"))
app.cfg.on_starting(server)                      # Arbiter.start
workers = [app.cfg.workers]
os.environ["SCORING_WORKERS"] = "3"
app.reload()                                     # Arbiter.reload at SIGHUP
workers.append(app.cfg.workers)
app.cfg.on_reload(server)
os.environ["SCORING_WORKERS"] = "2"
app.reload()
workers.append(app.cfg.workers)
print(json.dumps({"settings": settings, "workers": workers, "torch": "torch" in sys.modules}))
"""


def read_config(form: str, tmp: Path, **extra: str) -> dict[str, Any]:
    write_unavailable(tmp / "nvml.json")  # CPU mode on any machine
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SCORING_", "GPU_STAT_", "PROMETHEUS_"))}
    env.update(
        SCORING_RUN_DIR=str(tmp / "run"),
        GPU_STAT_FAKE_NVML=str(tmp / "nvml.json"),
        SCORING_GRPC_PORT="0",
        PYTHONPATH=str(ROOT),
        **extra,
    )
    env.pop("GUNICORN_CMD_ARGS", None)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, form], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("config")  # one run directory: settings derived from it agree
    return {form: read_config(form, tmp) for form in FORMS}


def test_both_forms_give_gunicorn_the_same_settings_and_hooks(configs: dict[str, dict[str, Any]]) -> None:
    thin, packaged = (configs[form]["settings"] for form in FORMS)
    assert thin == packaged
    module = "app.server.gunicorn_config"
    for hook in ("on_starting", "on_reload", "when_ready", "pre_fork", "post_fork", "child_exit", "on_exit"):
        assert thin[hook] == f"{module}.{hook}", hook
    assert thin["wsgi_app"] == repr("app.main:create_app")
    assert thin["worker_class"] == repr("app.server.worker.ScoringWebWorker")


@pytest.mark.parametrize("form", FORMS)
def test_a_reload_reads_the_configuration_afresh(configs: dict[str, dict[str, Any]], form: str) -> None:
    """``-c python:<module>`` imports the module: without the module forgetting itself a reload
    would keep the first reading (1, 1, 1)."""
    assert configs[form]["workers"] == [1, 3, 2]


@pytest.mark.parametrize("form", FORMS)
def test_the_master_does_not_import_torch(configs: dict[str, dict[str, Any]], form: str) -> None:
    assert configs[form]["torch"] is False


def test_the_console_command_is_gunicorn_with_the_packaged_config() -> None:
    assert cli.gunicorn_args(["-w", "4", "my.app:make"]) == ["-c", cli.CONFIG, "-w", "4", "my.app:make"]


def test_the_console_command_shows_gunicorns_help() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "app.server.cli", "--help"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: scoring-server [OPTIONS] [APP_MODULE]")
    assert "--worker-class" in done.stdout and "--config CONFIG" in done.stdout


def test_client_certificates_are_required_on_https_when_a_client_ca_is_set(tmp_path: Path) -> None:
    """SCORING_CLIENT_CA_FILE gives gunicorn ca_certs and CERT_REQUIRED (the HTTP side of mutual
    TLS; the gRPC side: tests/unit/test_grpc.py); without it, no client certificate is asked."""
    from tests.support.tls import self_signed

    cert, key = self_signed(tmp_path)
    tls = {"SCORING_CERTFILE": str(cert), "SCORING_KEYFILE": str(key)}
    mutual = read_config("gunicorn.conf.py", tmp_path, **tls, SCORING_CLIENT_CA_FILE=str(cert))["settings"]
    assert mutual["ca_certs"] == repr(str(cert)) and mutual["cert_reqs"] == repr(int(ssl.CERT_REQUIRED))
    plain = read_config("gunicorn.conf.py", tmp_path, **tls)["settings"]
    assert plain["ca_certs"] == repr(None) and plain["cert_reqs"] == repr(int(ssl.CERT_NONE))


#: Run in the child: read the packaged configuration with the fake NVML the environment names,
#: start (on_starting), and print the workers, the binding's floor and the start's log lines.
PLAN_CHILD = r"""
import json, logging, sys, types
from gunicorn.app.wsgiapp import WSGIApplication

sys.argv = ["gunicorn", "-c", sys.argv[1]]
try:
    app = WSGIApplication("%(prog)s [OPTIONS] [APP_MODULE]")
except SystemExit as exc:
    print(json.dumps({"refused": str(exc)}))
    raise SystemExit(0)
import app.server.gunicorn_config as config  # the module the hooks belong to
lines = []
class Keep(logging.Handler):
    def emit(self, record):
        lines.append((record.levelname, record.getMessage()))
log = logging.getLogger("plan"); log.addHandler(Keep()); log.setLevel(logging.INFO); log.propagate = False
app.cfg.on_starting(types.SimpleNamespace(cfg=app.cfg, log=log))
print(json.dumps({"workers": app.cfg.workers, "floor": config._policy.min_free_memory_bytes, "lines": lines,
                  "torch": "torch" in sys.modules}))
"""

#: Llama-2-7B's config.json as RADAR-Vicuna-7B's classifier (no weights: the plan counts them by
#: the architecture's formula, 6.61 B parameters).
RADAR_CONFIG = LLAMA_7B | {
    "architectures": ["LlamaForSequenceClassification"],
    "id2label": {"0": "human", "1": "machine"},
}


def plan_in_master(tmp: Path, gpus: list[dict[str, Any]], asked: int) -> dict[str, Any]:
    """The packaged configuration read in a child, as the master reads it, on a repository of one
    RADAR-style classifier (config only, bfloat16, pieces of 300 characters, batches of 32)."""
    from tests.support.fake_gpus import write_fake
    from tests.support.text_models import CLASSIFIER_TOML

    repository = tmp / "repo"
    (repository / "radar" / "hf").mkdir(parents=True, exist_ok=True)
    (repository / "radar" / "hf" / "config.json").write_text(json.dumps(RADAR_CONFIG))
    parameters = 'dtype = "bfloat16"\nmax_seq_length = 128\ntruncation = "pieces"\npiece_chars = 300'
    toml = CLASSIFIER_TOML.format(
        name="radar", num_labels=2, labels='["human", "machine"]', parameters=parameters
    )
    (repository / "radar" / "model.toml").write_text(
        toml.replace("max_batch_size = 16", "max_batch_size = 32")
    )
    write_fake(tmp / "nvml.json", gpus)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SCORING_", "GPU_STAT_", "PROMETHEUS_"))}
    env.pop("GUNICORN_CMD_ARGS", None)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update(
        SCORING_RUN_DIR=str(tmp / "run"),
        GPU_STAT_FAKE_NVML=str(tmp / "nvml.json"),
        SCORING_GRPC_PORT="0",
        SCORING_MODEL_REPOSITORY=str(repository),
        SCORING_MAX_PROCESSES_PER_GPU=str(asked),
        PYTHONPATH=str(ROOT),
    )
    done = subprocess.run(
        [sys.executable, "-c", PLAN_CHILD, cli.CONFIG],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_fewer_7b_workers_start_than_asked_where_they_do_not_fit(tmp_path: Path) -> None:
    """SCORING_MAX_PROCESSES_PER_GPU=8 of a 7B bfloat16 classifier (14.5 GiB a worker: 12.3 GiB of
    weights, activations of 32 x 128 tokens, the CUDA context, a 10 % margin): an 80 GiB GPU
    takes 5, one with 60 GiB used by another program takes 1; 6 workers fork, each GPU's
    shortfall is a warning, and a worker binds only where its planned bytes are free."""
    from tests.support.fake_gpus import GIB, gpu

    out = plan_in_master(
        tmp_path, [gpu(0, name="Fake H100"), gpu(1, name="Fake H100", memory_used=60 * GIB)], 8
    )
    assert out["workers"] == 6 and out["torch"] is False
    assert 14 * GIB < out["floor"] < 15 * GIB
    warnings = [message for level, message in out["lines"] if level == "WARNING"]
    assert len(warnings) == 2
    assert "asks for 8 workers on GPU 0 (Fake H100)" in warnings[0] and "starting 5" in warnings[0]
    assert "GPU 1 (Fake H100) has 20.0 GiB free" in warnings[1] and "starting 1" in warnings[1]
    assert any(
        "memory plan: 14." in message and "6.61 B parameters" in message for _, message in out["lines"]
    )
    fits = plan_in_master(tmp_path, [gpu(0)], 2)
    assert fits["workers"] == 2 and not [m for level, m in fits["lines"] if level == "WARNING"]


def test_no_gpu_that_holds_one_worker_is_a_refusal_at_start(tmp_path: Path) -> None:
    from tests.support.fake_gpus import GIB, gpu

    out = plan_in_master(tmp_path, [gpu(0, memory_total=16 * GIB, memory_used=4 * GIB)], 1)
    assert "cannot hold one worker" in out["refused"] and "bfloat16" in out["refused"]
