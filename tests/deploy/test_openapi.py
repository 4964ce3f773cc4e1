"""The committed OpenAPI 3 document (app/openapi.json) is valid and is what the code generates."""

from __future__ import annotations

from openapi_spec_validator import validate

from app.http.openapi import main as openapi_main
from app.http.openapi import render
from tests.support.openapi import SPEC_PATH, spec


def test_document_is_valid_openapi_3() -> None:
    validate(spec())
    assert spec()["openapi"].startswith("3.")


def test_document_is_generated_from_the_code() -> None:
    """app/openapi.json is what ``python -m app.http.openapi`` writes (rerun it after a change)."""
    assert SPEC_PATH.read_bytes() == render()
    assert openapi_main(["--check"]) == 0
