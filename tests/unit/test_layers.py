"""The layers of the house: imports flow down the documented order only (:data:`LAYERS`, with
the arrows the architecture forbids besides: :data:`FORBIDDEN`), and the serving core, the layers
below it and the gRPC front end know no HTTP framework: no module under app/serving, app/models,
app/protocols, app/handlers, app/grpc or app/observability imports aiohttp (an ``import`` or
``from ... import`` anywhere in the module, inside functions and ``TYPE_CHECKING`` blocks
included). The HTTP front end (app/http, app/main.py) and the process layer (app/server) hold
the aiohttp side."""

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


#: The rooms of app/ and gpu_stat/ from the top down (docs/architecture.md, *Tree*): a module
#: imports only from its own room or the rooms below it, type annotations included, so that
#: there is no import circle and the layers read as the architecture does.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("app/server",),
    ("app/main.py",),
    ("app/http",),
    ("app/grpc",),
    ("app/serving",),
    ("app/protocols", "app/handlers"),
    ("app/models",),
    ("app/observability", "app/onnx_session.py", "app/binding.py"),
    ("app/settings.py", "app/settings_doc.py", "app/errors.py", "app/datatypes.py", "app/__init__.py"),
    ("gpu_stat",),
)
#: Arrows the order would allow but the architecture does not: the process layer reaches the
#: HTTP front end only through the composition root (app/main.py), the HTTP front end never
#: starts gRPC, the serving core knows no handler.
FORBIDDEN = (("app/server", "app/http"), ("app/http", "app/grpc"), ("app/serving", "app/handlers"))


def room_of(path: str) -> str | None:
    """The room (a folder or a file of :data:`LAYERS`) a source path or dotted module is in."""
    path = path.replace(".", "/") if not path.endswith(".py") else path
    for layer in LAYERS:
        for room in layer:
            base = room[:-3] if room.endswith(".py") else room
            if path in (base, room) or path.startswith(base + "/"):
                return room
    return None


def level_of(room: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if room in layer)


def test_imports_flow_down_the_documented_order_only() -> None:
    sources = [
        p for top in ("app", "gpu_stat") for p in sorted((ROOT / top).rglob("*.py")) if "generated" not in p.parts
    ]
    wrong = []
    for path in sources:
        here = room_of(str(path.relative_to(ROOT)))
        assert here is not None, f"{path} is in no room of LAYERS"
        for module in imported_modules(path.read_text(), str(path)):
            if not module.startswith(("app", "gpu_stat")) or module.startswith("."):
                continue
            there = room_of(module)
            if there is None and module == "app":
                continue  # ``from app import errors`` names its module below
            if there is None or there == here:
                continue
            if level_of(there) < level_of(here) or any(
                here.startswith(a) and there.startswith(b) for a, b in FORBIDDEN
            ):
                wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not wrong, "imports against the documented order:\n" + "\n".join(wrong)


def test_the_check_finds_an_arrow_against_the_order() -> None:
    assert room_of("app/serving/unit.py") == "app/serving" and room_of("app.handlers.windows") == "app/handlers"
    assert level_of("app/serving") < level_of("app/models") < level_of("gpu_stat")
    assert ("app/serving", "app/handlers") in FORBIDDEN
