"""The data plane: the one serving path every protocol front end calls (HTTP V1/V2, gRPC).

A front end decodes its wire format into an :class:`~app.protocols.infer.InferRequest` and
encodes the :class:`~app.protocols.infer.InferResponse` it gets back; everything between is
here, once, for every protocol::

    admit(name, version, timeout)     model lookup (404) and early refusal (503), before the
                                      front end decodes the body: a refusal under overload
                                      costs no decoding
    infer(request)                    validation against the model (4xx), the outputs asked
                                      for, the deadline, admission (503 / 504), balancing among
                                      sibling workers (scatter, forwarding), dynamic batching,
                                      and the response object
    run(entry, arrays)                the array-level step of ``infer``: what a shard or a
                                      forwarded request from a sibling worker enters

Source: KServe's ``DataPlane`` (kserve/protocol/dataplane.py: ``infer`` takes an
``InferRequest`` and returns an ``InferResponse``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import numpy as np
from aiohttp import web

from app.errors import ModelNotReady
from app.protocols.infer import (
    InferRequest,
    InferResponse,
    build_response,
    requested_outputs,
    validate_inputs,
)
from app.protocols.limits import RequestLimits
from app.serving.state import ModelEntry, ModelRegistry, Spread
from app.settings import Settings

Arrays = dict[str, np.ndarray]


class DataPlane:
    """This worker's serving path over its models.

    Args:
        registry: the models this worker serves (and the balancing hooks installed on it).
        settings: the server's settings (default and maximum deadlines).
        limits: the request limits the codecs and validation enforce.
    """

    def __init__(self, registry: ModelRegistry, settings: Settings, limits: RequestLimits) -> None:
        self.registry = registry
        self.settings = settings
        self.limits = limits

    # --- deadlines -------------------------------------------------------------------

    def default_timeout_s(self, entry: ModelEntry) -> float:
        """The deadline of a request that names none: the model's ``timeout_ms``, else the
        server's ``request_timeout_ms``; seconds."""
        return (entry.config.timeout_ms or self.settings.request_timeout_ms) / 1000.0

    def max_timeout_s(self, entry: ModelEntry) -> float:
        """The longest deadline a client may ask of this model: its ``max_timeout_ms``, else
        the server's ``max_request_timeout_ms``; seconds."""
        return (entry.config.max_timeout_ms or self.settings.max_request_timeout_ms) / 1000.0

    def timeout_s(self, entry: ModelEntry, requested_s: float | None) -> float:
        """The deadline a request runs under, seconds: the client's own (``InferRequest.timeout_s``:
        ``X-Request-Timeout-Ms``, ``parameters.timeout``, a gRPC deadline, the earliest of them),
        clipped to :meth:`max_timeout_s`; the default (:meth:`default_timeout_s`, also clipped)
        when it names none.

        Clipping rather than refusing: a client that asks for a long deadline gets the longest
        the server grants, as a gRPC deadline longer than the server's limit would; admission
        then judges the request against the clipped deadline. ``inf`` and ``1e308`` are clipped
        too; a NaN or a deadline <= 0 counts as none (the parsers refuse those first).
        """
        cap = self.max_timeout_s(entry)
        if requested_s is None or not requested_s > 0:
            return min(self.default_timeout_s(entry), cap)
        return min(requested_s, cap)

    # --- the steps a front end calls --------------------------------------------------

    def admit(self, name: str, version: str | None, requested_s: float | None) -> ModelEntry:
        """The model a request addresses, once it is clear the request is not refused early:
        when a full batch or more already waits for the model and no request of the size
        recently seen could finish within the deadline, the request is refused before its body
        is decoded (a refusal under overload then costs the read, not the decoding; the full
        admission, with the request's own size, happens in :meth:`infer`).

        Args:
            name, version: the model addressed (version None = its highest).
            requested_s: the deadline known before decoding (a header, a gRPC deadline), s.

        Raises:
            ModelNotFound: unknown model or version (404).
            ModelNotReady: the model is unavailable (it could not be loaded: 503 with why).
            QueueFull: refused early (503 + Retry-After).
        """
        entry = self.registry.get(name, version)
        if entry.error is not None:
            raise ModelNotReady(f"model {entry.config.name!r} is unavailable: {entry.error}")
        batcher = entry.batcher
        if batcher is not None and batcher.backlogged:
            refusal = batcher.refuse_early(self.timeout_s(entry, requested_s))
            if refusal is not None:
                raise refusal
        return entry

    async def infer(
        self,
        request: InferRequest,
        *,
        request_id: str,
        entry: ModelEntry | None = None,
        is_disconnected: Callable[[], bool] | None = None,
        pinned: bool = False,
    ) -> InferResponse:
        """Validate, admit, run and answer one inference request.

        Args:
            request: the decoded request (its tensors not yet validated).
            request_id: echoed in errors and logs.
            entry: the model :meth:`admit` returned (default: looked up from the request).
            is_disconnected: True once the client has gone (its queued items are dropped).
            pinned: it arrived on a connection the worker cannot shed to rebalance (gRPC's one
                HTTP/2 connection per channel): it may be forwarded whole to a less-loaded
                sibling. HTTP leaves it False (it sheds connections instead).

        Returns:
            The response: the outputs asked for, ``[B, ...]`` each, in the request's item order.

        Raises:
            ModelNotFound: unknown model or version (404).
            InvalidInput: tensors that do not fit the model, unknown or repeated outputs (400).
            PayloadTooLarge: over an item, string or batch-cost limit (413).
            ModelNotReady, QueueFull, DeadlineExceeded, InferenceFailed, InsufficientStorage:
                see :meth:`app.serving.batcher.DynamicBatcher.infer`.
        """
        if entry is None:
            entry = self.registry.get(request.model_name, request.model_version)
        config = entry.config
        inputs = validate_inputs(config, request, self.limits)
        wanted = requested_outputs(config, request)  # an unknown output fails before the model runs
        timeout_s = self.timeout_s(entry, request.timeout_s)
        outputs = await self.run(
            entry,
            inputs,
            timeout_s=timeout_s,
            request_id=request_id,
            is_disconnected=is_disconnected,
            pinned=pinned,
        )
        return build_response(config, request, outputs, wanted)

    def run(
        self,
        entry: ModelEntry,
        inputs: Arrays,
        *,
        timeout_s: float,
        request_id: str,
        is_disconnected: Callable[[], bool] | None = None,
        forwarded: bool = False,
        pinned: bool = False,
    ) -> Awaitable[Arrays]:
        """Run validated arrays through ``entry``'s dynamic batcher, or, when the request is
        large and sibling workers are ready, in shards on them and here, or, when it is
        ``pinned`` and this worker is clearly busier than a sibling, whole on that sibling
        (``registry.spread``).

        Args:
            entry: the model version to run.
            inputs: one array per model input, ``[B, *item_shape]``, B >= 1, validated.
            timeout_s: the request's deadline from now, seconds.
            request_id: echoed in errors and logs.
            is_disconnected: True once the client has gone.
            forwarded: a shard or request from a sibling worker (app.server.peers): never split
                or forwarded again.
            pinned: see :meth:`infer`.

        Returns:
            An awaitable (await it at once) of one array per model output, ``[B, ...]``, in the
            request's item order. A plain function, so the common path costs no extra coroutine.

        Raises (when awaited):
            ModelNotReady, QueueFull, DeadlineExceeded, InferenceFailed, InsufficientStorage:
                see :meth:`app.serving.batcher.DynamicBatcher.infer`; a shard's error on a
                sibling is raised as the same class.
        """
        spread = self.registry.spread
        if spread is not None and not forwarded and entry.ready:
            items = len(next(iter(inputs.values())))
            if spread.considers(entry, items, pinned):

                async def run_here(arrays: Arrays, shard_s: float) -> Arrays:
                    return await self._run_here(entry, arrays, shard_s, request_id, is_disconnected)

                return _spread(spread, entry, inputs, timeout_s, request_id, run_here, pinned)
        # The common path: the batcher's coroutine itself, no extra layer (this is per request).
        return self._run_here(entry, inputs, timeout_s, request_id, is_disconnected)

    async def _run_here(
        self,
        entry: ModelEntry,
        inputs: Arrays,
        timeout_s: float,
        request_id: str,
        is_disconnected: Callable[[], bool] | None,
    ) -> Arrays:
        registry = self.registry
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


async def _spread(
    spread: Spread,
    entry: ModelEntry,
    inputs: Arrays,
    timeout_s: float,
    request_id: str,
    run_here: Callable[[Arrays, float], Coroutine[Any, Any, Arrays]],
    pinned: bool,
) -> Arrays:
    """``spread`` (scatter, or forward when ``pinned``); here, whole, if it declines."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    outputs = await spread(entry, inputs, timeout_s, request_id, run_here, pinned=pinned)
    if outputs is not None:
        return outputs
    return await run_here(inputs, max(0.0, deadline - loop.time()))


#: The worker's data plane (created with the app; front ends read it).
DATAPLANE = web.AppKey("dataplane", DataPlane)
