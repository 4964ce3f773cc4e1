#!/usr/bin/env python
"""Protocol benchmark: the same model over HTTP JSON, HTTP binary tensors and gRPC, driven by
Triton's perf_analyzer (closed loop, ``--concurrency-range``), items/s and p50/p99 latency.

It starts gunicorn on 127.0.0.1 serving one model, then for each protocol and concurrency level
runs ``scripts/perf_analyzer`` with ``-b ITEMS`` (items per request) and reads its CSV. HTTP JSON
is perf_analyzer with ``--input-tensor-format=json --output-tensor-format=json``; HTTP binary is
its default over HTTP; gRPC is ``-i grpc`` against the worker's gRPC port (skipped, and said so,
when the server does not serve gRPC). Writes the figures as JSON and a Markdown table.

    python scripts/bench_protocols.py --out docs/benchmarks/protocols-feed-ranker-cpu.json \\
        --markdown docs/benchmarks/protocols-feed-ranker-cpu.md
    python scripts/bench_protocols.py --concurrency 1 --interval-ms 1000 --protocols http-json  # smoke

Traffic goes only to 127.0.0.1; every perf_analyzer run is bounded (``--timeout``).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PERF_ANALYZER = ROOT / "scripts" / "perf_analyzer"
sys.path.insert(0, str(ROOT))

from scripts import harness  # noqa: E402
from scripts.benchmark import server  # noqa: E402

#: Protocol -> perf_analyzer arguments beyond the URL.
PROTOCOLS: dict[str, list[str]] = {
    "http-json": ["-i", "http", "--input-tensor-format=json", "--output-tensor-format=json"],
    "http-binary": ["-i", "http"],
    "grpc": ["-i", "grpc"],
}


def run_level(
    url: str, protocol: str, model: str, items: int, concurrency: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One perf_analyzer measurement; items/s and latencies (ms) from its CSV."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "perf.csv"
        cmd = [
            str(PERF_ANALYZER),
            "-m",
            model,
            "-u",
            url,
            *PROTOCOLS[protocol],
            "-b",
            str(items),
            "--concurrency-range",
            str(concurrency),
            "--measurement-interval",
            str(args.interval_ms),
            "--stability-percentage",
            str(args.stability),
            "-f",
            str(out),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        if done.returncode != 0 or not out.exists():
            tail = (done.stdout + done.stderr)[-1500:]
            return {"concurrency": concurrency, "error": f"perf_analyzer exit {done.returncode}: {tail}"}
        row = next(csv.DictReader(out.open()))
    return {
        "concurrency": concurrency,
        "items_per_s": float(row["Inferences/Second"]),
        "p50_ms": float(row["p50 latency"]) / 1000.0,
        "p99_ms": float(row["p99 latency"]) / 1000.0,
    }


def markdown(result: dict[str, Any]) -> str:
    """The results as a Markdown table, and the ratios at the highest concurrency."""
    lines = [
        f"**{result['model']}** on {result['machine']}, {result['workers']} worker(s), "
        f"{result['items_per_request']} items/request, perf_analyzer {result['interval_ms']} ms windows "
        f"({result['date']}).",
        "",
        "| protocol | concurrency | items/s | p50 ms | p99 ms |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for protocol, rows in result["protocols"].items():
        for row in rows:
            if "error" in row:
                lines.append(f"| {protocol} | {row['concurrency']} | failed | | |")
            else:
                lines.append(
                    f"| {protocol} | {row['concurrency']} | {row['items_per_s']:.0f} "
                    f"| {row['p50_ms']:.2f} | {row['p99_ms']:.2f} |"
                )
    if result.get("ratios"):
        top = max(result["concurrency"])
        shown = ", ".join(f"{p} {r:.2f}x" for p, r in result["ratios"].items())
        lines += ["", f"items/s relative to HTTP JSON at concurrency {top}: {shown}."]
    for protocol, why in result.get("skipped", {}).items():
        lines += ["", f"{protocol}: not measured ({why})."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, start the server, measure, write the results."""
    parser = harness.benchmark_parser(__doc__, model="feed-ranker")
    parser.add_argument("--items", type=int, default=8, help="items (rows) per request: perf_analyzer -b")
    parser.add_argument("--concurrency", default="1,8,64")
    parser.add_argument("--protocols", default="http-json,http-binary,grpc")
    parser.add_argument("--interval-ms", type=int, default=5000, help="perf_analyzer --measurement-interval")
    parser.add_argument("--stability", type=float, default=10.0, help="perf_analyzer --stability-percentage")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per perf_analyzer run")
    parser.add_argument(
        "--grpc-port-env", default="SCORING_GRPC_PORT", help="setting that sets the gRPC port"
    )
    parser.add_argument("--out", type=Path, help="JSON file for the results")
    parser.add_argument("--markdown", type=Path, help="Markdown file for the table")
    parser.add_argument("--machine", default=f"{platform.node()} ({os.cpu_count()} CPUs, no GPU)")
    args = parser.parse_args(argv)

    subprocess.run([str(PERF_ANALYZER), "--setup"], check=True, stdout=subprocess.DEVNULL)
    levels = [int(c) for c in args.concurrency.split(",")]
    protocols = args.protocols.split(",")
    grpc_port = int(os.environ.get(args.grpc_port_env) or harness.free_port())
    result: dict[str, Any] = {
        "model": args.model,
        "machine": args.machine,
        "workers": args.workers,
        "items_per_request": args.items,
        "interval_ms": args.interval_ms,
        "concurrency": levels,
        "date": time.strftime("%Y-%m-%d"),
        "load_average_at_start": os.getloadavg()[0],
        "protocols": {},
        "skipped": {},
    }
    grpc_env = {args.grpc_port_env: str(grpc_port)}
    with (
        tempfile.TemporaryDirectory() as tmp,
        server(Path(tmp), args.repository, args.model, args.workers, grpc_env) as srv,
    ):
        srv.wait_ready(300, count=args.workers)
        for protocol in protocols:
            if protocol == "grpc":
                url = f"127.0.0.1:{grpc_port}"
                probe = subprocess.run(
                    [
                        str(PERF_ANALYZER),
                        "-m",
                        args.model,
                        "-u",
                        url,
                        "-i",
                        "grpc",
                        "--concurrency-range",
                        "1",
                        "--measurement-interval",
                        "200",
                        "--stability-percentage",
                        "999",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=args.timeout,
                )
                if probe.returncode != 0:
                    result["skipped"][protocol] = f"no gRPC answer on {url}"
                    print(f"{protocol}: skipped, no gRPC answer on {url}", flush=True)
                    continue
            else:
                url = f"{harness.HOST}:{srv.port}"
            rows = []
            for c in levels:
                row = run_level(url, protocol, args.model, args.items, c, args)
                print(f"{protocol}: {row}", flush=True)
                rows.append(row)
            result["protocols"][protocol] = rows
    result["load_average_at_end"] = os.getloadavg()[0]
    base = {r["concurrency"]: r for r in result["protocols"].get("http-json", []) if "error" not in r}
    top = max(levels)
    if top in base:
        result["ratios"] = {
            p: row["items_per_s"] / base[top]["items_per_s"]
            for p, rows in result["protocols"].items()
            for row in rows
            if p != "http-json" and row["concurrency"] == top and "error" not in row
        }
    table = markdown(result)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
