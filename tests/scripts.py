"""Import the command-line scripts of ``scripts/`` (not a package; some have no .py suffix)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from types import ModuleType

from tests.server import ROOT


def load_script(name: str, filename: str) -> ModuleType:
    """``scripts/<filename>`` as module ``name`` (registered in sys.modules for dataclasses)."""
    path = ROOT / "scripts" / filename
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    return module
