"""A model repository with both demo models for end-to-end tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tests.server import ROOT

MINILM = "all-MiniLM-L6-v2"
RANKER = "feed-ranker"


def demo_repository(tmp: Path) -> Path:
    """``tmp/repo`` with all-MiniLM-L6-v2 (its folder linked) and feed-ranker exported fresh by
    scripts/export_ranking_model.py (its weights are not committed)."""
    path = ROOT / "scripts" / "export_ranking_model.py"
    spec = importlib.util.spec_from_file_location("export_ranking_model", path)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    repo = tmp / "repo"
    repo.mkdir()
    (repo / MINILM).symlink_to(ROOT / "model_repository" / MINILM)
    script.export(repo / RANKER, "torch_export", seed=0)
    return repo
