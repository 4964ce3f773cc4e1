"""gunicorn config of :mod:`benchmarks.request_path`: the server's own ``gunicorn.conf.py``, plus a
``post_worker_init`` hook that records which of the server's source files run.

Every Python call in the worker (every thread) goes to a profile function; while recording it
keeps ``(file, function)`` of each call made in a file under ``app/`` or ``gpu_stat/``, except
the calls made by the worker's periodic tasks (the tick that notifies gunicorn and publishes the
load, the hung-inference watchdog, the GPU poller, the boot heartbeat, the loop-lag sampler's
timer), which run whether or not a request is served. ``SIGUSR2`` starts recording (the set
emptied); the next one writes the set as JSON to ``$REQUEST_PATH_OUT/<pid>.json`` and stops.
Used for measurement only: never serve with it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
exec(compile((_ROOT / "gunicorn.conf.py").read_text(), str(_ROOT / "gunicorn.conf.py"), "exec"))

#: Functions whose calls (and everything they call) are the worker's background, not a request.
PERIODIC = frozenset(
    {
        "_tick_until_stopped",
        "_boot_heartbeat",
        "_watch_inference",
        "watch_inference",
        "poll_gpus",
        "_usr2",
        "_publish_load",
        "_serve",
        "_tick",  # app.observability.looplag.LoopLag's timer
    }
)
_SOURCES = tuple(str(_ROOT / part) + os.sep for part in ("app", "gpu_stat"))


def post_worker_init(worker: Any) -> None:
    """Install the recorder (module docstring) in this worker."""
    seen: set[tuple[str, str]] = set()
    state = {"on": False}
    out = Path(os.environ["REQUEST_PATH_OUT"])

    def periodic(frame: FrameType | None) -> bool:
        while frame is not None:
            if frame.f_code.co_name in PERIODIC:
                return True
            frame = frame.f_back
        return False

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if not state["on"] or event != "call":
            return
        filename = frame.f_code.co_filename
        if filename.startswith(_SOURCES) and not periodic(frame):
            seen.add((os.path.relpath(filename, _ROOT), frame.f_code.co_name))

    def _usr2(signum: int, frame: FrameType | None) -> None:
        if state["on"]:
            state["on"] = False
            rows = sorted(seen)
            (out / f"{os.getpid()}.json").write_text(json.dumps(rows))
        else:
            seen.clear()
            state["on"] = True
            (out / f"{os.getpid()}.recording").touch()

    signal.signal(signal.SIGUSR2, _usr2)
    sys.setprofile(profile)
    threading.setprofile(profile)
