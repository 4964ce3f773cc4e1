"""Protocols: the same model over HTTP JSON, HTTP binary tensors and gRPC, driven by Triton's
perf_analyzer (closed loop, ``--concurrency-range``): items/s and p50/p99 latency.

It starts gunicorn on 127.0.0.1 serving one model, then for each protocol and concurrency level
runs ``scripts/perf_analyzer`` with ``-b ITEMS`` (items per request) and reads its CSV. HTTP JSON
is perf_analyzer with ``--input-tensor-format=json --output-tensor-format=json``; HTTP binary is
its default over HTTP; gRPC is ``-i grpc`` against the workers' gRPC port (skipped, and said
so, when the server does not answer gRPC). Writes the figures as JSON and a Markdown table.

    python -m benchmarks.protocols --out docs/benchmarks/protocols-feed-ranker-cpu.json \\
        --markdown docs/benchmarks/protocols-feed-ranker-cpu.md
    python -m benchmarks.protocols --concurrency 1 --interval-ms 1000 --protocols http-json  # smoke

Traffic goes only to 127.0.0.1; every perf_analyzer run is bounded (``--timeout``).
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import report, server
from tests.support.gunicorn import HOST, worker_items, worker_shares

PERF_ANALYZER = server.ROOT / "scripts" / "perf_analyzer"
#: Protocol -> perf_analyzer arguments beyond the URL.
PROTOCOLS: dict[str, list[str]] = {
    "http-json": ["-i", "http", "--input-tensor-format=json", "--output-tensor-format=json"],
    "http-binary": ["-i", "http"],
    "grpc": ["-i", "grpc"],
}


def perf_analyzer_options(parser: argparse.ArgumentParser, stability: float) -> None:
    """The perf_analyzer options of this benchmark and :mod:`benchmarks.grpc_ceiling`."""
    parser.add_argument("--items", type=int, default=8, help="items (rows) per request: perf_analyzer -b")
    parser.add_argument("--concurrency", type=server.levels, default=[1, 8, 64])
    parser.add_argument("--interval-ms", type=int, default=5000, help="perf_analyzer --measurement-interval")
    parser.add_argument(
        "--stability", type=float, default=stability, help="perf_analyzer --stability-percentage"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per perf_analyzer run")


def perf_analyzer(
    url: str, protocol: str, model: str, *options: str, timeout: float
) -> subprocess.CompletedProcess[str]:
    """One ``scripts/perf_analyzer`` run against ``url`` over ``protocol``, its output captured; one
    that runs past ``timeout`` seconds is killed and reported with exit status 124 and the output
    it had written."""
    command = [str(PERF_ANALYZER), "-m", model, "-u", url, *PROTOCOLS[protocol], *options]
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:

        def text(out: bytes | str | None) -> str:
            return out.decode(errors="replace") if isinstance(out, bytes) else out or ""

        output = f"{text(exc.stdout)}{text(exc.stderr)}\n(killed after {timeout:.0f} s)"
        return subprocess.CompletedProcess(command, 124, output, "")


def run_level(
    url: str, protocol: str, model: str, concurrency: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One perf_analyzer measurement; items/s and latencies (ms) from its CSV, or ``error``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "perf.csv"
        done = perf_analyzer(
            url, protocol, model, "-b", str(args.items), "--concurrency-range", str(concurrency),
            "--measurement-interval", str(args.interval_ms), "--stability-percentage", str(args.stability),
            "-f", str(out), timeout=args.timeout,
        )  # fmt: skip
        if done.returncode != 0 or not out.exists():
            tail = (done.stdout + done.stderr)[-1500:]
            return {"concurrency": concurrency, "error": f"perf_analyzer exit {done.returncode}: {tail}"}
        with out.open() as f:
            row = next(csv.DictReader(f))
    return {
        "concurrency": concurrency,
        "items_per_s": float(row["Inferences/Second"]),
        "p50_ms": float(row["p50 latency"]) / 1000.0,
        "p99_ms": float(row["p99 latency"]) / 1000.0,
    }


def rows_table(rows: dict[str, list[dict[str, Any]]]) -> str:
    """Protocol, concurrency, items/s, p50 and p99 ms per measured level, and each worker's share
    of the items where the run measured it (perf_analyzer's counts include its warm-up)."""
    shares = any("worker_share" in r for levels in rows.values() for r in levels)

    def share(r: dict[str, Any]) -> tuple[str, ...]:
        return (report.shares(r.get("worker_share", {})),) if shares else ()

    def figures(r: dict[str, Any]) -> tuple[str, ...]:
        if "error" in r:
            return ("failed", "", "")
        return (f"{r['items_per_s']:.0f}", f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}")

    lines = [(p, r["concurrency"], *figures(r), *share(r)) for p, levels in rows.items() for r in levels]
    header = ("protocol", "concurrency", "items/s", "p50 ms", "p99 ms")
    if shares:
        return report.table((*header, "share of items per worker"), lines, "lrrrrl")
    return report.table(header, lines, "lrrrr")


def markdown(result: dict[str, Any]) -> str:
    """A caption, the table, and the ratios to HTTP JSON at the highest concurrency."""
    parts = [
        f"**{result['model']}** on {report.machine_label()}, {result['workers']} worker(s), "
        f"{result['items_per_request']} items/request, perf_analyzer {result['interval_ms']} ms windows "
        f"({result['date']}).",
        rows_table(result["protocols"]),
    ]
    if result.get("ratios"):
        shown = ", ".join(f"{p} {r:.2f}x" for p, r in result["ratios"].items())
        parts.append(f"items/s relative to HTTP JSON at concurrency {max(result['concurrency'])}: {shown}.")
    parts += [f"{protocol}: not measured ({why})." for protocol, why in result.get("skipped", {}).items()]
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, start the server, measure, write the results."""
    parser = server.parser(__doc__, model=server.RANKER)
    perf_analyzer_options(parser, stability=10.0)
    parser.add_argument("--protocols", type=server.comma_list(PROTOCOLS), default=list(PROTOCOLS))
    parser.add_argument("--out", type=Path, help="JSON file for the results")
    parser.add_argument("--markdown", type=Path, help="Markdown file for the table")
    args = parser.parse_args(argv)

    subprocess.run([str(PERF_ANALYZER), "--setup"], check=True, stdout=subprocess.DEVNULL)
    result = report.record(
        model=args.model, workers=args.workers, items_per_request=args.items, interval_ms=args.interval_ms,
        concurrency=args.concurrency, protocols={}, skipped={},
    )  # fmt: skip
    with (
        tempfile.TemporaryDirectory() as tmp,
        server.start(Path(tmp), args.repository, args.model, args.workers) as srv,
    ):
        srv.wait_ready(120, count=args.workers)
        print(f"server ready: {len(srv.workers())} worker(s)", flush=True)
        for protocol in args.protocols:
            url = srv.grpc_url if protocol == "grpc" else f"{HOST}:{srv.port}"
            if protocol == "grpc":
                probe = perf_analyzer(
                    url, protocol, args.model, "--concurrency-range", "1", "--measurement-interval", "200",
                    "--stability-percentage", "999", timeout=args.timeout,
                )  # fmt: skip
                if probe.returncode != 0:
                    result["skipped"][protocol] = f"no gRPC answer on {url}"
                    print(f"{protocol}: skipped, no gRPC answer on {url}", flush=True)
                    continue
            rows = []
            for c in args.concurrency:
                print(f"{protocol}: concurrency {c} ...", flush=True)
                before = worker_items(srv.scrape())
                row = run_level(url, protocol, args.model, c, args)
                row["worker_share"] = worker_shares(before, worker_items(srv.scrape()))
                print(f"{protocol}: {row}", flush=True)
                rows.append(row)
            result["protocols"][protocol] = rows
    result["load_average_at_end"] = report.machine()["load_average"]
    base = {r["concurrency"]: r for r in result["protocols"].get("http-json", []) if "error" not in r}
    top = max(args.concurrency)
    if top in base:
        result["ratios"] = {
            p: row["items_per_s"] / base[top]["items_per_s"]
            for p, rows in result["protocols"].items()
            for row in rows
            if p != "http-json" and row["concurrency"] == top and "error" not in row
        }
    table = markdown(result)
    report.write_json(args.out, result)
    report.write_text(args.markdown, table)
    print(table)


if __name__ == "__main__":
    main()
