"""``python -m gpu_stat``: the GPUs this process would see, as a table or as JSON.

Exits 0 also without NVML (saying so on stderr; ``--json`` prints ``[]``), so scripts and
health checks can run it anywhere; 2 for a malformed fake-NVML file or bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

from gpu_stat.query import backend_name, query_gpus
from gpu_stat.snapshot import GpuInfo, NvmlUnavailable

_MIB = 2**20


def _rows(gpus: Sequence[GpuInfo]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for gpu in gpus:
        for unit, label in [(gpu, str(gpu.index))] + [
            (m, f"{gpu.index}.mig{m.index}") for m in gpu.mig_instances
        ]:
            procs = "n/a" if unit.processes is None else " ".join(
                str(p.pid) for p in unit.processes
            ) or "-"
            util = "n/a" if unit.utilization_percent is None else f"{unit.utilization_percent}%"
            rows.append(
                (
                    label,
                    str(unit.nvml_index),
                    unit.uuid,
                    unit.name,
                    f"{unit.memory_used // _MIB}/{unit.memory_total // _MIB} MiB",
                    f"{unit.memory_free // _MIB} MiB",
                    util,
                    procs,
                )
            )
    return rows


def format_table(gpus: Sequence[GpuInfo]) -> str:
    """A fixed-width table, one line per GPU and per MIG instance."""
    header = ("IDX", "NVML", "UUID", "NAME", "USED/TOTAL", "FREE", "UTIL", "PIDS")
    rows = [header, *_rows(gpus)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_stat", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print a JSON list of GPUs")
    parser.add_argument(
        "--all", action="store_true", help="ignore CUDA_VISIBLE_DEVICES and list every GPU"
    )
    args = parser.parse_args(argv)
    try:
        gpus = query_gpus(respect_visible_devices=not args.all)
    except NvmlUnavailable as exc:
        print(f"NVML unavailable: {exc}", file=sys.stderr)
        if args.json:
            print("[]")
        return 0
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([dataclasses.asdict(g) for g in gpus], indent=2))
    else:
        print(f"backend: {backend_name()}")
        print(format_table(gpus) if gpus else "no GPU visible")
    return 0


if __name__ == "__main__":
    sys.exit(main())
