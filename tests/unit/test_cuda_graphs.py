"""CUDA graphs of tensor models (``cuda_graph_batch_sizes``), on the CPU: the option's validation,
its being ignored on the CPU, and :class:`GraphBuckets`' bucket choice, zero padding, output
slicing and cloning, and eager fallback, with CPU stand-ins for the captured graphs (a replay that
runs the module on the static inputs into the static outputs, as a graph would).

What only a GPU can show (capture, replay on the runner's streams, parity with eager): tests/gpu/test_gpu.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from app.errors import ModelLoadError
from app.models.repository import ModelConfig, read_config
from app.models.torch_formats import Bucket, GraphBuckets, TorchExportHandler
from app.serving.runner import ModelRunner
from tests.support.toy_models import TinyRanker, write_scale_model, write_tensor_model


class Replays:
    """CPU stand-ins for captured graphs: each replay runs ``module`` on a bucket's static inputs
    and writes its static outputs in place, and records (bucket size, a copy of the static
    inputs) so tests can see what the "graph" read."""

    def __init__(self, module: Callable[..., Any]) -> None:
        self.module = module
        self.seen: list[tuple[int, list[torch.Tensor]]] = []

    def bucket(self, size: int, widths: list[int]) -> Bucket:
        inputs = [torch.zeros(size, w) for w in widths]
        outputs = self.module(*inputs)

        def replay() -> None:
            self.seen.append((size, [t.clone() for t in inputs]))
            fresh = self.module(*inputs)
            if isinstance(outputs, torch.Tensor):
                outputs.copy_(fresh)
            else:
                for name in outputs:
                    outputs[name].copy_(fresh[name])

        return Bucket(size, inputs, outputs, replay)


def affine(x: torch.Tensor) -> torch.Tensor:
    """Row-wise: each output row depends on its input row only, as in a batched model."""
    return 2 * x + 1


class Eager:
    """The eager module, counting its calls."""

    def __init__(self, module: Callable[..., Any]) -> None:
        self.module = module
        self.calls: list[int] = []

    def __call__(self, *batch: torch.Tensor) -> Any:
        self.calls.append(int(batch[0].shape[0]))
        return self.module(*batch)


def graphs(
    sizes: list[int], widths: list[int] | None = None, module: Callable[..., Any] = affine
) -> tuple[GraphBuckets, Replays, Eager]:
    """GraphBuckets of ``sizes`` over ``module`` with stand-in graphs, its replays and its eager path."""
    replays = Replays(module)
    eager = Eager(module)
    # given out of order: GraphBuckets sorts them
    buckets = [replays.bucket(s, widths or [3]) for s in reversed(sizes)]
    return GraphBuckets(buckets, eager), replays, eager


def batch(items: int, width: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randn(items, width, generator=torch.Generator().manual_seed(seed)) + 5  # no zero rows


# --- bucket choice ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("items", "bucket"), [(1, 1), (2, 4), (3, 4), (4, 4), (5, 8), (8, 8), (9, None), (100, None)]
)
def test_a_batch_runs_in_the_smallest_bucket_that_holds_it(items: int, bucket: int | None) -> None:
    buckets, replays, eager = graphs([1, 4, 8])
    chosen = buckets.bucket_for(items)
    assert (chosen.size if chosen else None) == bucket
    out = buckets(batch(items))
    torch.testing.assert_close(out, affine(batch(items)))
    if bucket is None:
        assert eager.calls == [items] and replays.seen == []
    else:
        assert eager.calls == [] and [size for size, _ in replays.seen] == [bucket]


@torch.inference_mode()
def test_a_real_model_through_the_buckets_matches_it_eagerly() -> None:
    model = TinyRanker().eval()
    buckets, replays, _ = graphs([1, 4, 8], widths=[4], module=model)
    for items in range(1, 13):  # on, between and above the buckets
        features = batch(items, width=4, seed=items)
        torch.testing.assert_close(buckets(features), model(features))
    assert [size for size, _ in replays.seen] == [1, 4, 4, 4, 8, 8, 8, 8]


def test_sizes_are_sorted() -> None:
    buckets, _, _ = graphs([8, 1, 4])
    assert buckets.sizes == [1, 4, 8]


# --- padding ------------------------------------------------------------------------------


def test_the_rows_after_the_batch_are_zeros_even_after_a_larger_batch() -> None:
    buckets, replays, _ = graphs([8])
    first, second, third = batch(7, seed=1), batch(3, seed=2), batch(5, seed=3)
    for b in (first, second, third):
        buckets(b)
    for (_, (read,)), b in zip(replays.seen, (first, second, third), strict=True):
        items = b.shape[0]
        torch.testing.assert_close(read[:items], b)
        assert bool((read[items:] == 0).all()), f"padding after {items} items is not zeros: {read[items:]}"


def test_a_full_bucket_has_no_padding() -> None:
    buckets, replays, _ = graphs([4])
    buckets(batch(4))
    torch.testing.assert_close(replays.seen[0][1][0], batch(4))


def test_every_input_is_copied_and_padded() -> None:
    def two(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a.sum(dim=1, keepdim=True) * b[:, :1]

    buckets, replays, _ = graphs([4], widths=[3, 2], module=two)
    a, b = batch(6, 3, seed=1)[:3], batch(6, 2, seed=2)[:3]
    out = buckets(a, b)
    torch.testing.assert_close(out, two(a, b))
    read_a, read_b = replays.seen[0][1]
    torch.testing.assert_close(read_a[:3], a)
    torch.testing.assert_close(read_b[:3], b)


# --- outputs ------------------------------------------------------------------------------


def test_outputs_are_the_batch_rows_cloned_from_the_static_outputs() -> None:
    buckets, _, _ = graphs([8])
    static = buckets.bucket_for(8)
    assert static is not None
    first = buckets(batch(5, seed=1))
    assert first.shape == (5, 3)
    assert first.untyped_storage().data_ptr() != static.outputs.untyped_storage().data_ptr()
    buckets(batch(6, seed=2))  # the next replay overwrites the static outputs
    torch.testing.assert_close(first, affine(batch(5, seed=1)))


def test_mapping_outputs_keep_their_names() -> None:
    def named(x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"double": 2 * x, "total": x.sum(dim=1, keepdim=True)}

    buckets, _, _ = graphs([2, 4], module=named)
    x = batch(3)
    out = buckets(x)
    assert set(out) == {"double", "total"}
    torch.testing.assert_close(out["double"], 2 * x)
    torch.testing.assert_close(out["total"], x.sum(dim=1, keepdim=True))


# --- the option ---------------------------------------------------------------------------


def _config(tmp_path: Path, **fields: Any) -> ModelConfig:
    write_tensor_model(tmp_path, "ranker", "torch_export")  # max_batch_size = 16, inputs [4]
    config = read_config(tmp_path / "ranker")
    return msgspec.structs.replace(config, **fields)


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ([4, 2], "ascending without repeats"),
        ([1, 2, 2], "ascending without repeats"),
        ([0, 4], r"1\.\.max_batch_size \(16\)"),
        ([1, 32], r"1\.\.max_batch_size \(16\)"),
    ],
)
def test_bad_batch_sizes_are_refused(tmp_path: Path, sizes: list[int], message: str) -> None:
    config = _config(tmp_path, cuda_graph_batch_sizes=sizes)
    with pytest.raises(ModelLoadError, match=f"ranker/model.toml: cuda_graph_batch_sizes.*{message}"):
        config.validate()


def test_the_option_is_read_from_model_toml(tmp_path: Path) -> None:
    write_tensor_model(tmp_path, "ranker", "torchscript")
    toml = tmp_path / "ranker" / "model.toml"
    toml.write_text("cuda_graph_batch_sizes = [1, 4, 16]\n" + toml.read_text())
    assert read_config(tmp_path / "ranker").cuda_graph_batch_sizes == [1, 4, 16]
    toml.write_text(toml.read_text().replace("[1, 4, 16]", "[4, 1]"))
    with pytest.raises(ModelLoadError, match="ascending"):
        read_config(tmp_path / "ranker")


def test_a_handler_that_captures_no_graphs_refuses_them_at_load(tmp_path: Path) -> None:
    config = read_config(write_scale_model(tmp_path, "scale"))
    config.cuda_graph_batch_sizes = [1]
    config.validate()  # the text handlers capture graphs: a handler may ask
    with pytest.raises(ModelLoadError, match="does not capture CUDA graphs; remove cuda_graph_batch_sizes"):
        ModelRunner(config).load(torch.device("cpu"))


def test_variable_input_dimensions_cannot_be_captured(tmp_path: Path) -> None:
    config = _config(tmp_path, cuda_graph_batch_sizes=[1, 2])
    config.validate()
    config.inputs = [msgspec.structs.replace(config.inputs[0], shape=[-1])]
    with pytest.raises(ModelLoadError, match=r"fixed shapes.*\['features'\].*variable"):
        config.validate()


def test_off_by_default(tmp_path: Path) -> None:
    assert _config(tmp_path).cuda_graph_batch_sizes == []


def test_on_the_cpu_the_option_is_ignored_with_one_info_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    eager = ModelRunner(_config(tmp_path))
    eager.load(torch.device("cpu"))
    config = _config(tmp_path, cuda_graph_batch_sizes=[1, 4, 16])
    config.validate()
    with caplog.at_level(logging.INFO, logger="app.models.torch_formats"):
        runner = ModelRunner(config)
        runner.load(torch.device("cpu"))
        runner.warmup()
    lines = [r for r in caplog.records if r.name == "app.models.torch_formats"]
    assert [(r.levelno, r.getMessage()) for r in lines] == [
        (logging.INFO, "model ranker: cuda_graph_batch_sizes ignored on cpu (CUDA graphs need a CUDA device)")
    ]
    assert isinstance(runner.handler, TorchExportHandler)
    assert runner.handler.cuda_graph_batch_sizes == []
    features = np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)
    np.testing.assert_array_equal(
        runner.forward({"features": features})["probability"], eager.forward({"features": features})["probability"]
    )
