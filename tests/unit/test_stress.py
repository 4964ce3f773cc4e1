"""The stress run's parts that need no server (benchmarks/stress): the shipped schedules parse and
a mistake in one is named; a schedule scaled to another duration, or refused one too short for
its events' own times; the oracle's outcomes (references, refusals, a 404 inside and outside
an unload, a wire error on a killed worker's connection or not, sent before it was gone or
after); the resource bounds, and a run that judged no worker's memory failing; the client's
keep-alive behaviour against a server that closes idle connections; each API's pool and answer
reading, and the properties the decoder models' answers are checked by."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.settings import Settings
from benchmarks.stress import apis, monitor, oracle, schedule, wire
from benchmarks.stress.apis import Call, Reply
from tests.support.gunicorn import ROOT

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa"]


def test_the_shipped_schedules_parse_and_fit_their_main_phase() -> None:
    for name, events_at_least in (("schedule.toml", 80), ("schedule-ci.toml", 15)):
        plan, events = schedule.read(schedule.HERE / name)
        assert len(events) >= events_at_least, name
        assert {e.action for e in events} == set(schedule.ACTIONS) - {"sigterm"}, name
        assert all(e.at_s < plan.main_s - plan.tail_s for e in events), name
        named = {e.params["api"] for e in events if "api" in e.params}
        named |= {api for e in events for api in e.params.get("apis", [])}
        assert named <= set(apis.APIS) and {"completions", "score"} <= named, name


def test_another_duration_scales_every_event_keeping_order_and_spacing() -> None:
    plan, events = schedule.read(schedule.HERE / "schedule-ci.toml")
    stretched, scaled = schedule.read(schedule.HERE / "schedule-ci.toml", duration_s=150)
    assert stretched.main_s == 150 and stretched.tail_s == pytest.approx(plan.tail_s * 2.5)
    assert stretched.users == plan.users and stretched.warm_s == plan.warm_s  # not the schedule's clock
    assert [(e.action, e.params) for e in scaled] == [(e.action, e.params) for e in events]
    assert [e.at_s for e in scaled] == pytest.approx([e.at_s * 2.5 for e in events])
    assert all(e.at_s < stretched.main_s - stretched.tail_s for e in scaled)  # none skipped


def test_a_duration_too_short_for_the_events_own_times_is_refused_naming_them() -> None:
    """The 30-minute schedule leaves a worker a minute to be replaced after its SIGKILL before the
    HUP: 150 s would scale that minute to 5 s, and 82 of its events would not run otherwise."""
    with pytest.raises(ValueError, match=r"2:30 scales the schedule by 0\.0833.*sigkill at 3:45 \(60 s of its own\) "
                       r"ends before hup at 4:45.*shortest main phase .*: 30:00"):  # fmt: skip
        schedule.read(schedule.HERE / "schedule.toml", duration_s=150)
    with pytest.raises(ValueError, match=r"slow_readers at 0:03 \(8 s of its own\) ends before load at 0:11"):
        schedule.read(schedule.HERE / "schedule-ci.toml", duration_s=30)


def test_scaling_counts_each_events_own_time_and_the_main_phases_end(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text(
        "[load]\nmain_s = 100\ntail_s = 10\nround_s = 40\nreplace_s = 12\n"
        '[[event]]\nat = 10\naction = "slow_readers"\napi = "v1"\nseconds = 15\n'
        '[[event]]\nat = 20\naction = "reload"\nmodel = "clf"\n'  # the slow readers overlap it
        '[[event]]\nat = 40\naction = "hup"\n'
        '[[event]]\nat = 60\naction = "load_broken"\nmodel = "clf"\n'  # hold_s: 5 s by default
    )
    # The slow readers' 15 s end 15 s before the HUP (by 0.5 at least), the HUP's 12 s 8 s before
    # the broken version (by 0.6), the broken version's 5 s 35 s before the end (by 0.125).
    plan, events = schedule.read(path, duration_s=60)
    assert [e.at_s for e in events] == pytest.approx([6, 12, 24, 36])
    assert (plan.main_s, plan.tail_s, plan.round_s) == pytest.approx((60, 6, 24))
    with pytest.raises(
        ValueError, match=r"hup at 0:40 \(12 s of its own\) ends before load_broken at 1:00.*: 1:00"
    ):
        schedule.read(path, duration_s=59)
    assert schedule.own_s(events[3], plan) == 5.0 and schedule.own_s(events[1], plan) == 0.0


def test_an_event_in_the_tail_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "late.toml"
    path.write_text('[load]\nmain_s = 60\ntail_s = 10\n[[event]]\nat = 55\naction = "hup"\n')
    with pytest.raises(ValueError, match="hup at 0:55 starts in the tail: after 0:50"):
        schedule.read(path)


@pytest.mark.parametrize(
    ("event", "message"),
    [
        ('at = 1\naction = "explode"', "unknown action 'explode'"),
        ('at = 1\naction = "unload"', "missing a required argument: 'model'"),
        ('at = 1\naction = "hup"\nmodel = "clf"', "unexpected keyword argument 'model'"),
    ],
)
def test_a_schedule_mistake_is_named(tmp_path: Path, event: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(f"[load]\nusers = 2\n\n[[event]]\n{event}\n")
    with pytest.raises(ValueError, match=message):
        schedule.read(path)


def test_an_idle_pause_must_outlast_the_workers_idle_connections(tmp_path: Path) -> None:
    path = tmp_path / "short.toml"
    path.write_text("[load]\nidle_s = 5\npeer_keepalive_s = 6\n")
    with pytest.raises(ValueError, match="idle_s 5 must outlast peer_keepalive_s 6"):
        schedule.read(path)
    path.write_text("[load]\nidle_s = 5\npeer_keepalive_s = 2\n")
    assert schedule.read(path)[0].peer_keepalive_s == 2.0
    assert schedule.Plan().peer_keepalive_s == Settings().peer_keepalive_s  # the server's default


def test_seconds_reads_the_schedules_times() -> None:
    assert [schedule.seconds(v) for v in (90, "90", "90s", "1:30", "1.5m", "30m")] == [
        90,
        90,
        90,
        90,
        90,
        1800,
    ]


def v2_reply(values: list[float]) -> Reply:
    body = {"outputs": [{"name": "click_probability", "shape": [len(values), 1], "data": values}]}
    return Reply(200, {}, json.dumps(body).encode())


CALL = Call(0, "/v2/models/feed-ranker/infer", b"{}", (), 2)


@pytest.fixture
def judge() -> oracle.Oracle:
    judge = oracle.Oracle([apis.APIS["v2-json"], apis.APIS["grpc-ranker"]])
    judge.reference("v2-json", CALL, v2_reply([0.25, 0.5]))
    return judge


def test_answers_are_ok_within_rounding_and_wrong_beyond(judge: oracle.Oracle) -> None:
    assert judge.judge("v2-json", CALL, v2_reply([0.25 + 1e-7, 0.5]), 0, 1) == "ok"
    assert judge.judge("v2-json", CALL, v2_reply([0.25, 0.51]), 0, 1) == "wrong"
    assert judge.judge("v2-json", CALL, v2_reply([0.25]), 0, 1) == "wrong"  # not one per item
    assert judge.judge("v2-json", CALL, Reply(200, {}, b"not json"), 0, 1) == "wrong"
    assert judge.tally.total("wrong") == 3 and judge.tally.max_deviation == pytest.approx(1e-7)
    assert oracle.verdict(judge.tally) == ["3 wrong"]


def test_refusals_are_documented_and_a_500_is_not(judge: oracle.Oracle) -> None:
    assert judge.judge("v2-json", CALL, Reply(503, {"retry-after": "1"}, b"{}"), 0, 1) == "refused"
    assert judge.judge("v2-json", CALL, Reply(503, {}, b"{}"), 0, 1) == "refused"
    assert judge.judge("v2-json", CALL, Reply(504, {}, b"{}"), 0, 1) == "refused"
    assert judge.judge("v2-json", CALL, Reply(500, {}, b"{}"), 0, 1) == "unexpected_5xx"
    assert judge.judge("v2-json", CALL, Reply(400, {}, b"{}"), 0, 1) == "unexpected_4xx"
    assert judge.tally.retry_after_missing == 1
    assert oracle.verdict(judge.tally) == ["1 unexpected_5xx", "1 unexpected_4xx"]


def test_not_loaded_is_documented_only_while_the_schedule_had_unloaded_the_model(
    judge: oracle.Oracle,
) -> None:
    not_loaded = Reply(404, {}, b'{"error": "model feed-ranker is not loaded"}')
    judge.out_of_service(oracle.Window("feed-ranker", 10.0, 20.0))
    for began in (12.0, 25.0):
        assert judge.judge("v2-json", CALL, not_loaded, began, began + 0.1) == "pending"
    judge.settle()
    assert judge.tally.counts["v2-json"]["unloaded"] == 1
    assert judge.tally.counts["v2-json"]["unexpected_4xx"] == 1


def test_a_wire_error_counts_as_killed_only_on_the_victims_connections(judge: oracle.Oracle) -> None:
    judge.killed(oracle.Kill(at=50.0, pid=7, http_ports=frozenset({4000}), grpc_connections=1))
    for port, began, ended in ((4000, 49.0, 50.5), (4001, 49.0, 50.5), (4000, 51.0, 51.1)):
        judge.defer(oracle.Pending("v2-json", "feed-ranker", "http", began, ended, 0, "reset", port))
    for _ in range(2):  # the victim held one gRPC connection: one call is its loss, not two
        judge.defer(oracle.Pending("grpc-ranker", "feed-ranker", "grpc", 49.0, 50.5, 0, "UNAVAILABLE"))
    judge.settle()
    assert judge.tally.counts["v2-json"] == {"killed": 1, "unanswered": 2}
    assert judge.tally.counts["grpc-ranker"] == {"killed": 1, "unanswered": 1}


def test_a_request_sent_on_a_victims_connection_before_its_sockets_closed_counts_as_killed(
    judge: oracle.Oracle,
) -> None:
    """A client idle at the SIGKILL (waiting out a Retry-After) sends on its kept-alive connection
    to the victim after the signal, before the dying process has closed its sockets: the kernel
    resets it then, a loss of the kill. Sent once the victim was gone, it would be unexplained."""
    judge.killed(oracle.Kill(50.0, 7, frozenset({4000}), 0, gone=50.6))
    for began, ended in ((50.4, 50.8), (50.7, 50.8)):
        judge.defer(oracle.Pending("v2-json", "feed-ranker", "http", began, ended, 0, "reset", 4000))
    judge.settle()
    assert judge.tally.counts["v2-json"] == {"killed": 1, "unanswered": 1}
    (unexplained,) = judge.tally.examples["unanswered"]
    assert "a connection of SIGKILLed worker 7: sent +0.70 s after the signal" in unexplained


def test_a_grpc_channel_whose_connection_the_kill_reset_fails_fast_for_one_backoff_only(
    judge: oracle.Oracle,
) -> None:
    """Every worker listens on the gRPC port with SO_REUSEPORT: a connection the kernel queued on
    the victim's listening socket is reset when it dies, and its channel fails every call at
    once for one reconnect backoff. Those calls are the kill's; the same failure later, or any
    other failure of a channel, is not."""
    judge.killed(oracle.Kill(50.0, 7, frozenset(), 0, gone=50.1))
    refused = "UNAVAILABLE: failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:9: reset"
    for began, detail in (
        (50.2, refused),
        (51.2, refused),
        (51.5, refused),
        (50.3, "UNAVAILABLE: Socket closed"),
    ):
        judge.defer(oracle.Pending("grpc-ranker", "feed-ranker", "grpc", began, began + 0.05, 0, detail))
    judge.settle()
    assert judge.tally.counts["grpc-ranker"] == {"killed": 2, "unanswered": 2}


def sample(
    pid: int, at: float, phase: str, rss_mb: float, fds: int = 40, threads: int = 20
) -> monitor.Sample:
    return monitor.Sample(at, phase, pid, int(rss_mb * monitor.MB), int(rss_mb * monitor.MB), fds, threads)


def test_rss_growth_counts_from_each_workers_warm_point() -> None:
    samples = [
        sample(1, 5, "warmup", 500), sample(1, 10, "main", 700), sample(1, 100, "main", 740),
        sample(2, 50, "main", 300), sample(2, 65, "main", 600), sample(2, 100, "main", 610),  # born at 40
        sample(3, 90, "main", 300), sample(3, 99, "main", 900),  # never warm
    ]  # fmt: skip
    growth = monitor.rss_growth(samples, 10.0, 20.0, {2: 40.0, 3: 85.0}, baseline={1})
    assert growth == {1: pytest.approx(40.0), 2: pytest.approx(10.0)}


def test_with_rounds_rss_growth_compares_each_rounds_lowest_sample() -> None:
    """A model swap holds two copies for seconds: a sample taken then is a peak, not growth.
    With rounds of 100 s the first round once warm (warm at 20 + 100) is compared with the last
    round of the worker's life by their lowest samples; a leak raises every round's lowest."""
    level = [sample(1, at, "main", 600 + (80 if at % 50 == 0 else 0)) for at in range(0, 400, 10)]
    assert monitor.rss_growth(level, 0.0, 20.0, {1: 0.0}, baseline=set(), round_s=100) == {1: 0.0}
    leak = [sample(2, at, "main", 600 + at / 10 + (80 if at % 50 == 0 else 0)) for at in range(0, 400, 10)]
    (grown,) = monitor.rss_growth(leak, 0.0, 20.0, {2: 0.0}, baseline=set(), round_s=100).values()
    assert grown == pytest.approx((600 + 31) - (600 + 12), abs=0.01)  # lowest of (290, 390] vs [120, 220)
    short = [sample(3, at, "main", 600) for at in range(0, 300, 10)]  # warm at 120, not two rounds
    assert monitor.rss_growth(short, 0.0, 20.0, {3: 0.0}, baseline=set(), round_s=100) == {}


def test_a_run_that_judged_no_workers_memory_does_not_pass() -> None:
    assert monitor.growth_verdict({1: 12.0, 2: 60.5}, 50.0) == ["worker 2: RSS grew 60.5 MB (bound 50)"]
    assert monitor.growth_verdict({}, 50.0, round_s=240) == [
        "RSS growth judged for no worker: none lived two rounds (480 s) once warm in the main phase"
    ]
    short = [sample(1, at, "main", 600) for at in range(0, 300, 10)]  # warm at 120, not two rounds
    growth = monitor.rss_growth(short, 0.0, 20.0, {1: 0.0}, baseline=set(), round_s=100)
    assert monitor.growth_verdict(growth, 50.0, round_s=100) != []


def test_descriptors_and_threads_must_come_back_to_the_baseline() -> None:
    baseline = [sample(1, 0, "baseline", 700, fds=42, threads=20), sample(2, 0, "baseline", 700, fds=44)]
    end = [sample(1, 9, "end", 700, fds=42, threads=21), sample(3, 9, "end", 700, fds=45)]
    assert monitor.back_to_baseline(baseline, end) == [
        "worker 1: 21 threads at the end, 20 at the baseline",
        "worker 3: 45 descriptors at the end, 44 at the baseline",
    ]
    assert monitor.back_to_baseline(baseline, baseline) == []


@pytest.mark.parametrize(
    ("code", "details", "served", "status"),
    [
        ("UNAVAILABLE", "queue full", True, 503),
        ("UNAVAILABLE", "model ce is not loaded", True, 404),
        ("UNAVAILABLE", "Socket closed", False, 0),
        ("DEADLINE_EXCEEDED", "Deadline Exceeded", False, 0),
        ("DEADLINE_EXCEEDED", "did not finish", True, 504),
        ("INTERNAL", "boom", True, 500),
        ("CANCELLED", "CANCELLED", False, 499),
    ],
)
def test_grpc_outcomes_map_to_the_http_status_of_the_same_outcome(
    code: str, details: str, served: bool, status: int
) -> None:
    assert wire.grpc_status(code, details, served=served) == status


class ClosingServer(BaseHTTPRequestHandler):
    """Answers each POST with its connection's count and then closes the connection after
    every second answer, without saying so (an idle keep-alive connection closed by the server)."""

    protocol_version = "HTTP/1.1"
    answered = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        ClosingServer.answered += 1
        body = json.dumps({"n": ClosingServer.answered}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = ClosingServer.answered % 2 == 0

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def closing_server() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), ClosingServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_the_client_reuses_its_connection_and_replaces_one_the_server_closed(closing_server: int) -> None:
    conn = wire.Connection(closing_server, timeout_s=10)
    call = Call(0, "/", b"{}", (), 1)
    trips = []
    for _ in range(4):
        reply, trip = conn.request(call)
        assert reply.status == 200
        trips.append(trip)
        threading.Event().wait(0.05)  # the server's close reaches the client before the next send
    conn.close()
    assert [t.reused for t in trips] == [False, True, False, True]
    assert trips[0].local_port == trips[1].local_port != trips[2].local_port


def reply_of(body: object) -> Reply:
    return Reply(200, {}, json.dumps(body).encode())


def call_of(body: dict[str, object], items: int) -> Call:
    return Call(0, "/", json.dumps(body).encode(), (), items)


def test_pools_are_deterministic_and_every_answer_reader_checks_the_items() -> None:
    for api in apis.APIS.values():
        first, again = apis.pool(api, 6, WORDS, seed=1), apis.pool(api, 6, WORDS, seed=1)
        assert [c.body for c in first] == [c.body for c in again], api.name
        assert len({c.body for c in first}) == 6, api.name
    two, one = Call(0, "/", b"{}", (), 2), Call(0, "/", b"{}", (), 1)
    embeddings = {"data": [{"index": 1, "embedding": [0.0] * 384}, {"index": 0, "embedding": [1.0] * 384}]}
    read = apis.APIS["embeddings"].read(reply_of(embeddings), two)
    assert read[:384].tolist() == [1.0] * 384
    unsorted = {"results": [{"index": 0, "relevance_score": 0.1}, {"index": 1, "relevance_score": 0.9}]}
    with pytest.raises(ValueError, match="not sorted"):
        apis.APIS["rerank"].read(reply_of(unsorted), two)
    with pytest.raises(ValueError, match="indices"):
        apis.APIS["classify"].read(reply_of({"data": [{"index": 3, "probs": [1, 0, 0]}]}), one)
    assert np.array_equal(apis.APIS["v1"].read(Reply(200, {}, b'{"predictions": [[0.5]]}'), one), [0.5])


def test_the_decoder_apis_ask_what_their_models_serve_whole() -> None:
    """Prompts fit the causal LM (never cut), each completions request echoes with max_tokens 0
    or 1 (greedy: temperature 0 if any), the pieces request asks for each piece's result, the score request pairs its texts."""
    words = [w * 3 for w in WORDS]  # longer words: long posts pass the prompt bound if not cut
    for call in apis.pool(apis.APIS["completions"], 64, words):
        body = json.loads(call.body)
        assert body["echo"] is True and body["max_tokens"] in (0, 1) and body.get("logprobs", 0) <= 20
        assert body.get("temperature", 0) == 0 and ("temperature" not in body or body["max_tokens"] == 1)
        assert all(len(p) <= apis.PROMPT_CHARS for p in body["prompt"]) and len(body["prompt"]) == call.items
    for call in apis.pool(apis.APIS["pieces"], 8, words):
        assert {o["name"] for o in json.loads(call.body)["outputs"]} >= {"probabilities", "pieces", "windows"}
    for call in apis.pool(apis.APIS["score"], 16, words):
        body = json.loads(call.body)
        assert isinstance(body["text_1"], str) or len(body["text_1"]) == len(body["text_2"]) == call.items


