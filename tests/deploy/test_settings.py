"""The README's configuration table is the one generated from the settings
(``python -m app.settings_doc --write``)."""

from __future__ import annotations

from app.settings_doc import settings_table
from tests.support.gunicorn import ROOT


def test_readme_configuration_table_matches_the_settings() -> None:
    readme = (ROOT / "README.md").read_text()
    assert settings_table() in readme, "README table is stale: run `python -m app.settings_doc --write`"
