"""gunicorn config of :mod:`benchmarks.request_path`: the server's own ``gunicorn.conf.py``, plus a
``post_worker_init`` hook that records which of the server's source files run.

Every Python call in the worker (every thread) goes to a profile function; while recording it
keeps ``(file, function)`` of each call made in a file under ``app/`` or ``gpu_stat/``, and per
thread the order in which those files were entered (each call into a function of another file
than the last call's; a coroutine enters once, its resumptions by the event loop are not
calls), except the calls made by the worker's periodic tasks (the
tick that notifies gunicorn and publishes the load, the hung-inference watchdog, the GPU poller,
the boot heartbeat, the loop-lag sampler's timer) and the event loop's selector, which run
whether or not a request is served.
``SIGUSR2`` starts recording (everything emptied); the next one writes ``{"functions": [[file,
function], ...], "paths": [[file, ...] per thread]}`` as JSON to ``$REQUEST_PATH_OUT/<pid>.json``
and stops. Used for measurement only: never serve with it.
"""

from __future__ import annotations

import inspect
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
#: The event loop's own selector (``app.server.listener.ResumingSelector.select``): it runs on
#: every turn of the loop, whatever the loop serves; it is the loop, not the request's path.
LOOP = ("ResumingSelector", "select")
#: ``co_flags`` of a coroutine, generator or async generator: each resumption by the event loop
#: is a profiler "call" too, but not a call of the code: only its first one is an entry.
_SUSPENDS = inspect.CO_COROUTINE | inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR
_SOURCES = tuple(str(_ROOT / part) + os.sep for part in ("app", "gpu_stat"))


def post_worker_init(worker: Any) -> None:
    """Install the recorder (module docstring) in this worker."""
    seen: set[tuple[str, str]] = set()
    paths: dict[int, list[str]] = {}  # thread id -> the files it entered, in order
    started: set[int] = set()  # the coroutine frames already entered (a resumption is no entry)
    state = {"on": False}
    out = Path(os.environ["REQUEST_PATH_OUT"])

    def periodic(frame: FrameType | None) -> bool:
        if frame is not None and frame.f_code.co_qualname == ".".join(LOOP):
            return True
        while frame is not None:
            if frame.f_code.co_name in PERIODIC:
                return True
            frame = frame.f_back
        return False

    def enter(filename: str) -> None:
        path = paths.setdefault(threading.get_ident(), [])
        name = os.path.relpath(filename, _ROOT)
        if not path or path[-1] != name:
            path.append(name)

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if not state["on"] or event != "call":
            return
        if event == "return":
            return
        filename = frame.f_code.co_filename
        if filename.startswith(_SOURCES) and not periodic(frame):
            if frame.f_code.co_flags & _SUSPENDS:
                if id(frame) in started:
                    return
                started.add(id(frame))
            seen.add((os.path.relpath(filename, _ROOT), frame.f_code.co_name))
            enter(filename)

    def _usr2(signum: int, frame: FrameType | None) -> None:
        if state["on"]:
            state["on"] = False
            dump = {"functions": sorted(seen), "paths": [p for p in paths.values() if p]}
            (out / f"{os.getpid()}.json").write_text(json.dumps(dump))
        else:
            seen.clear()
            paths.clear()
            started.clear()
            state["on"] = True
            (out / f"{os.getpid()}.recording").touch()

    signal.signal(signal.SIGUSR2, _usr2)
    sys.setprofile(profile)
    threading.setprofile(profile)
