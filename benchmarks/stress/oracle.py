"""What every answer of a stress run is judged by: the references, the outcome of each request,
and the verdict against the bounds.

**References.** Each distinct request of a pool is sent once on the idle server before the load
starts (:meth:`Oracle.reference`); its answer's numbers (``apis.Api.read``) are the reference
for every later answer to the same request, by any worker, from the response cache or
computed, whatever version of the same weights serves. Equal means ``numpy.allclose`` with
``rtol`` 1e-4 and ``atol`` 1e-5: a transformer's numbers move by a rounding step with the
padding of the batch a text shares, a GEMM's with the batch size (docs/response-cache.md).

**Outcomes** (:data:`OUTCOMES`). A request ends in exactly one:

- ``ok``: 200 and the numbers equal the reference; ``wrong``: 200 and they do not, or the
  answer does not fit the request;
- ``refused``: a documented refusal, 503 (its ``Retry-After`` is counted apart), 504 or 429
  (gRPC UNAVAILABLE or DEADLINE_EXCEEDED sent by the server);
- ``unloaded``: 404 "not loaded" for a model the schedule had unloaded when the request started;
- ``killed``: no answer on a connection of a worker the schedule SIGKILLed, which the request
  was on while it died (docs/reliability.md: a SIGKILL costs the requests the worker held;
  :class:`Kill`), or a gRPC call of a channel whose connection the kill reset before the victim
  had accepted it (:meth:`Kill.reset_a_queued_connection`);
- ``unanswered``: no answer otherwise (reset, EOF, or nothing within the client's timeout);
- ``unexpected_5xx``, ``unexpected_4xx``: any other status.

Faulty clients (gone mid-request, cancelled, short deadlines) count under ``abandoned`` when
they gave up on purpose; their answers, when they read one, are judged as above.

**Bounds** (:func:`verdict`): 0 wrong, 0 unanswered, 0 unexpected 5xx or 4xx; the resource
bounds are ``monitor``'s.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from benchmarks.stress.apis import Api, Call, Reply

RTOL, ATOL = 1e-4, 1e-5
OUTCOMES = (
    "ok",
    "refused",
    "unloaded",
    "killed",
    "abandoned",
    "wrong",
    "unanswered",
    "unexpected_5xx",
    "unexpected_4xx",
)
#: Outcomes that fail the run whenever one occurs.
FAILING = ("wrong", "unanswered", "unexpected_5xx", "unexpected_4xx")
REFUSALS = (429, 503, 504)
#: The longest first reconnect backoff of a gRPC channel, seconds: gRPC's connection backoff
#: (doc/connection-backoff.md) waits INITIAL_BACKOFF 1 s with JITTER 0.2.
GRPC_RECONNECT_BACKOFF_S = 1.2


@dataclass(frozen=True)
class Kill:
    """A SIGKILL of the schedule: when (``at``, just before the signal), the victim's pid, the
    client ports of its HTTP connections, how many gRPC connections it held, and when it was
    ``gone`` (a zombie or reaped: its sockets closed). Until then its connections still take a
    request, which the kernel resets when it closes them: a client idle at the kill (waiting out
    a ``Retry-After``) can send on one after the signal, and lose that request to the kill too."""

    at: float
    pid: int
    http_ports: frozenset[int]
    grpc_connections: int
    gone: float = 0.0

    def overlaps(self, began: float, ended: float) -> bool:
        """Whether a request from ``began`` to ``ended`` was on the wire while the victim died."""
        return began <= max(self.at, self.gone) and self.at <= ended

    def reset_a_queued_connection(self, p: Pending) -> bool:
        """Whether ``p`` is a gRPC call that failed fast because its channel's connection attempt
        was reset by this kill: every worker listens on the gRPC port with ``SO_REUSEPORT``, so
        the kernel queues some new connections on the victim's own listening socket until it is
        closed, and then resets them (unless ``net.ipv4.tcp_migrate_req`` is 1: docs/reliability.md,
        *SIGKILL / crash*); the channel then fails its calls at once ("failed to connect to all
        addresses") for one reconnect backoff, gRPC's 1 s with 20 % jitter."""
        return (
            "failed to connect to all addresses" in p.detail
            and self.at <= p.began <= max(self.at, self.gone) + GRPC_RECONNECT_BACKOFF_S
        )


@dataclass(frozen=True)
class Window:
    """A model out of service from ``begin`` until ``end`` (monotonic seconds): an unload until
    the load that brought it back had returned."""

    model: str
    begin: float
    end: float


@dataclass(frozen=True)
class Pending:
    """A request whose outcome depends on what the schedule did meanwhile (a wire error, a 404):
    judged at the end, when every kill and unload is known."""

    api: str
    model: str
    protocol: str
    began: float
    ended: float
    status: int
    detail: str
    local_port: int = 0


@dataclass
class Tally:
    """Outcomes by API, the examples of each failing outcome, and the largest deviation from a
    reference seen in an answer judged ``ok``."""

    counts: dict[str, Counter[str]] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)
    retry_after_missing: int = 0
    max_deviation: float = 0.0

    def add(self, api: str, outcome: str, example: str = "") -> None:
        self.counts.setdefault(api, Counter())[outcome] += 1
        if example and outcome in (*FAILING, "killed") and len(self.examples.setdefault(outcome, [])) < 20:
            self.examples[outcome].append(f"{api}: {example}")

    def total(self, outcome: str) -> int:
        return sum(c[outcome] for c in self.counts.values())


