"""One inference request's context: who it is, by when it is due, at which priority level, in
which trace, how it travels and where it is recorded. Created once at the edge by each front end
(``app.http.inference.serve``, ``app.grpc.servicer``) with what its transport says (the id, the
arrival, the deadline its transport named, whether its client is still there, whether its
connection is pinned, its metrics); the data plane settles its deadline and priority level
against the model and carries it whole through the sibling router, the serving unit and across
to a sibling's shard.

The request's tensors are not in it (they change shape on the way: validated, expanded by the
item stage, cut into shards); only what stays the same for every item of the request is.
Source: KServe's ``InferRequest`` keeps ``request_id`` and ``parameters`` beside the tensors;
Triton's ``InferenceRequest`` keeps id, priority, timeout and trace on one object.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from app.observability.metrics import Recording

#: The deadline of a request whose transport named none, until the data plane settles the model's
#: (NaN: no comparison holds, so nothing reads it as a time by mistake).
NO_DEADLINE = math.nan


#: A request id a client may choose (HTTP ``X-Request-Id``, gRPC ``ModelInferRequest.id`` or
#: ``x-request-id`` metadata): 1 to 128 of these, echoed in responses and logs.
_VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def request_id(*candidates: str) -> str:
    """A request's id: the rule every front end applies (the HTTP edge to
    ``X-Request-Id``, gRPC to ``ModelInferRequest.id`` or ``x-request-id`` metadata). The first
    candidate that is a sane request id, else a new one: 128 random bits as 32 hex digits. An
    id names a request in logs and errors; it is no secret, so it comes from ``random``
    (reseeded in each forked worker), not a syscall."""
    for candidate in candidates:
        if candidate and _VALID_REQUEST_ID.match(candidate):
            return candidate
    return f"{random.getrandbits(128):032x}"


class RequestContext(msgspec.Struct, frozen=True):
    """What one inference request carries besides its tensors (module docstring). A frozen
    ``msgspec.Struct``: built and copied with a field changed (``msgspec.structs.replace``, as
    the data plane settles its deadline and priority) in C, several times cheaper than a frozen
    dataclass and ``dataclasses.replace`` (docs/benchmarks.md, *The host path*).

    Attributes:
        request_id: the id echoed in errors, logs and the response headers.
        deadline: the absolute time by which its outputs are due, ``loop.time()`` seconds of
            this worker's event loop (a shard sends what is left, ``app.server.peers``). As the
            edge builds it: the deadline its transport named (``X-Request-Timeout-Ms``, a gRPC
            deadline; :data:`NO_DEADLINE` for none); from the data plane's ``admit`` on, the one
            settled against the model (``app.serving.dataplane.DataPlane.settle``), brought
            forward by its ``parameters.timeout`` once its body is decoded.
        priority: Triton's request priority (1 = the highest level, 0 = the model's default
            level; ``app.serving.unit.ServingUnit.level`` maps it to a queue level), from the
            request's ``parameters.priority`` (the data plane's to read).
        trace: the W3C trace context (``traceparent``, ``tracestate``) as header pairs, for a
            sibling's spans to join the request's trace; empty when tracing is off.
        pinned: it arrived on a connection the worker cannot shed (gRPC's one HTTP/2
            connection per channel): it may be forwarded whole to a less-loaded sibling.
        forwarded: a shard or whole request a sibling sent here: never split or sent on again.
        is_disconnected: True once its client has gone (its queued items are then dropped);
            None: never asked (a shard, a test).
        arrival: when it arrived, ``loop.time()`` seconds (a shard: when it was received): its
            time budget, in messages, is ``deadline - arrival``; None: unknown.
        recording: its request metrics (``app.observability.metrics.Recording``), labelled
            with its model once the data plane has found it; None: metrics off, or a shard
            (the worker that received the request records it).
    """

    request_id: str
    deadline: float
    priority: int = 0
    trace: tuple[tuple[str, str], ...] = ()
    pinned: bool = False
    forwarded: bool = False
    is_disconnected: Callable[[], bool] | None = None
    arrival: float | None = None
    recording: Recording | None = None
