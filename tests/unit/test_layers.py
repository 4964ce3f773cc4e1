"""The serving core, the layers below it and the gRPC front end know no HTTP framework: no module
under app/serving, app/models, app/protocols, app/handlers, app/grpc or app/observability imports
aiohttp (an ``import`` or ``from ... import`` anywhere in the module, inside functions and
``TYPE_CHECKING`` blocks included). The HTTP front end (app/http, app/main.py) and the process
layer (app/server) hold the aiohttp side."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.gunicorn import ROOT

PURE = ("app/serving", "app/models", "app/protocols", "app/handlers", "app/grpc", "app/observability")


def imported_modules(source: str, filename: str = "<source>") -> set[str]:
    """Every module an ``import`` or ``from`` statement of ``source`` names (relative imports
    as written, with their leading dots)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.add("." * node.level + (node.module or ""))
    return found


def imports_aiohttp(source: str, filename: str = "<source>") -> bool:
    """True when ``source`` imports aiohttp or one of its submodules."""
    return any(m == "aiohttp" or m.startswith("aiohttp.") for m in imported_modules(source, filename))


def test_the_check_sees_every_form_of_import_and_ignores_text() -> None:
    assert imports_aiohttp("import aiohttp")
    assert imports_aiohttp("from aiohttp import web")
    assert imports_aiohttp("import aiohttp.web as w")
    assert imports_aiohttp("def f():\n    from aiohttp.typedefs import Handler\n")
    assert imports_aiohttp(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from aiohttp import web\n"
    )
    assert not imports_aiohttp(
        '"""No aiohttp here: ``python -m aiohttp.web``."""\n# from aiohttp import web\n'
    )
    assert not imports_aiohttp("import aiohttp_cors_like")


def test_the_serving_core_and_the_layers_below_it_import_no_aiohttp() -> None:
    paths = [path for folder in PURE for path in sorted((ROOT / folder).rglob("*.py"))]
    assert any(path.name == "core.py" for path in paths)  # the folders were found
    offenders = [
        str(Path(path).relative_to(ROOT)) for path in paths if imports_aiohttp(path.read_text(), str(path))
    ]
    assert not offenders, f"these modules import aiohttp: {offenders}"
