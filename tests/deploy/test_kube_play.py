"""The Kubernetes manifests under ``podman kube play``, on the CPU image that
scripts/container_check.py builds (``localhost/scoring-server:0.1.0-cpu``).

What is played: ``kubectl kustomize deploy/kubernetes/examples/keys-and-volume`` (the base with
the api-keys and model-volume components), its Secret projected as files (podman 4.3 cannot
mount a Secret volume of a Deployment: ``_secret_as_files``) and its emptyDirs as the kubelet
makes them (0777: ``_empty_dirs_as_the_kubelet_makes_them``), and this checkout's ``app``
over the image's (``_this_checkouts_server``: the server as it is now). Changed
for this machine only, by a kustomize overlay written here: the image (the local CPU build), no
``nvidia.com/gpu`` (no GPU: CPU mode), 2 CPUs (this machine has 2), one replica (podman makes
a pod per replica, on the same host ports), a hostPort on 127.0.0.1 for each container port,
and a 1 s repository poll. What it shows:

- the pod comes up under the manifests' security context (read-only root, no capabilities,
  uid 10001) with the claim mounted at ``/models`` and the Secret's keys read;
- the probes' paths answer on the probe port; with a broken model in the repository,
  readiness stays 503 naming it (strict readiness); once the broken folder is removed, the
  poll drops it and readiness turns 200, the good model serving all along;
- ``/metrics`` refuses a scrape without a key and takes the ServiceMonitor's (the Secret's
  ``metrics`` key as a bearer token).

Marked ``podman``; skipped, saying why, without podman and runc or without the image
(build it with scripts/container_check.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from benchmarks.driver import free_port, http, poll
from tests.support import engines
from tests.support.gunicorn import ROOT

IMAGE = "localhost/scoring-server:0.1.0-cpu"
EXAMPLE = ROOT / "deploy" / "kubernetes" / "examples" / "keys-and-volume"
KUBECTL = shutil.which("kubectl")
CLIENT_KEY = "client-" + uuid.uuid4().hex
METRICS_KEY = "metrics-" + uuid.uuid4().hex
FEATURES = {"inputs": [{"name": "features", "shape": [1, 32], "datatype": "FP32", "data": [0.5] * 32}]}


def _why_not() -> str | None:
    why = engines.missing()
    if why is None and KUBECTL is None:
        why = "kubectl not installed (it renders the kustomization)"
    if why is None and engines.podman("image", "exists", IMAGE, check=False).returncode != 0:
        why = f"{IMAGE} not built (scripts/container_check.py builds it)"
    return why


pytestmark = [pytest.mark.podman, pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))]

OVERLAY = """\
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - {example}
images:
  - name: registry.example.com/scoring-server
    newName: localhost/scoring-server
    newTag: 0.1.0-cpu
patches:
  - target:
      kind: Deployment
    patch: |-
      - op: replace
        path: /spec/replicas
        value: 1
      - op: remove
        path: /spec/template/spec/containers/0/resources/limits/nvidia.com~1gpu
      - op: remove
        path: /spec/template/spec/containers/0/resources/requests/nvidia.com~1gpu
      - op: replace
        path: /spec/template/spec/containers/0/resources/limits/cpu
        value: "2"
      - op: replace
        path: /spec/template/spec/containers/0/resources/requests/cpu
        value: "2"
      - op: add
        path: /spec/template/spec/containers/0/ports/0/hostPort
        value: {http_port}
      - op: add
        path: /spec/template/spec/containers/0/ports/0/hostIP
        value: 127.0.0.1
      - op: add
        path: /spec/template/spec/containers/0/ports/1/hostPort
        value: {grpc_port}
      - op: add
        path: /spec/template/spec/containers/0/ports/1/hostIP
        value: 127.0.0.1
      - op: add
        path: /spec/template/spec/containers/0/env/-
        value: {{name: SCORING_REPOSITORY_POLL_S, value: "1"}}
