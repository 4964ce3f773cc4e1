"""The padding benchmark's pure parts (benchmarks.padding): its requests, accepted by the
server's decoders; the documented configs read from docs/text-models.md and changed only where
the docstring says; the padding metric read back from two scrapes; the verdict and the table.
No server (the harness's own run is the end-to-end check)."""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from app.models.repository import read_config
from app.protocols import classify, rerank
from app.protocols.tensors import RequestLimits
from benchmarks import padding

WORDS = [f"word{i}" for i in range(200)]


def test_rerank_bodies_hold_twenty_documents_two_of_them_long() -> None:
    bodies = padding.rerank_bodies(WORDS, 5, seed=3)
    assert bodies == padding.rerank_bodies(WORDS, 5, seed=3)  # seeded
    for body, long in bodies:
        request = rerank.decode(body, RequestLimits())
        lengths = sorted(len(str(d).split()) for d in request.documents)
        assert len(lengths) == 20 and long
        assert all(5 <= n <= 15 for n in lengths[:18]), lengths
        assert all(200 <= n <= 400 for n in lengths[18:]), lengths
        assert request.model == "cross-encoder" and request.query
    assert len({body for body, _ in bodies}) == 5


def test_classify_bodies_are_the_feed_mix() -> None:
    bodies = padding.classify_bodies(WORDS, 60, share=0.1)
    longs = 0
    for body, long in bodies:
        texts = classify.decode(body, RequestLimits()).input
        assert len(texts) == 8
        words = [len(t.split()) for t in texts]
        longs += sum(n > 300 for n in words)
        assert long == any(n > 300 for n in words)
    assert 0.03 < longs / (60 * 8) < 0.2  # about 10 % of the posts


def test_long_text_has_the_words_asked_for() -> None:
    rng = random.Random(0)
    assert [len(padding.long_text(WORDS, rng, 200, 200).split()) for _ in range(3)] == [200] * 3


def test_load_requests_tag_requests_with_a_long_item() -> None:
    requests = padding.load_requests(padding.WORKLOADS["classify"], [(b"{}", True), (b"[]", False)])
    assert [(r.path, r.body, r.tag) for r in requests] == [
        ("/v1/classify", b"{}", "long"),
        ("/v1/classify", b"[]", "short"),
    ]


@pytest.mark.parametrize("workload", sorted(padding.WORKLOADS))
@pytest.mark.parametrize("overhead", [None, 0.0, 40.0, math.inf])
def test_served_config_is_the_documented_one_but_name_timeout_admission(
    tmp_path: Path, workload: str, overhead: float | None
) -> None:
    w = padding.WORKLOADS[workload]
    documented = padding.documented_config(padding.DOC.read_text(encoding="utf-8"), w.documented)
    served = padding.served_config(documented, w.served, overhead)
    (tmp_path / "model.toml").write_text(served)
    config = read_config(tmp_path)  # the server's own reader accepts it
    assert config.name == w.served
    assert config.timeout_ms == 60000 and config.admission == "capacity"
    expected = {} if overhead is None else {"call_overhead_tokens": overhead}
    assert config.parameters == {**read_documented(tmp_path, documented), **expected}
    changed = set(served.splitlines()) - set(documented.splitlines())
    assert len(changed) == 3 + (overhead is not None), changed


def read_documented(tmp_path: Path, documented: str) -> dict[str, Any]:
    folder = tmp_path / "documented"
    folder.mkdir()
    (folder / "model.toml").write_text(documented)
    return dict(read_config(folder).parameters)


def test_documented_config_names_a_missing_model() -> None:
    with pytest.raises(ValueError, match="no-such"):
        padding.documented_config('```toml\nname = "x"\n```\n', "no-such")


def test_labels_of_the_documented_configs() -> None:
    doc = padding.DOC.read_text(encoding="utf-8")
    assert padding.labels_of(padding.documented_config(doc, "ms-marco-MiniLM-L-6-v2")) == ["LABEL_0"]
    assert len(padding.labels_of(padding.documented_config(doc, "toxic-bert"))) == 6


METRICS = """# HELP scoring_batch_tokens_total Tokens.
# TYPE scoring_batch_tokens_total counter
scoring_batch_tokens_total{kind="real",model="cross-encoder",version="1"} 900.0
scoring_batch_tokens_total{kind="padded",model="cross-encoder",version="1"} 1000.0
scoring_batch_tokens_total{kind="real",model="cross-encoder",version="2"} 100.0
scoring_batch_tokens_total{kind="padded",model="cross-encoder",version="2"} 200.0
scoring_batch_tokens_total{kind="padded",model="other",version="1"} 5.0
"""


def test_token_counts_sum_a_models_samples() -> None:
    assert padding.token_counts(METRICS, "cross-encoder") == {"real": 1000.0, "padded": 1200.0}
    assert padding.token_counts(METRICS, "none") == {"real": 0.0, "padded": 0.0}


