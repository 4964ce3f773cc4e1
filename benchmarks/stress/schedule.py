"""The scenario schedule: a TOML file of what happens when (``schedule.toml`` beside this module,
30 minutes; ``schedule-ci.toml``, 60 seconds), and the actions it names.

A schedule has a ``[load]`` table (users, spawn rate, the phases' lengths, the sampling interval;
:class:`Plan`) and ``[[event]]`` entries: ``at`` (seconds into the main phase, or ``"m:ss"``), an
``action`` and its parameters:

==================  ===========================================================================
action              what it does (and what it expects of the server)
==================  ===========================================================================
gone_clients        ``count`` clients send a request of ``api`` and reset the connection,
                    ``mode`` "mid-body" (half the body sent) or "unread" (all sent, the answer
                    never read), ``after_ms`` later
cancel              ``count`` gRPC calls of ``api`` cancelled ``after_ms`` after they start
timeouts            ``count`` requests of each of ``apis`` with a deadline of ``ms``
                    (``X-Request-Timeout-Ms``, or the gRPC deadline): 200, 503 or 504
slow_readers        ``count`` clients of ``api`` read each answer ``chunk`` bytes at a time every
                    ``pause_ms`` through a small receive buffer, for ``seconds``: every answer right
reload              touch the model's ``model.toml``, load: 200, the model reloaded beside itself
unload / load       take the model out of service (its requests: 404 "not loaded") / back: 200
new_version         copy the spare version 2 (same weights) in and load: 200, version 2 serves
rollback            remove version 2 and load: 200, version 1 serves
load_broken         copy a broken version 2 in and load: 400, version 1 keeps serving; after
                    ``hold_s`` remove it and load again: 200
sigkill             SIGKILL a worker (stopped first to list what it holds); gunicorn replaces it
sigterm             SIGTERM a worker: it drains; gunicorn replaces it
hup                 SIGHUP the master: new workers, the old ones drain
remove_cache        delete the response cache's store under the workers' feet
stop_redis          stop the Redis tier (``start_redis`` starts it again on the same port)
==================  ===========================================================================

Each event runs on a thread of its own at its time (a greenlet under locust), so a slow one
does not delay the next; what each did, and any expectation it found broken, is recorded.

**Another duration.** ``--duration`` scales the schedule to it (:func:`scale`): every ``at``,
``tail_s`` and ``round_s`` by the duration over the schedule's ``main_s``, so that every event
runs, in the same order and with the same relative spacing. Some time is an event's own and
does not scale (:func:`own_s`): a slow reader's ``seconds``, a broken version's ``hold_s``, a
worker's replacement after ``sigkill``, ``sigterm`` or ``hup`` (the plan's ``replace_s``). A
duration so short that an event which ends before a later one begins (or before the main
phase ends) in the schedule would no longer do so is refused, naming the two and the shortest
duration that keeps them apart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import random
import shutil
import signal
import threading
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from app.settings import PEER_KEEPALIVE_S
from benchmarks.stress import repository, target, wire
from benchmarks.stress.oracle import Kill, Window
from benchmarks.stress.traffic import Traffic
from tests.support.gunicorn import Gunicorn

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Plan:
    """A run's ``[load]`` table: ``users`` started ``spawn_rate`` a second; the phases, seconds:
    warm-up under the users once all run (``warmup_s``), an idle pause for the baseline of
    descriptors and threads (at least ``idle_s``, until they settle), the main phase of
    ``main_s`` with the events (none starting in its last ``tail_s``), an idle end; the
    monitor's interval ``sample_s``; ``warm_s`` after which a worker forked during the run
    counts as warm; ``round_s``, the period after which the events repeat (0: they do not),
    over which RSS levels are taken (:func:`benchmarks.stress.monitor.rss_growth`); ``pool``
    distinct requests per API; the RSS growth bound, MB; ``peer_keepalive_s``, how long the
    workers keep an idle connection to each other (``SCORING_PEER_KEEPALIVE_S``: each idle
    pause outlasts it, so that those connections have closed when descriptors are counted);
    ``replace_s``, how long a worker's replacement (a SIGKILL's, a SIGTERM's, a HUP's) may take:
    its own time when the schedule is scaled (:func:`scale`)."""

    users: int = 64
    spawn_rate: float = 16.0
    warmup_s: float = 60.0
    idle_s: float = 20.0
    main_s: float = 1800.0
    tail_s: float = 120.0
    sample_s: float = 5.0
    warm_s: float = 60.0
    round_s: float = 0.0
    pool: int = 256
    rss_growth_mb: float = 50.0
    peer_keepalive_s: float = PEER_KEEPALIVE_S
    replace_s: float = 60.0


@dataclass(frozen=True)
class Event:
    at_s: float
    action: str
    params: dict[str, Any]


@dataclass
class Record:
    """What an event did: when it began and ended (seconds into the main phase), a note, and
    the expectation it found broken ("" when none)."""

    event: Event
    began_s: float = 0.0
    ended_s: float = 0.0
    note: str = ""
    failure: str = ""


class ActionFailed(Exception):
    """The server did not answer an action as documented."""


def _gone(process: psutil.Process, timeout_s: float = 30.0) -> float:
    """When ``process``, SIGKILLed, has closed its sockets: once gunicorn has reaped it (its last
    thread has exited; the first to go may leave a zombie leader while another still frees the
    memory and then the sockets, which takes a while on a busy machine). Monotonic seconds;
    polled every 5 ms, at most ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and process.is_running():
        time.sleep(0.005)
    return time.monotonic()


