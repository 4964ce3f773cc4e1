"""The one inference entry point every protocol front end calls (HTTP V1/V2, gRPC).

A front end decodes its wire format into validated arrays ``[B, *item_shape]`` per input
name, then awaits :func:`infer`. What happens between here and the batcher (admission,
balancing among sibling workers, scatter/gather of large requests) is decided here, once,
for every protocol. Source: KServe's ``DataPlane`` (kserve/protocol/dataplane.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import numpy as np

from app.serving.state import ModelEntry, ModelRegistry, Spread
from app.settings import Settings


def default_timeout_s(settings: Settings, entry: ModelEntry) -> float:
    """The deadline of a request that names none: the model's ``timeout_ms``, else the
    server's ``request_timeout_ms``; seconds."""
    return (entry.config.timeout_ms or settings.request_timeout_ms) / 1000.0


def max_timeout_s(settings: Settings, entry: ModelEntry) -> float:
    """The longest deadline a client may ask of this model: its ``max_timeout_ms``, else the
    server's ``max_request_timeout_ms``; seconds."""
    return (entry.config.max_timeout_ms or settings.max_request_timeout_ms) / 1000.0


def effective_timeout_s(settings: Settings, entry: ModelEntry, requested_s: float | None) -> float:
    """The deadline a request runs under, seconds: the client's own (``X-Request-Timeout-Ms``,
    V2 ``parameters.timeout``, a gRPC deadline), clipped to :func:`max_timeout_s`; the
    default (:func:`default_timeout_s`, also clipped) when it names none.

    Clipping rather than refusing: a client that asks for a long deadline gets the longest
    the server grants, as a gRPC deadline longer than the server's limit would; admission
    then judges the request against the clipped deadline. ``inf``, ``1e308`` and the like
    are clipped too; a NaN or a deadline <= 0 counts as none (front ends refuse those first).
    """
    cap = max_timeout_s(settings, entry)
    if requested_s is None or not requested_s > 0:
        return min(default_timeout_s(settings, entry), cap)
    return min(requested_s, cap)


def refuse_early(entry: ModelEntry, timeout_s: float) -> None:
    """Refuse a request to ``entry`` before its body is decoded when no request of the size
    recently seen could finish within ``timeout_s`` seconds (the front end calls this once it
    has the body, before decoding it; a refusal under overload then costs no decoding).

    Raises:
        QueueFull: 503 + Retry-After (see ``DynamicBatcher.refuse_early``).
    """
    batcher = entry.batcher
    if batcher is not None:
        refusal = batcher.refuse_early(timeout_s)
        if refusal is not None:
            raise refusal


def infer(
    registry: ModelRegistry,
    entry: ModelEntry,
    inputs: dict[str, np.ndarray],
    *,
    timeout_s: float,
    request_id: str,
    is_disconnected: Callable[[], bool] | None = None,
    forwarded: bool = False,
    pinned: bool = False,
) -> Awaitable[dict[str, np.ndarray]]:
    """Run one inference request through ``entry``'s dynamic batcher, or, when it is large and
    sibling workers are ready, in shards on them and here, or, when it is ``pinned`` and this
    worker is clearly busier than a sibling, whole on that sibling (``registry.spread``).

    Args:
        registry: this worker's models (a request that arrives while ``entry`` loads waits).
        entry: the model version to run.
        inputs: one array per model input, ``[B, *item_shape]``, B >= 1, validated.
        timeout_s: the request's deadline from now, seconds.
        request_id: echoed in errors and logs.
        is_disconnected: True once the client has gone (its queued items are dropped).
        forwarded: a shard or request from a sibling worker (app.server.peers): never split
            or forwarded again.
        pinned: it arrived on a connection the worker cannot shed to rebalance (gRPC's one
            HTTP/2 connection per channel): it may be forwarded whole to a less-loaded sibling
            (app.server.forward). HTTP leaves it False (it sheds connections instead).

    Returns:
        An awaitable (await it at once) of one array per model output, ``[B, ...]``, in the
        request's item order. A plain function, so the common path costs no extra coroutine.

    Raises (when awaited):
        ModelNotReady, QueueFull, DeadlineExceeded, InferenceFailed, InsufficientStorage:
            see :meth:`app.serving.batcher.DynamicBatcher.infer` (mapped to HTTP/gRPC codes
            by each front end's one error mapping); a shard's error on a sibling is raised
            as the same class.
    """
    spread = registry.spread
    if spread is not None and not forwarded and entry.ready:
        items = len(next(iter(inputs.values())))
        if spread.considers(entry, items, pinned):

            async def run_here(arrays: dict[str, np.ndarray], shard_s: float) -> dict[str, np.ndarray]:
                return await _run_here(registry, entry, arrays, shard_s, request_id, is_disconnected)

            return _spread(spread, entry, inputs, timeout_s, request_id, run_here, pinned)
    # The common path: the batcher's coroutine itself, no extra layer (this is per request).
    return _run_here(registry, entry, inputs, timeout_s, request_id, is_disconnected)


async def _spread(
    spread: Spread,
    entry: ModelEntry,
    inputs: dict[str, np.ndarray],
    timeout_s: float,
    request_id: str,
    run_here: Callable[[dict[str, np.ndarray], float], Coroutine[Any, Any, dict[str, np.ndarray]]],
    pinned: bool,
) -> dict[str, np.ndarray]:
    """``spread`` (scatter, or forward when ``pinned``); here, whole, if it declines."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    outputs = await spread(entry, inputs, timeout_s, request_id, run_here, pinned=pinned)
    if outputs is not None:
        return outputs
    return await run_here(inputs, max(0.0, deadline - loop.time()))


async def _run_here(
    registry: ModelRegistry,
    entry: ModelEntry,
    inputs: dict[str, np.ndarray],
    timeout_s: float,
    request_id: str,
    is_disconnected: Callable[[], bool] | None,
) -> dict[str, np.ndarray]:
    # This worker's published load (items queued + in flight) for its siblings' balancing.
    on_load = registry.on_load
    items = len(next(iter(inputs.values()))) if on_load is not None and inputs else 0
    if on_load is not None:
        on_load(items)
    try:
        if not entry.ready:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            entry = await registry.wait_ready(entry, timeout_s)
            timeout_s = max(0.0, deadline - loop.time())
        assert entry.batcher is not None
        return await entry.batcher.infer(
            inputs, timeout_s=timeout_s, request_id=request_id, is_disconnected=is_disconnected
        )
    finally:
        if on_load is not None:
            on_load(-items)
