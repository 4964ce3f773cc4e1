"""The stress run's locust users, one class per API, and its load shape.

Each user is a closed-loop client (no think time) of one API on a connection of its own: an
HTTP/1.1 keep-alive connection (:class:`~benchmarks.stress.wire.Connection`) or a gRPC channel
(:class:`~benchmarks.stress.wire.GrpcClient`). It sends a request drawn from its API's pool,
has the answer judged (:class:`~benchmarks.stress.traffic.Traffic`), and after a 503 waits the
``Retry-After`` it was given (at most 5 s), as a polite client does. Locust's own statistics get
every request under the API's name, and under ``<api> (<outcome>)`` when it was not ``ok``.

:class:`PhaseShape` is a ``LoadTestShape`` that follows the run's phase (set by
``benchmarks.stress.run``): the plan's users while warming up and in the main phase, none in the
idle pauses (the descriptor and thread baselines), and the end.

Not meant for the ``locust`` command: the users need the :class:`StressEnvironment`'s traffic,
which ``python -m benchmarks.stress`` builds (the server, the pools, the references).
"""

from __future__ import annotations

import random
import time
from typing import ClassVar, cast

from locust import LoadTestShape, User, constant, task
from locust.env import Environment

from benchmarks.stress.apis import APIS
from benchmarks.stress.schedule import Plan
from benchmarks.stress.traffic import Traffic
from benchmarks.stress.wire import Connection, GrpcClient


class StressEnvironment(Environment):
    """A locust ``Environment`` that carries the run's :class:`Traffic`."""

    traffic: Traffic


def _traffic(user: User) -> Traffic:
    return cast(StressEnvironment, user.environment).traffic


class ApiUser(User):
    """A client of one API (``api``, a name of ``benchmarks.stress.apis.APIS``) on a connection
    of its own: HTTP/1.1 keep-alive or a gRPC channel, as the API's protocol says."""

    abstract = True
    api: ClassVar[str] = ""
    wait_time = constant(0)

    def on_start(self) -> None:
        self.traffic = _traffic(self)
        self.rng = random.Random()
        grpc = self.traffic.oracle.apis[self.api].protocol == "grpc"
        self.client = GrpcClient(self.traffic.grpc_port) if grpc else Connection(self.traffic.port)

    @task
    def send(self) -> None:
        call = self.traffic.draw(self.api, self.rng)
        if isinstance(self.client, GrpcClient):
            result = self.traffic.grpc(self.api, self.client, call)
        else:
            result = self.traffic.http(self.api, self.client, call)
        if result.retry_after_s > 0:
            time.sleep(result.retry_after_s)

    def on_stop(self) -> None:
        self.client.close()


def _user_class(api: str) -> type[User]:
    """``ApiUser`` for ``api``, named after it (``grpc-clf`` -> ``GrpcClfUser``): locust's
    statistics and logs name users by class."""
    name = "".join(part.capitalize() for part in api.split("-")) + "User"
    return type(name, (ApiUser,), {"api": api, "__module__": __name__})


#: One user class per API of ``benchmarks.stress.apis.APIS``.
USERS: dict[str, type[User]] = {api: _user_class(api) for api in APIS}


class PhaseShape(LoadTestShape):
    """The plan's users in the phases ``warmup`` and ``main``, none in ``baseline`` and ``end``,
    and the end of the test at ``done``; ``phase`` is set by the run."""

    def __init__(self, plan: Plan) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.plan = plan
        self.phase = "warmup"

    def tick(self) -> tuple[int, float] | None:
        if self.phase == "done":
            return None
        return (self.plan.users if self.phase in ("warmup", "main") else 0), self.plan.spawn_rate