def pieces_answer(texts: list[str], pieces: list[list[dict[str, Any]]]) -> Reply:
    """A V2 answer of ``radar``: each text's probabilities the maximum of its pieces'."""
    probabilities = [np.max([p["probabilities"] for p in each], axis=0).tolist() for each in pieces]
    outputs = [
        {"name": "probabilities", "data": [v for row in probabilities for v in row]},
        {"name": "windows", "data": [len(each) for each in pieces]},
        {"name": "pieces", "data": [json.dumps(each) for each in pieces]},
    ]
    return reply_of({"outputs": outputs})


def test_a_pieces_answer_is_checked_against_its_texts() -> None:
    """Pieces in text order, each at most 300 characters, every character but white space in one;
    windows of a piece too long in tokens overlap."""
    texts = ["  short post", "x" * 400]
    call = call_of({"inputs": [{"name": "text", "data": texts}]}, 2)
    read = apis.APIS["pieces"].read
    one, two, three = (
        {"start": 2, "stop": 12, "probabilities": [0.25, 0.75]},
        {"start": 0, "stop": 300, "probabilities": [0.5, 0.5]},
        {"start": 280, "stop": 400, "probabilities": [0.875, 0.125]},  # overlaps the window before
    )
    assert read(pieces_answer(texts, [[one], [two, three]]), call).tolist() == [
        0.25, 0.75, 0.875, 0.5,  # the texts' probabilities: the maximum of their pieces'
        2, 12, 0.25, 0.75,
        0, 300, 280, 400, 0.5, 0.5, 0.875, 0.125,
    ]  # fmt: skip
    wrong = {
        "over 300 characters": [[one], [{**two, "stop": 301}, three]],
        r"a piece \[0, 300\) after one from 280": [[one], [three, two]],
        "of 12 characters": [[{**one, "stop": 13}], [two, three]],
        r"20 characters in no piece, from 300: 'xxx": [[one], [two, {**three, "start": 320}]],
        "do not sum to 1": [[{**one, "probabilities": [0.5, 0.75]}], [two, three]],
    }
    for message, pieces in wrong.items():
        with pytest.raises(ValueError, match=message):
            read(pieces_answer(texts, pieces), call)
    answer = json.loads(pieces_answer(texts, [[one], [two, three]]).body)
    answer["outputs"][0]["data"][0] = 0.3  # not the maximum of its pieces'
    with pytest.raises(ValueError, match="not its pieces' maximum"):
        read(reply_of(answer), call)
    answer["outputs"][0]["data"][0] = 0.25
    answer["outputs"][1]["data"] = [1, 3]
    with pytest.raises(ValueError, match="2 pieces, windows 3"):
        read(reply_of(answer), call)