def seconds(value: float | str) -> float:
    """``90``, ``"90"``, ``"90s"``, ``"1:30"`` or ``"30m"`` -> seconds."""
    text = str(value).strip()
    if ":" in text:
        minutes, secs = text.split(":")
        return int(minutes) * 60 + float(secs)
    unit = {"s": 1, "m": 60, "h": 3600}.get(text[-1:], 0)
    return float(text[:-1]) * unit if unit else float(text)


def read(path: Path, duration_s: float | None = None) -> tuple[Plan, list[Event]]:
    """The plan and events of the schedule at ``path``, scaled to a main phase of ``duration_s``
    where given (:func:`scale`).

    Raises:
        ValueError: an unknown action, a parameter the action does not take or a missing one;
            an event that starts in the tail (the main phase's last ``tail_s``); an idle pause
            no longer than ``peer_keepalive_s``; a ``duration_s`` too short for the events' own
            times.
    """
    data = tomllib.loads(path.read_text())
    load: dict[str, Any] = {k: seconds(v) if k.endswith("_s") else v for k, v in data.get("load", {}).items()}
    try:
        plan = Plan(**load)
    except TypeError as exc:
        raise ValueError(f"{path.name} [load]: {exc}") from None
    if plan.idle_s <= plan.peer_keepalive_s:
        raise ValueError(
            f"{path.name} [load]: idle_s {plan.idle_s:g} must outlast peer_keepalive_s "
            f"{plan.peer_keepalive_s:g} (the workers' idle connections to each other close first)"
        )
    events = []
    for raw in data.get("event", []):
        params = {k: v for k, v in raw.items() if k not in ("at", "action")}
        action = ACTIONS.get(raw.get("action", ""))
        if action is None:
            raise ValueError(f"{path.name}: unknown action {raw.get('action')!r}; known: {sorted(ACTIONS)}")
        try:
            inspect.signature(action).bind(None, **params)
        except TypeError as exc:
            raise ValueError(f"{path.name}: {raw['action']} at {raw.get('at')}: {exc}") from None
        event = Event(seconds(raw["at"]), raw["action"], params)
        if event.at_s >= plan.main_s - plan.tail_s:
            raise ValueError(
                f"{path.name}: {event.action} at {clock(event.at_s)} starts in the tail: after "
                f"{clock(plan.main_s - plan.tail_s)} (main_s {plan.main_s:g} less tail_s {plan.tail_s:g})"
            )
        events.append(event)
    events.sort(key=lambda e: e.at_s)
    if duration_s is None or duration_s == plan.main_s:
        return plan, events
    try:
        return scale(plan, events, duration_s)
    except ValueError as exc:
        raise ValueError(f"{path.name}: {exc}") from None


def clock(at_s: float) -> str:
    """Seconds as the schedules write them, ``"m:ss"`` (``"26:00"``; tenths where there are)."""
    minutes, secs = divmod(round(at_s, 1), 60)
    return f"{int(minutes)}:{secs:04.1f}".removesuffix(".0")


def own_s(event: Event, plan: Plan) -> float:
    """The seconds ``event`` takes whatever the schedule's clock: a slow reader's ``seconds``,
    a broken version's ``hold_s``, ``plan.replace_s`` for a worker's replacement; 0 for the
    rest (a few seconds at most: a model load, a client's request)."""
    bound = inspect.signature(ACTIONS[event.action]).bind(None, **event.params)
    bound.apply_defaults()
    if event.action == "slow_readers":
        return float(bound.arguments["seconds"])
    if event.action == "load_broken":
        return float(bound.arguments["hold_s"])
    if event.action in ("sigkill", "sigterm", "hup"):
        return plan.replace_s
    return 0.0


