"""The one place exceptions become gRPC status codes (the gRPC twin of app/http/edge.py).

    ScoringError (app.errors)      gRPC status           HTTP
    InvalidInput                   INVALID_ARGUMENT      400
    UnsupportedMediaType           INVALID_ARGUMENT      415
    HeaderFieldsTooLarge           INVALID_ARGUMENT      431
    Unauthorized                   UNAUTHENTICATED       401
    ModelNotFound                  NOT_FOUND             404
    ModelUnloaded                  UNAVAILABLE           404  (Triton's answer for an unloaded model)
    ModelControlFailed             INVALID_ARGUMENT      400
    PayloadTooLarge                RESOURCE_EXHAUSTED    413
    InsufficientStorage            RESOURCE_EXHAUSTED    507
    ClientDisconnected             CANCELLED             499
    ServiceUnavailable (ModelNotReady, QueueFull)
                                   UNAVAILABLE           503  (+ ``retry-after`` trailer, s)
    DeadlineExceeded               DEADLINE_EXCEEDED     504
    InferenceFailed                INTERNAL              500
    anything else                  INTERNAL              500  (logged with the request id)

The codes follow gRPC's status code guide (doc/statuscodes.md) and Triton's own mapping
(``TRITONSERVER_ERROR_INVALID_ARG`` -> INVALID_ARGUMENT, ``UNAVAILABLE`` -> UNAVAILABLE...).
Client mistakes are not logged as errors; 5xx-like outcomes get one WARNING line, unknown
exceptions one ERROR line with the traceback.
"""

from __future__ import annotations

import logging
import math

import grpc

from app import errors

log = logging.getLogger(__name__)

RETRY_AFTER_KEY = "retry-after"
REQUEST_ID_KEY = "x-request-id"

_CODES: dict[type[errors.ScoringError], grpc.StatusCode] = {
    errors.InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    errors.UnsupportedMediaType: grpc.StatusCode.INVALID_ARGUMENT,
    errors.HeaderFieldsTooLarge: grpc.StatusCode.INVALID_ARGUMENT,
    errors.Unauthorized: grpc.StatusCode.UNAUTHENTICATED,
    errors.ModelNotFound: grpc.StatusCode.NOT_FOUND,
    errors.ModelUnloaded: grpc.StatusCode.UNAVAILABLE,
    errors.ModelControlFailed: grpc.StatusCode.INVALID_ARGUMENT,
    errors.PayloadTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.InsufficientStorage: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.ClientDisconnected: grpc.StatusCode.CANCELLED,
    errors.ServiceUnavailable: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.InferenceFailed: grpc.StatusCode.INTERNAL,
}


def status_of(exc: errors.ScoringError) -> grpc.StatusCode:
    """The gRPC status of a domain error: its class's, else its nearest base class's."""
    for cls in type(exc).__mro__:
        code = _CODES.get(cls)
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL


def outcome(
    exc: BaseException, request_id: str, method: str
) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """(status, details, trailing metadata) for an exception raised by an RPC; logs it.

    Every answer carries the request id as ``x-request-id`` trailing metadata.
    """
    trailer: list[tuple[str, str]] = [(REQUEST_ID_KEY, request_id)]
    if isinstance(exc, errors.ScoringError):
        code = status_of(exc)
        if exc.retry_after_s is not None:
            trailer.append((RETRY_AFTER_KEY, str(max(1, math.ceil(exc.retry_after_s)))))
        if exc.status >= 500:
            log.warning("grpc %s request %s: %s %s", method, request_id, code.name, exc.message)
        return code, exc.message, tuple(trailer)
    log.error("grpc %s request %s failed", method, request_id, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal server error (request id {request_id})", tuple(trailer)
