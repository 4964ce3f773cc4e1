"""Export a Hugging Face sequence-classification folder (a classifier or a cross-encoder) as an
ONNX graph for the sequence-classification handler's ONNX backend (``backend = "onnx"``).

Usage::

    python scripts/export_sequence_classification.py --model-dir /models/ms-marco-MiniLM-L-6-v2 \\
        --out /models/repository/reranker/model.onnx

``--out`` gets ``transformers.AutoModelForSequenceClassification`` of ``--model-dir`` exported with
``torch.onnx.export`` (the TorchScript exporter, opset 17): the tokenizer's tensors (``input_ids``,
``attention_mask`` and, where the tokenizer gives them, ``token_type_ids``) int64
``[batch, tokens]`` -> ``logits`` float32 ``[batch, labels]``, both input axes dynamic, the
weights inside the file. Before it is kept, the graph runs in ONNX Runtime on calibration inputs
(single texts and (query, text) pairs of 1 to ``max_length`` tokens) and its logits must be
within ``--atol`` (default 1e-4) of the torch model's; else the file is removed and the script
exits 1. The handler keeps its tokenizer, softmax / sigmoid and windows, so the graph is the
model alone. Nothing is downloaded: the folder is local.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

#: Calibration inputs: (query or None, text) with texts of growing length, in words.
CALIBRATION_WORDS = (1, 4, 16, 64, 200)
OPSET = 17


def calibration(tokenizer: Any, max_length: int) -> list[dict[str, torch.Tensor]]:
    """Tokenised calibration batches (int64 ``[batch, tokens]`` per name): single texts and
    (query, text) pairs, truncated to ``max_length`` tokens."""
    words = [w for w, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]) if w.isalpha()][:500]
    texts = [" ".join(words[(7 * i) % len(words)] for i in range(n)) for n in CALIBRATION_WORDS]
    kwargs = {"padding": True, "truncation": True, "max_length": max_length, "return_tensors": "pt"}
    return [
        dict(tokenizer(texts, **kwargs)),
        dict(tokenizer(["a short query"] * len(texts), texts, **kwargs)),
    ]


def export(model_dir: Path, out: Path, atol: float) -> float:
    """Export ``model_dir`` to ``out`` and check it (module docstring); returns the largest
    absolute difference of the logits, ONNX Runtime against torch.

    Raises:
        ValueError: the graph's logits differ by more than ``atol`` (``out`` is removed).
        OSError: ``model_dir`` is not a loadable folder.
    """
    import onnxruntime

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    max_length = min(int(getattr(tokenizer, "model_max_length", 512) or 512), 512)
    batches = calibration(tokenizer, max_length)
    names = [n for n in ("input_ids", "attention_mask", "token_type_ids") if n in batches[0]]
    out.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")  # the TorchScript exporter's tracer warnings
        torch.onnx.export(
            model, tuple(batches[0][n] for n in names), str(out), dynamo=False, opset_version=OPSET,
            input_names=names, output_names=["logits"],
            dynamic_axes={n: {0: "batch", 1: "tokens"} for n in names} | {"logits": {0: "batch"}},
        )  # fmt: skip
    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    worst = 0.0
    with torch.inference_mode():
        for batch in batches:
            want = model(**{n: batch[n] for n in names}).logits.numpy()
            got = session.run(["logits"], {n: batch[n].numpy() for n in names})[0]
            worst = max(worst, float(np.abs(np.asarray(got) - want).max()))
    if worst > atol:
        out.unlink()
        raise ValueError(f"the graph's logits differ from torch's by {worst:.2e} > {atol:.0e}; not kept")
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, required=True, help="the Hugging Face folder")
    parser.add_argument("--out", type=Path, required=True, help="the .onnx file to write")
    parser.add_argument("--atol", type=float, default=1e-4, help="largest logit difference kept")
    args = parser.parse_args(argv)
    try:
        worst = export(args.model_dir, args.out, args.atol)
    except (ValueError, OSError) as exc:
        print(f"export_sequence_classification: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: logits within {worst:.1e} of torch's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
