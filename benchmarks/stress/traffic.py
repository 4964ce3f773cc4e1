"""One request of a stress run, sent and judged: a call drawn from its API's pool, sent on a
client of :mod:`benchmarks.stress.wire`, its answer judged by the :class:`~benchmarks.stress.oracle.Oracle`,
and reported to whoever listens (locust's request event).

The locust users (``locustfile``) and the schedule's faulty clients (``schedule``) both send
through :class:`Traffic`, so every request of the run is counted the same way.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from benchmarks.stress.apis import Call, Reply
from benchmarks.stress.oracle import Oracle, Pending
from benchmarks.stress.wire import Connection, GrpcClient, WireError

#: (api, outcome, milliseconds, response bytes) of each request, for locust's statistics.
Listener = Callable[[str, str, float, int], None]
#: The longest a polite client sleeps for a ``Retry-After``, seconds.
MAX_RETRY_AFTER_S = 5.0


@dataclass(frozen=True)
class Result:
    """A request's ``outcome`` (``oracle.OUTCOMES`` or "pending") and the ``Retry-After`` it
    carried (seconds, 0 when none)."""

    outcome: str
    retry_after_s: float = 0.0


class Traffic:
    """The pools, the oracle and the server's ports one run sends with."""

    def __init__(
        self, oracle: Oracle, pools: Mapping[str, list[Call]], port: int, grpc_port: int, listener: Listener
    ) -> None:
        self.oracle, self.pools, self.port, self.grpc_port = oracle, pools, port, grpc_port
        self.listener = listener

    def draw(self, api: str, rng: random.Random) -> Call:
        return rng.choice(self.pools[api])

    def http(
        self, api: str, conn: Connection, call: Call, headers: Mapping[str, str] | None = None
    ) -> Result:
        """Send ``call`` on ``conn`` and judge the answer; a wire error is judged at the end."""
        began = time.monotonic()
        try:
            reply, _ = conn.request(call, headers)
        except WireError as exc:
            return self._wire_error(api, began, exc)
        return self._judged(api, call, reply, began)

    def grpc(
        self,
        api: str,
        client: GrpcClient,
        call: Call,
        timeout_s: float = 90.0,
        cancel_after_s: float | None = None,
        *,
        short_deadline: bool = False,
    ) -> Result:
        """Send ``call`` on ``client``. A call the client cancelled (``cancel_after_s``) before the
        server answered, or whose ``short_deadline`` passed on the client's side first, is
        ``abandoned``."""
        began = time.monotonic()
        try:
            reply = client.request(call, timeout_s, cancel_after_s)
        except WireError as exc:
            if short_deadline and exc.kind.startswith("DEADLINE_EXCEEDED"):
                return self._abandoned(api, began)
            return self._wire_error(api, began, exc)
        if reply.status == 499 and cancel_after_s is not None:
            return self._abandoned(api, began)
        return self._judged(api, call, reply, began)

    def _abandoned(self, api: str, began: float) -> Result:
        self.oracle.count(api, "abandoned")
        self.listener(api, "abandoned", (time.monotonic() - began) * 1000, 0)
        return Result("abandoned")

    def _judged(self, api: str, call: Call, reply: Reply, began: float) -> Result:
        ended = time.monotonic()
        outcome = self.oracle.judge(api, call, reply, began, ended)
        self.listener(api, outcome, (ended - began) * 1000, len(reply.body))
        retry_after = 0.0
        if reply.status == 503:
            try:
                retry_after = min(float(reply.headers.get("retry-after", "0")), MAX_RETRY_AFTER_S)
            except ValueError:
                retry_after = 0.0
        return Result(outcome, retry_after)

    def _wire_error(self, api: str, began: float, exc: WireError) -> Result:
        ended = time.monotonic()
        spec = self.oracle.apis[api]
        reuse = f"reused after an HTTP {exc.previous} and {exc.idle_s:.2f} s idle" if exc.reused else "new"
        detail = f"{exc.kind} {'before' if exc.before else 'during'} the answer, connection {reuse}"
        if spec.protocol == "grpc":
            detail = exc.kind
        self.oracle.defer(Pending(api, spec.model, spec.protocol, began, ended, 0, detail, exc.local_port))
        self.listener(api, "pending", (ended - began) * 1000, 0)
        return Result("pending")
