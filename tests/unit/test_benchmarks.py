"""The measurement harnesses' shared code (benchmarks.driver, .payloads, .report, .server) and
the tests' bounded poll: percentiles, the closed loop, payloads every decoder of the server
accepts, tables, per-worker shares; and every harness parses its options."""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from app.grpc.codec import decode_request as decode_grpc
from app.models.repository import read_config
from app.protocols import v1, v2
from app.protocols.tensors import RequestLimits
from app.serving.dataplane import validate_inputs
from benchmarks import driver, payloads, report, server
from tests.support.gunicorn import ROOT, poll, worker_items, worker_shares

HARNESSES = sorted(
    p.stem
    for p in (ROOT / "benchmarks").glob("*.py")
    if p.stem
    not in (
        "__init__",
        "driver",
        "payloads",
        "report",
        "server",
        "request_path_conf",
        "loadgen",
        "stages",
        "decoder_folders",
    )
)


def test_percentiles_are_numpys_and_nan_when_empty() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert driver.percentiles(values, (0, 50, 90, 100)) == [1.0, 2.5, 3.7, 4.0]
    assert all(math.isnan(v) for v in driver.percentiles([], (50, 99)))


async def test_closed_loop_starts_no_request_after_the_deadline() -> None:
    until = time.perf_counter() + 1.0

    async def request(client: int) -> int:  # answered only once the deadline has passed
        await asyncio.sleep(until - time.perf_counter() + 0.01)
        return client

    assert sorted(await driver.closed_loop(request, 3, until)) == [0, 1, 2]
    assert await driver.closed_loop(request, 3, time.perf_counter() - 1) == []


def test_figures_count_only_answered_requests() -> None:
    answers = [driver.Answer(200, 0.001), driver.Answer(200, 0.003), driver.Answer(503, 0.0, "HTTP 503")]
    row = driver.figures(answers, items=4, concurrency=2, elapsed_s=2.0)
    assert (row["requests"], row["errors"], row["items_per_s"]) == (2, 1, 4.0)
    assert row["p50_ms"] == pytest.approx(2.0)


def test_clients_cycle_through_different_messages() -> None:
    next_for = driver.cycling(["a", "b", "c", "d"], concurrency=2)
    assert [next_for(0), next_for(1), next_for(0), next_for(1), next_for(0)] == ["a", "b", "c", "d", "a"]


def test_poll_returns_the_value_and_fails_with_diagnostics() -> None:
    values = iter([0, "", "done"])
    assert poll(lambda: next(values), 5, "a value", interval_s=0) == "done"
    with pytest.raises(AssertionError, match=r"waiting for never(.|\n)*the log tail"):
        poll(lambda: False, 0.01, "never", interval_s=0.001, diagnostics=lambda: "the log tail")


