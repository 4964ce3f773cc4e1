"""scripts/export_ranking_model.py: exported files (torch.export, TorchScript, ONNX) reproduce
the eager FeedRanker."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch

from tests.support.gunicorn import ROOT
from tests.support.tools import load_tool

REPOSITORY = ROOT / "model_repository"


script = load_tool("export_ranking_model.py")


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every format, exported once for the module: format -> model file."""
    return {
        fmt: script.export(tmp_path_factory.mktemp(fmt) / "feed-ranker", fmt, seed=3)
        for fmt in ("torch_export", "torchscript", "onnx")
    }


@pytest.mark.parametrize("fmt", ["torch_export", "torchscript", "onnx"])
@pytest.mark.parametrize("batch_size", [1, 7, 256])
def test_exported_model_matches_eager(exported: dict[str, Path], fmt: str, batch_size: int) -> None:
    loaded = script.load_exported(exported[fmt])
    eager = script.build_model(3)
    generator = torch.Generator().manual_seed(batch_size)
    features = torch.randn(batch_size, 32, generator=generator)
    user = torch.randn(1, 32, generator=generator).expand(batch_size, 32)
    with torch.inference_mode():
        expected = eager(features, user)
        got = loaded(features, user)
    assert got.shape == (batch_size, 1)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    assert bool(((got > 0) & (got < 1)).all())


def test_files_are_the_ones_the_format_names(exported: dict[str, Path]) -> None:
    assert exported["torch_export"].name == "model.pt2"
    assert exported["torchscript"].name == "model.pt"
    assert exported["onnx"].name == "model.onnx"
    assert isinstance(torch.export.load(exported["torch_export"]), torch.export.ExportedProgram)


def test_onnx_graph_has_a_dynamic_batch_axis_and_the_served_names(exported: dict[str, Path]) -> None:
    import onnxruntime

    session = onnxruntime.InferenceSession(str(exported["onnx"]), providers=["CPUExecutionProvider"])
    (features, user), (probability,) = session.get_inputs(), session.get_outputs()
    assert (features.name, features.type) == ("features", "tensor(float)")
    assert not isinstance(features.shape[0], int) and features.shape[1] == 32
    assert (user.name, user.shape[1]) == ("user", 32)
    assert (probability.name, probability.type, probability.shape[1]) == (
        "click_probability",
        "tensor(float)",
        1,
    )
    assert exported["onnx"].stat().st_size < 100_000  # the weights are inside: no external data file
    assert {p.name for p in exported["onnx"].parent.iterdir()} == {"model.onnx", "model.toml"}


def test_the_onnx_twin_is_the_same_model(exported: dict[str, Path]) -> None:
    features = torch.randn(300, 32, generator=torch.Generator().manual_seed(5))  # past the .pt2's bound
    user = torch.randn(300, 32, generator=torch.Generator().manual_seed(6))
    got = script.load_exported(exported["onnx"])(features, user)
    want = script.build_model(3)(features, user).detach()
    assert got.shape == (300, 1)
    assert float((got - want).abs().max()) <= 1e-6


@pytest.mark.parametrize(
    ("fmt", "file"), [("torch_export", "model.pt2"), ("torchscript", "model.pt"), ("onnx", "model.onnx")]
)
def test_model_toml_describes_the_export(exported: dict[str, Path], fmt: str, file: str) -> None:
    with (exported[fmt].parent / "model.toml").open("rb") as f:
        config = tomllib.load(f)
    assert config["name"] == "feed-ranker"
    assert config["format"] == fmt
    assert config["file"] == file
    assert config["max_batch_size"] == 256
    assert config["max_queue_delay_ms"] == 0.0
    assert config["inputs"] == [
        {"name": "features", "datatype": "FP32", "shape": [32]},
        {"name": "user", "datatype": "FP32", "shape": [32], "shared": "repeat", "optional": True},
    ]
    assert config["outputs"] == [{"name": "click_probability", "datatype": "FP32", "shape": [1]}]
    assert "handler" not in config
    assert "parameters" not in config
    assert isinstance(config["version"], str)
    assert isinstance(config["queue_capacity"], int)
    assert isinstance(config["timeout_ms"], int)
    assert all(1 <= b <= 256 for b in config["warmup_batch_sizes"])


def test_weights_depend_on_the_seed_only() -> None:
    before = torch.random.get_rng_state()
    first, again, other = script.build_model(0), script.build_model(0), script.build_model(1)
    assert torch.equal(torch.random.get_rng_state(), before)
    for a, b in zip(first.state_dict().values(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(first.mlp[0].weight, other.mlp[0].weight)
    assert not first.training


def test_cli_writes_both_files(tmp_path: Path) -> None:
    out = tmp_path / "ranker"
    script.main(["--out", str(out), "--format", "torchscript", "--max-batch-size", "64"])
    with (out / "model.toml").open("rb") as f:
        config = tomllib.load(f)
    assert (out / "model.pt").is_file()
    assert config["file"] == "model.pt"
    assert config["max_batch_size"] == 64


def test_pt2_batch_dimension_is_bounded_by_max_batch_size(tmp_path: Path) -> None:
    loaded = script.load_exported(script.export(tmp_path, max_batch_size=16))
    assert loaded(torch.zeros(16, 32)).shape == (16, 1)
    with pytest.raises(Exception, match="16"):
        loaded(torch.zeros(17, 32))


def test_unknown_format_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tflite"):
        script.export(tmp_path, "tflite")


@pytest.mark.parametrize(("name", "fmt"), [("feed-ranker", "torch_export"), ("feed-ranker-onnx", "onnx")])
def test_committed_model_toml_is_what_the_script_writes(name: str, fmt: str) -> None:
    committed = REPOSITORY / name / "model.toml"
    assert committed.read_text(encoding="utf-8") == script._model_toml(name, fmt, 256)


def test_a_request_without_its_user_scores_as_the_model_without_that_input() -> None:
    """The user's projection is drawn after every other weight and adds to the first layer: with
    zeros for the user (the input omitted), each layer sees what a features-only model sees."""
    model = script.build_model(0)
    features = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        without = model(features, torch.zeros(5, 32))
        features_only = torch.sigmoid(model.mlp(features))
        user = model(features, torch.ones(5, 32))
    torch.testing.assert_close(without, features_only, rtol=0, atol=0)
    assert not torch.allclose(user, without)
