#!/usr/bin/env python
"""Micro-benchmark of the load table (app.server.loadtable): ns per write and per look.

    python scripts/bench_loadtable.py [--slots 4] [--number 200000]

A "look" is what a worker does before an accept or a shed: read its own slot and its
siblings' and pick the least-loaded live one (app.server.balance.may_accept).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import timeit
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil

from app.server import balance
from app.server.loadtable import READY, LoadTable


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--slots", type=int, default=4, help="workers in the table")
    parser.add_argument("--number", type=int, default=200_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        table = LoadTable(tmp)
        pids = [os.getpid(), *[p for p in psutil.pids() if p != os.getpid()][: args.slots - 1]]
        slots = [table.claim(pid) for pid in pids]
        for slot in slots:
            table.set_state(slot, READY)
            table.beat(slot)
        me = slots[0]
        now = time.monotonic()
        n: int = args.number

        def best(statement: Callable[[], object]) -> float:  # timeit's advice: the minimum of repeats
            return float(min(timeit.repeat(statement, number=n, repeat=5))) / n

        figures = {
            "set_items (one pack_into)": best(lambda: table.set_items(me, 8)),
            "read one slot": best(lambda: table.read(slots[-1])),
            f"may_accept over {args.slots} slots": best(
                lambda: balance.may_accept(table.read(me), [table.read(s) for s in slots[1:]], now)
            ),
        }
        table.close()
    for name, seconds in figures.items():
        print(f"{name:32s} {seconds * 1e9:8.0f} ns")


if __name__ == "__main__":
    main()
