"""scripts/loadtest.py: levels and target checks, summaries, CSV, payloads the server accepts,
a short run against an in-process app."""

from __future__ import annotations

import argparse
import csv
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from app.models.repository import read_config
from app.protocols import v1, v2
from app.serving.dataplane import validate_inputs
from benchmarks import payloads
from tests.support.gunicorn import ROOT
from tests.support.tools import load_tool

lt = load_tool("loadtest.py")


def test_levels_and_target_are_checked() -> None:
    assert lt.parse_levels("1,2, 4") == [1.0, 2.0, 4.0]
    for bad in ("", "1,x", "0", "-1", "nan"):
        with pytest.raises(argparse.ArgumentTypeError):
            lt.parse_levels(bad)
    assert lt.check_target("http://127.0.0.1:8080/", False) == "http://127.0.0.1:8080"
    assert lt.check_target("http://localhost:1", False) == "http://localhost:1"
    assert lt.check_target("http://[::1]:1", False) == "http://[::1]:1"
    with pytest.raises(ValueError, match="--allow-remote"):
        lt.check_target("http://example.com:8080", False)
    with pytest.raises(ValueError, match="--allow-remote"):
        lt.check_target("http://127.0.0.1.example.com", False)
    assert lt.check_target("http://10.0.0.5:80", True) == "http://10.0.0.5:80"
    with pytest.raises(ValueError, match="http://host:port"):
        lt.check_target("ftp://127.0.0.1", True)


def test_refuses_a_remote_host_before_sending_anything(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        lt.main(["--url", "http://192.0.2.1:8080", "--model", "m", "--concurrency", "1"])
    assert exc.value.code == 2 and "--allow-remote" in capsys.readouterr().err


def test_summary_counts_only_measured_requests() -> None:
    R = lt.Record
    records = [
        R(2, 0.1, 9.0, 200, 4, counted=False),  # warmup: ignored
        *(R(2, 1.0 + i / 10, (i + 1) / 1000, 200, 4) for i in range(10)),
        R(2, 1.5, 0.5, 503, 4, error="HTTP 503"),
    ]
    s = lt.summarize("concurrency", 2, records, lt.Window(0.0, 1.0, 3.0))
    assert (s.requests, s.errors, s.seconds) == (11, 1, 2.0)
    assert s.requests_per_s == 5.0 and s.items_per_s == 20.0
    assert s.p50_ms == pytest.approx(5.5) and s.max_ms == pytest.approx(10.0)
    rows = lt.history(records)
    assert [r["time_s"] for r in rows] == [0.0, 1.0]
    assert rows[1]["requests_per_s"] == 10 and rows[1]["errors"] == 1


def test_csv_has_a_header_and_formatted_numbers(tmp_path: Path) -> None:
    lt.write_csv(tmp_path / "x.csv", [{"level": 1, "p50_ms": 1.23456, "p99_ms": math.nan}])
    with (tmp_path / "x.csv").open() as f:
        assert list(csv.DictReader(f)) == [{"level": "1", "p50_ms": "1.2346", "p99_ms": ""}]


@pytest.mark.parametrize("model", ["all-MiniLM-L6-v2", "feed-ranker"])
@pytest.mark.parametrize("protocol", ["v1", "v2"])
def test_payloads_are_accepted_by_the_servers_decoders(model: str, protocol: str) -> None:
    config = read_config(ROOT / "model_repository" / model)
    metadata = v2.model_metadata(config)
    names = ["text"] if model == "all-MiniLM-L6-v2" else []
    body = lt.build_payload(metadata, protocol, 3, names, random.Random(0))
    if protocol == "v1":
        arrays = validate_inputs(config, v1.decode_request(config, body))
    else:
        arrays = validate_inputs(config, v2.decode_request(body, config.name))
    first = config.inputs[0]
    assert arrays[first.name].shape[0] == 3
    if first.datatype == "BYTES":
        assert arrays[first.name].ravel()[0].decode().split("; ")[0] in payloads.HEADLINES
    with pytest.raises(ValueError, match="no input"):
        lt.build_payload(metadata, protocol, 1, ["nope"], random.Random(0))


async def test_a_short_run_against_an_app_writes_csv_and_plots(
    make_client: Callable[..., Any], scale_repo: Path, tmp_path: Path
) -> None:
    client = await make_client(scale_repo)
    base = str(client.make_url("")).rstrip("/")
    out = tmp_path / "out"
    args = lt.make_parser().parse_args(
        ["--url", base, "--model", "scale", "--inputs", "x", "--concurrency", "1,3",
         "--duration", "0.3", "--warmup", "0.1", "--out", str(out)]
    )  # fmt: skip
    summaries, records = await lt.run_levels(args, lt.check_target(base, False))
    assert [s.level for s in summaries] == [1, 3]
    assert all(s.requests > 0 and s.errors == 0 and s.p99_ms >= s.p50_ms > 0 for s in summaries)
    assert any(not r.counted for r in records)
    out.mkdir()
    written = lt.plot(out, summaries, lt.history(records), "scale")
    assert [p.name for p in written] == ["throughput_latency.png", "latency_over_time.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in written)
