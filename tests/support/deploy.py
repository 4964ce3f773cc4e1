"""Reading the deployment material for its checks (tests/deploy/test_deploy.py) and for the run
of the image's command on this machine (tests/e2e/test_deploy.py): the manifests under deploy/
and the final stage of the Dockerfile."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.support.gunicorn import ROOT

DEPLOY = ROOT / "deploy"
DOCKERFILE = ROOT / "Dockerfile"
HEALTH_READY = "/v2/health/ready"
HEALTH_LIVE = "/v2/health/live"
METRICS_PATH = "/metrics"


# --- manifests --------------------------------------------------------------------------


def yaml_docs(path: Path) -> list[dict[str, Any]]:
    """The non-empty YAML documents of ``path``."""
    with path.open(encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def manifest_files(root: Path) -> list[Path]:
    """The manifests under ``root``: every ``*.yaml`` but the kustomization files."""
    return sorted(p for p in root.rglob("*.yaml") if p.name not in ("kustomization.yaml",))


def all_docs() -> list[tuple[Path, dict[str, Any]]]:
    """(file, document) of every manifest under deploy/."""
    return [(path, doc) for path in manifest_files(DEPLOY) for doc in yaml_docs(path)]


def docs_of_kind(kind: str) -> list[tuple[Path, dict[str, Any]]]:
    """(file, document) of the manifests of ``kind``."""
    return [(path, doc) for path, doc in all_docs() if doc.get("kind") == kind]


def containers_of(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Containers of workload-like resources, KServe's included."""
    kind, spec = doc.get("kind"), doc.get("spec") or {}
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        pod = spec["template"]["spec"]
        yield from pod.get("initContainers") or []
        yield from pod["containers"]
    elif kind in ("ServingRuntime", "ClusterServingRuntime"):
        yield from spec["containers"]
    elif kind == "InferenceService":
        predictor = spec["predictor"]
        if "model" in predictor:
            yield predictor["model"]
        yield from predictor.get("containers") or []


def probes_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The startup, readiness and liveness probes ``container`` declares."""
    return {k: container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in container}


def served_containers() -> list[tuple[Path, dict[str, Any]]]:
    """Containers that run the scoring server (the ISVC's model inherits the runtime's)."""
    return [
        (path, c)
        for path, doc in all_docs()
        if doc["kind"] in ("Deployment", "ServingRuntime")
        for c in containers_of(doc)
    ]


def adapter_rules() -> list[dict[str, Any]]:
    """The prometheus-adapter rules (the ``adapter-config`` ConfigMap)."""
    (config_map,) = [d for _, d in docs_of_kind("ConfigMap") if d["metadata"]["name"] == "adapter-config"]
    return list(yaml.safe_load(config_map["data"]["config.yaml"])["rules"])


def series_name(rule: dict[str, Any]) -> str:
    """The Prometheus series an adapter rule reads."""
    match = re.match(r"^(\w+)\{", rule["seriesQuery"])
    assert match, rule["seriesQuery"]
    return match.group(1)


# --- Dockerfile -------------------------------------------------------------------------


@dataclass
class ImageConfig:
    """What a Dockerfile's final stage runs with (inherited from parent stages)."""

    env: dict[str, str] = field(default_factory=dict)
    entrypoint: list[str] | str | None = None
    cmd: list[str] | str | None = None
    healthcheck: list[str] | str | None = None
    user: str | None = None
    workdir: str | None = None
    runs: list[str] = field(default_factory=list)
    copies: list[str] = field(default_factory=list)
    base: str = ""


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs; continuation lines joined, comment lines dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continuation line"
    return out


def _expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), ""), value)


def _parse_env(args: str, env: dict[str, str]) -> dict[str, str]:
    tokens = shlex.split(args)
    if "=" not in tokens[0]:  # legacy form: ENV KEY value with spaces
        return {tokens[0]: _expand(args.split(None, 1)[1], env)}
    pairs = {}
    for token in tokens:
        key, sep, value = token.partition("=")
        assert sep, f"ENV {args!r}: {token!r} is not KEY=VALUE"
        pairs[key] = _expand(value, env)
    return pairs


def _exec_or_shell(args: str) -> list[str] | str:
    return json.loads(args) if args.startswith("[") else args


def parse_dockerfile(path: Path = DOCKERFILE) -> ImageConfig:
    """The final stage's configuration, following ``FROM <stage>`` chains."""
    stages: dict[str, ImageConfig] = {}
    current: ImageConfig | None = None
    for word, args in dockerfile_instructions(path.read_text(encoding="utf-8")):
        if word == "FROM":
            tokens = [t for t in args.split() if not t.startswith("--")]
            image, name = tokens[0], tokens[2] if len(tokens) >= 3 else None
            parent = stages.get(image)
            current = ImageConfig(
                env=dict(parent.env) if parent else {},
                entrypoint=parent.entrypoint if parent else None,
                cmd=parent.cmd if parent else None,
                healthcheck=parent.healthcheck if parent else None,
                user=parent.user if parent else None,
                workdir=parent.workdir if parent else None,
                runs=list(parent.runs) if parent else [],
                copies=list(parent.copies) if parent else [],
                base=parent.base if parent else image,
            )
            if name:
                stages[name] = current
            continue
        if current is None:
            assert word == "ARG", f"{word} before the first FROM"
            continue
        if word == "ENV":
            current.env.update(_parse_env(args, current.env))
        elif word == "ENTRYPOINT":
            current.entrypoint = _exec_or_shell(args)
            current.cmd = None  # Docker: a new ENTRYPOINT drops the inherited CMD
        elif word == "CMD":
            current.cmd = _exec_or_shell(args)
        elif word == "HEALTHCHECK":
            match = re.match(r"^(?:--\S+\s+)*CMD\s+(.*)$", args)
            current.healthcheck = _exec_or_shell(match.group(1)) if match else args
        elif word == "USER":
            current.user = args
        elif word == "WORKDIR":
            current.workdir = args
        elif word == "RUN":
            current.runs.append(args)
        elif word == "COPY":
            current.copies.append(args)
    assert current is not None, "Dockerfile has no FROM"
    return current
