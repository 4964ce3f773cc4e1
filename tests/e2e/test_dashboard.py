"""Every metric the Grafana dashboard (``deploy/grafana/scoring-server.json``) queries is on the
``/metrics`` of a running server, with samples, and with the labels and label values the
dashboard selects and groups on.

A real gunicorn of two workers bound to two fake GPUs (the fake NVML backend,
``GPU_STAT_FAKE_NVML``; the models run on the CPU), a model repository of four toy models: one
plain, one that prices its items (so padded and real tokens are counted), one slow one (so a
request with a short deadline is refused or times out) and one with a response cache. A few inferences, then scrapes. The
static checks of the dashboard: tests/deploy/test_grafana.py.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import grafana
from tests.support.fake_gpus import GIB, gpu, gpu_uuid, write_fake
from tests.support.gunicorn import Gunicorn, wait_for
from tests.support.metrics import Samples, parse, v2_body, value
from tests.support.toy_models import write_scale_model

pytestmark = pytest.mark.e2e

#: A handler in the model's own folder (model.toml: ``handler = "priced_handler:..."``): the
#: scale toy model, pricing each item at its tag's bytes + 1 tokens.
PRICED_HANDLER = """
import numpy as np

from tests.support.toy_models import ScaleHandler


class PricedScaleHandler(ScaleHandler):
    def item_costs(self, inputs):
        return np.array([len(bytes(t)) + 1 for t in inputs["tag"].reshape(-1)], dtype=np.int64)
"""


def write_repository(repo: Path) -> None:
    write_scale_model(repo, "scale")
    write_scale_model(repo, "slow", delay_ms=300)
    priced = write_scale_model(repo, "priced")
    toml = priced / "model.toml"
    toml.write_text(
        toml.read_text().replace("tests.support.toy_models:ScaleHandler", "priced_handler:PricedScaleHandler")
    )
    (priced / "priced_handler.py").write_text(textwrap.dedent(PRICED_HANDLER))
    write_scale_model(repo, "cached", response_cache=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gunicorn]:
    tmp = tmp_path_factory.mktemp("dashboard_server")
    write_repository(tmp / "repo")
    gpus = [gpu(0, memory_used=3 * GIB, utilization=37), gpu(1, memory_used=5 * GIB, utilization=61)]
    env = {
        "SCORING_MODEL_REPOSITORY": str(tmp / "repo"),
        "GPU_STAT_FAKE_NVML": str(write_fake(tmp / "gpus.json", gpus)),
        "SCORING_MAX_PROCESSES_PER_GPU": "1",
        "SCORING_DEVICE": "cpu",
        "SCORING_RESPONSE_CACHE_LOOKUP_TIMEOUT_MS": "60000",  # the hit below is not a test of timing
        "SCORING_GPU_METRICS_INTERVAL_S": "0.1",
        "SCORING_ACCESS_LOG": "",
    }
    with Gunicorn(tmp, env) as srv:
        srv.wait_ready(count=2)
        yield srv


def send_traffic(srv: Gunicorn) -> None:
    for i in range(4):
        assert srv.post("/v2/models/scale/infer", v2_body(i, items=2))[0] == 200
        assert srv.post("/v1/models/scale:predict", {"instances": [[i, i]]})[0] == 200
    tags = ["ab", "abcdefgh", "abcd"]  # 3, 9 and 5 tokens: one batch pads them to 3 x 9
    priced = {
        "inputs": [
            {"name": "x", "shape": [3, 2], "datatype": "FP32", "data": [1.0] * 6},
            {"name": "tag", "shape": [3, 1], "datatype": "BYTES", "data": tags},
        ]
    }
    for _ in range(2):
        status, _, answer = srv.post("/v2/models/priced/infer", priced)
        assert status == 200, (answer, srv.log_tail())
    # a miss, then (once written: writes leave the request path) a hit: the response cache panels
    assert srv.post("/v2/models/cached/infer", v2_body(1))[0] == 200
    def written() -> bool:  # the gauge exists at 0 from the load: wait for the write's figure
        return (value(parse(srv.scrape()), "scoring_response_cache_bytes", model="cached") or 0.0) > 0

    wait_for(written, 30, "the write", srv)
    assert srv.post("/v2/models/cached/infer", v2_body(1))[0] == 200
    # 300 ms per batch, 30 ms allowed: refused at admission (503) or timed out (504)
    status, _, answer = srv.post("/v2/models/slow/infer", v2_body(1), headers={"X-Request-Timeout-Ms": "30"})
    assert status in (503, 504), (status, answer)


def test_every_metric_the_dashboard_queries_is_exported(server: Gunicorn) -> None:
    send_traffic(server)
    queries = grafana.queries(grafana.load())
    wanted = {s.metric for q in queries for s in q.selectors}

    def complete() -> Samples | None:
        samples = parse(server.scrape())
        names = {name for name, _, _ in samples}
        gpus_seen = {lab.get("gpu_uuid") for n, lab, _ in samples if n == "scoring_gpu_utilization_percent"}
        ready = wanted <= names and gpus_seen == {gpu_uuid(0), gpu_uuid(1)}
        return samples if ready else None

    try:
        samples = wait_for(complete, 30, "every metric of the dashboard on /metrics", server)
    except AssertionError:
        names = {name for name, _, _ in parse(server.scrape())}
        raise AssertionError(f"not on /metrics: {sorted(wanted - names)}\n{server.log_tail()}") from None

    labels_of: dict[str, set[str]] = {}
    for name, labels, _ in samples:
        labels_of.setdefault(name, set()).update(labels)
    for query in queries:
        known = set(grafana.TARGET_LABELS)
        for selector in query.selectors:
            known |= labels_of[selector.metric]
            for label, op, wanted_value in selector.matchers:
                if label in grafana.TARGET_LABELS:
                    continue  # added by Prometheus, not on /metrics
                assert label in labels_of[selector.metric], f"{query.where}: {selector.metric} has no {label}"
                if op == "=":  # a literal value: some sample has it
                    assert any(
                        n == selector.metric and lab.get(label) == wanted_value for n, lab, _ in samples
                    ), f"{query.where}: no {selector.metric}{{{label}={wanted_value!r}}} sample"
        assert query.grouping <= known, f"{query.where}: groups on {sorted(query.grouping - known)}"

    # the figures behind the panels that only appear once something happened
    assert value(samples, "scoring_batch_tokens_total", model="priced", kind="real") == 2 * (3 + 9 + 5)
    assert value(samples, "scoring_batch_tokens_total", model="priced", kind="padded") == 2 * 3 * 9
    assert sum(v for n, lab, v in samples if n == "scoring_rejected_total" and lab["model"] == "slow") == 1
    assert value(samples, "scoring_gpu_utilization_percent", gpu_uuid=gpu_uuid(1)) == 61
    assert value(samples, "scoring_gpu_memory_used_bytes", gpu_uuid=gpu_uuid(0)) == 3 * GIB
    assert value(samples, "scoring_response_cache_items_total", model="cached", result="hit") == 1
    bindings = {lab["gpu_uuid"] for n, lab, _ in samples if n == "scoring_worker_binding_info"}
    assert bindings == {gpu_uuid(0), gpu_uuid(1)}  # the per-worker GPU panels join on it
