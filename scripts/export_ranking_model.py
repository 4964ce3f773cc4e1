"""Export the demo feed-ranking model into the model repository.

``FeedRanker`` maps 32 dense features per candidate item (FP32), and the user's 32 features
(FP32, shared by the request's items: sent once, ``shared = "repeat"`` in its model.toml;
zeros when omitted), to a click probability (FP32 in (0, 1)). Its weights are drawn from a
seeded generator, so the same seed always exports the same model. Usage::

    python scripts/export_ranking_model.py --out model_repository/feed-ranker \\
        [--format torch_export|torchscript|onnx] [--seed 0] [--max-batch-size 256] [--name NAME]

writes ``model.pt2`` (``torch.export``, dynamic batch dimension), ``model.pt`` (TorchScript) or
``model.onnx`` (``torch.onnx.export``, the torch.export-based exporter, dynamic batch axis;
served by ONNX Runtime) and the ``model.toml`` that serves it, after checking that the saved
file reloads and matches the eager model. ``scripts/install`` writes the demo's ``feed-ranker``
(torch_export) and ``feed-ranker-onnx`` (onnx) from the same seed, so they are the same model.
"""

from __future__ import annotations

import argparse
import logging
import math
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

NUM_FEATURES = 32
#: The user's features, one row for all of a request's candidates.
NUM_USER = 32
HIDDEN = (64, 32)
MAX_BATCH_SIZE = 256
FORMATS = {"torch_export": "model.pt2", "torchscript": "model.pt", "onnx": "model.onnx"}

# torch.jit's entry points are unannotated; these give mypy (strict) something to check against.
_jit_trace: Callable[..., torch.jit.ScriptModule] = torch.jit.trace
_jit_load: Callable[..., torch.jit.ScriptModule] = torch.jit.load


class FeedRanker(nn.Module):
    """Dense features FP32 ``[B, 32]`` and the user's FP32 ``[B, 32]`` -> MLP -> sigmoid ->
    click probability FP32 ``[B, 1]``. The user enters the first layer through a projection of
    its own, added to the features' (zeros add nothing: a request without its user scores as the
    model without that input did)."""

    def __init__(self, num_features: int = NUM_FEATURES, hidden: tuple[int, ...] = HIDDEN) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = num_features
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)
        self.user = nn.Linear(NUM_USER, hidden[0], bias=False)  # after the MLP: its draws come last

    def forward(self, features: torch.Tensor, user: torch.Tensor) -> torch.Tensor:
        first, *rest = self.mlp
        hidden = first(features) + self.user(user)
        for layer in rest:
            hidden = layer(hidden)
        return torch.sigmoid(hidden)


def build_model(seed: int = 0) -> FeedRanker:
    """A ``FeedRanker`` in eval mode with weights determined by ``seed`` alone.

    A private generator is used, so the global RNG is neither read nor advanced.
    """
    generator = torch.Generator().manual_seed(seed)
    # Built on the meta device, so nn.Linear's own initialisation draws nothing from the global
    # RNG; every parameter is then filled below.
    with torch.device("meta"):
        model = FeedRanker()
    model.to_empty(device="cpu")
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                # He initialisation keeps activations in range through the ReLUs.
                std = math.sqrt(2.0 / module.in_features)
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
                if module.bias is not None:
                    module.bias.copy_(torch.randn(module.bias.shape, generator=generator) * 0.01)
    return model.eval()


def _model_toml(name: str, fmt: str, max_batch_size: int) -> str:
    graphs = ""
    if fmt != "onnx":  # ONNX Runtime's models refuse the option
        buckets = [1 << i for i in range(max_batch_size.bit_length()) if 1 << i <= max_batch_size]
        graphs = (
            "# On a CUDA device: one CUDA graph per bucket (0.106 ms against 0.263 ms eager at 8 items"
            " on an\n# H200, 38 MiB); ignored on a CPU with one INFO line (docs/benchmarks.md, CUDA"
            f" graphs).\ncuda_graph_batch_sizes = {buckets}\n"
        )
    return f"""\
# Demo feed-ranking MLP written by scripts/export_ranking_model.py; rerun it to rebuild
# {FORMATS[fmt]}, which is not committed.
name = "{name}"
version = "1"
format = "{fmt}"
file = "{FORMATS[fmt]}"
max_batch_size = {max_batch_size}
max_queue_delay_ms = 0.0           # run at once when idle; batches form while one runs
queue_capacity = 8192              # items
timeout_ms = 1000
warmup_batch_sizes = [1, {max_batch_size}]
{graphs}
[[inputs]]
name = "features"
datatype = "FP32"
shape = [{NUM_FEATURES}]                       # per item, batch dim excluded

[[inputs]]
name = "user"
datatype = "FP32"
shape = [{NUM_USER}]
shared = "repeat"                  # sent once for all the request's items (batch dimension 1)
optional = true                    # zeros when omitted

[[outputs]]
name = "click_probability"
datatype = "FP32"
shape = [1]                        # in (0, 1)
"""


def _save_torch_export(model: FeedRanker, path: Path, max_batch_size: int) -> None:
    batch = torch.export.Dim("batch", min=1, max=max_batch_size)
    # An example batch of 1 would let export specialise the batch dimension to 1.
    size = min(8, max_batch_size)
    example = (torch.zeros(size, NUM_FEATURES), torch.zeros(size, NUM_USER))
    program = torch.export.export(model, example, dynamic_shapes=({0: batch}, {0: batch}))
    torch.export.save(program, path)


