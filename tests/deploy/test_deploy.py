"""Deployment artefacts: Dockerfile, Kubernetes and KServe manifests, systemd unit.

Static checks (no network, no Docker, no cluster):

- the Dockerfile's entry point, defaults and build arguments; ``scripts/container_check.py``
  (which builds and checks the image with podman, too slow for the suite) hands the build
  this machine's pip sources as those arguments and read-only mounts;

- every Kubernetes manifest, and every kustomization rendered with ``kubectl kustomize``
  where kubectl is installed, validates against the Kubernetes JSON schemas
  (``kubernetes_validate``, strict: unknown fields are errors);
- KServe and Prometheus Operator resources, which those schemas lack, are checked for
  their structure here, and their pod parts as core Kubernetes objects;
- probe paths are routes the server serves, probe ports the port it binds;
- every ``SCORING_*`` variable set anywhere is a field of ``app.settings.Settings`` and
  its value validates;
- shutdown budgets fit: grace period > preStop sleep + graceful drain.

End to end, the Dockerfile's ENTRYPOINT + CMD with its ENV run on this machine:
tests/e2e/test_deploy.py. Reading the manifests and the Dockerfile: tests/support/deploy.py.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate import utils as kv_utils

from app.settings import ENV_PREFIX, Settings
from tests.support.deploy import (
    DEPLOY,
    DOCKERFILE,
    HEALTH_LIVE,
    HEALTH_READY,
    METRICS_PATH,
    ImageConfig,
    adapter_rules,
    all_docs,
    containers_of,
    dockerfile_instructions,
    docs_of_kind,
    parse_dockerfile,
    probes_of,
    series_name,
    served_containers,
    yaml_docs,
)
from tests.support.gunicorn import ROOT
from tests.support.tools import load_tool

container_check = load_tool("container_check.py")

KUBERNETES = DEPLOY / "kubernetes"
KSERVE = DEPLOY / "kserve"
DOCKERIGNORE = ROOT / ".dockerignore"
SYSTEMD_UNIT = DEPLOY / "systemd" / "scoring-server.service"

#: Oldest Kubernetes the manifests target (PDB unhealthyPodEvictionPolicy is GA in 1.31)
#: and the newest the installed kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.31", kv_utils.major_minor(kv_utils.latest_version()))
KUSTOMIZE_KINDS = frozenset({"Kustomization", "Component"})
KSERVE_GROUP = "serving.kserve.io"
KSERVE_PROTOCOLS = frozenset({"v1", "v2", "grpc-v1", "grpc-v2"})
KSERVE_STORAGE_MOUNT = "/mnt/models"
QUEUE_METRIC = "scoring_queue_items"
REFUSAL_METRIC = "scoring_refusals_per_second"
KUBECTL = shutil.which("kubectl")


# --- loading ----------------------------------------------------------------------------


def _kustomization_dirs() -> list[Path]:
    return sorted(p.parent for p in KUBERNETES.rglob("kustomization.yaml"))


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    """Every kustomization under deploy/kubernetes rendered by ``kubectl kustomize``."""
    if KUBECTL is None:
        pytest.skip("kubectl not installed: kustomizations not rendered")
    out: dict[str, list[dict[str, Any]]] = {}
    for directory in _kustomization_dirs():
        if yaml_docs(directory / "kustomization.yaml")[0]["kind"] == "Component":
            continue  # rendered where a Kustomization uses it
        result = subprocess.run(
            [KUBECTL, "kustomize", str(directory)], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, f"kubectl kustomize {_rel(directory)}:\n{result.stderr}"
        out[_rel(directory)] = [d for d in yaml.safe_load_all(result.stdout) if d]
    return out


# --- Dockerfile -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def image() -> ImageConfig:
    return parse_dockerfile()


def test_dockerfile_entrypoint_is_exec_form_gunicorn(image: ImageConfig) -> None:
    """Exec form: gunicorn is PID 1 and receives SIGTERM/SIGHUP itself."""
    assert image.entrypoint == ["gunicorn", "-c", "gunicorn.conf.py"]
    assert image.cmd is None or isinstance(image.cmd, list), "CMD must be exec form"
    assert isinstance(image.healthcheck, list), "HEALTHCHECK CMD must be exec form"
    assert any(HEALTH_READY in part for part in image.healthcheck)
    assert image.healthcheck[0] == "python", "no curl in the image: the check uses python"


def test_dockerfile_defaults(image: ImageConfig) -> None:
    env = image.env
    assert env["SCORING_HOST"] == "0.0.0.0"
    assert env["SCORING_MODEL_REPOSITORY"] == "/models"
    assert env["PROMETHEUS_MULTIPROC_DIR"].startswith("/dev/shm/")
    assert "SCORING_GRACEFUL_TIMEOUT_S" in env
    assert env["SCORING_MAX_PROCESSES_PER_GPU"] == "4", "measured best on an H100 and an H200"
    assert image.user is not None
    uid = image.user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric non-root USER (runAsNonRoot can check it)"
    assert image.workdir is not None


def test_dockerfile_base_is_a_build_arg_and_torch_comes_first() -> None:
    text = DOCKERFILE.read_text(encoding="utf-8")
    instructions = dockerfile_instructions(text)
    args = [a.split("=")[0] for w, a in instructions if w == "ARG"]
    assert {"BASE", "TORCH_INDEX_URL", "TORCH_VERSION"} <= set(args)
    froms = [a for w, a in instructions if w == "FROM"]
    assert froms[0].startswith("${BASE}")
    runs = [a for w, a in instructions if w == "RUN"]
    torch_at = next(i for i, r in enumerate(runs) if "torch==${TORCH_VERSION}" in r)
    package_at = next(i for i, r in enumerate(runs) if re.search(r"pip install [^&]*\"\.", r))
    assert torch_at < package_at, "torch (pinned, CPU or CUDA index) before the package"
    assert "-c " in runs[package_at], "the package install must keep the pinned torch"


def test_the_gpu_image_swaps_in_onnxruntime_gpu_and_the_cpu_check_keeps_the_cpu_build() -> None:
    """Both builds provide the ``onnxruntime`` module: the default (GPU) image must end with
    onnxruntime-gpu alone, or the ONNX models never reach the GPU; the CPU image keeps the CPU
    build (scripts/container_check.py asks for it)."""
    instructions = dockerfile_instructions(DOCKERFILE.read_text(encoding="utf-8"))
    args = dict(a.split("=", 1) for w, a in instructions if w == "ARG" and "=" in a)
    assert args["ONNXRUNTIME"].strip('"').startswith("onnxruntime-gpu[")
    runs = [a for w, a in instructions if w == "RUN"]
    package_at = next(i for i, r in enumerate(runs) if re.search(r"pip install [^&]*\"\.", r))
    swap_at = next(i for i, r in enumerate(runs) if "pip uninstall -y onnxruntime" in r)
    assert swap_at > package_at and '"$ONNXRUNTIME"' in runs[swap_at]
    assert "-c /tmp/torch-constraint.txt" in runs[swap_at], "the swap keeps the pinned torch"
    source = (ROOT / "scripts" / "container_check.py").read_text(encoding="utf-8")
    assert '"ONNXRUNTIME=onnxruntime"' in source


def test_dockerfile_pip_sources_are_empty_build_args() -> None:
    """pip reads the build stage's PIP_* build arguments as its own variables: empty (PyPI) by
    default, and never in the runtime stage's environment."""
    instructions = dockerfile_instructions(DOCKERFILE.read_text(encoding="utf-8"))
    declared = dict(a.partition("=")[::2] for w, a in instructions if w == "ARG")
    for name in container_check.PIP_SOURCES.values():
        assert declared.get(name) == "", f"ARG {name}= (empty: pip's default index) is missing"
    assert not [k for k in parse_dockerfile().env if k.startswith("PIP_")]


