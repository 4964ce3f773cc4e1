"""ModelRunner: one loaded model on one device, called from the inference thread.

``run_batch`` is the only thing the batcher calls per batch. It runs the
handler's preprocess -> predict -> postprocess under ``torch.inference_mode()``
and, when the device runs out of memory, halves the batch and retries each half
(recursively), so only an item that fails alone is reported as too large.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from app.datatypes import NUMPY_DTYPES
from app.errors import ModelLoadError
from app.models.base import Handler
from app.models.repository import ModelConfig, TensorSpec
from app.models.segment import Segment
from app.models.torch_formats import TorchExportHandler, TorchScriptHandler

log = logging.getLogger(__name__)


def is_out_of_memory(exc: BaseException) -> bool:
    """True for a device out-of-memory error (CUDA OOM, or a RuntimeError saying so)."""
    oom_type = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    return isinstance(exc, oom_type) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


def resolve_handler(config: ModelConfig) -> Handler:
    """Instantiate the handler for ``config``'s format.

    ``handler = "module:Class"``: a ``module.py`` inside the model folder wins
    over an importable module of that name. Importing a handler runs its code:
    a model repository is trusted like the server's own code.

    Raises:
        ModelLoadError: module or class not found, the module raised while importing, or the
            class lacks a hook.
    """
    if config.format == "torch_export":
        return TorchExportHandler()
    if config.format == "torchscript":
        return TorchScriptHandler()
    assert config.handler is not None
    module_name, _, class_name = config.handler.partition(":")
    local = config.path / (module_name.replace(".", "/") + ".py")
    try:
        if local.is_file():
            qualified = f"_scoring_model_{config.name.replace('-', '_')}_{module_name}"
            spec = importlib.util.spec_from_file_location(qualified, local)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[qualified] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        cls = getattr(module, class_name)
    except Exception as exc:  # a handler module may raise anything while it imports
        shown = exc if isinstance(exc, (ImportError, AttributeError)) else f"{type(exc).__name__}: {exc}"
        raise ModelLoadError(
            f"model {config.name}: cannot import handler {config.handler!r}: {shown}"
        ) from exc
    handler = cls()
    missing = [h for h in ("load", "preprocess", "predict", "postprocess") if not hasattr(handler, h)]
    if missing:
        raise ModelLoadError(f"model {config.name}: handler {config.handler!r} lacks {', '.join(missing)}")
    return handler  # type: ignore[no-any-return]


def synthetic_inputs(specs: list[TensorSpec], batch_size: int) -> dict[str, np.ndarray]:
    """Warmup inputs: zeros (numeric) or ``b"warmup"`` (BYTES), variable dims set to 8."""
    return {s.name: s.filled(batch_size, text=b"warmup", variable_dim=8) for s in specs}


class ModelRunner:
    """A model's handler plus its config; all methods run on the inference thread."""

    def __init__(self, config: ModelConfig, handler: Handler | None = None) -> None:
        self.config = config
        self.handler: Handler = handler if handler is not None else resolve_handler(config)
        self.device = torch.device("cpu")
        self.load_seconds = 0.0
        self.warmup_seconds = 0.0

    def load(self, device: torch.device) -> None:
        """Load onto ``device``; raises ``ModelLoadError`` (with the cause) on failure."""
        start = time.perf_counter()
        self.device = device
        try:
            self.handler.load(device, self.config)
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"model {self.config.name}: load failed: {exc!r}") from exc
        self.load_seconds = time.perf_counter() - start

    def warmup(self) -> None:
        """Run one batch per ``warmup_batch_sizes`` entry and check the outputs' shapes.

        Raises:
            ModelLoadError: the model fails on synthetic input or returns
                outputs that do not match ``model.toml``.
        """
        start = time.perf_counter()
        for batch_size in self.config.warmup_batch_sizes:
            try:
                outputs = self.forward(synthetic_inputs(self.config.inputs, batch_size))
            except Exception as exc:
                raise ModelLoadError(
                    f"model {self.config.name}: warmup at batch size {batch_size} failed: {exc!r}"
                ) from exc
            self._check_outputs(outputs, batch_size)
        self.warmup_seconds = time.perf_counter() - start

    def _check_outputs(self, outputs: Mapping[str, np.ndarray], batch_size: int) -> None:
        for spec in self.config.outputs:
            arr = outputs.get(spec.name)
            if arr is None:
                raise ModelLoadError(f"model {self.config.name}: output {spec.name!r} missing")
            want = (batch_size, *spec.shape)
            ok = arr.ndim == len(want) and all(w in (-1, a) for w, a in zip(want, arr.shape, strict=True))
            if not ok:
                raise ModelLoadError(
                    f"model {self.config.name}: output {spec.name!r} has shape {list(arr.shape)}, "
                    f"model.toml declares [batch, *{spec.shape}]"
                )

    def forward(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch as is: inputs [B, ...] per input name -> outputs [B, ...] per output
        (numpy, the dtypes ``model.toml`` declares), under ``torch.inference_mode()``.

        Raises:
            Exception: whatever the handler raised, device out-of-memory included.
        """
        with torch.inference_mode():
            batch = self.handler.preprocess(inputs)
            raw = self.handler.predict(batch)
            outputs = self.handler.postprocess(raw)
        return {
            s.name: np.asarray(outputs[s.name], dtype=NUMPY_DTYPES[s.datatype]) for s in self.config.outputs
        }

    def run_batch(self, inputs: Mapping[str, np.ndarray]) -> list[Segment]:
        """Run one batch, halving it on device out-of-memory errors.

        Returns segments covering items [0, B) in order; a segment whose
        ``outputs`` is None is a single item that does not fit in memory alone.

        Raises:
            Exception: whatever the handler raised, other than out-of-memory.
        """
        return self._run_split(inputs, 0)

    def _run_split(self, inputs: Mapping[str, np.ndarray], offset: int) -> list[Segment]:
        batch_size = len(next(iter(inputs.values())))
        try:
            return [Segment(offset, offset + batch_size, self.forward(inputs))]
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if batch_size == 1:
            log.warning("model %s: one item does not fit in %s memory", self.config.name, self.device)
            return [Segment(offset, offset + 1, None)]
        half = batch_size // 2
        log.warning(
            "model %s: out of memory at batch size %d, retrying as %d + %d",
            self.config.name,
            batch_size,
            half,
            batch_size - half,
        )
        return self._run_split({k: v[:half] for k, v in inputs.items()}, offset) + self._run_split(
            {k: v[half:] for k, v in inputs.items()}, offset + half
        )

    def close(self) -> None:
        """Drop the handler's references so device memory can be freed."""
        close = getattr(self.handler, "close", None)
        if callable(close):
            close()
        self.handler = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def describe(runner: ModelRunner) -> dict[str, Any]:
    """Load/warmup figures for logs: seconds, device."""
    return {
        "model": runner.config.name,
        "version": runner.config.version,
        "device": str(runner.device),
        "load_s": round(runner.load_seconds, 3),
        "warmup_s": round(runner.warmup_seconds, 3),
    }
