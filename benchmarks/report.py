"""How a benchmark writes what it measured: a JSON record (with the machine it ran on and the
date) and Markdown tables for docs/benchmarks.md."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import gpu_stat


def gpus() -> list[str]:
    """The names of the GPUs NVML sees (``gpu_stat``; ``CUDA_VISIBLE_DEVICES`` applied), none
    without NVML."""
    try:
        return [gpu.name for gpu in gpu_stat.query_gpus()]
    except gpu_stat.NvmlUnavailable:
        return []


def machine() -> dict[str, Any]:
    """Where a benchmark ran: host name, CPU count, GPUs, platform, Python version and the load
    average (1 min) now."""
    return {
        "node": platform.node(),
        "cpus": os.cpu_count(),
        "gpus": gpus(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average": os.getloadavg()[0],
    }


def machine_label() -> str:
    """This machine for a table's caption, e.g. ``vm (2 CPUs, no GPU)``."""
    found = gpus()
    gpu = f"{len(found)} x {found[0]}" if found else "no GPU"
    return f"{platform.node()} ({os.cpu_count()} CPUs, {gpu})"


def record(**figures: Any) -> dict[str, Any]:
    """A JSON record: ``figures`` after the date and :func:`machine`."""
    return {"date": time.strftime("%Y-%m-%d"), "machine": machine(), **figures}


def write_json(path: Path | None, result: Mapping[str, Any]) -> None:
    """Write ``result`` as indented JSON to ``path`` (its folder made), or nothing if None."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, default=str) + "\n")


def write_text(path: Path | None, text: str) -> None:
    """Write ``text`` and a newline to ``path`` (its folder made), or nothing if None."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")


def publish(path: Path, result: Mapping[str, Any], tables: str) -> None:
    """Write ``result`` as JSON to ``path`` and ``tables`` beside it (``.md``), and print the
    tables."""
    write_json(path, result)
    write_text(path.with_suffix(".md"), tables)
    print(tables)


def table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str) -> str:
    """A Markdown table: ``header``, then one line per row (cells as ``str()``); ``align`` has
    one letter per column, ``l`` (text) or ``r`` (numbers).

    Raises:
        ValueError: ``align`` does not name every column, or has another letter.
    """
    if len(align) != len(header) or set(align) - {"l", "r"}:
        raise ValueError(f"align {align!r}: one of l/r per column of {list(header)}")
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def shares(share: Mapping[Any, float]) -> str:
    """Each worker's share of the items, e.g. ``48 % / 52 %``."""
    return " / ".join(f"{100 * s:.0f} %" for s in share.values())
