"""Goodput under overload from clients that resend at once: documents reranked per second at a
high concurrency against a low one, and whether a request the server admitted ever ran past its
deadline.

One server (``--workers`` workers) serves ``--model`` (default all-MiniLM-L6-v2); every request
is one Cohere ``/v1/rerank`` of a feed query against ``--documents`` feed texts (titles and
descriptions over the model's vocabulary, ``benchmarks.payloads.feed_texts``) with a deadline of
``--deadline-ms`` (``X-Request-Timeout-Ms``). wrk (a C client: it never shares the bound it
measures the way Python clients would) drives ``--low`` and then ``--high`` keep-alive
connections for ``--seconds`` each, ``--rounds`` times in turn; its clients send their next
request the moment an answer comes, whatever ``Retry-After`` says. Per level, the medians over
rounds of: documents/s answered 200, the refusals (503) and 504s per second, and from the
server's access log the 504s that came after admission (answered later than
``--late-ms``: a refusal at once takes milliseconds, a request that ran out of time takes its
deadline). Printed: the ratio high/low of documents/s (the goal: >= 0.9) and the late 504s (the
goal: none).

    python -m benchmarks.goodput --seconds 20 --rounds 2 --out docs/benchmarks/goodput-cpu.json

Traffic goes only to 127.0.0.1.
"""

from __future__ import annotations

import json
import random
import re
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import loadgen, payloads, report, server

#: An access log line's status and seconds (gunicorn_config's format: ``... %s %b %Tf rid=...``).
_LINE = re.compile(r'" (\d{3}) \S+ ([0-9.]+) rid=')


def bodies(repository: Path, model: str, documents: int, count: int, seed: int = 0) -> list[bytes]:
    """``count`` rerank requests, each a feed query against ``documents`` feed texts."""
    texts = payloads.feed_texts(payloads.model_words(repository, model), count=4000, seed=seed)
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        doc = {"model": model, "query": payloads.QUERY, "documents": rng.sample(texts, documents)}
        out.append(json.dumps(doc).encode())
    return out


def answered(log: Path, offset: int, late_s: float) -> tuple[int, dict[str, int]]:
    """What the access log holds past ``offset`` bytes: its new length, and the counts of
    ``"504"``, ``"late_504"`` (slower than ``late_s``) and ``"503"``."""
    data = log.read_bytes()
    counts = {"503": 0, "504": 0, "late_504": 0}
    for line in data[offset:].decode(errors="replace").splitlines():
        match = _LINE.search(line)
        if match is None:
            continue
        status, seconds = match.group(1), float(match.group(2))
        if status in ("503", "504"):
            counts[status] += 1
        if status == "504" and seconds > late_s:
            counts["late_504"] += 1
    return len(data), counts


def main(argv: list[str] | None = None) -> None:
    parser = server.parser(__doc__, model=server.MINILM)
    server.options(
        parser, documents=20, low=8, high=64, seconds=20.0, rounds=2, deadline_ms=10_000.0, late_ms=1_000.0
    )
    args = parser.parse_args(argv)
    if not loadgen.wrk_available():
        raise SystemExit("wrk is not installed (apt-get install wrk)")
    headers = {"Content-Type": "application/json", "X-Request-Timeout-Ms": str(int(args.deadline_ms))}
    made = bodies(args.repository, args.model, args.documents, 64)
    requests = [loadgen.Request("/v1/rerank", b, headers) for b in made]
    runs: dict[int, list[dict[str, Any]]] = {args.low: [], args.high: []}
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "access.log"
        env = {"SCORING_ACCESS_LOG": str(log), "SCORING_LOG_FORMAT": "text"}
        with server.start(Path(tmp), args.repository, args.model, args.workers, env) as srv:
            srv.wait_ready(300, count=args.workers)
            offset = log.stat().st_size if log.exists() else 0
            for _ in range(args.rounds):
                for level in (args.low, args.high):
                    run = loadgen.run_wrk(srv.url, requests, level, args.seconds)
                    offset, counts = answered(log, offset, args.late_ms / 1000)
                    row = run.figures(args.documents)
                    row.update({f"{k}_per_s": v / run.elapsed_s for k, v in counts.items()})
                    row["late_504"] = counts["late_504"]
                    runs[level].append(row)
    levels = []
    for level, rows in runs.items():
        levels.append({
            "concurrency": level,
            "documents_per_s": statistics.median(r["items_per_s"] for r in rows),
            "refusals_per_s": statistics.median(r["503_per_s"] for r in rows),
            "deadline_504_per_s": statistics.median(r["504_per_s"] for r in rows),
            "late_504": sum(r["late_504"] for r in rows),
            "p50_ms": statistics.median(r["p50_ms"] for r in rows),
            "runs": rows,
        })  # fmt: skip
        row = levels[-1]
        print(f"c = {level:3}: {row['documents_per_s']:7.1f} documents/s, "
              f"{row['refusals_per_s']:7.1f} 503/s, {row['deadline_504_per_s']:5.1f} 504/s "
              f"({row['late_504']} after admission), "
              f"p50 {row['p50_ms']:.0f} ms")  # fmt: skip
    low, high = (level["documents_per_s"] for level in levels)
    ratio = high / low if low else 0.0
    print(f"c = {args.high} / c = {args.low}: {ratio:.2f}x documents/s")
    result = report.record(
        benchmark="goodput", model=args.model, documents=args.documents, seconds=args.seconds,
        rounds=args.rounds, workers=args.workers, deadline_ms=args.deadline_ms, ratio=ratio, levels=levels,
    )  # fmt: skip
    report.write_json(args.out, result)


if __name__ == "__main__":
    main()
