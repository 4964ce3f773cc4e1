"""Which handler runs a model: a built-in loader for the tensor formats (``torch_export``,
``torchscript``: :mod:`app.models.torch_formats`; ``onnx``: :mod:`app.models.onnx_format`), or
the ``module:Class`` that ``model.toml``'s ``handler`` names (:mod:`app.models.base` is the
contract it implements)."""

from __future__ import annotations

import importlib
import importlib.util
import sys

from app.errors import ModelLoadError
from app.models.base import Handler
from app.models.repository import ModelConfig
from app.models.torch_formats import TorchExportHandler, TorchScriptHandler


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
    if config.format == "onnx":
        from app.models.onnx_format import OnnxHandler  # onnxruntime is imported when a session opens

        return OnnxHandler()
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
