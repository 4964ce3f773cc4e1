"""Worker states in ``<run dir>/workers/<pid>``: how workers coordinate boot, drain and recycle.

One small file per worker holding ``binding`` (waiting for a GPU slot, written by
``gunicorn.conf.py``'s ``post_fork``), ``booting`` (bound, importing), ``loading``, ``ready``
(warm and listening), ``draining`` (unready, still accepting) or ``stopping`` (listener closed,
finishing requests). The master removes it in ``child_exit``. Imported by the master (no torch,
no aiohttp). Load, which changes per request, lives in :mod:`app.server.loadtable` instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from gpu_stat.family import live_children

log = logging.getLogger(__name__)

STATES_DIR = "workers"
BINDING, BOOTING, LOADING = "binding", "booting", "loading"
READY, DRAINING, STOPPING = "ready", "draining", "stopping"


def states_dir(run_dir: str | os.PathLike[str]) -> Path:
    """Where the workers of the server with this run directory publish their state."""
    return Path(run_dir) / STATES_DIR


class SiblingStates:
    """This worker's state file, and a view of its siblings' (the master's other children).

    Args:
        directory: ``<run dir>/workers``; None disables the files (nothing to coordinate).
        pid: this worker's pid.
        ppid: the master's pid.
    """

    def __init__(self, directory: Path | None, pid: int, ppid: int) -> None:
        self.directory = directory
        self.pid = pid
        self.ppid = ppid
        self.state: str | None = None

    def publish(self, state: str) -> None:
        """Write this worker's state (best effort: a failure only weakens coordination)."""
        if state == self.state or self.directory is None:
            return
        self.state = state
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.directory / f".{self.pid}.tmp"
            tmp.write_text(state)
            tmp.replace(self.directory / str(self.pid))
        except OSError as exc:
            log.warning("cannot publish worker state %r in %s: %s", state, self.directory, exc)

    def siblings(self) -> dict[int, str]:
        """pid -> state of every other live worker (``binding`` when it has not said yet)."""
        states = {}
        for pid in live_children(self.ppid):  # gpu_stat.family: the one "my siblings" helper
            if pid == self.pid:
                continue
            state = BINDING
            if self.directory is not None:
                with contextlib.suppress(OSError):
                    state = (self.directory / str(pid)).read_text().strip() or BINDING
            states[pid] = state
        return states

    def replacement_booting(self) -> bool:
        """True while no other worker is ready and one is bound and still booting or loading."""
        states = set(self.siblings().values())
        return READY not in states and bool(states & {BOOTING, LOADING})

    def others_serving(self) -> bool:
        """True while another worker accepts requests (ready, or draining but still listening)."""
        return bool(set(self.siblings().values()) & {READY, DRAINING})

    def may_recycle(self) -> bool:
        """True when another worker is ready, or there is no other worker at all."""
        states = self.siblings()
        return not states or READY in states.values()
