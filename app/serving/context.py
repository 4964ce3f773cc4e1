"""One inference request's context: who it is, by when it is due, at which priority level, in
which trace, and how it travels. Created once at the edge, carried whole through the data plane,
the sibling router, the serving unit and across to a sibling's shard.

The request's tensors are not in it (they change shape on the way: validated, expanded by the
item stage, cut into shards); only what stays the same for every item of the request is.
Source: KServe's ``InferRequest`` keeps ``request_id`` and ``parameters`` beside the tensors;
Triton's ``InferenceRequest`` keeps id, priority, timeout and trace on one object.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestContext:
    """What one inference request carries besides its tensors (module docstring).

    Attributes:
        request_id: the id echoed in errors, logs and the response headers.
        deadline: the absolute time by which its outputs are due, ``loop.time()`` seconds of
            this worker's event loop (a shard sends what is left, ``app.server.peers``).
        priority: Triton's request priority (1 = the highest level, 0 = the model's default
            level; ``app.serving.queue.RequestQueue.level`` maps it to a queue level).
        trace: the W3C trace context (``traceparent``, ``tracestate``) as header pairs, for a
            sibling's spans to join the request's trace; empty when tracing is off.
        pinned: it arrived on a connection the worker cannot shed (gRPC's one HTTP/2
            connection per channel): it may be forwarded whole to a less-loaded sibling.
        forwarded: a shard or whole request a sibling sent here: never split or sent on again.
        is_disconnected: True once its client has gone (its queued items are then dropped);
            None: never asked (a shard, a test).
        arrival: when it arrived, ``loop.time()`` seconds (a shard: when it was received): its
            time budget, in messages, is ``deadline - arrival``; None: unknown.
    """

    request_id: str
    deadline: float
    priority: int = 0
    trace: tuple[tuple[str, str], ...] = ()
    pinned: bool = False
    forwarded: bool = False
    is_disconnected: Callable[[], bool] | None = None
    arrival: float | None = None
