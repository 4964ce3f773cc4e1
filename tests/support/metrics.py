"""Reading a Prometheus text exposition in the metrics tests (in-process and on real gunicorn),
and the V2 body they send to the scale toy model."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Samples = list[tuple[str, dict[str, str], float]]


def parse(text: str) -> Samples:
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The value of the one sample named ``name`` whose labels include ``labels``; None if absent."""
    found = [v for n, lab, v in samples if n == name and labels.items() <= lab.items()]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


def total(samples: Samples, name: str, **labels: str) -> float:
    return sum(v for n, lab, v in samples if n == name and labels.items() <= lab.items())


def v2_body(x: float, items: int = 1) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "shape": [items, 2], "datatype": "FP32", "data": [x, x] * items}]}