def scale(plan: Plan, events: list[Event], duration_s: float) -> tuple[Plan, list[Event]]:
    """``plan`` and ``events`` scaled to a main phase of ``duration_s``: every ``at``, the plan's
    ``tail_s`` and ``round_s`` by ``duration_s / plan.main_s``. The events keep their order and
    relative spacing; their own times (:func:`own_s`) do not scale.

    Raises:
        ValueError: an event that ends (its ``at`` plus its own time) before a later event
            begins, or before the main phase ends, would not once scaled; the message names both
            and the shortest duration that keeps every such pair apart.
    """
    factor = duration_s / plan.main_s
    needed, binding = 0.0, ""
    for i, event in enumerate(events):
        own = own_s(event, plan)
        if not own:
            continue
        later = [(e.at_s, f"{e.action} at {clock(e.at_s)}") for e in events[i + 1 :]]
        for at_s, name in [*later, (plan.main_s, f"the main phase's end at {clock(plan.main_s)}")]:
            if event.at_s + own <= at_s and own / (at_s - event.at_s) > needed:
                needed = own / (at_s - event.at_s)
                binding = f"{event.action} at {clock(event.at_s)} ({own:g} s of its own) ends before {name}"
    if factor < needed:
        raise ValueError(
            f"a main phase of {clock(duration_s)} scales the schedule by {factor:.3g}, too short for "
            f"its events' own times: {binding}, which it would no longer do; the shortest main phase "
            f"that keeps every event's own time: {clock(needed * plan.main_s)}"
        )
    scaled = dataclasses.replace(
        plan, main_s=duration_s, tail_s=plan.tail_s * factor, round_s=plan.round_s * factor
    )
    return scaled, [Event(e.at_s * factor, e.action, e.params) for e in events]


