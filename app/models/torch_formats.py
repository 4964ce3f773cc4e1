"""Built-in handlers for tensor models: ``torch.export`` archives and TorchScript.

Both take the model's inputs in ``model.toml`` order as positional tensors and
map the returned tensor (or tuple of tensors) to the declared outputs in order.
Neither unpickles anything: ``torch.export.load`` reads a zip of tensors and a
serialized graph, ``torch.jit.load`` reads TorchScript code and tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from app.errors import ModelLoadError
from app.models.repository import ModelConfig


class _TensorHandler:
    """Shared numpy <-> torch plumbing; subclasses implement ``_load_module``."""

    def __init__(self) -> None:
        self._module: Any = None
        self._device = torch.device("cpu")
        self._input_names: list[str] = []
        self._output_names: list[str] = []

    def _load_module(self, path: str, device: torch.device) -> Any:
        raise NotImplementedError

    def load(self, device: torch.device, config: ModelConfig) -> None:
        """Load ``config.path / config.file`` onto ``device``.

        Raises:
            ModelLoadError: the file is missing, outside the model's folder, or not a
                loadable archive.
        """
        path = config.weights_path()
        shown = f"{config.path.name}/{config.file}"
        if not path.is_file():
            raise ModelLoadError(f"model {config.name}: weights file {shown} not found")
        self._device = device
        self._input_names = [s.name for s in config.inputs]
        self._output_names = [s.name for s in config.outputs]
        try:
            self._module = self._load_module(str(path), device)
        except Exception as exc:
            raise ModelLoadError(f"model {config.name}: cannot load {shown}: {exc}") from exc

    def preprocess(self, inputs: Mapping[str, np.ndarray]) -> list[torch.Tensor]:
        """numpy [B, ...] per input -> tensors on the device (pinned, async copy on CUDA)."""
        tensors = []
        for name in self._input_names:
            t = torch.from_numpy(np.ascontiguousarray(inputs[name]))
            if self._device.type == "cuda":
                t = t.pin_memory().to(self._device, non_blocking=True)
            tensors.append(t)
        return tensors

    def predict(self, batch: list[torch.Tensor]) -> Any:
        """Call the module with the input tensors, positionally."""
        return self._module(*batch)

    def postprocess(self, outputs: Any) -> dict[str, np.ndarray]:
        """Tensor or tuple/list/dict of tensors -> numpy arrays by declared output name."""
        if isinstance(outputs, torch.Tensor):
            seq: Sequence[Any] = (outputs,)
        elif isinstance(outputs, Mapping):
            seq = [outputs[n] for n in self._output_names]
        else:
            seq = outputs
        if len(seq) != len(self._output_names):
            raise ValueError(
                f"model returned {len(seq)} outputs, model.toml declares {len(self._output_names)}"
            )
        return {n: t.detach().cpu().numpy() for n, t in zip(self._output_names, seq, strict=True)}


class TorchExportHandler(_TensorHandler):
    """Serves a ``torch.export`` archive (``.pt2`` written by ``torch.export.save``)."""

    def _load_module(self, path: str, device: torch.device) -> Any:
        program = torch.export.load(path)
        if device.type != "cpu":
            from torch.export.passes import move_to_device_pass

            program = move_to_device_pass(program, device)
        return program.module()


class TorchScriptHandler(_TensorHandler):
    """Serves a TorchScript archive (``torch.jit.save``)."""

    def _load_module(self, path: str, device: torch.device) -> Any:
        module = torch.jit.load(path, map_location=device)  # type: ignore[no-untyped-call]
        module.eval()
        return module
