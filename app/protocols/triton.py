"""Triton's model configuration, statistics and model repository extensions: the JSON shapes.

Pure functions from our :class:`ModelConfig` to the documents Triton serves, so Triton's own
tools (``perf_analyzer``, ``tritonclient``'s ``get_model_config``/``get_inference_statistics``/
``get_model_repository_index``) read them unchanged. No aiohttp here.

Sources (triton-inference-server/server): ``docs/protocol/extension_model_configuration.md``
and the ``ModelConfig`` message of ``model_config.proto`` (field names, ``TYPE_*`` names,
``dims`` without the batch dimension when ``max_batch_size > 0``);
``docs/protocol/extension_statistics.md``; ``docs/protocol/extension_model_repository.md``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from app.errors import InvalidInput
from app.models.repository import ModelConfig, TensorSpec
from app.protocols.infer import lengths_name

if TYPE_CHECKING:
    from app.observability.metrics import Duration, ModelStats

#: The extensions ``GET /v2`` lists (the model repository extension: index, load and unload;
#: see docs/protocols.md).
EXTENSIONS: list[str] = [
    "binary_tensor_data",
    "classification",
    "model_configuration",
    "statistics",
    "model_repository",
]
#: The output parameter of Triton's classification extension: the top k classes instead of values.
CLASSIFICATION = "classification"

#: Open Inference Protocol datatype -> Triton ``DataType`` enum name.
TRITON_TYPES: dict[str, str] = {
    "BOOL": "TYPE_BOOL",
    "UINT8": "TYPE_UINT8",
    "UINT16": "TYPE_UINT16",
    "UINT32": "TYPE_UINT32",
    "UINT64": "TYPE_UINT64",
    "INT8": "TYPE_INT8",
    "INT16": "TYPE_INT16",
    "INT32": "TYPE_INT32",
    "INT64": "TYPE_INT64",
    "FP16": "TYPE_FP16",
    "FP32": "TYPE_FP32",
    "FP64": "TYPE_FP64",
    "BYTES": "TYPE_STRING",
}

#: Our model format -> Triton ``backend`` name (the closest Triton backend).
_BACKENDS = {"torch_export": "pytorch", "torchscript": "pytorch", "onnx": "onnxruntime", "handler": "python"}


def _input(spec: TensorSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "data_type": TRITON_TYPES[spec.datatype],
        "format": "FORMAT_NONE",
        "dims": list(spec.shape),
        "is_shape_tensor": False,
        "allow_ragged_batch": False,
        "optional": spec.optional,
    }


def _output(spec: TensorSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "data_type": TRITON_TYPES[spec.datatype],
        "dims": list(spec.shape),
        "label_filename": "",
        "is_shape_tensor": False,
    }


def _outputs(spec: TensorSpec) -> list[dict[str, Any]]:
    """A ragged output as the protocol sends it (``app.protocols.tensors.wire_tensors``): its rows, then
    their lengths, one an item."""
    if not spec.ragged:
        return [_output(spec)]
    lengths = TensorSpec(lengths_name(spec.name), "INT64", [1])
    return [_output(spec), _output(lengths)]


def model_config(config: ModelConfig, device: str) -> dict[str, Any]:
    """Triton's model configuration JSON for ``config``.

    Args:
        config: the model.
        device: the worker's torch device (``"cpu"``, ``"cuda:0"``): the instance group kind.

    Returns:
        ``name``, ``platform``, ``backend``, ``max_batch_size`` (items), ``input``/``output`` with
        ``data_type`` (``TYPE_FP32``...) and ``dims`` without the batch dimension,
        ``dynamic_batching`` (``max_queue_delay_microseconds``; no preferred sizes: a batch runs
        as soon as it is full or its delay is over), one instance group, ``parameters``,
        ``response_cache`` (``enable``: the per-item cache of docs/response-cache.md).
    """
    gpu = device.startswith("cuda")
    return {
        "name": config.name,
        "platform": config.platform,
        "backend": _BACKENDS[config.format],
        "version_policy": _version_policy(config),
        "max_batch_size": config.max_batch_size,
        "input": [_input(s) for s in config.inputs],
        "output": [t for s in config.outputs for t in _outputs(s)],
        "batch_input": [],
        "batch_output": [],
        "dynamic_batching": {
            "preferred_batch_size": [],
            "max_queue_delay_microseconds": round(config.max_queue_delay_ms * 1000),
            "preserve_ordering": True,
            "priority_levels": config.priority_levels,
            "default_priority_level": config.default_priority_level or config.priority_levels,
            "priority_queue_policy": {},
        },
        "instance_group": [
            {
                "name": f"{config.name}_0",
                "kind": "KIND_GPU" if gpu else "KIND_CPU",
                "count": 1,
                "gpus": [int(device.partition(":")[2] or 0)] if gpu else [],
                "passive": False,
            }
        ],
        "default_model_filename": config.file or "",
        "parameters": {k: {"string_value": str(v)} for k, v in sorted(config.parameters.items())},
        "model_warmup": [],
        "response_cache": {"enable": config.response_cache.enable},
    }


def _duration(d: Duration) -> dict[str, int]:
    return {"count": d.count, "ns": d.ns}


def model_statistics(name: str, version: str, stats: ModelStats) -> dict[str, Any]:
    """Triton's ``$model_stat`` object for one model version. ``compute_input`` and
    ``compute_output`` carry the counts of ``compute_infer`` and 0 ns (conversion runs inside the
    model call; perf_analyzer requires the three counts to be equal). ``cache_hit`` and
    ``cache_miss`` count items (the cache is per item), with their share of the lookups' time."""
    no_time = {"count": stats.compute_infer.count, "ns": 0}
    return {
        "name": name,
        "version": version,
        "last_inference": stats.last_inference_ms,
        "inference_count": stats.inference_count,
        "execution_count": stats.execution_count,
        "inference_stats": {
            "success": _duration(stats.success),
            "fail": _duration(stats.fail),
            "queue": _duration(stats.queue),
            "compute_input": no_time,
            "compute_infer": _duration(stats.compute_infer),
            "compute_output": no_time,
            "cache_hit": _duration(stats.cache_hit),
            "cache_miss": _duration(stats.cache_miss),
        },
        "batch_stats": [
            {
                "batch_size": size,
                "compute_input": {"count": d.count, "ns": 0},
                "compute_infer": _duration(d),
                "compute_output": {"count": d.count, "ns": 0},
            }
            for size, d in sorted(stats.batches.items())
        ],
        "memory_usage": [],
    }