def test_padding_figures_over_a_window() -> None:
    before = {"real": 1000.0, "padded": 1200.0}
    after = {"real": 1750.0, "padded": 2200.0}
    assert padding.padding_figures(before, after) == {
        "real_tokens": 750.0,
        "padded_tokens": 1000.0,
        "padding_share": 0.25,
    }
    assert math.isnan(padding.padding_figures(before, before)["padding_share"])


def test_measured_costs_read_from_the_log() -> None:
    log = (
        "INFO sequence classification: a forward call costs 29.0 tokens beyond its tokens; attention "
        "doubles a token's cost at 1448 tokens\nother line\n"
        "x: a forward call costs 0.0 tokens beyond its tokens; attention doubles a token's cost at inf tokens"
    )
    assert padding.measured_costs(log) == [
        {"overhead": 29.0, "knee": 1448.0},
        {"overhead": 0.0, "knee": math.inf},
    ]


def row(overhead: float | None, rate: float, share: float = 0.02) -> dict[str, Any]:
    return {
        "call_overhead_tokens": overhead, "items_per_s": rate, "p50_ms": 900.0, "p99_ms": 2100.0,
        "padding_share": share, "padded_tokens": 5000.0, "statuses": {},
    }  # fmt: skip


def test_verdict_against_the_best_sweep_run() -> None:
    runs = [row(None, 90.0), row(0.0, 8.0), row(40.0, 93.0), row(math.inf, 6.7, 0.86)]
    v = padding.verdict(runs)
    assert v == {
        "best_overhead": 40.0, "best_items_per_s": 93.0, "ratio": 0.968, "padding_share": 0.02, "passed": True,
    }  # fmt: skip
    assert not padding.verdict([row(None, 80.0), row(40.0, 93.0)])["passed"]  # 0.86 of the best
    assert not padding.verdict([row(None, 93.0, 0.11), row(40.0, 93.0)])["passed"]  # padding
    with pytest.raises(ValueError, match="default"):
        padding.verdict([row(40.0, 93.0)])


def test_tables_show_each_run_against_the_best() -> None:
    runs = [row(None, 90.0), row(40.0, 93.0), row(math.inf, 6.7, 0.864)]
    result = {
        "workers": 2, "concurrency": 8, "duration_s": 30.0, "warmup_s": 5.0, "date": "2026-11-27",
        "workloads": {"rerank": {"runs": runs, "verdict": padding.verdict(runs)}},
    }  # fmt: skip
    text = padding.tables(result)
    assert "default 0.97 x the best (call_overhead_tokens = 40.0)" in text
    assert "met." in text and "NOT met" not in text
    lines = text.splitlines()
    assert "| default (measured) | 90.0 | 0.97 | 900 / 2100 | 2.0 % | 5000 | - | 90.0 |" in lines
    assert "| call_overhead_tokens = inf | 6.7 | 0.07 | 900 / 2100 | 86.4 % | 5000 | - | 6.7 |" in lines
    json.dumps(result)  # the record is JSON


def test_a_run_over_rounds_is_its_medians() -> None:
    rounds = [
        {**row(40.0, 93.0), "statuses": {"503": 1}, "measured_cost": [{"overhead": 30.0, "knee": 900.0}]},
        {**row(40.0, 80.0, 0.04), "statuses": {"503": 2}, "measured_cost": []},
        {**row(40.0, 99.0, 0.03), "statuses": {}, "measured_cost": [{"overhead": 35.0, "knee": 800.0}]},
    ]
    run = padding.median_run(rounds)
    assert run["items_per_s"] == 93.0 and run["padding_share"] == 0.03
    assert run["call_overhead_tokens"] == 40.0
    assert run["rounds_items_per_s"] == [93.0, 80.0, 99.0]
    assert run["statuses"] == {"503": 3} and len(run["measured_cost"]) == 2
    with pytest.raises(ValueError, match="round"):
        padding.median_run([])
    runs = [run, padding.median_run([{**row(None, 90.0), "measured_cost": []}])]
    assert "| 93.0 / 80.0 / 99.0 |" in padding.workload_table(
        "rerank", {"runs": runs, "verdict": padding.verdict(runs)}
    )


def test_overheads_option() -> None:
    assert padding.overheads("0,10,inf") == [0.0, 10.0, math.inf]
    for bad in ("", "-1", "nan"):
        with pytest.raises(argparse.ArgumentTypeError):
            padding.overheads(bad)
    with pytest.raises(ValueError):
        padding.overheads("x")
    with pytest.raises(SystemExit):  # argparse's usage error
        padding.parse_args(["--overheads", "x"])
    args = padding.parse_args(["--overheads", "0,inf", "--workloads", "rerank", "--duration", "5"])
    assert (args.overheads, args.workloads, args.duration) == ([0.0, math.inf], ["rerank"], 5.0)