"""


SECRET = {"clients": f"{CLIENT_KEY}\n", "metrics": METRICS_KEY}


def _secret_as_files(deployment: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The Secret ``scoring-server-api-keys`` as the kubelet projects it: a folder with one file
    per key, and the keys an env var takes from it as values. podman 4.3's kube play crashes on
    a Secret volume in a Deployment (a nil secrets manager in kube/volume.go), so the folder is a
    hostPath here; the paths, names and keys are the component's."""
    folder.mkdir(exist_ok=True)
    for key, value in SECRET.items():
        (folder / key).write_text(value, encoding="utf-8")
    folder.chmod(0o755)
    pod = deployment["spec"]["template"]["spec"]
    for volume in pod["volumes"]:
        if "secret" in volume:
            assert volume["secret"]["secretName"] == "scoring-server-api-keys"
            del volume["secret"]
            volume["hostPath"] = {"path": str(folder), "type": "Directory"}
    for container in pod["containers"]:
        for env in container["env"]:
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"] == "scoring-server-api-keys"
                env["value"] = SECRET[ref["key"]]
                del env["valueFrom"]
    return deployment


def _render(tmp: Path, http_port: int, grpc_port: int) -> list[dict[str, Any]]:
    overlay = tmp / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        OVERLAY.format(example=os.path.relpath(EXAMPLE, overlay), http_port=http_port, grpc_port=grpc_port),
        encoding="utf-8",
    )
    assert KUBECTL is not None
    done = subprocess.run([KUBECTL, "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(overlay)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def _fill_volume(name: str, broken: bool) -> Path:
    """The claim's podman volume with the image's feed-ranker and, when ``broken``, a model
    whose model.toml does not parse; returns the volume's folder on this machine."""
    engines.podman("volume", "create", name)
    mountpoint = Path(engines.podman("volume", "inspect", "--format", "{{.Mountpoint}}", name).stdout.strip())
    engines.podman("run", "--rm", "--user", "0", "-v", f"{name}:/dst", "--entrypoint", "cp", IMAGE,
                   "-r", "/models/feed-ranker", "/dst/")  # fmt: skip
    if broken:
        (mountpoint / "broken").mkdir()
        (mountpoint / "broken" / "model.toml").write_text("name = \n", encoding="utf-8")
    return mountpoint


def _empty_dirs_as_the_kubelet_makes_them(deployment: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """The kubelet makes each emptyDir a fresh folder of mode 0777, which the image's uid 10001
    can write; podman 4.3 makes it root's, 0755, and the server cannot create its run directory
    or metrics folder there. So each emptyDir is played as such a folder (hostPath)."""
    for volume in deployment["spec"]["template"]["spec"]["volumes"]:
        if "emptyDir" in volume:
            folder = tmp / f"empty-{volume['name']}"
            folder.mkdir(exist_ok=True)
            folder.chmod(0o777)
            del volume["emptyDir"]
            volume["hostPath"] = {"path": str(folder), "type": "Directory"}
    return deployment


def _this_checkouts_server(deployment: dict[str, Any]) -> dict[str, Any]:
    """This checkout's ``app`` package mounted read-only over the image's, so the manifests are
    played with the server as it is now, in the image's environment (the image is built once,
    in minutes; the server code changes more often than its dependencies)."""
    installed = engines.podman(
        "run", "--rm", "--network", "none", "--entrypoint", "python", IMAGE,
        "-c", "import app, os; print(os.path.dirname(app.__file__))",
    ).stdout.strip()  # fmt: skip
    pod = deployment["spec"]["template"]["spec"]
    pod["volumes"].append({"name": "checkout-app", "hostPath": {"path": str(ROOT / "app"), "type": "Directory"}})
    pod["containers"][0]["volumeMounts"].append({"name": "checkout-app", "mountPath": installed, "readOnly": True})
    return deployment


@pytest.fixture(scope="module")
def played(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    tmp = tmp_path_factory.mktemp("kube")
    http_port, grpc_port = free_port(), free_port()
    docs = [d for d in _render(tmp, http_port, grpc_port) if d["kind"] in ("Deployment", "PersistentVolumeClaim")]
    (claim,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    volume = claim["metadata"]["name"]
    engines.podman("volume", "rm", "-f", volume, check=False)
    repository = _fill_volume(volume, broken=True)
    deployments = [
        _this_checkouts_server(_empty_dirs_as_the_kubelet_makes_them(_secret_as_files(d, tmp / "api-keys"), tmp))
        for d in docs
        if d["kind"] == "Deployment"
    ]
    play = tmp / "play.yaml"
    play.write_text(yaml.safe_dump_all(deployments), encoding="utf-8")
    engines.podman("kube", "down", str(play), timeout=120, check=False)  # a run cut off before its teardown
    try:
        engines.podman("kube", "play", str(play), timeout=300)
        yield f"http://127.0.0.1:{http_port}", repository
    finally:
        engines.podman("kube", "down", str(play), timeout=120, check=False)
        engines.podman("volume", "rm", "-f", volume, check=False)


def _logs() -> str:
    names = engines.podman("ps", "-a", "--format", "{{.Names}}", check=False).stdout.split()
    return "\n".join(engines.podman("logs", "--tail", "40", n, check=False).stderr for n in names if "scoring" in n)


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, Any] | None:
    try:
        status, _, body = http("GET", url, headers=headers, timeout=5)
    except OSError:
        return None
    return status, body


def test_the_pod_runs_strictly_ready_with_keys_and_the_model_volume(played: tuple[str, Path]) -> None:
    url, repository = played
    live = poll(lambda: _get(f"{url}/v2/health/live"), 300, "liveness answers", interval_s=1, diagnostics=_logs)
    assert live[0] == 200

    def unready_naming_the_broken_model() -> Any:
        got = _get(f"{url}/v2/health/ready")
        return got[1] if got and got[0] == 503 and "broken" in json.dumps(got[1]) else None

    body = poll(unready_naming_the_broken_model, 300, "readiness 503 naming the broken model",
                interval_s=1, diagnostics=_logs)  # fmt: skip
    assert body["ready"] is False
    headers = {"Authorization": f"Bearer {CLIENT_KEY}"}

    def served() -> Any:
        status, _, out = http("POST", f"{url}/v2/models/feed-ranker/infer", FEATURES, headers=headers)
        return out if status == 200 else None

    out = poll(served, 300, "the good model serving beside the broken one", interval_s=1, diagnostics=_logs)
    assert len(out["outputs"][0]["data"]) == 1
    status, _, body = http("GET", f"{url}/v2/health/ready")
    assert status == 503 and "broken" in body["unavailable"], body  # strict: still unready
    assert http("POST", f"{url}/v2/models/feed-ranker/infer", FEATURES)[0] == 401

    shutil.rmtree(repository / "broken")  # what a fix published to the volume does
    poll(lambda: (_get(f"{url}/v2/health/ready") or (0,))[0] == 200 or None, 120, "ready once the broken model is gone",
         interval_s=1, diagnostics=_logs)  # fmt: skip


def test_metrics_are_scraped_with_the_service_monitors_key(played: tuple[str, Path]) -> None:
    url, _ = played
    poll(lambda: _get(f"{url}/v2/health/live"), 300, "liveness answers", interval_s=1, diagnostics=_logs)
    assert http("GET", f"{url}/metrics")[0] == 401
    status, _, text = http("GET", f"{url}/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"})
    assert status == 200 and "scoring_worker_binding_info" in text


def test_the_container_runs_as_the_manifests_say(played: tuple[str, Path]) -> None:
    names = [n for n in engines.podman("ps", "--format", "{{.Names}}").stdout.split() if "scoring-server" in n]
    (name,) = [n for n in names if not n.endswith("-infra")]
    inspect = json.loads(engines.podman("inspect", name).stdout)[0]
    assert inspect["HostConfig"]["ReadonlyRootfs"] is True
    assert inspect["Config"]["User"].split(":")[0] == "10001"
    assert inspect["HostConfig"]["CapDrop"] and not inspect["HostConfig"]["CapAdd"]
    mounts = {m["Destination"]: m for m in inspect["Mounts"]}
    assert mounts["/models"]["RW"] is False and mounts["/etc/scoring/api-keys"]["RW"] is False