def _version_policy(config: ModelConfig) -> dict[str, Any]:
    policy = config.version_policy
    if policy.all:
        return {"all": {}}
    if policy.specific is not None:
        return {"specific": {"versions": [int(v) for v in policy.specific if v.isdigit()]}}
    return {"latest": {"num_versions": policy.latest or 1}}


def statistics(model_stats: list[dict[str, Any]], pid: int, workers: int = 1) -> dict[str, Any]:
    """Triton's ``$stats_model_response``; ``worker_pid`` (ours) names the worker that answered,
    ``workers`` (ours) how many workers' statistics are summed in it."""
    return {"model_stats": model_stats, "worker_pid": pid, "workers": workers}


def _add_durations(into: dict[str, Any], other: dict[str, Any]) -> None:
    for key, value in other.items():
        if isinstance(value, dict) and "count" in value:
            into[key] = {"count": into[key]["count"] + value["count"], "ns": into[key]["ns"] + value["ns"]}


def sum_statistics(per_worker: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The ``$model_stat`` objects of several workers (each a list, as :func:`model_statistics`
    makes them) summed per (name, version), as one server's: counts and ns added,
    ``last_inference`` the latest, ``batch_stats`` added per batch size. Sorted by (name, version).
    A model version some workers lack counts what the others have."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for stats in per_worker:
        for stat in stats:
            key = (stat["name"], stat["version"])
            into = merged.get(key)
            if into is None:
                merged[key] = copy.deepcopy(stat)
                continue
            into["last_inference"] = max(into["last_inference"], stat["last_inference"])
            into["inference_count"] += stat["inference_count"]
            into["execution_count"] += stat["execution_count"]
            _add_durations(into["inference_stats"], stat["inference_stats"])
            sizes = {b["batch_size"]: b for b in into["batch_stats"]}
            for batch in stat["batch_stats"]:
                known = sizes.get(batch["batch_size"])
                if known is None:
                    sizes[batch["batch_size"]] = copy.deepcopy(batch)
                else:
                    _add_durations(known, batch)
            into["batch_stats"] = [sizes[size] for size in sorted(sizes)]
    return [merged[key] for key in sorted(merged)]


def repository_entry(name: str, version: str, state: str, reason: str = "") -> dict[str, str]:
    """One entry of Triton's ``$repository_index_response``: ``state`` READY, LOADING or
    UNAVAILABLE, ``reason`` why it is not READY."""
    return {"name": name, "version": version, "state": state, "reason": reason}


def classification_count(value: Any, output: str, datatype: str) -> int:
    """The k of an output's ``"parameters": {"classification": k}``.

    Raises:
        InvalidInput: k not a positive integer, or the output not numeric.
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidInput(
            f"outputs: {output!r} parameters.classification must be a positive integer, got {value!r}"
        )
    if datatype in ("BYTES", "BOOL"):
        raise InvalidInput(f"outputs: {output!r} is {datatype}; classification needs a numeric output")
    return value


def classification(values: np.ndarray, k: int, labels: Sequence[str] | None) -> np.ndarray:
    """Triton's classification extension: for each item of ``values`` (``[B, ...]``, flattened per
    item) its ``k`` largest values, highest first (ties by index), as BYTES
    ``b"<value>:<index>[:<label>]"`` (the value as C's ``%f``, the label where ``labels`` names
    the index): an object array ``[B, min(k, C)]``.

    Source: Triton's ``docs/protocol/extension_classification.md``.
    """
    flat = np.asarray(values).reshape(len(values), -1)
    k = min(k, flat.shape[1])
    order = np.argsort(-flat.astype(np.float64), axis=1, kind="stable")[:, :k]
    out = np.empty((len(flat), k), dtype=object)
    for b, row in enumerate(order):
        for j, index in enumerate(row):
            text = f"{float(flat[b, index]):f}:{int(index)}"
            if labels is not None and index < len(labels):
                text += f":{labels[index]}"
            out[b, j] = text.encode()
    return out