def test_container_check_hands_the_build_the_pip_sources(tmp_path: Path) -> None:
    """``pip config list`` output -> build arguments, with local folders mounted read-only."""
    index = tmp_path / "pypi" / "simple"
    wheels = tmp_path / "wheels"
    index.mkdir(parents=True)
    wheels.mkdir()
    cert = tmp_path / "ca.pem"
    cert.write_text("", encoding="utf-8")
    listed = "\n".join(
        [
            "global.index-url='https://global.invalid/simple'",
            "install.index-url='https://install.invalid/simple'",
            f"global.extra-index-url='file://{index} https://extra.invalid/simple'",
            "global.find-links='/ignored'",
            f":env:.find-links='{wheels}'",
            f"global.cert='{cert}'",
            ":env:.default-timeout='180'",
        ]
    )
    config = container_check.parse_pip_config(listed)
    assert config["index-url"] == "https://install.invalid/simple", "[install] over [global]"
    assert config["find-links"] == str(wheels), "PIP_* variables over the files"
    sources = container_check.build_sources(config, torch_index_url="https://torch.invalid/cpu")
    assert sources.args == {
        "PIP_INDEX_URL": "https://install.invalid/simple",
        # an index folder's parent is mounted: its pages link to ../../files/
        "PIP_EXTRA_INDEX_URL": "file:///mnt/pip/0/simple https://extra.invalid/simple",
        "PIP_FIND_LINKS": "/mnt/pip/1",
        "PIP_CERT": "/mnt/pip/2",
        "TORCH_INDEX_URL": "https://torch.invalid/cpu",
    }
    assert sources.volumes == [
        (str(index.parent), "/mnt/pip/0"),
        (str(wheels), "/mnt/pip/1"),
        (str(cert), "/mnt/pip/2"),
    ]
    assert sources.podman_args()[-2:] == ["--volume", f"{cert}:/mnt/pip/2:ro"]
    assert container_check.build_sources({}).podman_args() == [], "no pip configuration: PyPI"