def completion(
    text: str,
    tokens: list[str],
    own: Sequence[float | None],
    top: Sequence[dict[str, float] | None],
    made: int = 0,
) -> Reply:
    offsets = np.concatenate(([0], np.cumsum([len(t) for t in tokens])[:-1])).tolist()
    logprobs = {"tokens": tokens, "token_logprobs": own, "top_logprobs": top, "text_offset": offsets}
    choice = {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": "length"}
    usage = {"prompt_tokens": len(tokens) + 1 - made, "completion_tokens": made}
    return reply_of({"choices": [choice], "usage": usage})


def test_a_completion_is_checked_against_its_prompt() -> None:
    read = apis.APIS["completions"].read
    call = call_of({"model": "lm", "prompt": ["ab c"], "echo": True, "max_tokens": 0, "logprobs": 1}, 1)
    good = completion("ab c", ["ab", " c"], [-1.0, -2.0], [{"ab": -1.0}, {" d": -0.5}])
    assert read(good, call).tolist() == [-1.0, -2.0, -1.0, -0.5, 3, 0]
    assert read(completion("ab c", ["ab", " c"], [None, -2.0], [None, {" d": -0.5}]), call).tolist() == [
        1.0, -2.0, -0.5, 3, 0  # a first token without context: null, read as +1
    ]  # fmt: skip
    wrong = {
        "spell 'ab d'": completion("ab c", ["ab", " d"], [-1.0, -2.0], [{"ab": -1.0}, {" d": -0.5}]),
        "above 0": completion("ab c", ["ab", " c"], [-1.0, 0.5], [{"ab": -1.0}, {" c": 0.5}]),
        "beside alternatives": completion("ab c", ["ab", " c"], [-1.0, -0.25], [{"ab": -1.0}, {" d": -0.5}]),
        "2 tokens, 1 log-probs": completion("ab c", ["ab", " c"], [-1.0], [{"ab": -1.0}]),
    }
    for message, reply in wrong.items():
        with pytest.raises(ValueError, match=message):
            read(reply, call)
    shifted = json.loads(good.body)
    shifted["choices"][0]["logprobs"]["text_offset"] = [0, 3]
    with pytest.raises(ValueError, match="not the tokens'"):
        read(reply_of(shifted), call)
    echoed = json.loads(good.body)
    echoed["choices"][0]["text"] = "ab"
    with pytest.raises(ValueError, match="not its prompt"):
        read(reply_of(echoed), call)
    without = call_of({"model": "lm", "prompt": ["ab c"], "echo": True, "max_tokens": 0}, 1)
    with pytest.raises(ValueError, match="for logprobs None"):
        read(good, without)
    plain = {
        "choices": [{"text": "ab c", "index": 0, "logprobs": None}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 0},
    }
    assert read(reply_of(plain), without).tolist() == [3, 0]


def test_a_completion_with_the_next_token_ends_with_the_greedy_one() -> None:
    """max_tokens 1, as lm-evaluation-harness 0.4.4 and later send it: the prompt and its greedy
    next token, one more entry in the lists, the token's log-prob the best of its row."""
    read = apis.APIS["completions"].read
    call = call_of({"model": "lm", "prompt": ["ab c"], "echo": True, "max_tokens": 1, "logprobs": 1}, 1)
    top = [{"ab": -1.0}, {" d": -0.5}, {"!": -0.25}]
    good = completion("ab c!", ["ab", " c", "!"], [-1.0, -2.0, -0.25], top, made=1)
    assert read(good, call).tolist() == [-1.0, -2.0, -0.25, -1.0, -0.5, -0.25, 3, 1]
    wrong = {
        "not the greedy": completion("ab c?", ["ab", " c", "?"], [-1.0, -2.0, -3.0], top, made=1),
        "does not end with the next token": completion(
            "ab c?", ["ab", " c", "!"], [-1.0, -2.0, -0.25], top, made=1
        ),
        "not its prompt": completion("ab d!", ["ab", " d", "!"], [-1.0, -2.0, -0.25], top, made=1),
        "completion tokens": completion("ab c!", ["ab", " c", "!"], [-1.0, -2.0, -0.25], top, made=0),
    }
    for message, reply in wrong.items():
        with pytest.raises(ValueError, match=message):
            read(reply, call)


def test_causal_reranker_scores_are_probabilities() -> None:
    two = Call(0, "/", b"{}", (), 2)
    scores = {"data": [{"index": 0, "score": 0.25}, {"index": 1, "score": 1.5}]}
    with pytest.raises(ValueError, match=r"scores outside \[0, 1\]"):
        apis.APIS["score"].read(reply_of(scores), two)
    results = {"results": [{"index": 1, "relevance_score": 0.5}, {"index": 0, "relevance_score": -0.5}]}
    with pytest.raises(ValueError, match="outside"):
        apis.APIS["causal-rerank"].read(reply_of(results), two)
    results["results"][1]["relevance_score"] = 0.25
    assert apis.APIS["causal-rerank"].read(reply_of(results), two).tolist() == [0.25, 0.5]


def test_the_stress_run_is_a_module_with_options() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.stress", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "--duration" in done.stdout and "--schedule" in done.stdout


def test_a_run_too_short_for_its_schedule_stops_before_it_starts(tmp_path: Path) -> None:
    """``--duration 150s`` of the 30-minute schedule would have run 5 of its events: refused, saying
    why, before any model is built or server started."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.stress", "--duration", "150s", "--out", str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "too short for its events' own times" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()
