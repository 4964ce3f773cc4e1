"""The hand-kept part of the OpenAPI description: one entry per operation besides inference (the
inference APIs declare theirs: ``app.protocols.apis``), the error answers, the common parameters,
and the msgspec types whose schemas become components (:mod:`app.http.openapi` generates
``app/openapi.json`` from them and from the APIs)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from app.protocols import schemas
from app.protocols.v2 import HEADER_LENGTH

REF = "#/components/schemas/{name}"

#: Error responses: name -> (status, description, extra headers).
ERRORS: dict[str, tuple[str, str, list[str]]] = {
    "BadRequest": (
        "400",
        "Malformed JSON or binary body, nested too deeply, wrong datatype or shape, "
        "sizes that do not add up, non-finite floats, bad timeout.",
        [],
    ),
    "Unauthorized": ("401", "No valid API key.", ["WWW-Authenticate"]),
    "NotFound": ("404", "Unknown model or version.", []),
    "TooLarge": (
        "413",
        "Body over SCORING_MAX_REQUEST_BYTES, more items than SCORING_MAX_ITEMS_PER_REQUEST, "
        "or a string over SCORING_MAX_STRING_BYTES.",
        [],
    ),
    "UnsupportedMediaType": ("415", "Content-Type is neither JSON nor application/octet-stream.", []),
    "HeaderFieldsTooLarge": (
        "431",
        "A header field or the request line over SCORING_MAX_HEADER_BYTES, or "
        "more than SCORING_MAX_HEADERS fields.",
        [],
    ),
    "ModelFailed": (
        "500",
        "The model raised on the batch holding this request (names the model and request id).",
        [],
    ),
    "Unavailable": (
        "503",
        "Queue full, model not ready, or load failed; retry after Retry-After seconds.",
        ["Retry-After"],
    ),
    "DeadlineExceeded": ("504", "The request's deadline passed.", []),
    "InsufficientStorage": ("507", "One item does not fit in device memory even alone.", []),
}
#: The errors of an inference API.
INFER_ERRORS = (
    "BadRequest",
    "Unauthorized",
    "NotFound",
    "TooLarge",
    "UnsupportedMediaType",
    "HeaderFieldsTooLarge",
    "ModelFailed",
    "Unavailable",
    "DeadlineExceeded",
    "InsufficientStorage",
)


@dataclass(frozen=True)
class Op:
    """One operation: path, method, id, tag, summary, 200 answer (schema name or inline
    schema, description), request body schema, a 503 answer, errors, open to all."""

    path: str
    method: str
    op_id: str
    tag: str
    summary: str
    ok: tuple[str | dict[str, Any], str]
    body: str | None = None
    unavailable: str | None = None
    errors: tuple[str, ...] = ("Unauthorized", "HeaderFieldsTooLarge")
    open: bool = False
    content_type: str = "application/json"


def _versioned(op: Op) -> list[Op]:
    """``op`` at ``/v2/models/{name}...`` and at ``/v2/models/{name}/versions/{version}...``."""
    tail = op.path.removeprefix("/v2/models/{name}")
    versioned = "/v2/models/{name}/versions/{version}" + tail
    return [op, replace(op, path=versioned, op_id=op.op_id.replace("model", "modelVersion", 1))]


_MODEL = ("NotFound", "Unauthorized", "HeaderFieldsTooLarge")
OPERATIONS: list[Op] = [
    Op(
        "/",
        "get",
        "v1ServerLive",
        "health",
        "Liveness (KServe V1)",
        ("V1Live", "The worker's event loop answers."),
        unavailable="V1Live",
        open=True,
    ),
    Op(
        "/v2",
        "get",
        "serverMetadata",
        "v2",
        "Server metadata",
        ("ServerMetadata", "Name, version, extensions, this worker."),
    ),
    Op(
        "/v2/health/live",
        "get",
        "serverLive",
        "health",
        "Liveness",
        ("Live", "The worker's event loop answers."),
        unavailable="Live",
        errors=("HeaderFieldsTooLarge",),
        open=True,
    ),
    Op(
        "/v2/health/ready",
        "get",
        "serverReady",
        "health",
        "Readiness",
        ("Ready", "Every model loaded and warm."),
        unavailable="Ready",
        errors=("HeaderFieldsTooLarge",),
        open=True,
    ),
    *_versioned(
        Op(
            "/v2/models/{name}",
            "get",
            "modelMetadata",
            "v2",
            "Model metadata",
            ("ModelMetadata", "Inputs and outputs, batch dimension -1."),
            errors=_MODEL,
        )
    ),
    *_versioned(
        Op(
            "/v2/models/{name}/ready",
            "get",
            "modelReady",
            "v2",
            "Model readiness",
            ("ModelReady", "Loaded, warm, not draining."),
            unavailable="ModelReady",
            errors=_MODEL,
        )
    ),
    *_versioned(
        Op(
            "/v2/models/{name}/config",
            "get",
            "modelConfig",
            "triton",
            "Model configuration (Triton)",
            ("TritonModelConfig", "Triton's model configuration; dims without the batch dimension."),
            errors=_MODEL,
        )
    ),
    Op(
        "/v2/models/stats",
        "get",
        "modelsStatistics",
        "triton",
        "Statistics of every model (Triton; this worker)",
        ("ModelStatistics", "Cumulative counts and nanoseconds of the answering worker."),
    ),
    *_versioned(
        Op(
            "/v2/models/{name}/stats",
            "get",
            "modelStatistics",
            "triton",
            "Model statistics (Triton; this worker)",
            ("ModelStatistics", "Cumulative counts and nanoseconds of the answering worker."),
            errors=_MODEL,
        )
    ),
    Op(
        "/v2/repository/index",
        "post",
        "repositoryIndex",
        "triton",
        "Model repository index (Triton)",
        (
            {"type": "array", "items": {"$ref": REF.format(name="RepositoryIndexEntry")}},
            "Every model version.",
        ),
        body="RepositoryIndexRequest",
        errors=("BadRequest", "Unauthorized", "HeaderFieldsTooLarge"),
    ),
    Op(
        "/v2/repository/models/{name}/load",
        "post",
        "repositoryModelLoad",
        "triton",
        "Load or reload a model on every worker (Triton's model repository extension)",
        ({"type": "object"}, "Every worker serves the model's versions as its folders say now."),
        body="RepositoryModelRequest",
        errors=("BadRequest", "Unauthorized", "HeaderFieldsTooLarge"),
    ),
    Op(
        "/v2/repository/models/{name}/unload",
        "post",
        "repositoryModelUnload",
        "triton",
        "Unload a model on every worker (Triton's model repository extension)",
        ({"type": "object"}, "Every worker has drained and freed the model."),
        body="RepositoryModelRequest",
        errors=("BadRequest", "Unauthorized", "HeaderFieldsTooLarge"),
    ),
    Op(
        "/v1/models",
        "get",
        "v1ListModels",
        "v1",
        "List models (KServe V1)",
        ("ModelList", "Names of the models served."),
    ),
    Op(
        "/v1/models/{name}",
        "get",
        "v1ModelStatus",
        "v1",
        "Model status (KServe V1)",
        ("ModelReady", "Ready."),
        unavailable="ModelReady",
        errors=_MODEL,
    ),
    Op(
        "/metrics",
        "get",
        "metrics",
        "server",
        "Prometheus metrics of the whole server",
        ({"type": "string"}, "Prometheus text exposition format."),
        content_type="text/plain",
    ),
    Op(
        "/openapi.json",
        "get",
        "openapi",
        "server",
        "This document",
        ({"type": "object"}, "OpenAPI 3 document."),
    ),
]

#: The msgspec types whose schemas become ``components.schemas`` (and the APIs' own).
TYPES: list[Any] = [
    schemas.Error,
    schemas.V1Live,
    schemas.Live,
    schemas.Ready,
    schemas.ModelReady,
    schemas.ModelList,
    schemas.ServerMetadata,
    schemas.ModelMetadata,
    schemas.TritonModelConfig,
    schemas.ModelStatistics,
    schemas.RepositoryIndexRequest,
    schemas.RepositoryModelRequest,
    schemas.RepositoryIndexEntry,
]

PARAMS = {
    "name": {
        "name": "name",
        "in": "path",
        "required": True,
        "description": "Model name.",
        "schema": {"type": "string"},
    },
    "version": {
        "name": "version",
        "in": "path",
        "required": True,
        "description": "Model version.",
        "schema": {"type": "string"},
    },
    "timeout": {
        "name": "X-Request-Timeout-Ms",
        "in": "header",
        "required": False,
        "description": "Deadline of this request, milliseconds (504 when it passes).",
        "schema": {"type": "number", "exclusiveMinimum": 0},
    },
    "request_id": {
        "name": "X-Request-Id",
        "in": "header",
        "required": False,
        "description": "Request id to echo (1-128 of A-Z a-z 0-9 . _ : -); generated when absent or invalid.",
        "schema": {"type": "string"},
    },
    "header_length": {
        "name": HEADER_LENGTH,
        "in": "header",
        "required": False,
        "description": "Binary tensor data extension (Triton): length of the JSON at the start of "
        "the body; the inputs' binary data follow it.",
        "schema": {"type": "integer", "minimum": 0},
    },
}
