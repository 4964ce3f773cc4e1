"""Where a request runs: here, in shards on this worker and its siblings, or whole on a sibling.

The data plane asks its balancer (``app.server.balance.WorkerBalancer.may_leave``) of every
request (one cheap condition) and awaits the router only for the requests that may leave; the router
then makes one of two choices, by the rules of :mod:`app.server.balance`:

- **Scatter/gather** (large requests): a request with more items than its model's
  ``max_batch_size`` (``scatter = true`` in ``model.toml``, the default) is cut into contiguous
  shards, one per worker that takes part (this one and its least-loaded live siblings, at most
  one shard per ``max_batch_size`` items, none to a sibling that already has a full batch);
  the shards run in parallel, this worker's own through its serving unit and the others' through
  their internal endpoints (:mod:`app.server.peers`), and the outputs are concatenated in item
  order. A sibling that cannot be reached costs nothing but time: its shard runs here; one that
  stalls costs the request a 504 at its deadline (never a hang); any shard's error is the
  request's error, and the other shards are cancelled.
- **Forwarding** (requests on pinned connections): a gRPC client sends every call of a channel
  over one long-lived HTTP/2 connection, which stays on the worker that accepted it; unlike
  HTTP/1.1 keep-alive it cannot be shed one response at a time (``Connection: close``), only
  aged out (``grpc_max_connection_age_s``: the kernel re-places it on reconnect, blind to
  load). So a request that arrives on such a *pinned* connection and is not split is forwarded
  whole to a sibling when this worker is clearly busier than that sibling
  (:func:`app.server.balance.pick_target`: power of two choices). An idle worker never forwards
  (no hop at c = 1), a 2:1 imbalance is the most left in place, and a request does not leave
  while it would wait less than ``MIN_WAIT_S`` here (the model's backlog; ``app.server.balance``):
  for a model whose batches take a fraction of a millisecond the hop costs more CPU on both
  workers than the wait it saves. The sibling's items count at least what this worker has
  forwarded to it and not yet had answered (the table lags the hop). A sibling that cannot be
  reached, whose queue is full or whose copy of the model is not ready (a HUP reload in
  progress) costs nothing but time: the request runs here.

A shard or forwarded request keeps its request context (``app.serving.context``: id, remaining
deadline, priority, trace) and is never split or forwarded again there (``forwarded``). It also
keeps its client: aiohttp does not cancel a handler whose client has gone, so while parts of a
request run on siblings the router looks at its client every ``DISCONNECT_CHECK_S``; once it has
gone, every part is cancelled (ClientDisconnected, 499): the calls to the siblings close their
connections, and each sibling drops the items still queued for it (its own ``is_disconnected``:
``app.server.peers``), as this worker drops its own part. A part whose deadline passes ends the
same way: the sibling's answer is awaited at most ``REPLY_GRACE_S`` past it, then the call closes.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import numpy as np

from app import errors
from app.server.balance import Load, WorkerSlot, pick_siblings, pick_target, splits
from app.server.peers import PeerClient, PeerUnavailable
from app.serving.context import RequestContext
from app.serving.siblings import Arrays, LocalRun
from app.serving.unit import ServingUnit

log = logging.getLogger(__name__)

#: While parts of a request run on siblings, how often its client is looked at, seconds: one
#: wakeup per such request, and a client that left costs its siblings at most this much more work.
DISCONNECT_CHECK_S = 0.05

T = TypeVar("T")


def shard_bounds(items: int, shards: int) -> list[tuple[int, int]]:
    """``shards`` contiguous, near-equal ``[start, stop)`` ranges covering ``range(items)``."""
    cuts = [round(i * items / shards) for i in range(shards + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(shards)]


class Router:
    """Where requests that leave this worker go (module docstring); the worker's balancer
    (``app.server.balance.WorkerBalancer``) hands it the requests that may leave.

    Args:
        slot: this worker's slot in the load table (its own items, its siblings' loads).
        peers: the client of the siblings' internal endpoints.
        on_scatter: called with (model, version, shards sent to siblings) per scattered request.
        on_forward: called with (model, version) per request sent whole to a sibling (one
            refused there and run here included).
        forward: forward pinned requests (False: scatter only).
        rng: the random source of the two choices.
    """

    def __init__(
        self,
        slot: WorkerSlot,
        peers: PeerClient,
        *,
        on_scatter: Callable[[str, str, int], None] | None = None,
        on_forward: Callable[[str, str], None] | None = None,
        forward: bool = True,
        rng: random.Random | None = None,
    ) -> None:
        self.slot = slot
        self.peers = peers
        self.on_scatter = on_scatter
        self.on_forward = on_forward
        self.forward = forward
        self.rng = rng or random.Random()
        self.pending: dict[int, int] = {}  # items forwarded per sibling pid, not yet answered

    async def route(
        self, unit: ServingUnit, inputs: Arrays, context: RequestContext, local: LocalRun
    ) -> Arrays | None:
        """The request's outputs, or None when it should run here whole (forwarded only when
        ``context.pinned``); every part runs under ``context``.

        Raises:
            DeadlineExceeded: a sibling did not answer before ``context.deadline`` (it stalled).
            ClientDisconnected: the client left first (every part was cancelled).
            ScoringError: a sibling's run failed (same class as there).
        """
        items = len(next(iter(inputs.values())))
        if splits(unit.scatter, unit.max_batch_size, items):
            siblings = pick_siblings(self.slot.others(), items, unit.max_batch_size, time.monotonic())
            if siblings:
                return await _while_connected(
                    self._scatter(unit, inputs, items, context, local, siblings), context
                )
        if context.pinned and self.forward:
            return await _while_connected(self._forward(unit, inputs, items, context, local), context)
        return None

    async def _scatter(
        self,
        unit: ServingUnit,
        inputs: Arrays,
        items: int,
        context: RequestContext,
        local: LocalRun,
        siblings: list[Load],
    ) -> Arrays:
        request_id = context.request_id
        bounds = shard_bounds(items, len(siblings) + 1)
        log.debug(
            "balance: request %s (%d items of %s) in %d shards, to pids %s",
            request_id, items, unit.name, len(bounds), [s.pid for s in siblings],
        )  # fmt: skip
        if self.on_scatter is not None:
            self.on_scatter(unit.name, unit.version, len(siblings))

        def part(i: int) -> Arrays:
            start, stop = bounds[i]
            return {name: array[start:stop] for name, array in inputs.items()}

        async def remote(i: int, sibling: Load) -> Arrays:
            shard = part(i)
            try:
                return await self.peers.infer(sibling.pid, unit.name, unit.version, shard, context)
            except PeerUnavailable as exc:
                log.info("request %s: shard %d runs here (%s)", request_id, i, exc)
                return await local(shard)

        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Task[Arrays]] = [loop.create_task(local(part(0)))]
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

    async def _forward(
        self, unit: ServingUnit, inputs: Arrays, items: int, context: RequestContext, local: LocalRun
    ) -> Arrays | None:
        request_id = context.request_id
        mine = self.slot.items
        target = pick_target(mine, self.slot.others(), time.monotonic(), self.pending, self.rng)
        if target is None:
            log.debug("balance: request %s runs here (%d items here)", request_id, mine)
            return None
        log.debug(
            "balance: forwarding request %s (%d items of %s) to pid %d (%d items there, %d here)",
            request_id, items, unit.name, target.pid, target.items, mine,
        )  # fmt: skip
        self.pending[target.pid] = self.pending.get(target.pid, 0) + items
        if self.on_forward is not None:
            self.on_forward(unit.name, unit.version)
        try:
            outputs = await self.peers.infer(target.pid, unit.name, unit.version, inputs, context)
        except (PeerUnavailable, errors.ServiceUnavailable, errors.ModelNotFound) as exc:  # nothing ran there
            log.info("request %s: runs here, not on pid %d (%s)", request_id, target.pid, exc)
            refused = True
        else:
            refused = False
        finally:
            left = self.pending.get(target.pid, 0) - items
            if left > 0:
                self.pending[target.pid] = left
            else:
                self.pending.pop(target.pid, None)
        if refused:
            return await local(inputs)
        return outputs


async def _while_connected(work: Coroutine[Any, Any, T], context: RequestContext) -> T:
    """``work``, cancelled once the client of the request it serves has gone (module docstring).

    Raises:
        ClientDisconnected: the client left before ``work`` ended.
    """
    gone = context.is_disconnected
    if gone is None:
        return await work
    task = asyncio.get_running_loop().create_task(work)
    try:
        while True:
            done, _ = await asyncio.wait((task,), timeout=DISCONNECT_CHECK_S)
            if done:
                return task.result()
            if gone():
                log.info("request %s: its client left; its parts on sibling workers are cancelled",
                         context.request_id)  # fmt: skip
                raise errors.ClientDisconnected(f"client of request {context.request_id} left")
    finally:
        task.cancel()  # nothing when it ended; else its calls to siblings close
