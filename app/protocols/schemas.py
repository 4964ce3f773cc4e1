"""The JSON documents of the HTTP API that are not inference bodies, as msgspec types.

The OpenAPI description (``app/openapi.json``) takes its component schemas from these types
and from the request/response types of :mod:`app.protocols.v2` and :mod:`app.protocols.v1`
(``python -m app.http.openapi`` generates it; ``tests/test_openapi.py`` checks that the file is current
and that real answers validate against it). Field names follow the Open Inference Protocol
and Triton's extensions (sources in :mod:`app.protocols.triton`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

Datatype = Literal[
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64", "BYTES",
]  # fmt: skip
NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class Error(msgspec.Struct):
    """Every error answer: a message naming what is wrong (and the request id for 5xx)."""

    error: str


class Live(msgspec.Struct, omit_defaults=True):
    """``GET /v2/health/live``."""

    live: bool
    error: str | None = None


class V1Live(msgspec.Struct, omit_defaults=True):
    """``GET /`` (KServe V1 liveness): ``status`` is ``alive``."""

    status: str
    error: str | None = None


class Ready(msgspec.Struct, omit_defaults=True):
    """``GET /v2/health/ready``; ``error`` when a model failed to load."""

    ready: bool
    error: str | None = None


class ModelReady(msgspec.Struct):
    """Model readiness (V2 ``.../ready`` and V1 ``GET /v1/models/{name}``)."""

    name: str
    ready: bool


class ModelList(msgspec.Struct):
    """``GET /v1/models``."""

    models: list[str]


class ServerMetadata(msgspec.Struct, omit_defaults=True):
    """``GET /v2``: ``worker`` is the answering worker (pid, device, GPU binding)."""

    name: str
    version: str
    extensions: list[str]
    worker: dict[str, Any] | None = None


class TensorMetadata(msgspec.Struct):
    """An input or output in model metadata; the batch dimension is -1."""

    name: str
    datatype: Datatype
    shape: list[int]


class ModelMetadata(msgspec.Struct, omit_defaults=True):
    """``GET /v2/models/{name}``."""

    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]
    parameters: dict[str, Any] | None = None


class ModelConfigInput(msgspec.Struct):
    """Triton ``ModelInput``: ``dims`` without the batch dimension."""

    name: str
    data_type: str
    dims: list[int]
    format: str = "FORMAT_NONE"
    is_shape_tensor: bool = False
    allow_ragged_batch: bool = False
    optional: bool = False


class ModelConfigOutput(msgspec.Struct):
    """Triton ``ModelOutput``: ``dims`` without the batch dimension."""

    name: str
    data_type: str
    dims: list[int]
    label_filename: str = ""
    is_shape_tensor: bool = False


class DynamicBatching(msgspec.Struct):
    """Triton ``ModelDynamicBatching``."""

    max_queue_delay_microseconds: NonNegative
    preferred_batch_size: list[int] = msgspec.field(default_factory=list)


class TritonModelConfig(msgspec.Struct):
    """``GET /v2/models/{name}/config``: Triton's model configuration (its other fields,
    such as ``instance_group``, are present as Triton writes them)."""

    name: str
    platform: str
    backend: str
    max_batch_size: NonNegative
    input: list[ModelConfigInput]
    output: list[ModelConfigOutput]
    dynamic_batching: DynamicBatching


class DurationStat(msgspec.Struct):
    """Triton ``$duration_stat``: a count and cumulative nanoseconds."""

    count: NonNegative
    ns: NonNegative


class InferStats(msgspec.Struct):
    """Triton ``$inference_stats``."""

    success: DurationStat
    fail: DurationStat
    queue: DurationStat
    compute_input: DurationStat
    compute_infer: DurationStat
    compute_output: DurationStat
    cache_hit: DurationStat
    cache_miss: DurationStat


class BatchStat(msgspec.Struct):
    """Triton ``$batch_stats``: model calls of one batch size (items)."""

    batch_size: NonNegative
    compute_input: DurationStat
    compute_infer: DurationStat
    compute_output: DurationStat


class ModelStat(msgspec.Struct):
    """Triton ``$model_stat``; ``last_inference`` in ms since the epoch."""

    name: str
    version: str
    last_inference: NonNegative
    inference_count: NonNegative
    execution_count: NonNegative
    inference_stats: InferStats
    batch_stats: list[BatchStat]
    memory_usage: list[Any]


class ModelStatistics(msgspec.Struct):
    """``GET /v2/models[/{name}]/stats``: the server's counts, ``workers`` workers' summed
    (``worker_pid`` answered)."""

    model_stats: list[ModelStat]
    worker_pid: int
    workers: int


class RepositoryIndexRequest(msgspec.Struct, omit_defaults=True):
    """``POST /v2/repository/index`` body (optional): ``ready`` keeps only ready models."""

    ready: bool = False


class RepositoryModelRequest(msgspec.Struct, omit_defaults=True):
    """Body of ``POST /v2/repository/models/{name}/load`` and ``/unload`` (optional; Triton's
    ``config`` and ``file:`` overrides are refused: the repository holds the configuration)."""

    parameters: dict[str, Any] | None = None


class RepositoryIndexEntry(msgspec.Struct):
    """One model version of the repository index."""

    name: str
    version: str
    state: Literal["READY", "LOADING", "UNLOADING", "UNAVAILABLE"]
    reason: str