def test_free_ports_are_below_the_ephemeral_range_unless_it_leaves_no_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No outgoing connection can be given the port before the server binds it."""
    low = driver._ephemeral_low()
    ports = {driver.free_port() for _ in range(20)}
    assert all(10000 <= port < low for port in ports) and len(ports) > 1, (low, ports)
    for port in ports:  # free: bindable now
        with socket.socket() as s:
            s.bind((driver.HOST, port))
    monkeypatch.setattr(driver, "_ephemeral_low", lambda: 10500)  # no room below: the OS's pick
    assert driver.free_port() >= low


@pytest.mark.parametrize("model", [server.MINILM, server.RANKER])
def test_payloads_are_accepted_by_every_decoder(model: str) -> None:
    repository = ROOT / "model_repository"
    config = read_config(repository / model)
    request = payloads.tensors(payloads.inputs_of(repository, model), 3, random.Random(0))
    sent = {t.name: t.array for t in request}
    decoded = [
        validate_inputs(config, v2.decode_request(payloads.v2_json(request), config.name)),
        validate_inputs(config, decode_grpc(payloads.grpc_request(model, request), config, RequestLimits())),
    ]
    if len(request) == 1:  # V1 instances of one input (MiniLM sends text and query)
        decoded.append(validate_inputs(config, v1.decode_request(config, payloads.v1_json(request))))
    for arrays in decoded:
        for name, array in sent.items():
            assert arrays[name].shape == array.shape
            if array.dtype == object:
                assert arrays[name].tolist() == array.tolist()
            else:
                assert arrays[name].tobytes() == array.tobytes()


def test_minilm_texts_differ_and_the_query_is_fixed() -> None:
    request = payloads.tensors(
        payloads.inputs_of(ROOT / "model_repository", server.MINILM), 8, random.Random(1)
    )
    texts, queries = (t.array.ravel().tolist() for t in request)
    assert len(set(texts)) == 8 and set(queries) == {payloads.QUERY.encode()}
    text_only = payloads.inputs_of(ROOT / "model_repository", server.MINILM, query=False)
    assert [s.name for s in text_only] == ["text"]
    long = payloads.tensors(text_only, 2, random.Random(0), payloads.text_of(1500))[0].array
    assert {len(t) for t in long.ravel()} == {1500}


def test_tables_align_numbers_right_and_need_every_column() -> None:
    assert report.table(("mode", "items/s"), [("on", 12)], "lr") == (
        "| mode | items/s |\n| --- | ---: |\n| on | 12 |"
    )
    with pytest.raises(ValueError, match="one of l/r per column"):
        report.table(("a", "b"), [], "l")
    assert report.shares({2: 0.484, 1: 0.516}) == "48 % / 52 %"


def test_worker_shares_come_from_two_scrapes() -> None:
    before = worker_items(
        'scoring_worker_items_total{pid="7"} 10.0\nscoring_worker_items_total{pid="9"} 0.0\n'
    )
    after = worker_items(
        'scoring_worker_items_total{pid="7"} 40.0\nscoring_worker_items_total{pid="9"} 10.0\n'
    )
    assert before == {7: 10.0, 9: 0.0}
    assert worker_shares(before, after) == {7: 0.75, 9: 0.25}
    assert worker_shares(after, after) == {7: 0.0, 9: 0.0}


def test_levels_and_lists_are_checked() -> None:
    assert server.levels("1,4,16") == [1, 4, 16]
    for bad in ("", "0", "x", "1,-2"):
        with pytest.raises(argparse.ArgumentTypeError):
            server.levels(bad)
    assert server.comma_list(["on", "off"])("on,off") == ["on", "off"]
    with pytest.raises(argparse.ArgumentTypeError, match="choose from"):
        server.comma_list(["on", "off"])("maybe")


@pytest.mark.parametrize("name", HARNESSES)
def test_every_harness_runs_as_a_module(name: str) -> None:
    """``python -m benchmarks.<name> --help`` from the repository root: imports and options."""
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout


def test_the_cache_benchmarks_ideal_lru_continues_from_what_was_sent_before() -> None:
    from benchmarks.cache import lru_hits, lru_hits_after, sent_items

    assert lru_hits([1, 2, 1, 3, 1, 2], 2) == 2  # 1 hits twice; 2 was evicted by 3
    assert lru_hits_after([np.array([1, 2])], np.array([1, 3, 1, 2]), 2) == 2  # warm: 1 hits twice
    assert lru_hits_after([], np.array([1, 3, 1]), 2) == 1
    ranks = np.arange(12)  # 6 requests of 2 items
    assert sent_items(ranks, 2, 3, 1).tolist() == [0, 1, 2, 3, 4, 5]
    assert sent_items(ranks, 2, 3, 1, start=5).tolist() == [10, 11, 0, 1, 2, 3]  # wraps around


def test_the_request_path_table_in_the_docs_is_the_harness_table() -> None:
    """docs/architecture.md's request-path table is what ``python -m benchmarks.request_path
    --table`` prints: its header, one row per path the harness measures, numbers in the cells."""
    from benchmarks import request_path

    text = (ROOT / "docs/architecture.md").read_text()
    table = text[text.index("<!-- request-path -->") + len("<!-- request-path -->") : text.index("<!-- /request-path -->")]
    lines = table.strip().splitlines()
    fake = {name: {"files": {str(i): [] for i in range(3)}, "moves": 5, "returns": 4} for name in request_path.PATHS}
    generated = request_path.table(fake).splitlines()
    assert lines[:2] == generated[:2]
    assert [line.split(" | ")[0] for line in lines[2:]] == [line.split(" | ")[0] for line in generated[2:]]
    for line in lines[2:]:
        assert all(cell.strip().isdigit() for cell in line.strip("|").split("|")[1:]), line
