"""benchmarks.decoder_check (issue 52's 7B classifier step) rehearsed on the CPU with its tiny
config: a run through the server's handler (its RADAR-style model.toml, pieces of 300 characters)
that writes every figure it promises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import decoder_check


def test_flops_and_peaks() -> None:
    assert decoder_check.forward_flops(10, 2, 4, [3, 1]) == 2 * 10 * 4 + 4 * 2 * 4 * (9 + 1)
    assert decoder_check.peak_tflops("NVIDIA H100 80GB HBM3", None) == 989.0
    assert decoder_check.peak_tflops("NVIDIA H100 PCIe", None) == 756.0
    assert decoder_check.peak_tflops("NVIDIA H200", None) == 989.0
    assert decoder_check.peak_tflops("cpu", None) is None
    assert decoder_check.peak_tflops("cpu", 1.5) == 1.5
    with pytest.raises(ValueError, match="more --posts"):
        next(decoder_check.batches([[1]], 2))


def test_the_tiny_rehearsal_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "decoder_check.json"
    argv = [
        "--size",
        "tiny",
        "--device",
        "cpu",
        "--posts",
        "2",
        "--batch",
        "4",
        "--seconds",
        "0.2",
        "--out",
        str(out),
    ]
    assert decoder_check.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["size"] == "tiny" and result["pieces"] >= 40  # 2 posts of 1,500 words
    assert result["split_ms_per_post"] > 0 and set(result["cost_model"]) == {
        "call_overhead_tokens",
        "attention_knee_tokens",
    }
    assert 0 < result["mean_tokens_per_piece"] <= result["max_tokens_per_piece"]
    assert result["plan"]["weight_bytes"] == 2 * result["plan"]["parameters"]
    assert result["items"] >= 4 and result["items_per_s"] > 0 and result["x_seed"] > 0
    assert result["mfu"] is None and result["memory"] == {}  # a CPU has no peak table entry nor CUDA memory
