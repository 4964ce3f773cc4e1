"""Reading the Grafana dashboard (``deploy/grafana/scoring-server.json``) for its checks: the
static ones (tests/deploy/test_grafana.py) and the scrape of a running server
(tests/e2e/test_dashboard.py).

Every query of the dashboard (each panel target's ``expr``, and the series selector of each
templating ``label_values(...)`` query) is parsed with a real PromQL parser (``promql-parser``,
the Rust one of GreptimeDB) after Grafana's interval variables are replaced by a duration; what
the checks need from it: the metric of every series selector with its label matchers, and the
label names that aggregations and vector matching group on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import promql_parser

from tests.support.gunicorn import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "scoring-server.json"
#: Labels Prometheus adds to every scraped series (the target's): never on /metrics itself.
TARGET_LABELS = frozenset({"job", "instance"})
#: Grafana's interval variables, which only stand where PromQL wants a duration.
_INTERVALS = re.compile(r"\$(?:__rate_interval|__interval|__range)\b|\$\{(?:__rate_interval|__interval|__range)\}")
_LABEL_VALUES = re.compile(r"^\s*label_values\((?P<selector>.+),\s*(?P<label>\w+)\s*\)\s*$", re.S)


@dataclass(frozen=True)
class Selector:
    """One series selector: its metric name and its label matchers (name, operator, value)."""

    metric: str
    matchers: tuple[tuple[str, str, str], ...]


@dataclass(frozen=True)
class Query:
    """One PromQL query of the dashboard: where it is, its text, and what it selects and groups."""

    where: str
    expr: str
    selectors: tuple[Selector, ...]
    grouping: frozenset[str]


def load(path: Path = DASHBOARD) -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return dashboard


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside (collapsed) rows included, rows themselves included."""
    out: list[dict[str, Any]] = []
    for panel in dashboard.get("panels", []):
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def parse(expr: str) -> promql_parser.Expr:
    """The AST of a dashboard query; ValueError where it is not PromQL."""
    return promql_parser.parse(_INTERVALS.sub("5m", expr))


def _operator(op: promql_parser.MatchOp) -> str:
    for known, text in (
        (promql_parser.MatchOp.Equal, "="),
        (promql_parser.MatchOp.NotEqual, "!="),
        (promql_parser.MatchOp.Re, "=~"),
        (promql_parser.MatchOp.NotRe, "!~"),
    ):
        if op == known:
            return text
    raise ValueError(f"unknown match operator {op!r}")


def analyse(where: str, expr: str) -> Query:
    """Parse ``expr`` and collect its selectors and grouping labels."""
    selectors: list[Selector] = []
    grouping: set[str] = set()

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            matchers = tuple(
                (m.name, _operator(m.op), m.value) for m in node.matchers.matchers if m.name != "__name__"
            )
            assert node.name, f"{where}: a selector without a metric name: {expr}"
            selectors.append(Selector(node.name, matchers))
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            grouping.update(node.modifier.labels)
        elif isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None:
            if node.modifier.matching is not None:
                grouping.update(node.modifier.matching.labels)
            grouping.update(node.modifier.group_labels or ())

    promql_parser.walk(parse(expr), visit)
    return Query(where, expr, tuple(selectors), frozenset(grouping))


def queries(dashboard: dict[str, Any]) -> list[Query]:
    """Every PromQL query of the dashboard: panel targets, then templating variables' selectors."""
    found = []
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            found.append(analyse(f"panel {panel.get('title')!r} target {target.get('refId')}", target["expr"]))
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable["query"]
        text = query["query"] if isinstance(query, dict) else query
        match = _LABEL_VALUES.match(text)
        assert match, f"variable {variable['name']}: expected label_values(<selector>, <label>), got {text!r}"
        found.append(analyse(f"variable {variable['name']}", match["selector"]))
    return found


def metrics(dashboard: dict[str, Any]) -> set[str]:
    """The metric names (as exported: ``_total``, ``_bucket``, ...) the dashboard queries."""
    return {s.metric for q in queries(dashboard) for s in q.selectors}