class Scenario:
    """Runs the events of a schedule against ``srv`` (``workers`` workers, models of
    ``folder``'s repository, Redis ``redis``), sending faulty traffic through ``traffic``."""

    def __init__(
        self, srv: Gunicorn, workers: int, folder: Path, redis: target.RedisProcess, traffic: Traffic
    ) -> None:
        self.srv, self.workers, self.redis, self.traffic = srv, workers, redis, traffic
        self.repo, self.spares = repository.repository_of(folder), repository.spares_of(folder)
        self.records: list[Record] = []
        self.started = time.monotonic()
        self._unloaded: dict[str, float] = {}
        self._threads: list[threading.Thread] = []
        self._rng = random.Random(0)

    def run(self, events: list[Event]) -> None:
        """Start each event at its time (seconds after this call); return once every event has
        finished."""
        self.started = time.monotonic()
        for event in events:
            time.sleep(max(0.0, self.started + event.at_s - time.monotonic()))
            thread = threading.Thread(target=self._one, args=(event,), name=f"event-{event.action}")
            thread.start()
            self._threads.append(thread)
        for thread in self._threads:
            thread.join()
        for model, began in self._unloaded.items():  # unloaded by the schedule, never loaded again
            self.traffic.oracle.out_of_service(Window(model, began, float("inf")))

    def _one(self, event: Event) -> None:
        record = Record(event, began_s=time.monotonic() - self.started)
        self.records.append(record)
        try:
            record.note = ACTIONS[event.action](self, **event.params)
        except Exception as exc:  # any error of an action fails the run, with its name
            record.failure = f"{type(exc).__name__}: {exc}"
        record.ended_s = time.monotonic() - self.started

    # --- the server ---------------------------------------------------------------------

    def _settled(self, gone: set[int]) -> float:
        return target.settle(self.srv, self.workers, gone)

    def hup(self) -> str:
        old = {w.pid for w in self.srv.workers()}
        os.kill(self.srv.proc.pid, signal.SIGHUP)
        return f"workers {sorted(old)} replaced in {self._settled(old):.1f} s"

    def sigterm(self) -> str:
        victim = self.srv.workers()[0].pid
        os.kill(victim, signal.SIGTERM)
        return f"worker {victim} drained and replaced in {self._settled({victim}):.1f} s"

    def sigkill(self) -> str:
        victim = self.srv.workers()[0].pid
        os.kill(victim, signal.SIGSTOP)
        time.sleep(0.3)  # what runs elsewhere completes; the victim's requests cannot
        process = psutil.Process(victim)
        connections = (getattr(process, "net_connections", None) or process.connections)("tcp")
        ports = frozenset(c.raddr.port for c in connections if c.raddr and c.laddr.port == self.srv.port)
        grpc = sum(1 for c in connections if c.raddr and c.laddr.port == self.srv.grpc_port)  # IPv6-mapped
        at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        gone = _gone(process)
        self.traffic.oracle.killed(Kill(at, victim, ports, grpc, gone))
        settled = self._settled({victim})
        held = f"{len(ports)} HTTP, {grpc} gRPC connections"
        return f"worker {victim} ({held}) gone {gone - at:.2f} s after the kill, replaced in {settled:.1f} s"

    def _control(self, action: str, model: str, expect: int = 200) -> str:
        began = time.monotonic()
        status, answer = target.control(self.srv, action, model)
        if status != expect:
            raise ActionFailed(f"{action} {model}: HTTP {status} {str(answer)[:300]} (expected {expect})")
        return f"{action} {model}: {status} in {time.monotonic() - began:.1f} s"

    def reload(self, model: str) -> str:
        os.utime(self.repo / model / "model.toml")
        return self._control("load", model)

    def unload(self, model: str) -> str:
        self._unloaded[model] = time.monotonic()
        return self._control("unload", model)

    def load(self, model: str) -> str:
        try:
            return self._control("load", model)
        finally:
            began = self._unloaded.pop(model, None)
            if began is not None:
                self.traffic.oracle.out_of_service(Window(model, began, time.monotonic()))

    def new_version(self, model: str) -> str:
        shutil.copytree(self.spares / f"{model}-2", self.repo / f"{model}-2")
        return self._control("load", model)

    def rollback(self, model: str) -> str:
        shutil.rmtree(self.repo / f"{model}-2")
        return self._control("load", model)

    def load_broken(self, model: str, hold_s: float = 5.0) -> str:
        broken = self.repo / f"{model}-broken"
        shutil.copytree(self.spares / f"{model}-broken", broken, symlinks=True)
        try:
            refused = self._control("load", model, expect=400)
            time.sleep(hold_s)
        finally:
            shutil.rmtree(broken)
        return f"{refused}; removed: {self._control('load', model)}"

    def remove_cache(self) -> str:
        store = self.srv.run_dir / "response-cache"
        shutil.rmtree(store, ignore_errors=True)
        return f"removed {store.name}"

    def stop_redis(self) -> str:
        self.redis.stop()
        return "redis-server stopped"

    def start_redis(self) -> str:
        self.redis.start()
        return "redis-server started"

    # --- faulty clients -----------------------------------------------------------------

    def _in_parallel(self, count: int, one: Callable[[int], None]) -> None:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def gone_clients(self, api: str, count: int = 16, mode: str = "unread", after_ms: float = 5.0) -> str:
        def one(i: int) -> None:
            call = self.traffic.draw(api, random.Random(i))
            with contextlib.suppress(OSError):  # the server may close first: the client leaves either way
                wire.gone_mid_request(self.traffic.port, call, mode, after_ms / 1000)
            self.traffic.oracle.count(api, "abandoned")

        self._in_parallel(count, one)
        return f"{count} clients of {api} gone ({mode}, {after_ms} ms)"

    def cancel(self, api: str, count: int = 16, after_ms: float = 5.0) -> str:
        def one(i: int) -> None:
            client = wire.GrpcClient(self.traffic.grpc_port)
            try:
                self.traffic.grpc(
                    api, client, self.traffic.draw(api, random.Random(i)), cancel_after_s=after_ms / 1000
                )
            finally:
                client.close()

        self._in_parallel(count, one)
        return f"{count} calls of {api} cancelled after {after_ms} ms"

    def timeouts(self, apis: list[str], count: int = 8, ms: float = 20.0) -> str:
        def one(i: int) -> None:
            api = apis[i % len(apis)]
            call = self.traffic.draw(api, random.Random(i))
            if self.traffic.oracle.apis[api].protocol == "grpc":
                client = wire.GrpcClient(self.traffic.grpc_port)
                try:
                    self.traffic.grpc(api, client, call, timeout_s=ms / 1000, short_deadline=True)
                finally:
                    client.close()
                return
            conn = wire.Connection(self.traffic.port)
            try:
                self.traffic.http(api, conn, call, {"X-Request-Timeout-Ms": str(ms)})
            finally:
                conn.close()

        self._in_parallel(count * len(apis), one)
        return f"{count * len(apis)} requests with a {ms} ms deadline"

    def slow_readers(
        self, api: str, count: int = 4, seconds: float = 10.0, chunk: int = 1024, pause_ms: float = 20.0
    ) -> str:
        sent = [0]

        def one(i: int) -> None:
            rng = random.Random(i)
            conn = wire.Connection(
                self.traffic.port, rcvbuf=4096, read_chunk=chunk, read_pause_s=pause_ms / 1000
            )
            until = time.monotonic() + seconds
            try:
                while time.monotonic() < until:
                    self.traffic.http(api, conn, self.traffic.draw(api, rng))
                    sent[0] += 1
            finally:
                conn.close()

        self._in_parallel(count, one)
        return f"{count} slow readers of {api}: {sent[0]} answers read"


ACTIONS: dict[str, Callable[..., str]] = {
    name: getattr(Scenario, name)
    for name in ("hup", "sigterm", "sigkill", "reload", "unload", "load", "new_version", "rollback",
                 "load_broken", "remove_cache", "stop_redis", "start_redis", "gone_clients", "cancel",
                 "timeouts", "slow_readers")
}  # fmt: skip
