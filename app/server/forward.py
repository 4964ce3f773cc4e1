"""Forwarding of whole requests that arrive on pinned connections (gRPC) to a less-loaded sibling.

A gRPC client sends every call of a channel over one long-lived HTTP/2 connection, which stays
on the worker that accepted it; unlike HTTP/1.1 keep-alive, it cannot be shed one response at
a time (``Connection: close``), only aged out (``grpc_max_connection_age_s``: the kernel
re-places it on reconnect, blind to load). So a request that arrives on such a *pinned*
connection (``dataplane.infer(..., pinned=True)``) is forwarded whole to a sibling's internal
endpoint (:mod:`app.server.peers`) when this worker is clearly busier than that sibling.

**Decision** (:func:`pick_target`): power of two choices among the live ready siblings (two
drawn at random, the one with fewer items kept; Mitzenmacher, "The Power of Two Choices in
Randomized Load Balancing", as Ray Serve's request router does): with several busy workers
forwarding at once they do not all herd onto the one least-loaded sibling. The request goes
there when this worker's items (queued + in flight here, exact) are :func:`clearly_busier`
than the sibling's (at least 1 and more than twice + 0.5): an idle worker never forwards (no
hop at c = 1), and a 2:1 imbalance is the most left in place, so the hop (a Unix-socket
round trip and a copy of the arrays) is paid only where it buys a shorter queue. Nor does
a request leave while the wait here (the model's backlog, ``DynamicBatcher.backlog_s``) is
under ``MIN_WAIT_S``: for a model whose batches take a fraction of a millisecond the hop costs
more CPU on both workers than the wait it saves (measured: feed-ranker over one gRPC channel,
16 calls in flight, 1,280 items/s forwarding against 2,119 without). The
sibling's items are the larger of what it published and what this worker has forwarded to
it and not yet had answered (the table lags the hop by one admission).

A forwarded request keeps its request id and remaining deadline and is never forwarded or
split again (``forwarded=True`` there). A sibling that cannot be reached, whose queue is full
or whose copy of the model is not ready or not there (a HUP reload in progress) costs nothing
but time: the request runs here. A sibling that stalls costs the request
DEADLINE_EXCEEDED / 504 at its deadline, never a hang.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import numpy as np

from app import errors
from app.server.balance import Balancer, clearly_busier
from app.server.loadtable import Load
from app.server.peers import PeerClient, PeerUnavailable
from app.serving.state import ModelEntry

log = logging.getLogger(__name__)

#: Forward only when a request would wait at least this long here, seconds.
MIN_WAIT_S = 0.005

Arrays = dict[str, np.ndarray]
LocalRun = Callable[[Arrays, float], Coroutine[Any, Any, Arrays]]


def pick_target(
    mine: int,
    siblings: Sequence[Load],
    now: float,
    pending: dict[int, int] | None = None,
    rng: random.Random | None = None,
) -> Load | None:
    """The sibling a pinned request should go to, or None to run it here (module docstring).

    Args:
        mine: this worker's items queued + in flight (before this request).
        siblings: the other slots of the load table (dead, stale and unready ones are skipped).
        now: ``time.monotonic()``, seconds.
        pending: items this worker forwarded per sibling pid, not yet answered.
        rng: the random source of the two choices (tests pass a seeded one).
    """
    if mine < 1:
        return None
    pending = pending or {}
    live = [s for s in siblings if s.live(now)]
    if len(live) > 2:
        live = (rng or random).sample(live, 2)

    def load(s: Load) -> tuple[int, float]:
        return (max(s.items, pending.get(s.pid, 0)), s.recent)

    best = min(live, key=load, default=None)
    if best is None or not clearly_busier(mine, load(best)[0]):
        return None
    return best


class Forwarder:
    """Forwards whole pinned requests to less-loaded siblings (used by :class:`app.server.scatter.Scatter`).

    Args:
        balancer: this worker's view of the load table (``items``: its own load).
        peers: the client of the siblings' internal endpoints.
        on_forward: called with (model, version) per request sent to a sibling (metrics;
            one refused there and run here included).
        rng: the random source of the two choices.
    """

    def __init__(
        self,
        balancer: Balancer,
        peers: PeerClient,
        on_forward: Callable[[str, str], None] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.balancer = balancer
        self.peers = peers
        self.on_forward = on_forward
        self.rng = rng or random.Random()
        self.pending: dict[int, int] = {}  # items forwarded per sibling pid, not yet answered

    async def __call__(
        self, entry: ModelEntry, inputs: Arrays, timeout_s: float, request_id: str, local: LocalRun
    ) -> Arrays | None:
        """The request's outputs from a sibling, or None when it should run here.

        Raises:
            DeadlineExceeded: the sibling did not answer within ``timeout_s`` (it stalled).
            ScoringError: the sibling's run failed (same class as there).
        """
        if not self.balancer.ready:
            return None
        batcher = entry.batcher
        if batcher is not None:
            wait = batcher.backlog_s(asyncio.get_running_loop().time()) - batcher.max_queue_delay_s
            if wait < MIN_WAIT_S:
                return None  # the hop would cost more than the wait it saves
        mine = self.balancer.items
        target = pick_target(mine, self.balancer.siblings(), time.monotonic(), self.pending, self.rng)
        config = entry.config
        if target is None:
            log.debug("balance: request %s runs here (%d items here)", request_id, mine)
            return None
        items = len(next(iter(inputs.values())))
        log.debug(
            "balance: forwarding request %s (%d items of %s) to pid %d (%d items there, %d here)",
            request_id, items, config.name, target.pid, target.items, mine,
        )  # fmt: skip
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        self.pending[target.pid] = self.pending.get(target.pid, 0) + items
        if self.on_forward is not None:
            self.on_forward(config.name, config.version)
        try:
            outputs = await self.peers.infer(
                target.pid, config.name, config.version, inputs, timeout_s=timeout_s, request_id=request_id
            )
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
            return await local(inputs, max(0.0, deadline - loop.time()))
        return outputs
