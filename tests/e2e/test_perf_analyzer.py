"""Triton's perf_analyzer (2.41.1, set up by scripts/perf_analyzer) against real gunicorn on both
demo models, with its default options: it reads the model config and metadata, sends its default
(binary) requests, reads the server statistics, and must exit 0."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.demo_repo import MINILM, RANKER
from tests.support.fixtures import DEMO_GROUP
from tests.support.gunicorn import ROOT, Gunicorn

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group(DEMO_GROUP)]

SCRIPT = ROOT / "scripts" / "perf_analyzer"

#: Protocol -> how perf_analyzer reaches the server: its -i value and the URL it is given.
ENDPOINTS: dict[str, Callable[[Gunicorn], list[str]]] = {
    "http": lambda srv: ["-i", "http", "-u", f"127.0.0.1:{srv.port}"],
    "grpc": lambda srv: ["-i", "grpc", "-u", srv.grpc_url],
}


@pytest.fixture(scope="module")
def perf_analyzer() -> Path:
    done = subprocess.run([str(SCRIPT), "--setup"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return Path(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def server(demo_server: Gunicorn) -> Gunicorn:
    """The shared demo server (``tests.support.fixtures.demo_server``): 2 workers, so over HTTP
    perf_analyzer's statistics calls reach either, and each answers the server's statistics."""
    return demo_server


@pytest.mark.alone  # perf_analyzer 2.41.1 can crash at exit (SIGSEGV) on a shared CPU
@pytest.mark.parametrize("protocol", sorted(ENDPOINTS))
@pytest.mark.parametrize("model", [RANKER, MINILM])
def test_perf_analyzer_runs_with_default_options(
    perf_analyzer: Path, server: Gunicorn, tmp_path: Path, model: str, protocol: str
) -> None:
    csv = tmp_path / "perf.csv"
    # Defaults but for a short window and no stability demand (the CI machine is shared, and
    # perf_analyzer exits non-zero when three windows differ by more than 10 %).
    args = [str(SCRIPT), "-m", model, *ENDPOINTS[protocol](server)]
    args += ["--measurement-interval", "500", "--stability-percentage", "999", "-f", str(csv)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Successful request count" in done.stdout  # it read the server statistics
    header, row = csv.read_text().splitlines()[:2]
    assert header.startswith("Concurrency,Inferences/Second") and float(row.split(",")[1]) > 0
    assert "Traceback" not in server.log()
