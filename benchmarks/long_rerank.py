"""An idle model keeps its word: a rerank of long documents with a short deadline is either
refused at once or answered in time, never admitted and then late.

One server (``--workers`` workers) serves ``--model`` (default all-MiniLM-L6-v2, whose long
texts run in windows); ``--tries`` times, one after another on an otherwise idle server, one
Cohere ``/v1/rerank`` of a query against ``--documents`` documents of ``--words`` words each
with a deadline of ``--deadline-ms`` (``X-Request-Timeout-Ms``). Printed per try: the status,
the seconds it took, and whether it broke the promise (a 504 that took longer than
``--late-ms``: admitted, then late; the goal is none); at the end the counts per status.

    python -m benchmarks.long_rerank --tries 20 --out docs/benchmarks/long-rerank-cpu.json

Traffic goes only to 127.0.0.1.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks import driver, payloads, report, server


def documents(repository: Path, model: str, count: int, words: int, seed: int) -> list[str]:
    """``count`` documents of ``words`` words drawn from the model's vocabulary."""
    vocabulary = payloads.model_words(repository, model)
    rng = random.Random(seed)
    return [" ".join(rng.choice(vocabulary) for _ in range(words)) for _ in range(count)]


def main(argv: list[str] | None = None) -> None:
    parser = server.parser(__doc__, model=server.MINILM)
    server.options(parser, tries=20, documents=10, words=1500, deadline_ms=5000.0, late_ms=1000.0)
    args = parser.parse_args(argv)
    headers = {"Content-Type": "application/json", "X-Request-Timeout-Ms": str(int(args.deadline_ms))}
    tries = []
    with tempfile.TemporaryDirectory() as tmp, server.start(
        Path(tmp), args.repository, args.model, args.workers
    ) as srv:
        srv.wait_ready(300, count=args.workers)
        url = srv.url + "/v1/rerank"
        for i in range(args.tries):
            texts = documents(args.repository, args.model, args.documents, args.words, i)
            body = json.dumps({"model": args.model, "query": payloads.QUERY, "documents": texts}).encode()
            started = time.perf_counter()
            status, _, answer = driver.http("POST", url, body, headers, timeout=args.deadline_ms / 1000 + 30)
            took = time.perf_counter() - started
            late = status == 504 and took * 1000 > args.late_ms
            said = answer.get("error", "") if isinstance(answer, dict) else ""
            tries.append({"status": status, "seconds": round(took, 3), "late": late, "said": said[:200]})
            flag = "  ADMITTED, THEN LATE" if late else ""
            print(f"try {i + 1:2}: {status} in {took:.2f} s{flag}  {said[:90]}")
    counts = Counter(str(t["status"]) for t in tries)
    late = sum(t["late"] for t in tries)
    print(f"statuses {dict(counts)}; admitted, then late: {late}")
    result = report.record(
        benchmark="long_rerank", model=args.model, documents=args.documents, words=args.words,
        deadline_ms=args.deadline_ms, workers=args.workers, statuses=dict(counts), late=late, tries=tries,
    )  # fmt: skip
    report.write_json(args.out, result)


if __name__ == "__main__":
    main()
