"""Model control on a real GPU: all-MiniLM-L6-v2 swapped from version 1 to version 2 under load,
one worker on the first GPU, with the worker's CUDA memory (NVML's per-process figure) before,
during and after. Marked ``gpu``: skipped where torch sees no CUDA device (tests/conftest.py).

What it shows: no request fails; during the swap both versions are resident (the peak is at most
about twice the model's share, never the old copy left behind); after it the worker's memory is
back within 10 % of before plus PyTorch's allocator slack (the old copy's cached blocks are given
back by ``torch.cuda.empty_cache``). The figures go to the test's output (``-s``).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.driver import http
from gpu_stat import query_gpus
from tests.support.gunicorn import ROOT, Gunicorn
from tests.support.load import SteadyLoad

pytestmark = [pytest.mark.gpu, pytest.mark.e2e, pytest.mark.slow]

MINILM = "all-MiniLM-L6-v2"
BODY = {"inputs": [{"name": "text", "shape": [4, 1], "datatype": "BYTES", "data": ["a feed item title"] * 4}]}
#: What the allocator may keep beyond the weights after a swap (its cached blocks of the new
#: copy's warmup), bytes.
SLACK = 256 * 2**20


def worker_gpu_bytes(pid: int) -> int:
    """The GPU memory NVML lists for ``pid`` on any GPU (0 when not listed)."""
    return sum(
        p.used_memory or 0
        for gpu in query_gpus(respect_visible_devices=False)
        for p in gpu.processes or ()
        if p.pid == pid
    )


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Gunicorn, Path]]:
    for key in list(os.environ):
        if key.startswith("GPU_STAT_"):  # the real NVML
            monkeypatch.delenv(key)
    repo = tmp_path / "repo"
    (repo / f"{MINILM}-1").mkdir(parents=True)
    shutil.copy(ROOT / "model_repository" / MINILM / "model.toml", repo / f"{MINILM}-1" / "model.toml")
    env = {
        "SCORING_MODEL_REPOSITORY": str(repo),
        "SCORING_GPUS": "0",
        "SCORING_MAX_PROCESSES_PER_GPU": "1",
        "SCORING_MODEL_CONTROL_MODE": "explicit",
        "SCORING_ACCESS_LOG": "",
    }
    with Gunicorn(tmp_path, env, torch_threads=None) as srv:
        srv.wait_ready(300)
        yield srv, repo


@pytest.mark.timeout(900)
def test_minilm_swap_on_the_gpu_fails_nothing_and_gives_the_old_copy_back(
    served: tuple[Gunicorn, Path],
) -> None:
    server, repo = served
    (worker,) = server.workers()
    before = worker_gpu_bytes(worker.pid)
    assert before > 0, "NVML lists no GPU memory for the worker"
    peak = [before]
    stop = threading.Event()

    def sample() -> None:
        while True:  # NVML sampled every 50 ms until the load call has returned
            peak[0] = max(peak[0], worker_gpu_bytes(worker.pid))
            if stop.wait(0.05):
                return

    sampler = threading.Thread(target=sample, daemon=True)
    with SteadyLoad(server.port, f"/v2/models/{MINILM}/infer", BODY, connections=8) as load:
        new = repo / f"{MINILM}-2"
        shutil.copytree(repo / f"{MINILM}-1", new)
        toml = new / "model.toml"
        toml.write_text(toml.read_text().replace('version = "1"', 'version = "2"'))
        sampler.start()
        status, _, body = http("POST", f"{server.url}/v2/repository/models/{MINILM}/load", {}, timeout=600)
        stop.set()
        sampler.join()
        assert status == 200, body
        load.wait_for_more(100)
    after = worker_gpu_bytes(worker.pid)
    print(f"worker GPU memory: before {before >> 20} MiB, peak {peak[0] >> 20} MiB, after {after >> 20} MiB")
    assert set(load.statuses) == {200}, (load.statuses, load.errors)
    assert load.versions["2"] > 0
    assert peak[0] < 2 * before + SLACK
    assert after <= before * 1.1 + SLACK
