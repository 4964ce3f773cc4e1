"""The Prometheus alert rules (deploy/kubernetes/monitoring/prometheus-rules.yaml): valid for
Prometheus (``promtool check rules``), firing and silent where they should on series shaped as
the server exports them, including a counter that has no series until its first event
(``promtool test rules``, tests/deploy/data/alerts-test.yaml); and every metric they read is one
the server defines. promtool comes from Debian's ``prometheus`` package; without it the two
promtool tests skip and say so."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.deploy import DEPLOY
from tests.support.gunicorn import ROOT

RULES = DEPLOY / "kubernetes" / "monitoring" / "prometheus-rules.yaml"
UNIT_TESTS = Path(__file__).parent / "data" / "alerts-test.yaml"
PROMTOOL = shutil.which("promtool")


def _groups() -> dict[str, object]:
    doc = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["kind"] == "PrometheusRule"
    return {"groups": doc["spec"]["groups"]}


@pytest.fixture
def rules_file(tmp_path: Path) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(_groups()), encoding="utf-8")
    return path


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    if PROMTOOL is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_promtool_accepts_the_rules(rules_file: Path) -> None:
    done = _promtool("check", "rules", str(rules_file), cwd=rules_file.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 5 rules found" in done.stdout


def test_the_alerts_fire_and_stay_silent_as_their_unit_tests_say(rules_file: Path) -> None:
    shutil.copy(UNIT_TESTS, rules_file.parent / "alerts-test.yaml")
    done = _promtool("test", "rules", "alerts-test.yaml", cwd=rules_file.parent)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_metric_an_alert_reads_is_one_the_server_exports() -> None:
    source = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "app" / "observability").glob("*.py"))
    exprs = [r["expr"] for g in _groups()["groups"] for r in g["rules"]]  # type: ignore[attr-defined]
    names = {m for e in exprs for m in re.findall(r"\b(scoring_[a-z_]+)", e)}
    assert names
    for name in names:
        base = name.removesuffix("_total")
        assert f'"{base}"' in source, f"{name}: no metric {base!r} in app/observability"
