"""README.md and docs/*.md name only what exists: every repository path (in prose, code spans,
code blocks and links), every ``python -m`` module of this repository, every ``#anchor`` of a
link to one of these pages, and every dotted name of the server's code (``app.serving.unit``,
``app.serving.unit.ServingUnit.infer``), which is also checked in the docstrings and comments of
app/ and gpu_stat/. The README's settings table is checked in tests/deploy/test_settings.py.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import io
import re
import tokenize
from functools import cache
from pathlib import Path

import pytest

from tests.support.gunicorn import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Top-level folders of the repository: a word starting with one of these and a slash is a path.
FOLDERS = (
    "app",
    "gpu_stat",
    "scripts",
    "benchmarks",
    "tests",
    "docs",
    "deploy",
    "proto",
    "model_repository",
    ".ci",
)
TOP_FILES = (
    "Dockerfile",
    "gunicorn.conf.py",
    "setup.py",
    "pyproject.toml",
    "README.md",
    ".dockerignore",
    ".gitignore",
)
#: Words shaped like paths that name something else.
NOT_PATHS = {"deploy/scoring-server"}  # kubectl's deployment/name in `kubectl rollout status`
_FOLDER = "|".join(re.escape(f) for f in FOLDERS)
_FILE = "|".join(re.escape(f) for f in TOP_FILES)
# Not after a letter, dot, slash or "<" (a URL's path, a placeholder such as <run dir>/workers);
# stops at what cannot be in a path here (spaces, quotes, "<" of a placeholder, "::" of a test id).
PATH = re.compile(rf"(?<![\w./<-])((?:{_FOLDER})/[\w./-]*)")
FILE = re.compile(rf"(?<![\w./<-])({_FILE})(?![\w-])")
MODULE = re.compile(r"python3? -m ((?:app|benchmarks|gpu_stat|tests)(?:\.\w+)*)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
#: A dotted name in one of the code packages: a module, optionally followed by attributes.
DOTTED = re.compile(r"(?<![\w./-])((?:app|gpu_stat|benchmarks)(?:\.[A-Za-z_]\w*)+)")
#: Endings that make a dotted word a file name, not a code name (``benchmarks.md``).
FILE_ENDINGS = {"md", "py", "json", "toml", "yaml", "yml", "svg", "png", "txt", "proto", "pt2", "onnx"}
SOURCES = sorted([*(ROOT / "app").rglob("*.py"), *(ROOT / "gpu_stat").rglob("*.py")])
HEADING = re.compile(r"^#{1,6} +(.+?) *$", re.M)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of ``page``: lower case, punctuation but ``-`` dropped, spaces
    as ``-``."""
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in HEADING.findall(page.read_text())}


