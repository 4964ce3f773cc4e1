"""ONNX models for tests: the toy ranker of :mod:`tests.support.toy_models` as an ONNX graph
(written with ``onnx.helper`` from the same weights, in milliseconds, or exported with
``torch.onnx.export``), and ONNX files broken in each way the ``onnx`` format must refuse."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.support.toy_models import TENSOR_TOML, TinyRanker

ONNX_FILE = "model.onnx"


def tiny_ranker_graph(
    *,
    input_name: str = "features",
    output_name: str = "probability",
    dtype: Any = np.float32,
    batch: int | str = "batch",
    width: int = 1,
    output_shape: list[int | str] | None = None,
    extra_output: bool = False,
    twice: bool = False,
) -> bytes:
    """TinyRanker (``sigmoid(features @ W.T + b)``, W ``[1, 4]``) as a serialised ONNX model:
    input ``[batch, 4]``, output ``[batch, width]`` (``output_shape`` overrides what the graph
    declares of its output, the computation unchanged; ``width`` > 1 repeats the weights);
    ``extra_output`` adds an output ``logit`` that model.toml need not declare; ``twice`` returns
    every row twice (``[2 x batch, width]``: a size no shape inference knows before a run)."""
    import onnx
    from onnx import helper, numpy_helper

    model = TinyRanker().eval()
    weight = model.linear.weight.detach().numpy().T.astype(dtype)  # [4, 1]
    bias = model.linear.bias.detach().numpy().astype(dtype)
    weight, bias = np.repeat(weight, width, axis=1), np.repeat(bias, width)
    element = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    declared = output_shape if output_shape is not None else [batch, width]
    outputs = [helper.make_tensor_value_info(output_name, element, declared)]
    if extra_output:
        outputs.append(helper.make_tensor_value_info("logit", element, [batch, width]))
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", [input_name, "W"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["logit"]),
            helper.make_node("Sigmoid", ["logit"], ["rows" if twice else output_name]),
            *([helper.make_node("Concat", ["rows", "rows"], [output_name], axis=0)] if twice else []),
        ],
        "tiny_ranker",
        [helper.make_tensor_value_info(input_name, element, [batch, 4])],
        outputs,
        initializer=[numpy_helper.from_array(weight, "W"), numpy_helper.from_array(bias, "b")],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 8
    onnx.checker.check_model(proto)
    serialised: bytes = proto.SerializeToString()
    return serialised


def write_onnx_model(repo: Path, name: str, content: bytes | None = None, toml: str = TENSOR_TOML) -> Path:
    """A ``format = "onnx"`` model folder ``repo/name`` serving ``content`` (default: the tiny
    ranker graph) with TinyRanker's model.toml (``features`` FP32 [4] -> ``probability`` FP32
    [1]); returns the folder."""
    folder = repo / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ONNX_FILE).write_bytes(tiny_ranker_graph() if content is None else content)
    (folder / "model.toml").write_text(toml.format(name=name, fmt="onnx", file=ONNX_FILE))
    return folder


def export_onnx_ranker(repo: Path, name: str) -> TinyRanker:
    """TinyRanker exported with ``torch.onnx.export`` (the torch.export-based exporter, dynamic
    batch axis) into a ``format = "onnx"`` folder ``repo/name``; returns the eager model."""
    model = TinyRanker().eval()
    folder = repo / name
    folder.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        program = torch.onnx.export(
            model,
            (torch.zeros(2, 4),),
            dynamo=True,
            input_names=["features"],
            output_names=["probability"],
            dynamic_shapes=({0: torch.export.Dim("batch", min=1)},),
            verbose=False,
        )
    assert program is not None
    program.save(str(folder / ONNX_FILE), external_data=False)
    (folder / "model.toml").write_text(TENSOR_TOML.format(name=name, fmt="onnx", file=ONNX_FILE))
    return model


def write_broken_onnx_models(repo: Path) -> dict[str, str]:
    """One ``format = "onnx"`` model folder per way an ONNX file can disagree with what serves
    it, in ``repo``; returns ``name/1`` -> a piece of the reason each is reported with."""
    good = tiny_ranker_graph()
    broken = {
        # half a file: protobuf cannot parse it
        "onnx-truncated": (good[: len(good) // 2], "cannot load onnx-truncated/model.onnx with onnxruntime"),
        # a file that is no ONNX model at all
        "onnx-not-onnx": (b"PK\x03\x04 this is a zip, not a graph", "cannot load onnx-not-onnx/model.onnx"),
        # the graph's input is called x: model.toml's features is not there
        "onnx-input-name": (
            tiny_ranker_graph(input_name="x"),
            "declares input 'features', but onnx-input-name/model.onnx has no input of that name",
        ),
        # float64 where model.toml says FP32
        "onnx-dtype": (
            tiny_ranker_graph(dtype=np.float64),
            "input 'features' is FP32 in model.toml but FP64 (tensor(double)) in onnx-dtype/model.onnx",
        ),
        # the graph says its output is [batch, 2]; model.toml declares [1]
        "onnx-output-shape": (
            tiny_ranker_graph(width=2),
            "output 'probability' has shape [batch, 2] in onnx-output-shape/model.onnx",
        ),
        # two rows per item, which only a run shows: the warmup sees it
        "onnx-output-runtime": (
            tiny_ranker_graph(twice=True, output_shape=["rows", 1]),
            "output 'probability' has shape [2, 1], model.toml declares [batch, *[1]]",
        ),
        # a batch axis fixed at 8: batches of 1 to 16 items cannot run
        "onnx-fixed-batch": (tiny_ranker_graph(batch=8), "fixed batch axis of 8"),
    }
    for name, (content, _) in broken.items():
        write_onnx_model(repo, name, content)
    return {f"{name}/1": reason for name, (_, reason) in broken.items()}
