"""A feed request's shared part sent once: the demo feed-ranker's ``user`` input (``shared =
"repeat"``) sent as one row against the same request with the row repeated for every candidate.

One server (``--workers`` workers) serves the feed-ranker; each request is one user x
``--items`` candidates over V2 JSON (32 features a candidate, 32 for the user). Per round, a
closed loop of ``--seconds`` at ``--concurrency`` with the user repeated (what a Triton client
must send), then one with it sent once, from the same client (wrk when installed, else client
processes: ``benchmarks.loadgen``), the rounds alternating; printed per form: the medians over
rounds of items/s and p50, the ratio shared/repeated, and the request bytes. Before the runs the
two forms' answers are compared (equal to the bit).

    python -m benchmarks.shared_inputs --items 500 --concurrency 8 --seconds 10 --rounds 3 \\
        --out docs/benchmarks/shared-inputs-cpu.json

Traffic goes only to 127.0.0.1.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import driver, loadgen, report, server

FEATURES = USER = 32


def bodies(items: int, count: int, seed: int = 0) -> dict[str, list[bytes]]:
    """``count`` requests of one user x ``items`` candidates, in both forms: ``"repeated"`` (the
    user's row sent for each candidate) and ``"shared"`` (sent once, batch dimension 1)."""
    rng = random.Random(seed)
    out: dict[str, list[bytes]] = {"repeated": [], "shared": []}
    for _ in range(count):
        features = [round(rng.random(), 4) for _ in range(items * FEATURES)]
        user = [round(rng.random(), 4) for _ in range(USER)]
        for form, rows in (("repeated", items), ("shared", 1)):
            doc = {"inputs": [
                {"name": "features", "datatype": "FP32", "shape": [items, FEATURES], "data": features},
                {"name": "user", "datatype": "FP32", "shape": [rows, USER], "data": user * rows},
            ]}  # fmt: skip
            out[form].append(json.dumps(doc).encode())
    return out


def same_answers(url: str, forms: dict[str, list[bytes]]) -> None:
    """Both forms of the first request answer the same probabilities, bit for bit.

    Raises:
        AssertionError: they differ.
    """
    headers = dict(driver.JSON_HEADERS)
    answers = [driver.http("POST", url, forms[form][0], headers) for form in ("repeated", "shared")]
    assert all(status == 200 for status, _, _ in answers), [status for status, _, _ in answers]
    data = [body["outputs"][0]["data"] for _, _, body in answers]
    assert data[0] == data[1], "the shared form answered otherwise than the repeated one"


def main(argv: list[str] | None = None) -> None:
    parser = server.parser(__doc__)
    server.options(parser, items=500, concurrency=8, seconds=10.0, rounds=3, requests=16)
    args = parser.parse_args(argv)
    forms = bodies(args.items, args.requests)
    path = f"/v2/models/{server.RANKER}/infer"
    runs: dict[str, list[dict[str, Any]]] = {"repeated": [], "shared": []}
    with tempfile.TemporaryDirectory() as tmp, server.start(
        Path(tmp), args.repository, server.RANKER, args.workers
    ) as srv:
        srv.wait_ready(300, count=args.workers)
        same_answers(srv.url + path, forms)
        for _ in range(args.rounds):
            for form in ("repeated", "shared"):
                requests = [loadgen.Request(path, b) for b in forms[form]]
                if loadgen.wrk_available():
                    run = loadgen.run_wrk(srv.url, requests, args.concurrency, args.seconds)
                else:
                    run = loadgen.run_processes(srv.url, requests, args.concurrency, args.seconds)
                runs[form].append(run.figures(args.items))
    rows = []
    for form, figures in runs.items():
        row = {
            "form": form,
            "items_per_s": statistics.median(f["items_per_s"] for f in figures),
            "p50_ms": statistics.median(f["p50_ms"] for f in figures),
            "errors": sum(f["errors"] for f in figures),
            "request_bytes": statistics.mean(len(b) for b in forms[form]),
            "runs": figures,
        }
        rows.append(row)
        print(f"{form:9} {row['items_per_s']:9.0f} items/s  p50 {row['p50_ms']:7.1f} ms  "
              f"{row['request_bytes'] / 1024:6.1f} KiB a request  errors {row['errors']}")  # fmt: skip
    ratio = rows[1]["items_per_s"] / rows[0]["items_per_s"] if rows[0]["items_per_s"] else float("nan")
    print(f"shared / repeated: {ratio:.2f}x items/s")
    result = report.record(
        benchmark="shared_inputs", items=args.items, concurrency=args.concurrency, seconds=args.seconds,
        rounds=args.rounds, workers=args.workers, ratio=ratio, forms=rows,
    )  # fmt: skip
    report.write_json(args.out, result)


if __name__ == "__main__":
    main()
