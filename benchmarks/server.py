"""The server under measurement: start it as a benchmark wants it, and the command-line options
that every benchmark which starts one shares.

The launcher is the tests' (:class:`tests.support.gunicorn.Gunicorn`): gunicorn on a free
127.0.0.1 port with a run directory of its own, ready when every worker's state file says so.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from tests.support.gunicorn import ROOT, Gunicorn

__all__ = [
    "DEMO_REPOSITORY", "MINILM", "OPTIONS", "RANKER", "ROOT", "comma_list", "levels", "options", "parser",
    "start",
]  # fmt: skip

DEMO_REPOSITORY = ROOT / "model_repository"
MINILM, RANKER = "all-MiniLM-L6-v2", "feed-ranker"


def start(
    tmp: Path,
    repository: Path,
    models: str,
    workers: int,
    env: Mapping[str, str] | None = None,
    *,
    root: Path = ROOT,
    config: str | Path = "gunicorn.conf.py",
) -> Gunicorn:
    """gunicorn on 127.0.0.1 serving ``models`` (comma-separated; "" = all) of ``repository``
    with ``workers`` workers (on a GPU host: ``workers`` per GPU, ``SCORING_MAX_PROCESSES_PER_GPU``,
    so that ``wait_ready(count=workers)`` is met there too), access log off. ``SCORING_*`` settings
    of this process's environment pass through (e.g. ``SCORING_MAX_PROCESSES_PER_GPU``,
    ``SCORING_TORCH_THREADS``), ``env`` over them; ``root``: the checkout whose server runs. Not
    yet ready: call ``wait_ready``."""
    settings = {
        "SCORING_MODEL_REPOSITORY": str(repository),
        "SCORING_MODELS": models,
        "SCORING_WORKERS": str(workers),
        "SCORING_MAX_PROCESSES_PER_GPU": os.environ.get("SCORING_MAX_PROCESSES_PER_GPU", str(workers)),
        "SCORING_ACCESS_LOG": "",
        "SCORING_LOG_LEVEL": "warning",
        **(env or {}),
    }
    return Gunicorn(
        tmp, settings, clean_env=False, torch_threads=None, drain_grace_s=None, root=root, config=config
    )


def parser(
    doc: str | None,
    *,
    model: str | None = None,
    models: str | None = None,
    torch_threads: int | None = None,
) -> argparse.ArgumentParser:
    """The argument parser of a benchmark that starts the server: ``doc`` (its docstring) as
    its help, and the options such benchmarks share: ``--repository`` (default: the demo one),
    ``--workers`` (default 2), and, where a default is given, ``--model`` (one model),
    ``--models`` (comma-separated) and ``--torch-threads``."""
    result = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    result.add_argument("--repository", type=Path, default=DEMO_REPOSITORY)
    if model is not None:
        result.add_argument("--model", default=model)
    if models is not None:
        result.add_argument("--models", type=comma_list(), default=models.split(","))
    result.add_argument("--workers", type=int, default=2)
    if torch_threads is not None:
        result.add_argument("--torch-threads", type=int, default=torch_threads)
    return result


def comma_list(known: Iterable[str] | None = None) -> Callable[[str], list[str]]:
    """An argparse ``type``: a comma-separated list of values, each one of ``known`` where given
    (argparse reports any other as a usage error)."""
    allowed = None if known is None else list(known)

    def parse(text: str) -> list[str]:
        values = [v for v in text.split(",") if v]
        unknown = sorted(set(values) - set(allowed)) if allowed is not None else []
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {allowed}")
        return values

    return parse


def levels(text: str) -> list[int]:
    """An argparse ``type``: comma-separated positive whole numbers (concurrency levels)."""
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected whole numbers, e.g. 1,4,16") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: levels must be positive")
    return values


#: The options the load benchmarks share, by name: (type, what it is); each benchmark gives its
#: own defaults (:func:`options`).
OPTIONS: dict[str, tuple[type, str]] = {
    "seconds": (float, "seconds a run"),
    "rounds": (int, "rounds of every configuration, in turn"),
    "concurrency": (int, "requests in flight"),
    "low": (int, "the low concurrency"),
    "high": (int, "the high concurrency"),
    "items": (int, "items (candidates) a request"),
    "documents": (int, "documents a request"),
    "words": (int, "words a document"),
    "tries": (int, "requests, one after another"),
    "requests": (int, "distinct requests cycled"),
    "deadline_ms": (float, "each request's deadline, ms (X-Request-Timeout-Ms)"),
    "late_ms": (float, "a 504 slower than this, ms, came after admission"),
}


def options(parser: argparse.ArgumentParser, **defaults: Any) -> argparse.ArgumentParser:
    """``parser`` with the shared options named in ``defaults`` (:data:`OPTIONS`: ``deadline_ms``
    is ``--deadline-ms``), each with its default, and ``--out`` (a JSON file for the figures)."""
    for name, default in defaults.items():
        kind, text = OPTIONS[name]
        flag = f"--{name.replace('_', '-')}"
        parser.add_argument(flag, type=kind, default=default, help=f"{text} (default {default})")
    parser.add_argument("--out", type=Path, help="JSON file for the figures")
    return parser
