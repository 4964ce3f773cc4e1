"""Load a user tool of ``scripts/`` by its path, for its unit tests.

``scripts/`` is a folder of commands, not a package (some have no ``.py`` suffix), so a test
loads the file it tests rather than importing it.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from types import ModuleType

from tests.support.gunicorn import ROOT


def load_tool(filename: str) -> ModuleType:
    """``scripts/<filename>`` as a module named after the file (registered in ``sys.modules``,
    which dataclasses need).

    Raises:
        FileNotFoundError: no such tool.
    """
    path = ROOT / "scripts" / filename
    name = path.name.removesuffix(".py")
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    return module