def test_container_check_names_the_packages_it_lacks(capsys: pytest.CaptureFixture[str]) -> None:
    assert container_check.main(["--no-build", "--runtime", "no-such-oci-runtime"]) == 2
    err = capsys.readouterr().err
    assert "no-such-oci-runtime" in err and "apt-get install -y podman runc" in err


def _dockerignore_regex(pattern: str) -> re.Pattern[str]:
    """Docker's pattern syntax (Go filepath.Match plus ``**``), anchored at the context root.

    A pattern that matches a folder also matches everything inside it.
    """
    out, i, pattern = "", 0, pattern.strip("/")
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[" and "]" in pattern[i:]:
            close = pattern.index("]", i)
            out, i = out + pattern[i : close + 1], close + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + "(?:/.*)?")


def _dockerignored(relpath: str, patterns: list[str]) -> bool:
    """Whether the build context leaves ``relpath`` out (the last matching pattern wins)."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        if _dockerignore_regex(pattern.removeprefix("!")).fullmatch(relpath):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_what_the_build_needs() -> None:
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    setup_reads = re.findall(r"open\(\"([^\"]+)\"", (ROOT / "setup.py").read_text(encoding="utf-8"))
    needed = [
        "setup.py",
        "pyproject.toml",
        "gunicorn.conf.py",
        "app/__init__.py",
        "app/settings.py",
        "gpu_stat",
        "scripts/export_ranking_model.py",
        "scripts/export_sentence_embedding.py",
        "model_repository/feed-ranker/model.toml",
        "model_repository/feed-ranker-onnx/model.toml",
        "model_repository/all-MiniLM-L6-v2-onnx/model.toml",
        *setup_reads,
    ]
    for rel in needed:
        assert (ROOT / rel).exists(), f"the image build needs {rel}, which does not exist"
        assert not _dockerignored(rel, patterns), f".dockerignore excludes {rel}"
    ignored = ("model_repository/feed-ranker/model.pt2", "model_repository/feed-ranker-onnx/model.onnx")
    for rel in (".venv", ".git", "tests", "benchmarks", *ignored):
        assert _dockerignored(rel, patterns), f".dockerignore should exclude {rel}"


# --- settings and the server's routes -------------------------------------------------


def _env_list(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env") or [] if "name" in e}


def _patch_docs() -> Iterator[tuple[Path, dict[str, Any]]]:
    """Strategic-merge patches written inline in kustomization files."""
    for directory in _kustomization_dirs():
        path = directory / "kustomization.yaml"
        for patch in yaml_docs(path)[0].get("patches") or []:
            body = yaml.safe_load(patch["patch"]) if "patch" in patch else None
            if isinstance(body, dict):
                yield path, body


def _scoring_env() -> list[tuple[str, str, str]]:
    """(where, NAME, value) of every SCORING_* variable the deployment artefacts set."""
    found = [(_rel(DOCKERFILE), k, v) for k, v in parse_dockerfile().env.items() if k.startswith(ENV_PREFIX)]
    for path, doc in [*all_docs(), *_patch_docs()]:
        for container in containers_of(doc):
            found += [(_rel(path), k, v) for k, v in _env_list(container).items() if k.startswith(ENV_PREFIX)]
    found += [(_rel(SYSTEMD_UNIT), k, v) for k, v in _unit_env().items() if k.startswith(ENV_PREFIX)]
    return found


def test_scoring_env_vars_are_settings() -> None:
    found = _scoring_env()
    assert found
    fields = Settings.model_fields
    for where, name, value in found:
        key = name[len(ENV_PREFIX) :].lower()
        assert key in fields, f"{where}: {name} is not a setting (app/settings.py: {sorted(fields)})"
        Settings.model_validate({key: value})  # raises pydantic.ValidationError on a bad value


def _served_get_paths() -> set[str]:
    from aiohttp import web

    from app.http.routes import routes

    return {r.path for r in routes if isinstance(r, web.RouteDef) and r.method == "GET"}


def _effective_port(container: dict[str, Any], name: str = "port") -> int:
    """The port the server in ``container`` binds: ``port`` (HTTP) or ``grpc_port``."""
    env = {**parse_dockerfile().env, **_env_list(container)}
    return int(env.get(f"SCORING_{name.upper()}", Settings.model_fields[name].default))


def _probe_port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in container.get("ports") or [] if "name" in p}
    assert port in named, f"probe port {port!r} is not a named port of {container.get('name')}"
    return int(named[port])


def test_probes_hit_served_paths_on_the_served_port() -> None:
    served = _served_get_paths()
    checked = 0
    for path, container in served_containers():
        probes = probes_of(container)
        assert set(probes) == {"startupProbe", "readinessProbe", "livenessProbe"}, _rel(path)
        assert probes["readinessProbe"]["httpGet"]["path"] == HEALTH_READY
        assert probes["livenessProbe"]["httpGet"]["path"] == HEALTH_LIVE
        assert probes["startupProbe"]["httpGet"]["path"] == HEALTH_READY
        startup = probes["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "slow model loads"
        for probe in probes.values():
            get = probe["httpGet"]
            assert get["path"] in served, f"{_rel(path)}: {get['path']} is not a route"
            assert _probe_port(container, get["port"]) == _effective_port(container), _rel(path)
            checked += 1
        ports = {p.get("name", "http"): p["containerPort"] for p in container["ports"]}
        assert ports["http" if "http" in ports else next(iter(ports))] == _effective_port(container)
        if "grpc" in ports:  # the KServe V2 gRPC port, where the server binds it
            assert ports["grpc"] == _effective_port(container, "grpc_port"), _rel(path)
        assert len(ports) <= 2, _rel(path)
    assert checked >= 6


def test_prometheus_scrape_annotations_match_the_server() -> None:
    for path, doc in docs_of_kind("Deployment"):
        annotations = doc["spec"]["template"]["metadata"]["annotations"]
        (container,) = doc["spec"]["template"]["spec"]["containers"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/path"] == METRICS_PATH
        assert int(annotations["prometheus.io/port"]) == _effective_port(container), _rel(path)
        env = {**parse_dockerfile().env, **_env_list(container)}
        mounts = [m["mountPath"] for m in container["volumeMounts"]]
        assert any(env["PROMETHEUS_MULTIPROC_DIR"].startswith(m + "/") for m in mounts), (
            "PROMETHEUS_MULTIPROC_DIR must be on a mounted (writable) volume"
        )


# --- Kubernetes -------------------------------------------------------------------------


def _validate(doc: dict[str, Any], version: str, where: str) -> None:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
        return
    except kubernetes_validate.ValidationError as exc:
        location = ".".join(str(p) for p in exc.path)
        message = f"{where}: {doc['kind']}/{doc['metadata']['name']} at {location}: {exc.message}"
    pytest.fail(message)  # outside the except: the schema dump of the chained error is noise


CORE_DOCS = [
    pytest.param(path, doc, id=f"{_rel(path)}:{doc['kind']}")
    for path, doc in all_docs()
    if path.is_relative_to(KUBERNETES) and doc["kind"] not in ("ServiceMonitor", "PrometheusRule", "ScaledObject")
]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(("path", "doc"), CORE_DOCS)
def test_kubernetes_manifest_validates(path: Path, doc: dict[str, Any], version: str) -> None:
    _validate(doc, version, _rel(path))


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_rendered_kustomizations_validate(rendered: dict[str, list[dict[str, Any]]], version: str) -> None:
    for where, docs in rendered.items():
        assert docs, f"{where} renders nothing"
        for doc in docs:
            _validate(doc, version, where)


def test_kustomization_references_exist() -> None:
    for directory in _kustomization_dirs():
        data = yaml_docs(directory / "kustomization.yaml")[0]
        assert data["kind"] in KUSTOMIZE_KINDS
        for ref in [*(data.get("resources") or []), *(data.get("components") or [])]:
            assert (directory / ref).exists(), f"{_rel(directory)}: {ref} does not exist"


def test_pools_are_separate(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Each pool's Service, PDB and HPA reach only that pool's pods; every pool serves a model set."""
    pools = {k: v for k, v in rendered.items() if "/pools/" in k}
    assert len(pools) >= 2
    pod_labels = {
        where: next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["metadata"]["labels"]
        for where, docs in pools.items()
    }
    for where, docs in pools.items():
        by_kind = {d["kind"]: d for d in docs}
        deployment = by_kind["Deployment"]
        env = _env_list(deployment["spec"]["template"]["spec"]["containers"][0])
        assert env["SCORING_MODELS"], f"{where}: a pool names its models"
        selectors = [
            by_kind["Service"]["spec"]["selector"],
            by_kind["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"],
        ]
        for selector in selectors:
            matching = [w for w, labels in pod_labels.items() if selector.items() <= labels.items()]
            assert matching == [where], f"{where}: selector {selector} matches pods of {matching}"
        if "HorizontalPodAutoscaler" in by_kind:
            target = by_kind["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
            assert target["name"] == deployment["metadata"]["name"]
            assert "replicas" not in deployment["spec"], "the HPA owns the replica count"


def _pod_volumes(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in pod.get("volumes") or []}


def test_deployment_is_gpu_non_root_read_only_and_drains(image: ImageConfig) -> None:
    (_, deployment), *_ = docs_of_kind("Deployment")
    spec = deployment["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert spec["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    assert (
        container["resources"]["limits"]["nvidia.com/gpu"]
        == container["resources"]["requests"]["nvidia.com/gpu"]
    )
    for key in ("cpu", "memory"):
        assert key in container["resources"]["requests"] and key in container["resources"]["limits"]
    # The image's USER is what runs unless the pod says otherwise: keep them the same.
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert image.user is not None
    assert str(pod["securityContext"]["runAsUser"]) == image.user.split(":")[0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    volumes = _pod_volumes(pod)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    _assert_grace_fits(pod["terminationGracePeriodSeconds"], container, "deployment")


def _prestop_seconds(container: dict[str, Any]) -> int:
    pre_stop = container["lifecycle"]["preStop"]
    if "sleep" in pre_stop:
        return int(pre_stop["sleep"]["seconds"])
    command = pre_stop["exec"]["command"]
    assert command[0] == "sleep", command
    return int(command[1])


def _graceful_timeout(container: dict[str, Any]) -> int:
    env = {**parse_dockerfile().env, **_env_list(container)}
    return int(env.get("SCORING_GRACEFUL_TIMEOUT_S", Settings.model_fields["graceful_timeout_s"].default))


def _assert_grace_fits(grace: int, container: dict[str, Any], where: str) -> None:
    needed = _prestop_seconds(container) + _graceful_timeout(container)
    assert grace > needed, f"{where}: terminationGracePeriodSeconds {grace} <= preStop + drain {needed}"


def test_hpa_scales_on_the_queue_and_refusal_metrics_the_adapter_serves() -> None:
    ((_, hpa),) = docs_of_kind("HorizontalPodAutoscaler")
    names = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    assert names == {QUEUE_METRIC, REFUSAL_METRIC}
    assert names <= {r["name"]["as"] for r in adapter_rules()}
    (refusals,) = [r for r in adapter_rules() if r["name"]["as"] == REFUSAL_METRIC]
    # No refusal yet = no scoring_rejected_total series: the query must still give 0 per pod,
    # from a series every live worker exports, or the HPA never scales down.
    assert "scoring_rejected_total" in refusals["metricsQuery"] and " or " in refusals["metricsQuery"]
    assert series_name(refusals) == "scoring_worker_binding_info"
    assert QUEUE_METRIC.startswith("scoring_")
    assert hpa["spec"]["scaleTargetRef"]["name"] == docs_of_kind("Deployment")[0][1]["metadata"]["name"]
    (rule,) = [r for r in adapter_rules() if r["name"]["as"] == QUEUE_METRIC]
    series = series_name(rule)
    assert re.fullmatch(rule["name"]["matches"], series)
    defined = [p for p in (ROOT / "app").rglob("*.py") if f'"{series}"' in p.read_text(encoding="utf-8")]
    assert defined, f"prometheus-adapter reads {series}, which the server (app/) does not export"


def test_service_monitor_structure() -> None:
    ((path, monitor),) = docs_of_kind("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["name"]
    service = docs_of_kind("Service")[0][1]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items(), "selects the Services"
    port_names = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in port_names, _rel(path)
        assert endpoint["path"] == METRICS_PATH
        allowed = {"port", "path", "interval", "scrapeTimeout", "scheme", "relabelings", "authorization"}
        assert set(endpoint) <= allowed


def test_the_service_monitor_scrapes_with_a_key_the_server_accepts(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """With API keys on, /metrics needs a key (SCORING_METRICS_AUTH defaults to true): the
    ServiceMonitor's bearer token is a key of the Secret that the api-keys component hands the
    server as SCORING_API_KEYS. tests/unit/test_auth.py shows the server accepts it as a Bearer."""
    assert Settings.model_fields["metrics_auth"].default is True
    ((_, monitor),) = docs_of_kind("ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["authorization"]["type"] == "Bearer"
    secret = endpoint["authorization"]["credentials"]
    docs = rendered["deploy/kubernetes/examples/keys-and-volume"]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["SCORING_API_KEYS"]["valueFrom"]["secretKeyRef"] == secret
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["api-keys"]["secret"]["secretName"] == secret["name"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "api-keys")
    assert Path(env["SCORING_API_KEYS_FILE"]["value"]).parent == Path(mount["mountPath"])


def test_the_model_volume_is_the_repository_and_model_control_follows_it(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """Kubernetes can serve models that are not baked into the image: the model-volume
    component mounts a shared claim at SCORING_MODEL_REPOSITORY and turns on polling."""
    docs = rendered["deploy/kubernetes/examples/keys-and-volume"]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (claim,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = _env_list(container)
    volumes = _pod_volumes(pod)
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    mount = mounts[env["SCORING_MODEL_REPOSITORY"]]
    assert mount["readOnly"] is True
    assert volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert env["SCORING_MODEL_CONTROL_MODE"] == "poll"


def test_keda_scaled_object_uses_the_same_signals_and_reads_zero_without_refusals() -> None:
    ((path, scaled),) = docs_of_kind("ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    deployment = docs_of_kind("Deployment")[0][1]
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    triggers = {t["name"]: t for t in scaled["spec"]["triggers"]}
    assert set(triggers) == {"queue", "refusals"}
    for trigger in triggers.values():
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        assert trigger["metadata"]["query"].rstrip().endswith("or vector(0)"), _rel(path)
    assert "scoring_queue_depth" in triggers["queue"]["metadata"]["query"]
    assert "scoring_rejected_total" in triggers["refusals"]["metadata"]["query"]


# --- KServe -----------------------------------------------------------------------------

#: InferenceService predictor fields that are KServe's own, not a PodSpec's.
_PREDICTOR_ONLY = frozenset(
    {
        "minReplicas",
        "maxReplicas",
        "scaleTarget",
        "scaleMetric",
        "scaleMetricType",
        "containerConcurrency",
        "timeout",
        "canaryTrafficPercent",
        "logger",
        "batcher",
        "labels",
        "annotations",
        "deploymentStrategy",
        "autoScaling",
        "model",
        "storageUris",
        "workerSpec",
        "storageContainerName",
    }
)
#: predictor.model fields that are KServe's own, not a Container's.
_MODEL_ONLY = frozenset(
    {"modelFormat", "runtime", "runtimeVersion", "protocolVersion", "storageUri", "storage"}
)
#: ServingRuntime spec fields that are KServe's own, not a PodSpec's.
_RUNTIME_ONLY = frozenset(
    {
        "supportedModelFormats",
        "protocolVersions",
        "multiModel",
        "disabled",
        "builtInAdapter",
        "grpcEndpoint",
        "grpcDataEndpoint",
        "httpDataEndpoint",
        "replicas",
        "storageHelper",
        "annotations",
        "labels",
        "workerSpec",
    }
)


def _as_deployment(
    name: str, pod_spec: dict[str, Any], strategy: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A synthetic Deployment around ``pod_spec``, to check it against the core schemas."""
    labels = {"app": name}
    spec: dict[str, Any] = {
        "selector": {"matchLabels": labels},
        "template": {"metadata": {"labels": labels}, "spec": pod_spec},
    }
    if strategy is not None:
        spec["strategy"] = strategy
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name}, "spec": spec}


def _runtimes() -> dict[str, dict[str, Any]]:
    return {
        d["metadata"]["name"]: d
        for _, d in all_docs()
        if d["kind"] in ("ServingRuntime", "ClusterServingRuntime")
    }


def test_serving_runtime_structure() -> None:
    runtimes = _runtimes()
    assert runtimes
    for name, runtime in runtimes.items():
        assert runtime["apiVersion"] == f"{KSERVE_GROUP}/v1alpha1"
        spec = runtime["spec"]
        formats = spec["supportedModelFormats"]
        assert formats and all(isinstance(f["name"], str) and f["name"] for f in formats)
        assert all(isinstance(f.get("version", ""), str) for f in formats), "versions are strings"
        assert {"v1", "v2"} <= set(spec["protocolVersions"]) <= KSERVE_PROTOCOLS
        (container,) = spec["containers"]
        assert container["name"] == "kserve-container", "KServe merges the predictor into this name"
        assert container["image"]
        env = _env_list(container)
        assert env["SCORING_MODEL_REPOSITORY"] == KSERVE_STORAGE_MOUNT
        assert env["SCORING_HOST"] == "0.0.0.0"
        image = parse_dockerfile()
        assert isinstance(image.entrypoint, list) and isinstance(image.cmd, list)
        assert [*container["command"], *container["args"]] == [*image.entrypoint, *image.cmd]
        assert int(spec["annotations"]["prometheus.kserve.io/port"]) == _effective_port(container)
        assert spec["annotations"]["prometheus.kserve.io/path"] == METRICS_PATH
        pod = {k: v for k, v in spec.items() if k not in _RUNTIME_ONLY}
        for version in KUBERNETES_VERSIONS:
            _validate(_as_deployment(name, pod), version, f"ServingRuntime {name} as a pod")


def test_kserve_runtime_passes_restricted_pod_security_and_exposes_grpc() -> None:
    """The restricted Pod Security level needs seccompProfile RuntimeDefault; service links off
    (a Service named scoring-grpc would inject SCORING_GRPC_PORT=tcp://...); gRPC exposed on the
    port the server binds; the image set by kustomize, not written in the runtime."""
    for name, runtime in _runtimes().items():
        (container,) = runtime["spec"]["containers"]
        assert container["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert container["securityContext"]["runAsNonRoot"] is True
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["h2c"] == _effective_port(container, "grpc_port")
        assert "grpc-v2" in runtime["spec"]["protocolVersions"]
        assert "/" not in container["image"], "the registry comes from deploy/kserve/kustomization.yaml"
    for path, isvc in docs_of_kind("InferenceService"):
        assert isvc["spec"]["predictor"]["enableServiceLinks"] is False, _rel(path)
    kustomization = yaml_docs(KSERVE / "kustomization.yaml")[0]
    assert {i["name"] for i in kustomization["images"]} == {c["image"] for r in _runtimes().values() for c in r["spec"]["containers"]}
    with pytest.raises(ValueError):  # what a service link would inject
        Settings.model_validate({"grpc_port": "tcp://10.0.0.1:8081"})


def _cpus(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def _sized_containers(rendered: dict[str, list[dict[str, Any]]]) -> Iterator[tuple[str, dict[str, Any], dict[str, str]]]:
    """(where, container with its resources, its SCORING_* env) for every rendered Deployment
    and every InferenceService merged with its runtime."""
    for where, docs in rendered.items():
        for doc in docs:
            if doc["kind"] == "Deployment":
                (container,) = doc["spec"]["template"]["spec"]["containers"]
                yield where, container, _env_list(container)
    runtimes = _runtimes()
    for path, isvc in docs_of_kind("InferenceService"):
        model = isvc["spec"]["predictor"]["model"]
        (runtime_container,) = runtimes[model["runtime"]]["spec"]["containers"]
        env = {**_env_list(runtime_container), **_env_list(model)}
        yield _rel(path), model, env


def test_workers_per_gpu_and_cpus_follow_the_sizing_rule(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """4 workers per GPU (measured best on an H100 and an H200, docs/benchmarks.md), and CPUs
    = workers x (torch threads + 1) (docs/deploy.md, Sizing workers per GPU)."""
    checked = 0
    for where, container, env in _sized_containers(rendered):
        per_gpu = int(env["SCORING_MAX_PROCESSES_PER_GPU"])
        assert per_gpu == 4, where
        gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        threads = int(env.get("SCORING_TORCH_THREADS", "1"))
        needed = gpus * per_gpu * (threads + 1)
        assert _cpus(container["resources"]["requests"]["cpu"]) >= needed, f"{where}: {needed} CPUs"
        checked += 1
    assert checked >= 4
    assert re.search(r"^Environment=SCORING_MAX_PROCESSES_PER_GPU=4$", SYSTEMD_UNIT.read_text(), re.M)


def test_inference_service_structure() -> None:
    runtimes = _runtimes()
    services = docs_of_kind("InferenceService")
    assert services
    for path, isvc in services:
        assert isvc["apiVersion"] == f"{KSERVE_GROUP}/v1beta1"
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", isvc["metadata"]["name"]), "DNS-1035 name"
        predictor = isvc["spec"]["predictor"]
        model = predictor["model"]
        runtime = runtimes[model["runtime"]]
        formats = {(f["name"], f.get("version")) for f in runtime["spec"]["supportedModelFormats"]}
        assert (model["modelFormat"]["name"], model["modelFormat"].get("version")) in formats
        assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
        assert re.match(r"^[a-z0-9]+://", model["storageUri"])
        assert model["resources"]["limits"]["nvidia.com/gpu"]
        assert predictor["minReplicas"] <= predictor["maxReplicas"]
        assert predictor["deploymentStrategy"]["rollingUpdate"]["maxUnavailable"] == 0
        (runtime_container,) = runtime["spec"]["containers"]
        merged = {**runtime_container, "env": [*runtime_container["env"], *model.get("env", [])]}
        _assert_grace_fits(predictor["terminationGracePeriodSeconds"], merged, _rel(path))
        container = {k: v for k, v in model.items() if k not in _MODEL_ONLY}
        pod = {k: v for k, v in predictor.items() if k not in _PREDICTOR_ONLY}
        pod["containers"] = [{"name": "kserve-container", "image": runtime_container["image"], **container}]
        for version in KUBERNETES_VERSIONS:
            _validate(
                _as_deployment(isvc["metadata"]["name"], pod, predictor["deploymentStrategy"]),
                version,
                f"{_rel(path)} predictor as a Deployment",
            )


# --- systemd ----------------------------------------------------------------------------


def _unit() -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    for line in SYSTEMD_UNIT.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        values.setdefault(key.strip(), []).append(value.strip())
    return values


def _unit_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for value in _unit().get("Environment", []):
        for token in shlex.split(value):
            key, _, val = token.partition("=")
            env[key] = val
    return env


def test_systemd_unit() -> None:
    unit = _unit()
    (exec_start,) = unit["ExecStart"]
    argv = shlex.split(exec_start)
    assert Path(argv[0]).name == "gunicorn" and argv[1:] == ["-c", "gunicorn.conf.py"]
    assert unit["KillMode"] == ["mixed"] and unit["KillSignal"] == ["SIGTERM"]
    env = _unit_env()
    graceful = int(env.get("SCORING_GRACEFUL_TIMEOUT_S", Settings.model_fields["graceful_timeout_s"].default))
    assert int(unit["TimeoutStopSec"][0]) > graceful
    runtime_dirs = {f"/run/{d}" for d in unit["RuntimeDirectory"][0].split()}
    assert env["SCORING_RUN_DIR"] in runtime_dirs, "systemd creates the run directory"
    metrics = env.get("PROMETHEUS_MULTIPROC_DIR")
    assert metrics is None or Path(metrics).parent == Path(env["SCORING_RUN_DIR"]), "inside the run dir"


def test_systemd_runtime_directory_mode_is_one_the_server_accepts(tmp_path: Path) -> None:
    """systemd makes the RuntimeDirectory with RuntimeDirectoryMode (default 0755) before the
    server starts; the server then checks it (app/server/rundir.py) and must accept it."""
    from app.server import rundir

    (mode,) = _unit().get("RuntimeDirectoryMode", ["0755"])
    made = tmp_path / "scoring-server"
    made.mkdir()
    made.chmod(int(mode, 8))
    assert rundir.prepare(made) == made
    made.chmod(0o750)  # what the unit used to set: refused, so the test can fail
    with pytest.raises(rundir.RunDirError, match="open to other users"):
        rundir.prepare(made)
