"""A model folder's JSON files (``config.json``, ``modules.json``, sentence-transformers' settings,
the tokenizer's ``tokenizer_config.json``...) read as the libraries read them: a file the folder
lacks is empty (each library has its defaults for it), a file that is not JSON is refused with
its path named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["read_json", "read_json_object"]


def read_json(path: Path) -> Any:
    """The JSON value ``path`` holds; ``{}`` where there is no such file.

    Raises:
        ValueError: the file is not valid JSON (the message names the file and where it fails).
    """
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def read_json_object(path: Path) -> dict[str, Any]:
    """:func:`read_json` of a file of settings: its object, or ``{}`` where it holds another value.

    Raises:
        ValueError: as :func:`read_json`.
    """
    value = read_json(path)
    return value if isinstance(value, dict) else {}