def _save_torchscript(model: FeedRanker, path: Path) -> None:
    # Tracing records the whole model (it has no data-dependent control flow) and, unlike
    # torch.jit.script, needs no source file. TorchScript is deprecated in torch 2.x; this
    # format exists for servers that still load it.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, message=".*torch.jit")
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*torch.jit")
        traced = _jit_trace(model, (torch.zeros(4, NUM_FEATURES), torch.zeros(4, NUM_USER)))
        torch.jit.save(traced, str(path))


def _save_onnx(model: FeedRanker, path: Path) -> None:
    # The torch.export-based exporter (torch.onnx's default since 2.9; the TorchScript-based one
    # is deprecated). Its own imports raise FutureWarnings that are not ours to fix.
    batch = torch.export.Dim("batch", min=1)
    example = (torch.zeros(8, NUM_FEATURES), torch.zeros(8, NUM_USER))
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # "torchvision is not installed"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        # both inputs' batch axes are the one Dim: the exporter says it names it once
        warnings.filterwarnings("ignore", message=".*shares the same shape constraints", category=UserWarning)
        program = torch.onnx.export(
            model,
            example,
            dynamo=True,
            input_names=["features", "user"],
            output_names=["click_probability"],
            dynamic_shapes=({0: batch}, {0: batch}),
            verbose=False,
        )
    assert program is not None
    program.save(str(path), external_data=False)


def load_exported(path: Path) -> Callable[..., torch.Tensor]:
    """Reload a ``model.pt2``, ``model.pt`` or ``model.onnx`` written by ``export`` as a
    callable: features FP32 ``[B, 32]`` (and the user FP32 ``[B, 32]``, zeros when not given)
    -> probabilities FP32 ``[B, 1]`` (an ONNX Runtime session on the CPU for ``.onnx``)."""
    if path.suffix == ".onnx":
        import onnxruntime

        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])

        def run(x: torch.Tensor, user: torch.Tensor | None = None) -> torch.Tensor:
            u = user if user is not None else torch.zeros(len(x), NUM_USER)
            return torch.from_numpy(session.run(None, {"features": x.numpy(), "user": u.numpy()})[0])

        return run
    if path.suffix == ".pt2":
        module: torch.nn.Module = torch.export.load(path).module()
    else:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning, message=".*torch.jit")
            warnings.filterwarnings("ignore", category=FutureWarning, message=".*torch.jit")
            module = _jit_load(str(path), map_location="cpu")

    def call(x: torch.Tensor, user: torch.Tensor | None = None) -> torch.Tensor:
        out: torch.Tensor = module(x, user if user is not None else torch.zeros(len(x), NUM_USER))
        return out

    return call


def _verify(model: FeedRanker, path: Path, max_batch_size: int) -> None:
    loaded = load_exported(path)
    generator = torch.Generator().manual_seed(1234)
    for size in sorted({1, 7, max_batch_size} & set(range(1, max_batch_size + 1))):
        x = torch.randn(size, NUM_FEATURES, generator=generator)
        user = torch.randn(1, NUM_USER, generator=generator).expand(size, NUM_USER)
        with torch.inference_mode():
            expected, got = model(x, user), loaded(x, user)
        if got.shape != (size, 1) or not torch.allclose(got, expected, rtol=1e-5, atol=1e-6):
            raise RuntimeError(f"{path} does not reproduce the eager model at batch size {size}")


def export(
    out_dir: Path,
    fmt: str = "torch_export",
    seed: int = 0,
    *,
    max_batch_size: int = MAX_BATCH_SIZE,
    name: str | None = None,
) -> Path:
    """Write the model file and ``model.toml`` into ``out_dir``; return the model file's path.

    ``fmt`` is ``"torch_export"`` (``model.pt2``), ``"torchscript"`` (``model.pt``) or
    ``"onnx"`` (``model.onnx``); ``max_batch_size`` is both the ``.pt2``'s batch-dimension bound
    and the ``model.toml`` setting (the ``.onnx``'s batch axis is unbounded); ``name`` defaults
    to ``out_dir``'s name. Raises ``ValueError`` for an unknown format and ``RuntimeError`` when
    the reloaded file does not match the eager model.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {sorted(FORMATS)}")
    if max_batch_size < 2:
        raise ValueError(f"max_batch_size must be >= 2, got {max_batch_size}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(seed)
    path = out_dir / FORMATS[fmt]
    if fmt == "torch_export":
        _save_torch_export(model, path, max_batch_size)
    elif fmt == "onnx":
        _save_onnx(model, path)
    else:
        _save_torchscript(model, path)
    _verify(model, path, max_batch_size)
    toml = _model_toml(name or out_dir.resolve().name, fmt, max_batch_size)
    (out_dir / "model.toml").write_text(toml, encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="model folder to write")
    parser.add_argument("--format", choices=sorted(FORMATS), default="torch_export")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument(
        "--max-batch-size", type=int, default=MAX_BATCH_SIZE, help="items per batch (default 256)"
    )
    parser.add_argument("--name", help="model name (default: the --out folder's name)")
    args = parser.parse_args(argv)
    path = export(args.out, args.format, args.seed, max_batch_size=args.max_batch_size, name=args.name)
    print(f"wrote {path} and {path.parent / 'model.toml'}")


if __name__ == "__main__":
    main()
