"""The Grafana dashboard ``deploy/grafana/scoring-server.json``, statically: a dashboard Grafana
can import (uid, title, panels with targets, a templated data source), whose every query is
PromQL over metrics the server defines (``app.observability.metrics``, ``.gpu``), with the labels they
carry, each listed in docs/observability.md. That a running server exports every one of them:
tests/e2e/test_dashboard.py.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from app.observability.gpu import GpuMetrics
from app.observability.metrics import ServerMetrics
from tests.support import grafana
from tests.support.gunicorn import ROOT

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
#: Sample names of each metric type on /metrics (prometheus_client; ``_created`` left out:
#: multiprocess mode does not export it).
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
#: What the issue asks the dashboard to show, as the metrics that show it.
REQUIRED = {
    "scoring_requests_total",  # request rate
    "scoring_request_duration_seconds_bucket",  # latency quantiles
    "scoring_queue_depth",
    "scoring_queue_duration_seconds_bucket",  # queue wait
    "scoring_batch_size_bucket",
    "scoring_batch_tokens_total",  # padding waste
    "scoring_rejected_total",  # admission refusals
    "scoring_gpu_memory_used_bytes",
    "scoring_gpu_memory_total_bytes",
    "scoring_gpu_utilization_percent",
    "scoring_worker_binding_info",  # per worker
    "scoring_worker_load_items",
}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return grafana.load()


@pytest.fixture(scope="module")
def exported() -> dict[str, tuple[str, frozenset[str]]]:
    """Sample name on /metrics -> (the metric's name in docs, its label names), for every metric
    the server defines."""
    registry = CollectorRegistry()
    defined = [*vars(ServerMetrics(registry)).values(), *vars(GpuMetrics(registry)).values()]
    out = {}
    for metric in defined:
        if isinstance(metric, MetricWrapperBase):
            # prometheus_client keeps a metric's type, name and label names in these attributes
            name, kind, labels = metric._name, str(metric._type), frozenset(metric._labelnames)
            documented = name + "_total" if kind == "counter" else name
            for suffix in SUFFIXES[kind]:
                out[name + suffix] = (documented, labels | ({"le"} if suffix == "_bucket" else set()))
    return out


def test_it_is_a_dashboard(dashboard: dict[str, Any]) -> None:
    assert isinstance(dashboard["uid"], str) and re.fullmatch(r"[\w-]{1,40}", dashboard["uid"])
    assert dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int)
    assert dashboard["time"]["from"] and dashboard["time"]["to"]
    panels = grafana.panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    graphs = [p for p in panels if p["type"] != "row"]
    assert len(graphs) >= 10
    for panel in graphs:
        where = f"panel {panel.get('title')!r}"
        assert panel["title"] and panel["type"] in {"timeseries", "stat", "table", "gauge", "bargauge"}, where
        pos = panel["gridPos"]
        assert all(isinstance(pos[k], int) for k in "hwxy") and 0 <= pos["x"] < pos["x"] + pos["w"] <= 24, where
        assert panel["datasource"] == DATASOURCE, where
        targets = panel["targets"]
        assert targets, f"{where}: no targets"
        ref_ids = [t["refId"] for t in targets]
        assert len(ref_ids) == len(set(ref_ids)), f"{where}: refIds must be unique"
        for target in targets:
            assert target["expr"].strip() and target.get("datasource", DATASOURCE) == DATASOURCE, where


def test_the_data_source_is_a_variable(dashboard: dict[str, Any]) -> None:
    """No data source of one Grafana is named: the dashboard imports into any."""
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"

    def datasources(node: Any) -> list[Any]:
        if isinstance(node, dict):
            found = [node["datasource"]] if "datasource" in node else []
            return found + [d for v in node.values() for d in datasources(v)]
        if isinstance(node, list):
            return [d for v in node for d in datasources(v)]
        return []

    builtin = {"type": "grafana", "uid": "-- Grafana --"}  # the annotations of the dashboard itself
    assert all(d in (DATASOURCE, builtin) for d in datasources(dashboard)), datasources(dashboard)


def test_every_query_is_promql_over_metrics_the_server_defines(
    dashboard: dict[str, Any], exported: dict[str, tuple[str, frozenset[str]]]
) -> None:
    queries = grafana.queries(dashboard)  # parses each: ValueError where it is not PromQL
    assert len(queries) >= 20
    for query in queries:
        assert query.selectors, f"{query.where}: selects nothing: {query.expr}"
        for selector in query.selectors:
            assert selector.metric in exported, f"{query.where}: {selector.metric} is not a metric of the server"


def test_every_label_queried_is_a_label_of_its_metric(
    dashboard: dict[str, Any], exported: dict[str, tuple[str, frozenset[str]]]
) -> None:
    for query in grafana.queries(dashboard):
        known = set(grafana.TARGET_LABELS)
        for selector in query.selectors:
            labels = exported[selector.metric][1]
            known |= labels
            for name, _, _ in selector.matchers:
                assert name in labels | grafana.TARGET_LABELS, f"{query.where}: {selector.metric} has no label {name}"
        assert query.grouping <= known, f"{query.where}: groups on {sorted(query.grouping - known)}"


def test_it_shows_what_the_issue_asks(dashboard: dict[str, Any]) -> None:
    missing = REQUIRED - grafana.metrics(dashboard)
    assert not missing, f"the dashboard does not show {sorted(missing)}"
    exprs = " ".join(q.expr for q in grafana.queries(dashboard))
    assert "histogram_quantile(" in exprs
    assert 'kind="padded"' in exprs and 'kind="real"' in exprs


def test_every_metric_queried_is_documented(
    dashboard: dict[str, Any], exported: dict[str, tuple[str, frozenset[str]]]
) -> None:
    docs = (ROOT / "docs" / "observability.md").read_text(encoding="utf-8")
    for metric in grafana.metrics(dashboard):
        documented = exported[metric][0]
        assert f"| `{documented}` |" in docs, f"{documented} is not in docs/observability.md's table"
