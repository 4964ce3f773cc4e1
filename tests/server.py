"""Run a real gunicorn server on 127.0.0.1 for end-to-end tests (the shared harness's launcher)."""

from __future__ import annotations

import ssl
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from scripts import harness
from scripts.harness import ROOT, free_port, http, poll

__all__ = ["ROOT", "Gunicorn", "free_port", "http", "poll", "wait_for"]

T = TypeVar("T")


class Gunicorn(harness.Gunicorn):
    """:class:`scripts.harness.Gunicorn` with a clean environment and one torch thread per worker."""

    def __init__(
        self,
        tmp: Path,
        env: Mapping[str, str] | None = None,
        args: Sequence[str] | None = None,
        *,
        context: ssl.SSLContext | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(
            tmp, {"SCORING_TORCH_THREADS": "1", **(env or {})}, args, context=context, headers=headers
        )


def wait_for(predicate: Callable[[], T | None], timeout_s: float, what: str, srv: harness.Gunicorn) -> T:
    """:func:`scripts.harness.poll` that fails with ``srv``'s log tail."""
    return poll(predicate, timeout_s, what, diagnostics=srv.log_tail)
