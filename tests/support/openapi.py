"""The OpenAPI 3 document the server serves (app/openapi.json), for its tests."""

from __future__ import annotations

import json
from typing import Any

from tests.support.gunicorn import ROOT

SPEC_PATH = ROOT / "app" / "openapi.json"


def spec() -> dict[str, Any]:
    """app/openapi.json, freshly read (a test may change its copy)."""
    document: dict[str, Any] = json.loads(SPEC_PATH.read_text())
    return document
