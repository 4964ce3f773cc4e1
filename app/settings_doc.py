"""Render the settings as the README's configuration table.

``python -m app.settings_doc`` prints it; ``--write`` replaces the table between
the ``settings-table`` markers in README.md.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from app.settings import ENV_PREFIX, Settings

README = Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(r"(<!-- settings-table:[^\n]*-->\n).*?(\n<!-- /settings-table -->)", re.S)


def settings_table() -> str:
    """A Markdown table: variable, default, description; one row per ``Settings`` field."""
    rows = ["| Variable | Default | Description |", "| --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        default = field.default
        shown = "(unset)" if default is None else f"`{default}`"
        if name == "model_repository":
            shown = "`model_repository`"
        rows.append(f"| `{ENV_PREFIX}{name.upper()}` | {shown} | {field.description} |")
    return "\n".join(rows)


def write_readme(path: Path = README) -> None:
    """Replace the table between the README's ``settings-table`` markers."""
    text = path.read_text(encoding="utf-8")
    path.write_text(_BLOCK.sub(lambda m: m[1] + settings_table() + m[2], text), encoding="utf-8")


if __name__ == "__main__":
    if "--write" in sys.argv:
        write_readme()
    else:
        print(settings_table())
