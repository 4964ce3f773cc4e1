"""scripts/export_ranking_model.py: exported files reproduce the eager FeedRanker."""

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
    """Both formats, exported once for the module: format -> model file."""
    return {
        fmt: script.export(tmp_path_factory.mktemp(fmt) / "feed-ranker", fmt, seed=3)
        for fmt in ("torch_export", "torchscript")
    }


@pytest.mark.parametrize("fmt", ["torch_export", "torchscript"])
@pytest.mark.parametrize("batch_size", [1, 7, 256])
def test_exported_model_matches_eager(exported: dict[str, Path], fmt: str, batch_size: int) -> None:
    loaded = script.load_exported(exported[fmt])
    eager = script.build_model(3)
    features = torch.randn(batch_size, 32, generator=torch.Generator().manual_seed(batch_size))
    with torch.inference_mode():
        expected = eager(features)
        got = loaded(features)
    assert got.shape == (batch_size, 1)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    assert bool(((got > 0) & (got < 1)).all())


def test_files_are_the_ones_the_format_names(exported: dict[str, Path]) -> None:
    assert exported["torch_export"].name == "model.pt2"
    assert exported["torchscript"].name == "model.pt"
    assert isinstance(torch.export.load(exported["torch_export"]), torch.export.ExportedProgram)


@pytest.mark.parametrize(("fmt", "file"), [("torch_export", "model.pt2"), ("torchscript", "model.pt")])
def test_model_toml_describes_the_export(exported: dict[str, Path], fmt: str, file: str) -> None:
    with (exported[fmt].parent / "model.toml").open("rb") as f:
        config = tomllib.load(f)
    assert config["name"] == "feed-ranker"
    assert config["format"] == fmt
    assert config["file"] == file
    assert config["max_batch_size"] == 256
    assert config["max_queue_delay_ms"] == 0.0
    assert config["inputs"] == [{"name": "features", "datatype": "FP32", "shape": [32]}]
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
    with pytest.raises(ValueError, match="onnx"):
        script.export(tmp_path, "onnx")


def test_committed_model_toml_is_what_the_script_writes() -> None:
    committed = REPOSITORY / "feed-ranker" / "model.toml"
    assert committed.read_text(encoding="utf-8") == script._model_toml("feed-ranker", "torch_export", 256)
