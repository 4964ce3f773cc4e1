"""Settings: env parsing, validation, and the README table generated from them."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.settings import Settings
from app.settings_doc import settings_table
from tests.support.gunicorn import ROOT


def test_env_vars_with_prefix_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCORING_PORT", "9001")
    monkeypatch.setenv("SCORING_MODELS", "a, b")
    monkeypatch.setenv("SCORING_GPUS", "0,GPU-abc")
    s = Settings()
    assert s.port == 9001 and s.model_names == ("a", "b") and s.gpu_allow_list == ("0", "GPU-abc")
    assert s.host == "127.0.0.1"  # loopback unless told otherwise


def test_invalid_values_are_rejected_with_the_field_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCORING_PORT", "70000")
    with pytest.raises(ValidationError, match="port"):
        Settings()
    monkeypatch.delenv("SCORING_PORT")
    monkeypatch.setenv("SCORING_FOREIGN_PROCESS_POLICY", "maybe")
    with pytest.raises(ValidationError, match="foreign_process_policy"):
        Settings()


def test_readme_configuration_table_matches_the_settings() -> None:
    readme = (ROOT / "README.md").read_text()
    assert settings_table() in readme, "README table is stale: run `python -m app.settings_doc --write`"
