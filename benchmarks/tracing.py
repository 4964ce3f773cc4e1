"""What tracing costs: this checkout's server with OpenTelemetry tracing off, on with every request
sampled, and on with 1 % of the requests sampled (``parentbased_traceidratio``, the usual
production setting), spans exported over OTLP/HTTP to a receiver on 127.0.0.1 (a process of its
own that reads and drops them), in alternating rounds, with the regression check's load
(:mod:`benchmarks.regression`: 2 workers, the feed-ranker, V2 JSON of one item; c = 1 p50 and
c = 64 items/s); the medians compared.

    python -m benchmarks.tracing --rounds 6 --out docs/benchmarks/tracing-cpu.json

Traffic goes only to 127.0.0.1; every run is bounded by ``--seconds``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from benchmarks import report, server
from benchmarks.regression import measure


class _Drop(BaseHTTPRequestHandler):
    """An OTLP/HTTP endpoint that reads each export and answers 200."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def _receive(ports: multiprocessing.Queue[int]) -> None:  # the receiver's process
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), _Drop)
    ports.put(receiver.server_address[1])
    receiver.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=8.0, help="per concurrency level")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    ports: multiprocessing.Queue[int] = multiprocessing.Queue()
    receiver = multiprocessing.Process(target=_receive, args=(ports,), daemon=True)
    receiver.start()
    on = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{ports.get(timeout=30)}/v1/traces",
    }
    sides: dict[str, dict[str, str]] = {
        "off": {},
        "on, 100 % sampled": {**on, "OTEL_TRACES_SAMPLER": "always_on"},
        "on, 1 % sampled": {
            **on,
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "0.01",
        },
    }
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for turn in range(args.rounds):
        order = list(sides.items())[turn % 3 :] + list(sides.items())[: turn % 3]  # each side first in turn
        for name, env in order:
            rounds[name].append(measure(server.ROOT, args.seconds, env))
            print(name, rounds[name][-1], flush=True)
    receiver.terminate()
    medians = {
        name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in rounds.items()
    }
    result: dict[str, Any] = report.record(rounds=rounds, medians=medians)
    rows = [(name, m["c1_p50_ms"], m["c64_items_per_s"]) for name, m in medians.items()]
    print(report.table(("tracing", "c = 1 p50 ms (median)", "c = 64 items/s (median)"), rows, "lrr"))
    report.write_json(args.out, result)


if __name__ == "__main__":
    main()
