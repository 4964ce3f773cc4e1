"""The collector is the process owner's (``app.serving.boot``, ``ServingCore.owns_process``): a core
that owns its process (the gunicorn worker) freezes what its boot loaded and collects its young
generation every ``GC_YOUNG_OBJECTS`` while it serves, and puts both back at its stop; a core run
in another program's process (tests, an embedding host) leaves that program's collector as it
found it."""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import pytest

from app.main import build_core
from app.serving.boot import GC_YOUNG_OBJECTS
from app.settings import Settings
from tests.support.fixtures import eventually


@pytest.mark.parametrize("owns_process", [True, False], ids=["worker", "in-process"])
async def test_only_a_core_that_owns_its_process_sets_the_collector(
    scale_repo: Path, owns_process: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="app.serving.boot")
    threshold, frozen = gc.get_threshold(), gc.get_freeze_count()
    core = build_core(Settings(model_repository=scale_repo, device="cpu"), owns_process=owns_process)
    async with core.running():
        # The boot's ready line comes after what it does to the collector.
        await eventually(lambda: any(" ready: binding " in r.getMessage() for r in caplog.records), 60.0)
        if owns_process:
            assert gc.get_threshold() == (GC_YOUNG_OBJECTS, *threshold[1:])
            assert gc.get_freeze_count() > frozen
        else:
            assert gc.get_threshold() == threshold and gc.get_freeze_count() == frozen
    assert gc.get_threshold() == threshold
    assert gc.get_freeze_count() == (0 if owns_process else frozen)
