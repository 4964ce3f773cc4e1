"""What the serving layer may ask of the process that runs it and of that process's sibling
workers: three small interfaces, one per job, handed to :func:`app.main.create_app` at
construction and never replaced.

- :class:`Balancer`: this worker's load among its siblings and the requests that leave it, as
  the data plane sees them on every request: it publishes the load (at every admission and
  completion), asks whether a request should leave (scatter/gather of a large request,
  forwarding of a request on a pinned gRPC connection) and has it run there.
- :class:`Siblings`: the other workers as a whole, for the rarer questions: does another worker
  serve already (startup), apply a model control change on every one (model control), their
  statistics (the statistics endpoints).
- :class:`Supervisor`: the process. The hung-inference watchdog asks it to drain and exit.

Which connection should move to a less-loaded sibling is no question of the serving core: it is
the HTTP front end's keep-alive policy (``app.http.state.SHEDDING``).

The gunicorn worker implements them (``app.server.balance.WorkerBalancer``,
``app.server.siblings.WorkerSiblings``, ``app.server.worker.ScoringWebWorker``); :class:`Alone`
stands in for all three where there are no siblings and nothing restarts the process: in-process
tests, ``python -m aiohttp.web``, a worker whose load table cannot be opened.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from app.serving.context import RequestContext
    from app.serving.unit import ServingUnit

Arrays = dict[str, np.ndarray]
#: Runs (part of) a request on this worker, under the request's context: inputs -> outputs.
LocalRun = Callable[[Arrays], Coroutine[Any, Any, Arrays]]


class Balancer(Protocol):
    """This worker's load and the requests that leave it (module docstring)."""

    def add_load(self, items: int) -> None:
        """This worker took on (``items`` > 0) or finished (< 0) items: publish its load."""
        ...

    def may_leave(self, unit: ServingUnit, items: int, pinned: bool) -> bool:
        """Whether a request of ``items`` items may leave this worker (cheap: asked of every
        request); False runs it here without awaiting :meth:`route`."""
        ...

    async def route(
        self, unit: ServingUnit, inputs: Arrays, context: RequestContext, local: LocalRun
    ) -> Arrays | None:
        """The request's outputs when it ran (in part) on siblings, each part under the request's
        ``context`` (its deadline, id, priority, trace and client travel with it: a part on a
        sibling is cancelled there once the client has gone), or None to run it here whole.

        Raises:
            ScoringError: a sibling's run failed (the same class), or it did not answer before
                ``context.deadline`` (DeadlineExceeded), or the client left (ClientDisconnected).
        """
        ...


class Siblings(Protocol):
    """The other workers of this server (module docstring)."""

    def others_serving(self) -> bool:
        """Whether another worker of the server serves now (blocking: call it off the loop)."""
        ...

    async def apply(self, action: str, name: str) -> dict[int, str]:
        """Have every sibling that is not leaving (ready or not) apply a model control ``action``
        (``load``, ``unload``) to model ``name`` (``app.serving.control``); each that failed,
        pid -> why ({} = all did)."""
        ...

    async def statistics(self) -> list[list[dict[str, Any]]]:
        """Each reachable sibling's Triton statistics of its model versions (``$model_stat``
        objects, ``app.protocols.triton.model_statistics``); one that does not answer within
        ``app.server.peers.STATS_TIMEOUT_S`` is left out."""
        ...


class Supervisor(Protocol):
    """The process that runs this app."""

    def request_stop(self, reason: str) -> bool:
        """Ask the process to drain and exit; False when nothing can stop it."""
        ...


class Alone:
    """No siblings and no supervisor: every request runs here, nothing restarts the process."""

    def add_load(self, items: int) -> None:
        """Nobody reads it."""

    def may_leave(self, unit: ServingUnit, items: int, pinned: bool) -> bool:
        """Never."""
        return False

    async def route(
        self, unit: ServingUnit, inputs: Arrays, context: RequestContext, local: LocalRun
    ) -> Arrays | None:
        """Here, whole."""
        return None

    def others_serving(self) -> bool:
        """Nobody else."""
        return False

    async def apply(self, action: str, name: str) -> dict[int, str]:
        """Nobody else to tell."""
        return {}

    async def statistics(self) -> list[list[dict[str, Any]]]:
        """Nobody else counts."""
        return []

    def request_stop(self, reason: str) -> bool:
        """Nothing restarts this process."""
        return False
