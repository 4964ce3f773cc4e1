"""Micro-benchmark of the load table (app.server.balance): time per write, per read of a slot,
and per accept decision, measured by pyperf (calibrated loops, several worker processes, mean
and standard deviation).

    python -m benchmarks.loadtable                      # pyperf's default rigour
    python -m benchmarks.loadtable --fast --slots 8     # a quick look; pyperf's options apply
    python -m benchmarks.loadtable -o loadtable.json    # pyperf's JSON (python -m pyperf show ...)

A "look" is what a worker does before an accept or a shed: read its own slot and its siblings'
and pick the least-loaded live one (``app.server.balance.may_accept``).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable

import psutil
import pyperf

from app.server.balance import READY, LoadTable, may_accept


def timer(operation: Callable[[], object]) -> Callable[[int], float]:
    """pyperf's time function for ``operation``: seconds for ``loops`` calls."""

    def run(loops: int) -> float:
        start = time.perf_counter()
        for _ in range(loops):
            operation()
        return time.perf_counter() - start

    return run


def main() -> None:
    runner = pyperf.Runner(
        program_args=("-m", "benchmarks.loadtable"),
        add_cmdline_args=lambda cmd, args: cmd.extend(["--slots", str(args.slots)]),
    )
    runner.argparser.add_argument("--slots", type=int, default=4, help="workers in the table")
    args = runner.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        table = LoadTable(tmp)
        pids = [os.getpid(), *[p for p in psutil.pids() if p != os.getpid()][: args.slots - 1]]
        slots = [table.claim(pid) for pid in pids]
        for slot in slots:
            table.set_state(slot, READY)
            table.beat(slot)
        me, now = slots[0], time.monotonic()
        runner.bench_time_func("set_items (one pack_into)", timer(lambda: table.set_items(me, 8)))
        runner.bench_time_func("read one slot", timer(lambda: table.read(slots[-1])))
        runner.bench_time_func(
            f"may_accept over {args.slots} slots",
            timer(lambda: may_accept(table.read(me), [table.read(s) for s in slots[1:]], now)),
        )
        table.close()


if __name__ == "__main__":
    main()