def missing(page: Path, root: Path) -> list[str]:
    """What ``page`` names that does not exist under ``root``: repository paths, ``python -m``
    modules, and relative links (with their ``#anchor``, when they point at a Markdown page)."""
    text = page.read_text(encoding="utf-8")
    absent = []
    for name in {p.rstrip(".") for p in PATH.findall(text)} - NOT_PATHS | set(FILE.findall(text)):
        if not (root / name).exists():
            absent.append(name)
    for module in set(MODULE.findall(text)):
        base = root.joinpath(*module.split("."))
        if not (base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()):
            absent.append(f"python -m {module}")
    for target in set(LINK.findall(text)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        unknown_anchor = bool(anchor) and linked.suffix == ".md" and anchor not in anchors(linked)
        if not linked.exists() or unknown_anchor:
            absent.append(target)
    return sorted(absent)


#: Modules whose import changes this process (the gunicorn master's configuration makes a run
#: directory and sets PROMETHEUS_MULTIPROC_DIR, which every later in-process app of this test
#: process would then refuse): their top-level names are read from the source instead.
NOT_IMPORTED = frozenset({"app.server.gunicorn_config"})


def top_level_names(module: str) -> set[str]:
    """The functions, classes and assigned names at the top of ``module``'s source."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    names: set[str] = set()
    for node in ast.parse(Path(spec.origin).read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


@cache
def resolves(name: str) -> bool:
    """Whether dotted ``name`` is a module of the repository, or a module and attributes of it
    (``app.serving.unit.ServingUnit.infer``). Modules are found without being imported; only a
    module whose attributes are named is imported."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        if any(module.startswith(f"{plain}.") for plain in NOT_IMPORTED):
            continue  # find_spec would import it to look for a submodule; it has none
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent is not a package
            found = False
        if not found:
            continue
        if i == len(parts):
            return True
        if module in NOT_IMPORTED:
            return len(parts) == i + 1 and parts[i] in top_level_names(module)
        target: object = importlib.import_module(module)
        for attribute in parts[i:]:
            if not hasattr(target, attribute):
                return False
            target = getattr(target, attribute)
        return True
    return False


def dotted_names(text: str) -> set[str]:
    """The dotted code names in ``text`` (file names such as ``benchmarks.md`` left out)."""
    return {name for name in DOTTED.findall(text) if name.rsplit(".", 1)[1] not in FILE_ENDINGS}


def prose_of(source: Path) -> str:
    """The docstrings, other strings and comments of a Python file."""
    tokens = tokenize.generate_tokens(io.StringIO(source.read_text(encoding="utf-8")).readline)
    return "\n".join(t.string for t in tokens if t.type in (tokenize.STRING, tokenize.COMMENT))


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_path_command_and_link_named_exists(page: Path) -> None:
    absent = missing(page, ROOT)
    absent += sorted(n for n in dotted_names(page.read_text(encoding="utf-8")) if not resolves(n))
    assert not absent, f"{page.relative_to(ROOT)} names what does not exist: {absent}"


def test_every_code_name_in_docstrings_and_comments_exists() -> None:
    """A module, class or function named in the server's own docstrings and comments exists
    (a rename or a removal that leaves its old name behind fails here)."""
    absent = {
        f"{source.relative_to(ROOT)}: {name}"
        for source in SOURCES
        for name in dotted_names(prose_of(source))
        if not resolves(name)
    }
    assert not absent, f"names that do not exist: {sorted(absent)}"


def test_a_dotted_name_that_does_not_resolve_is_reported() -> None:
    """The check itself: modules, attributes, and both gone."""
    text = (
        "see app.serving.unit, app.serving.unit.ServingUnit.infer, the `app.main:create_app` "
        "factory, app.serving.batcher (gone), app.serving.unit.DynamicBatcher and "
        "app.server.loadboard.LoadTable; e.g. app. and apps.x are not names, nor docs/benchmarks.md"
    )
    names = dotted_names(text)
    assert names == {
        "app.serving.unit", "app.serving.unit.ServingUnit.infer", "app.main", "app.serving.batcher",
        "app.serving.unit.DynamicBatcher", "app.server.loadboard.LoadTable",
    }  # fmt: skip
    assert sorted(n for n in names if not resolves(n)) == [
        "app.server.loadboard.LoadTable", "app.serving.batcher", "app.serving.unit.DynamicBatcher",
    ]  # fmt: skip


def test_a_removed_path_is_reported(tmp_path: Path) -> None:
    """The check itself: on a copy of a page's words, what is gone is named."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "serve").touch()
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "soak.py").touch()
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## A section\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "Run `scripts/serve`, then `scripts/gone --x`; see scripts/serve.\n"
        "```bash\npython -m benchmarks.soak --json out.json\npython -m benchmarks.vanished\n```\n"
        "[here](other.md#a-section), [there](other.md#no-such-section), [lost](lost.md), "
        "[web](https://example.com/docs/x), `<run dir>/workers/<pid>`, `deploy/pools/<pool>/`.\n"
    )
    assert missing(page, tmp_path) == [
        "deploy/pools/",
        "lost.md",
        "other.md#no-such-section",
        "python -m benchmarks.vanished",
        "scripts/gone",
    ]
