"""The ONNX harnesses' own arithmetic (benchmarks/onnx.py, benchmarks/onnx_precision.py): how the
rounds of a point are merged, the cosine, and the tables, on made-up figures."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from benchmarks import onnx, onnx_precision


def test_rounds_of_a_point_merge_into_one_row() -> None:
    rows = [
        {"items_per_s": 100.0, "p50_ms": 10.0, "p99_ms": 30.0, "statuses": {"200": 50}},
        {"items_per_s": 120.0, "p50_ms": 12.0, "p99_ms": 25.0, "statuses": {"200": 60, "503": 2}},
        {"items_per_s": 110.0, "p50_ms": 11.0, "p99_ms": 40.0, "statuses": {"200": 55}},
    ]
    merged = onnx.merge(rows, 15.0)
    assert merged == {
        "items_per_s": 110.0,
        "p50_ms": 11.0,
        "p99_ms": 40.0,
        "statuses": {"200": 165, "503": 2},
        "seconds": 45.0,
    }


def test_served_table_shows_the_ratio_and_other_answers() -> None:
    row = {"items_per_s": 100.0, "p50_ms": 10.0, "p99_ms": 20.0, "statuses": {"200": 9}}
    point = {
        "model": "all-MiniLM-L6-v2",
        "set": "mix",
        "concurrency": 8,
        "torch": row,
        "onnx": {**row, "items_per_s": 130.0, "statuses": {"200": 9, "503": 1}},
        "items_ratio": 1.3,
        "p50_ratio": 1.0,
    }
    result: dict[str, Any] = {
        "workers": 2,
        "torch_threads": 1,
        "duration_s": 15.0,
        "rounds": 2,
        "date": "2026-11-24",
        "items": 8,
        "ranker_items": 1,
        "points": [point],
    }
    table = onnx.markdown(result)
    assert (
        "| all-MiniLM-L6-v2 | mix | 8 | 100.0 | 130.0 | **1.30** | 10.0 | 10.0 | 1.00 | onnx 503: 1 |"
        in table
    )


def test_cosines_are_row_wise() -> None:
    a = np.array([[1.0, 0.0], [1.0, 1.0]], dtype=np.float32)
    b = np.array([[2.0, 0.0], [1.0, -1.0]], dtype=np.float32)
    np.testing.assert_allclose(onnx_precision.cosines(a, b), [1.0, 0.0], atol=1e-12)


def test_precision_table_compares_with_torch() -> None:
    result: dict[str, Any] = {
        "device": "cpu",
        "threads": 1,
        "batch": 32,
        "date": "2026-11-24",
        "machine": {"load_average": 0.5},
        "texts": 1000,
        "rounds": 3,
        "speed_texts": 256,
        "clock": "cpu",
        "accuracy": {
            "torch": {"min_cosine": 1.0, "mean_cosine": 1.0},
            "int8": {"min_cosine": 0.95957, "mean_cosine": 0.9846},
        },
        "speed": {"torch": {"short": 200.0, "mix": 40.0}, "int8": {"short": 330.0, "mix": 66.0}},
    }
    table = onnx_precision.markdown(result)
    assert "items per CPU second" in table
    assert "| int8 | model.int8.onnx | 0.95957 | 0.98460 | 330.0 | 1.65x | 66.0 | 1.65x |" in table


@pytest.mark.parametrize("argv", [[], ["--threads", "1", "--clock", "cpu", "--rounds", "1"]])
def test_precision_options(argv: list[str]) -> None:
    args = onnx_precision.parse_args(argv)
    assert args.texts == 1000 and args.batch == 32
    assert args.clock in onnx_precision.CLOCKS
