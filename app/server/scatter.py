"""Scatter/gather: a large inference request runs in shards on this worker and its siblings.

A request with more items than its model's ``max_batch_size`` (``scatter = true`` in
``model.toml``, the default) is cut into contiguous shards, one per worker that takes part
(this one and its least-loaded live siblings, at most one shard per ``max_batch_size`` items);
the shards run in parallel, this worker's own through its batcher and the others' through
their internal endpoints (:mod:`app.server.peers`); the outputs are concatenated in item
order. A sibling that cannot be reached costs nothing but time: its shard runs here. A
sibling that stalls costs the request a 504 at its deadline (never a hang); any shard's error
is the request's error, and the other shards are cancelled.

A request that is not split but arrived on a pinned connection (gRPC: ``pinned=True``) may be
forwarded whole to a less-loaded sibling instead (:mod:`app.server.forward`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

from app import errors
from app.server.balance import Balancer
from app.server.forward import Forwarder
from app.server.loadtable import Load
from app.server.peers import PeerClient, PeerUnavailable
from app.serving.state import ModelEntry

log = logging.getLogger(__name__)

Arrays = dict[str, np.ndarray]
LocalRun = Callable[[Arrays, float], Coroutine[Any, Any, Arrays]]


def shard_bounds(items: int, shards: int) -> list[tuple[int, int]]:
    """``shards`` contiguous, near-equal ``[start, stop)`` ranges covering ``range(items)``."""
    cuts = [round(i * items / shards) for i in range(shards + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(shards)]


def pick_siblings(siblings: list[Load], items: int, max_batch_size: int, now: float) -> list[Load]:
    """The least-loaded live siblings that take a shard: at most one shard per
    ``max_batch_size`` items, this worker keeping one. A sibling with a full batch (or more)
    already queued or running is saturated: a shard would only wait there."""
    wanted = math.ceil(items / max(1, max_batch_size)) - 1
    free = (s for s in siblings if s.live(now) and s.items < max_batch_size)
    live = sorted(free, key=lambda s: (s.recent, s.items, s.connections))
    return live[: max(0, wanted)]


class Scatter:
    """The ``ModelRegistry.spread`` hook of :func:`app.serving.dataplane.infer`.

    Args:
        balancer: this worker's view of the load table.
        peers: the client of the siblings' internal endpoints.
        on_scatter: called with (model, version, shards sent to siblings) per scattered request.
        forwarder: forwards whole requests that arrive on pinned connections (None: never).
    """

    def __init__(
        self,
        balancer: Balancer,
        peers: PeerClient,
        on_scatter: Callable[[str, str, int], None] | None = None,
        forwarder: Forwarder | None = None,
    ) -> None:
        self.balancer = balancer
        self.peers = peers
        self.on_scatter = on_scatter
        self.forwarder = forwarder

    def considers(self, entry: ModelEntry, items: int, pinned: bool) -> bool:
        """Whether a request of ``items`` items may leave this worker: split (more items than
        ``max_batch_size``, ``scatter`` on, this worker ready) or forwarded whole (``pinned``
        and a forwarder). Cheap: the request path asks it of every request."""
        config = entry.config
        if pinned and self.forwarder is not None:
            return True
        return config.scatter and items > config.max_batch_size and self.balancer.ready

    async def __call__(
        self,
        entry: ModelEntry,
        inputs: Arrays,
        timeout_s: float,
        request_id: str,
        local: LocalRun,
        *,
        pinned: bool = False,
    ) -> Arrays | None:
        """The request's outputs, or None when it should run here whole.

        ``pinned``: the request came on a connection this worker cannot shed (gRPC): if it is
        not split, it may be forwarded whole (:class:`app.server.forward.Forwarder`).
        """
        outputs = await self._scatter(entry, inputs, timeout_s, request_id, local)
        if outputs is None and pinned and self.forwarder is not None:
            outputs = await self.forwarder(entry, inputs, timeout_s, request_id, local)
        return outputs

    async def _scatter(
        self, entry: ModelEntry, inputs: Arrays, timeout_s: float, request_id: str, local: LocalRun
    ) -> Arrays | None:
        config = entry.config
        items = len(next(iter(inputs.values())))
        if not config.scatter or items <= config.max_batch_size or not self.balancer.ready:
            return None
        siblings = pick_siblings(self.balancer.siblings(), items, config.max_batch_size, time.monotonic())
        if not siblings:
            return None
        bounds = shard_bounds(items, len(siblings) + 1)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        log.debug(
            "balance: request %s (%d items of %s) in %d shards, to pids %s",
            request_id, items, config.name, len(bounds), [s.pid for s in siblings],
        )  # fmt: skip
        if self.on_scatter is not None:
            self.on_scatter(config.name, config.version, len(siblings))

        def part(i: int) -> Arrays:
            start, stop = bounds[i]
            return {name: array[start:stop] for name, array in inputs.items()}

        async def remote(i: int, sibling: Load) -> Arrays:
            shard = part(i)
            try:
                return await self.peers.infer(
                    sibling.pid, config.name, config.version, shard,
                    timeout_s=max(0.0, deadline - loop.time()), request_id=request_id,
                )  # fmt: skip
            except PeerUnavailable as exc:
                log.info("request %s: shard %d runs here (%s)", request_id, i, exc)
                return await local(shard, max(0.0, deadline - loop.time()))

        tasks: list[asyncio.Task[Arrays]] = [loop.create_task(local(part(0), timeout_s))]
        tasks += [loop.create_task(remote(i + 1, s)) for i, s in enumerate(siblings)]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
        try:
            return {name: np.concatenate([r[name] for r in results]) for name in results[0]}
        except (KeyError, ValueError) as exc:
            raise errors.InferenceFailed(f"request {request_id}: shards disagree on outputs: {exc}") from exc
