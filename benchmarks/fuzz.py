"""Fuzzing every HTTP route and every gRPC method of a real server (docs/reliability.md, *Fuzzing*):
no server error, no hang, no dead worker, a model reached through every route that serves
inference; the cases sent and the 200s per route.

Starts gunicorn on 127.0.0.1 with the stress run's models (``benchmarks.stress.repository``:
feed-ranker, all-MiniLM-L6-v2 with the response cache, a BERT classifier and cross-encoder, a
decoder classifier in pieces, a causal LM, a causal reranker), ``--workers`` workers and
explicit model control, then:

1. **HTTP**: schemathesis against app/openapi.json narrowed to the server's models (the path's
   ``name`` and the body's ``model``), with a valid example per request body and OpenAPI links
   for its stateful phase (the repository index to each model's operations, an unload or load
   to the same model's inference and the opposite call: ``tests.support.fuzz.fuzz_document``),
   every phase (examples, coverage, fuzzing, stateful); checks: no server error (503 and 504
   expected), documented statuses and content types, every request answered within 10 s; each
   route that takes an inference request body (:data:`EXAMPLES`' schemas) answered 200 at least
   once. ``--max-time`` repeats the fuzzing and stateful phases until it is spent.
2. **gRPC**: for each method of ``inference.GRPCInferenceService``, ``--grpc-examples``
   hypothesis-drawn messages of its request type (any subset of fields, any value of each
   field's type, model names and datatypes the server knows half the time) and as many arbitrary
   byte strings: never INTERNAL, UNKNOWN or DATA_LOSS, always an answer from the server (its
   ``x-request-id`` trailer) within 30 s (``tests.support.fuzz.fuzz_grpc``).
3. The workers that served at the start still serve (none died or was replaced) and answer.

    python -m benchmarks.fuzz --max-time 1800 --grpc-examples 5000 --json fuzz.json   # the long run
    python -m benchmarks.fuzz --max-examples 5 --grpc-examples 20                     # a smoke run

Exit status 1 when anything failed. Traffic goes only to 127.0.0.1; it stops by itself.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import report
from benchmarks.stress import repository, target
from benchmarks.stress.repository import CAUSAL_RR, CE, CLF, LM, MINILM, MODELS, RANKER
from tests.support.fuzz import fuzz_document, fuzz_grpc, routes_taking, run_schemathesis
from tests.support.gunicorn import Gunicorn

#: A valid request body per request schema of app/openapi.json, for the stress repository.
EXAMPLES = {
    "InferenceRequest": {
        "inputs": [{"name": "features", "shape": [1, 32], "datatype": "FP32", "data": [0.5] * 32}]
    },
    "PredictRequest": {"instances": [[0.5] * 32]},
    "EmbeddingRequest": {"model": MINILM, "input": ["a short post about the weather"]},
    "RerankRequest": {"model": CE, "query": "weather at sea", "documents": ["storms at sea", "a recipe"]},
    "ClassifyRequest": {"model": CLF, "input": ["you are all wonderful people"]},
    "ScoreRequest": {"model": CAUSAL_RR, "text_1": "weather at sea", "text_2": ["storms at sea", "a recipe"]},
    "CompletionRequest": {
        "model": LM,
        "prompt": ["A post to score."],
        "echo": True,
        "max_tokens": 0,
        "logprobs": 1,
    },
}


def fuzz(
    srv: Gunicorn, folder: Path, *, max_examples: int, grpc_examples: int, max_time_s: int | None = None
) -> dict[str, Any]:
    """Fuzz ``srv`` (serving the stress repository): the figures and ``failures`` (empty: none)."""
    before = {w.pid for w in srv.workers()}
    document = fuzz_document({name: ["1"] for name in MODELS}, EXAMPLES)
    status, output, statuses = run_schemathesis(
        srv.url, document, folder / "schemathesis", max_examples=max_examples, max_time_s=max_time_s
    )
    failures = [] if status == 0 else [f"schemathesis exited {status}:\n{output}"]
    summary = output[output.rfind("SUMMARY") :] if "SUMMARY" in output else output[-3000:]
    routes = {route: sum(counts.values()) for route, counts in statuses.items()}
    served = {route: statuses.get(route, Counter())[200] for route in routes_taking(document, EXAMPLES)}
    failures += [
        f"{route}: no 200 in {routes.get(route, 0)} cases {dict(statuses.get(route, {}))}: no model reached"
        for route, ok in served.items()
        if not ok
    ]
    methods, grpc_failures = fuzz_grpc(srv.grpc_url, [*MODELS, f"{RANKER}-x"], grpc_examples)
    failures += grpc_failures
    after = {w.pid for w in srv.workers()}
    if after != before:
        failures.append(
            f"workers died or were replaced: {sorted(before)} -> {sorted(after)}\n{srv.log_tail()}"
        )
    live, _, _ = srv.get("/v2/health/live")
    if live != 200:
        failures.append(f"liveness {live} after the fuzzing")
    documented = {f"{method.upper()} {path}" for path, ops in document["paths"].items() for method in ops}
    return {
        "http_cases": sum(routes.values()),
        "schemathesis_summary": summary,
        "routes": dict(sorted(routes.items())),
        "ok_per_route": {route: statuses[route][200] for route in sorted(statuses)},
        "routes_not_reached": sorted(documented - set(routes)),
        "inference_routes_without_200": sorted(route for route, ok in served.items() if not ok),
        "grpc_cases": sum(methods.values()),
        "grpc_methods": methods,
        "failures": failures,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-examples", type=int, default=100, help="schemathesis: cases per operation")
    parser.add_argument(
        "--max-time", type=int, help="schemathesis: repeat fuzzing and stateful for this many s"
    )
    parser.add_argument(
        "--grpc-examples", type=int, default=500, help="messages per gRPC method (and as many byte strings)"
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="fuzz-"))
    repository.build(folder)
    srv = target.start_server(folder, repository.repository_of(folder), args.workers, redis_url="")
    try:
        srv.wait_ready(600, count=args.workers)
        results = fuzz(
            srv,
            folder,
            max_examples=args.max_examples,
            grpc_examples=args.grpc_examples,
            max_time_s=args.max_time,
        )
    finally:
        srv.stop(120)
    print(f"{'cases':>8} {'200s':>6}  route")
    for route, count in results["routes"].items():
        print(f"{count:>8} {results['ok_per_route'][route]:>6}  {route}")
    for method, count in results["grpc_methods"].items():
        print(f"{count:>8}  gRPC {method}")
    print(results["schemathesis_summary"])
    print(f"{results['http_cases']} HTTP cases, {results['grpc_cases']} gRPC calls")
    print(f"routes not reached: {results['routes_not_reached']}")
    print("PASSED" if not results["failures"] else "FAILED:\n" + "\n".join(results["failures"][:20]))
    argv_text = " ".join(argv if argv is not None else sys.argv[1:])
    report.write_json(args.json, report.record(command=f"python -m benchmarks.fuzz {argv_text}", **results))
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
