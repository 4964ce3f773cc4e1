"""A test model's ``model.toml`` as data: one declaration (a dict of ``app.models.repository.ModelConfig``'s
keys) that is written as the file a server reads (:func:`write_model`) or parsed as the server
parses it, with no file (:func:`parsed`), so that a model served end to end and a handler loaded
in process read the same declaration."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import tomli_w

from app.models.repository import ModelConfig

__all__ = ["handler_model", "parsed", "tensor", "write_model"]

#: The batching of the handler models tests serve: small batches, a short delay.
BATCHING = {"max_batch_size": 16, "max_queue_delay_ms": 2.0, "warmup_batch_sizes": [1, 16]}


def tensor(name: str, datatype: str, shape: Sequence[int], **flags: Any) -> dict[str, Any]:
    """A declared input or output (``[[inputs]]`` / ``[[outputs]]``); ``flags``: ``optional``,
    ``ragged``, ``labels``..."""
    return {"name": name, "datatype": datatype, "shape": list(shape), **flags}


def handler_model(
    name: str,
    handler: str,
    inputs: Sequence[Mapping[str, Any]],
    outputs: Sequence[Mapping[str, Any]],
    parameters: Mapping[str, Any],
    **fields: Any,
) -> dict[str, Any]:
    """The declaration of a ``format = "handler"`` model: :data:`BATCHING` unless ``fields`` (more
    top-level keys, tables such as ``response_cache``) says otherwise; a parameter that is None
    is left out (TOML has no null)."""
    return {
        "name": name,
        "version": "1",
        "format": "handler",
        "handler": handler,
        **BATCHING,
        **fields,
        "inputs": [dict(i) for i in inputs],
        "outputs": [dict(o) for o in outputs],
        "parameters": {key: value for key, value in parameters.items() if value is not None},
    }


def parsed(declared: Mapping[str, Any], path: Path) -> ModelConfig:
    """``declared`` as ``app.models.repository.read_config`` gives it for the model folder
    ``path`` (where ``model_dir`` is resolved), validated; no file written.

    Raises:
        msgspec.ValidationError, ModelLoadError: what the server refuses of such a file.
    """
    config = msgspec.convert(dict(declared), ModelConfig)
    config.path = path
    config.validate()
    return config


def write_model(
    repo: Path, declared: Mapping[str, Any], build: Callable[[Path], object] | None = None
) -> Path:
    """The model folder ``repo/<name>``: ``declared`` as its ``model.toml`` and, with ``build``,
    ``build(<its folder>/<model_dir>)`` to make the model's files."""
    folder = repo / str(declared["name"])
    folder.mkdir(parents=True, exist_ok=True)
    if build is not None:
        build(folder / declared["parameters"]["model_dir"])
    (folder / "model.toml").write_text(tomli_w.dumps(declared))
    return folder
