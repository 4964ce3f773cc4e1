"""A model repository with both demo models for end-to-end tests."""

from __future__ import annotations

from pathlib import Path

from tests.support.gunicorn import ROOT
from tests.support.tools import load_tool

MINILM = "all-MiniLM-L6-v2"
RANKER = "feed-ranker"


def demo_repository(tmp: Path) -> Path:
    """``tmp/repo`` with all-MiniLM-L6-v2 (its folder linked) and feed-ranker exported fresh by
    scripts/export_ranking_model.py (its weights are not committed)."""
    repo = tmp / "repo"
    repo.mkdir()
    (repo / MINILM).symlink_to(ROOT / "model_repository" / MINILM)
    load_tool("export_ranking_model.py").export(repo / RANKER, "torch_export", seed=0)
    return repo
