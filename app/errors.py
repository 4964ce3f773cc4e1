"""Domain exceptions of the serving path, one class per HTTP outcome.

The only place they become HTTP responses is :mod:`app.http.edge`; model code
and codecs raise these and know nothing of aiohttp.

    ScoringError                 status   meaning
    ├── InvalidInput              400      the request body or a tensor is wrong
    ├── Unauthorized              401      no valid API key (+ WWW-Authenticate)
    ├── ModelNotFound             404      unknown model or version
    │   └── ModelUnloaded         404      a model unloaded by model control (gRPC UNAVAILABLE)
    ├── ModelControlFailed        400      a load or unload refused or failed (on some worker)
    ├── RequestTimeout            408      request body too slow (+ Connection: close)
    ├── PayloadTooLarge           413      too many items, a string too long, an item over
    │                                      the model's batch cost bound
    ├── UnsupportedMediaType      415      body is not JSON
    ├── HeaderFieldsTooLarge      431      a header field too long, or too many
    ├── ClientDisconnected        499      client went away before its items ran
    ├── InferenceFailed           500      the model raised on a batch
    ├── ServiceUnavailable        503      not ready / draining / queue full
    │   ├── ModelNotReady
    │   └── QueueFull             (+ Retry-After)
    ├── DeadlineExceeded          504      request timeout passed
    └── InsufficientStorage       507      one item alone does not fit in device memory
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar


class ScoringError(Exception):
    """Base class: ``status`` is the HTTP status; ``str(exc)`` is the client message;
    ``headers`` go on the error response."""

    status: int = 500
    headers: ClassVar[Mapping[str, str]] = {}

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


class InvalidInput(ScoringError):
    status = 400


class Unauthorized(ScoringError):
    status = 401
    headers: ClassVar[Mapping[str, str]] = {"WWW-Authenticate": 'Bearer realm="scoring-server"'}


class ModelNotFound(ScoringError):
    status = 404


class ModelUnloaded(ModelNotFound):
    pass


class ModelControlFailed(ScoringError):
    status = 400


class RequestTimeout(ScoringError):
    status = 408
    headers: ClassVar[Mapping[str, str]] = {"Connection": "close"}


class PayloadTooLarge(ScoringError):
    status = 413


class UnsupportedMediaType(ScoringError):
    status = 415


class HeaderFieldsTooLarge(ScoringError):
    status = 431


class ClientDisconnected(ScoringError):
    status = 499


class InferenceFailed(ScoringError):
    status = 500


class ServiceUnavailable(ScoringError):
    status = 503


class ModelNotReady(ServiceUnavailable):
    pass


class QueueFull(ServiceUnavailable):
    pass


class DeadlineExceeded(ScoringError):
    status = 504


class InsufficientStorage(ScoringError):
    status = 507


class ModelLoadError(Exception):
    """A model could not be configured or loaded (bad model.toml, missing file, bad handler)."""
