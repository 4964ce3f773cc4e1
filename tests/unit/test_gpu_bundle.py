"""scripts/gpu_bundle.py and scripts/gpu-acceptance: what an offline GPU host is given, and how
the acceptance run is called. Nothing here downloads (the wheels part needs pip's index and is
run by hand) or needs a GPU."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support.gunicorn import ROOT
from tests.support.tools import load_tool

bundle = load_tool("gpu_bundle.py")
ACCEPTANCE = ROOT / "scripts" / "gpu-acceptance"


def test_the_wheels_carry_the_servers_packages_and_not_the_hosts_stack() -> None:
    carried = bundle.carried_packages("3.12")
    # the server's own runtime and what the GPU tests need beyond pytest
    for name in (
        "gunicorn",
        "msgspec",
        "pydantic-settings",
        "prometheus-client",
        "pytest-aiohttp",
        "py3nvml",
    ):
        assert name in carried, name
    # the host's CUDA PyTorch, numpy and pytest (and what they need) stay on the host
    for name in ("torch", "numpy", "pytest", "sympy", "jinja2"):
        assert name not in carried, name
    # the generated gRPC code's minimum versions travel even though the host may have them
    assert {"protobuf", "grpcio"} <= set(carried)
    assert all(version for version in carried.values())


def test_the_requirements_file_names_every_server_requirement() -> None:
    lines = bundle.top_requirements("3.12")
    names = {canonicalize_name(Requirement(line).name) for line in lines}
    declared = {canonicalize_name(r.name) for r in bundle.server_requirements("3.12")}
    assert "gunicorn" in declared and "torch" in declared
    assert declared | set(bundle.TEST_ROOTS) == names
    # every package named there is carried or is the host's own (torch, numpy)
    host = bundle.closure(bundle.HOST_ROOTS, "3.12")
    assert names <= set(bundle.carried_packages("3.12")) | set(host)


@pytest.mark.slow
def test_the_float16_minilm_loads_as_float32_with_the_same_embeddings(tmp_path: Path) -> None:
    folder = bundle.pack_minilm(tmp_path / "bundle", preset=0)
    assert (folder / "model.safetensors.xz").stat().st_size < 45e6  # half of 87 MB, compressed
    assert not (folder / "model.safetensors").exists()
    # what scripts/gpu-acceptance setup runs on the host (python scripts/gpu_bundle.py --unpack)
    assert bundle.unpack(folder.parent, tmp_path / "cache") == [str(tmp_path / "cache" / "minilm")]
    model_dir = tmp_path / "cache" / "minilm"
    export = load_tool("export_sentence_embedding.py")
    # the exporter asks for float32 whatever dtype the weights are stored in
    rounded = export.load_pipeline(model_dir)
    assert {p.dtype for p in rounded.parameters()} == {torch.float32}
    exact = export.load_pipeline(export.model_folder(None, bundle.MINILM_PACKAGE))
    texts = list(export.CHECK_TEXTS)
    a = exact.encode(texts, normalize_embeddings=True)
    b = rounded.encode(texts, normalize_embeddings=True)
    cosines = np.sum(a * b, axis=1)
    assert cosines.min() >= 0.99999, cosines


def test_the_weightless_minilm_unpacks_with_seeded_random_weights_of_its_shapes(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from app.handlers.embedding_pipeline import load_pipeline

    folder = bundle.pack_minilm_shape(tmp_path / "bundle")
    assert bundle.size_mb(folder) < 1.0 and not list(folder.glob("model.safetensors*"))
    (first,) = bundle.unpack(folder.parent, tmp_path / "a")
    (second,) = bundle.unpack(folder.parent, tmp_path / "b")
    a, b = load_file(Path(first) / "model.safetensors"), load_file(Path(second) / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the same seed
    assert a["embeddings.word_embeddings.weight"].shape == (30522, 384)
    pipeline = load_pipeline(Path(first), torch.device("cpu"), {"dtype": torch.float32})
    features = {
        "input_ids": torch.tensor([[101, 7592, 102]]),
        "attention_mask": torch.ones(1, 3, dtype=torch.long),
    }
    features["token_type_ids"] = torch.zeros_like(features["input_ids"])
    embedding = pipeline(features)
    assert embedding.shape == (1, 384) and torch.isfinite(embedding).all()


def acceptance(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(ACCEPTANCE), *args], capture_output=True, text=True, timeout=60)


def test_the_acceptance_script_lists_its_steps_and_refuses_unknown_ones() -> None:
    shown = acceptance("--help")
    assert shown.returncode == 0
    for step in ("setup", "tests", "bench", "check", "protocols"):
        assert f"  {step}" in shown.stdout, step
    unknown = acceptance("benchmark")
    assert unknown.returncode == 2
    assert "unknown argument 'benchmark'" in unknown.stderr
    none = acceptance("--out", "/nonexistent/out")
    assert none.returncode == 2
    assert "name at least one step" in none.stderr


def test_the_gpu_run_holds_each_step_to_its_limit_and_keeps_what_it_wrote(tmp_path: Path) -> None:
    import os
    import sys
    import tarfile

    env = {**os.environ, "PYTHON": sys.executable, "GPU_RUN_STEPS": "decoder bogus", "GPU_RUN_DECODER_S": "1"}
    done = subprocess.run(
        [str(ROOT / "scripts" / "gpu-run"), str(tmp_path / "out")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    log = (tmp_path / "out" / "run.log").read_text()
    assert "decoder: OUT OF TIME after" in log and "unknown step 'bogus'" in log
    assert all("] [" in line for line in log.splitlines() if line.startswith("[gpu-run"))  # the machine named
    with tarfile.open(tmp_path / "out" / "figures.tgz") as figures:
        assert "./run.log" in figures.getnames()