class Oracle:
    """References and outcomes of one run (thread- and greenlet-safe: one lock)."""

    def __init__(self, apis: Iterable[Api]) -> None:
        self.apis = {api.name: api for api in apis}
        self.references: dict[tuple[str, int], np.ndarray] = {}
        self.tally = Tally()
        self.pending: list[Pending] = []
        self.kills: list[Kill] = []
        self.windows: list[Window] = []
        #: Monotonic time the examples' times count from (the main phase's start).
        self.t0 = 0.0
        self._lock = threading.Lock()

    def reference(self, api: str, call: Call, reply: Reply) -> None:
        """Keep ``reply`` as the reference of ``call``.

        Raises:
            RuntimeError: it is not a 200 whose numbers can be read.
        """
        if reply.status != 200:
            raise RuntimeError(f"reference of {api} #{call.index}: HTTP {reply.status} {reply.body[:300]!r}")
        self.references[(api, call.index)] = self.apis[api].read(reply, call)

    def judge(self, api: str, call: Call, reply: Reply, began: float, ended: float) -> str:
        """The outcome of an answer (pending ones are judged at the end and return "pending")."""
        spec = self.apis[api]
        if reply.status == 200:
            return self._compare(api, call, reply)
        if reply.status in REFUSALS:
            with self._lock:
                if reply.status == 503 and "retry-after" not in reply.headers:
                    self.tally.retry_after_missing += 1
                    examples = self.tally.examples.setdefault("503 without Retry-After", [])
                    if len(examples) < 20:
                        examples.append(f"{api}: t={began - self.t0:.1f}s {reply.body[:200]!r}")
                self.tally.add(api, "refused")
            return "refused"
        detail = (
            f"t={began - self.t0:.1f}s HTTP {reply.status} {reply.headers.get('grpc-message', '')} "
            f"{reply.body[:200]!r} {dict(reply.headers) if spec.protocol == 'grpc' else ''}"
        )
        if reply.status == 404 and "not loaded" in detail:
            self.defer(Pending(api, spec.model, spec.protocol, began, ended, 404, detail))
            return "pending"
        outcome = "unexpected_5xx" if reply.status >= 500 else "unexpected_4xx"
        with self._lock:
            self.tally.add(api, outcome, detail)
        return outcome

    def _compare(self, api: str, call: Call, reply: Reply) -> str:
        want = self.references[(api, call.index)]
        try:
            got = self.apis[api].read(reply, call)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            outcome, example = "wrong", f"#{call.index}: unreadable answer ({exc!r}): {reply.body[:200]!r}"
        else:
            close = got.shape == want.shape and bool(np.allclose(got, want, rtol=RTOL, atol=ATOL))
            deviation = float(np.max(np.abs(got - want))) if got.shape == want.shape and got.size else 0.0
            outcome = "ok" if close else "wrong"
            example = "" if close else f"#{call.index}: max |got - reference| = {deviation:.3g}"
            if close:
                with self._lock:
                    self.tally.max_deviation = max(self.tally.max_deviation, deviation)
        with self._lock:
            self.tally.add(api, outcome, example)
        return outcome

    def count(self, api: str, outcome: str, example: str = "") -> None:
        """Count an outcome decided by the caller (``abandoned``; ``unanswered`` for a call whose
        client itself failed)."""
        with self._lock:
            self.tally.add(api, outcome, example)

    def defer(self, pending: Pending) -> None:
        """A wire error or a 404 "not loaded": judged by :meth:`settle`."""
        with self._lock:
            self.pending.append(pending)

    def killed(self, kill: Kill) -> None:
        with self._lock:
            self.kills.append(kill)

    def out_of_service(self, window: Window) -> None:
        with self._lock:
            self.windows.append(window)

    def settle(self) -> None:
        """Judge the pending requests now that every kill and unload is known (call once, after
        the load has stopped)."""
        grpc_budget = {kill: kill.grpc_connections for kill in self.kills}
        for p in self.pending:
            if p.status == 404:
                unloaded = any(w.model == p.model and w.begin <= p.began <= w.end for w in self.windows)
                self.tally.add(p.api, "unloaded" if unloaded else "unexpected_4xx", p.detail)
                continue
            kill = self._kill_of(p, grpc_budget)
            outcome = "killed" if kill is not None else "unanswered"
            victim = self._victim_of(p) if kill is None or p.began > kill.at else ""
            where = f"port {p.local_port}, {p.ended - p.began:.2f} s{victim}"
            self.tally.add(p.api, outcome, f"t={p.began - self.t0:.1f}s {p.detail} ({where})")
        self.pending.clear()

    def _victim_of(self, p: Pending) -> str:
        """For an HTTP wire error on a connection a SIGKILLed worker held, sent after the signal:
        when, against that kill."""
        for kill in self.kills:
            if p.protocol == "http" and p.local_port in kill.http_ports:
                return (
                    f"; a connection of SIGKILLed worker {kill.pid}: sent {p.began - kill.at:+.2f} s after"
                    f" the signal, {kill.gone - kill.at:.2f} s before it was gone"
                )
        return ""

    def _kill_of(self, p: Pending, grpc_budget: dict[Kill, int]) -> Kill | None:
        """The SIGKILL that explains a wire error: the request was in flight while the victim died
        (:meth:`Kill.overlaps`) and (HTTP) on one of the victim's connections, or (gRPC, whose
        port a client cannot see) one of at most as many as the victim had gRPC connections."""
        for kill in self.kills:
            if p.protocol == "grpc" and kill.reset_a_queued_connection(p):
                return kill
            if not kill.overlaps(p.began, p.ended):
                continue
            if p.protocol == "http" and p.local_port in kill.http_ports:
                return kill
            if p.protocol == "grpc" and grpc_budget[kill] > 0:
                grpc_budget[kill] -= 1
                return kill
        return None


def verdict(tally: Tally) -> list[str]:
    """The bounds the answers broke (empty: none): any wrong answer, request without an answer,
    or unexpected status."""
    return [f"{tally.total(outcome)} {outcome}" for outcome in FAILING if tally.total(outcome)]


def table(tally: Tally, apis: Sequence[str]) -> list[str]:
    """Requests by API and outcome as text rows (a header, one row per API, the total)."""
    header = f"{'api':<12}" + "".join(f"{o:>15}" for o in OUTCOMES) + f"{'all':>10}"
    rows = [header]
    for api in [*apis, "all"]:
        counts = tally.counts.get(api, Counter()) if api != "all" else Counter()
        if api == "all":
            for c in tally.counts.values():
                counts.update(c)
        rows.append(
            f"{api:<12}" + "".join(f"{counts[o]:>15}" for o in OUTCOMES) + f"{sum(counts.values()):>10}"
        )
    return rows
