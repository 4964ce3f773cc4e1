#!/usr/bin/env python
"""Load test a running scoring server: throughput and latency percentiles, CSV and PNG plots.

Drives one model of a server that is already running (``scripts/serve``) with payloads built
from the model's metadata (``GET /v2/models/{name}``) by ``benchmarks.payloads``: headline-like
texts for ``BYTES`` inputs (all-MiniLM-L6-v2), random numbers for numeric ones (feed-ranker).
Two modes, each level bounded in time:

- closed loop, ``--concurrency 1,2,4,8,16``: that many clients, each sending its next request
  when the previous one is answered (throughput vs latency as load grows);
- open loop, ``--rate 20,40``: requests start at a fixed rate whatever the answers; latency is
  measured from each request's scheduled start, so a slow server cannot hide its queueing
  ("coordinated omission").

The first ``--warmup`` seconds of each level are sent but not counted. Traffic goes only to
127.0.0.1/localhost/::1 unless ``--allow-remote`` is given.

    python scripts/loadtest.py --model all-MiniLM-L6-v2 --inputs text \\
        --concurrency 1,2,4,8,16 --duration 10 --out docs/loadtest
    python scripts/loadtest.py --model feed-ranker --protocol v1 --rate 50,100,200 --duration 10

Writes to ``--out``: ``summary.csv`` (one row per level), ``history.csv`` (per second),
``requests.csv`` with ``--raw``, and ``throughput_latency.png`` and ``latency_over_time.png``
(needs matplotlib). Percentiles are numpy's (linear interpolation between order statistics).

Source: the closed/open-loop distinction and per-level reporting follow Triton's
perf_analyzer and locust's CSV reports (``stats.csv``, ``stats_history.csv``). The requests and
the closed loop are the benchmarks' own (``benchmarks.driver``, ``benchmarks.payloads``), so a
load test and a benchmark send the same thing the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import math
import random
import sys
import time
import urllib.parse
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import driver, payloads

LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


# --- pure parts ---------------------------------------------------------------------------


def parse_levels(text: str) -> list[float]:
    """``"1,2,4"`` -> [1.0, 2.0, 4.0]; every level must be a positive number."""
    try:
        levels = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated numbers, e.g. 1,2,4") from None
    if not levels or any(not (level > 0 and math.isfinite(level)) for level in levels):
        raise argparse.ArgumentTypeError(f"{text!r}: levels must be positive numbers")
    return levels


def check_target(url: str, allow_remote: bool) -> str:
    """The server URL without a trailing slash.

    Raises:
        ValueError: not http(s), or a host other than loopback without ``allow_remote``.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r}: expected http://host:port")
    if parts.hostname not in LOCAL_HOSTS and not allow_remote:
        raise ValueError(
            f"refusing to load test {parts.hostname}: only {sorted(LOCAL_HOSTS)} unless --allow-remote"
        )
    return url.rstrip("/")


@dataclass(frozen=True)
class Record:
    """One request: ``start_s`` since the test began, ``latency_s`` (from the scheduled start in
    open loop), HTTP ``status`` (0 = no answer), ``items`` sent, ``counted`` = after warmup."""

    level: float
    start_s: float
    latency_s: float
    status: int
    items: int
    counted: bool = True
    error: str = ""


@dataclass(frozen=True)
class Window:
    """One level's time, seconds since the test began: warmup from ``start_s``, measured from
    ``measured_from_s`` to ``stop_s``."""

    start_s: float
    measured_from_s: float
    stop_s: float


@dataclass(frozen=True)
class Summary:
    """One level's figures; latencies in ms over the successful (200) requests."""

    mode: str
    level: float
    start_s: float
    measured_from_s: float
    seconds: float
    requests: int
    errors: int
    requests_per_s: float
    items_per_s: float
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float


def summarize(mode: str, level: float, records: Iterable[Record], window: Window) -> Summary:
    """Figures of the counted requests of one level; rates over the measured part of ``window``."""
    counted = [r for r in records if r.counted]
    ok = [r for r in counted if r.status == 200]
    lat = [r.latency_s * 1000 for r in ok]
    p50, p90, p95, p99 = driver.percentiles(lat, (50, 90, 95, 99))
    seconds = window.stop_s - window.measured_from_s
    span = max(seconds, 1e-9)
    return Summary(
        mode=mode,
        level=level,
        start_s=window.start_s,
        measured_from_s=window.measured_from_s,
        seconds=seconds,
        requests=len(counted),
        errors=len(counted) - len(ok),
        requests_per_s=len(ok) / span,
        items_per_s=sum(r.items for r in ok) / span,
        mean_ms=sum(lat) / len(lat) if lat else math.nan,
        p50_ms=p50,
        p90_ms=p90,
        p95_ms=p95,
        p99_ms=p99,
        max_ms=max(lat, default=math.nan),
    )


def history(
    records: Iterable[Record], bucket_s: float = 1.0, end_s: float | None = None
) -> list[dict[str, float]]:
    """Per ``bucket_s`` of test time (by request start): level, requests/s, errors,
    p50/p95/p99 ms of the successful requests. Warmup requests are included. The last bucket's
    rate is over its part before ``end_s`` (the end of the test), when given."""
    buckets: dict[int, list[Record]] = {}
    for r in records:
        buckets.setdefault(int(r.start_s // bucket_s), []).append(r)
    rows = []
    for index in sorted(buckets):
        batch = buckets[index]
        lat = [r.latency_s * 1000 for r in batch if r.status == 200]
        p50, p95, p99 = driver.percentiles(lat, (50, 95, 99))
        rows.append(
            {
                "time_s": index * bucket_s,
                "level": batch[-1].level,
                "requests_per_s": len(lat) / _covered(index * bucket_s, bucket_s, end_s),
                "errors": sum(r.status != 200 for r in batch),
                "p50_ms": p50,
                "p95_ms": p95,
                "p99_ms": p99,
            }
        )
    return rows


def _covered(start: float, length: float, end: float | None) -> float:
    if end is None or end >= start + length:
        return length
    return max(end - start, 1e-3)


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """Rows of dicts (same keys) to CSV; floats with 4 decimals, NaN as empty."""

    def cell(value: Any) -> Any:
        if isinstance(value, float):
            return "" if math.isnan(value) else f"{value:.4f}"
        return value

    with path.open("w", newline="", encoding="utf-8") as f:
        if not rows:
            return
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({k: cell(v) for k, v in row.items()} for row in rows)


def build_payload(
    metadata: dict[str, Any], protocol: str, batch: int, names: Sequence[str], rng: random.Random
) -> bytes:
    """A request body of ``batch`` items for the inputs ``names`` (empty = every input), V2 or
    V1 JSON (``benchmarks.payloads``).

    Raises:
        ValueError: an input name the model does not have.
    """
    specs = {s.name: s for s in payloads.inputs_of_metadata(metadata)}
    chosen = list(names) or list(specs)
    unknown = [n for n in chosen if n not in specs]
    if unknown:
        raise ValueError(f"model {metadata['name']} has no input {unknown}; it has {sorted(specs)}")
    request = payloads.tensors([specs[n] for n in chosen], batch, rng)
    return payloads.v1_json(request) if protocol == "v1" else payloads.v2_json(request)


def endpoint(base: str, protocol: str, model: str, version: str | None) -> str:
    quoted = urllib.parse.quote(model, safe="")
    if protocol == "v1":
        return f"{base}/v1/models/{quoted}:predict"
    suffix = f"/versions/{urllib.parse.quote(version, safe='')}" if version else ""
    return f"{base}/v2/models/{quoted}{suffix}/infer"


# --- driving the server ----------------------------------------------------------------------


@dataclass
class Run:
    url: str
    payloads: list[bytes]
    items: int
    warmup_s: float
    duration_s: float
    t0: float

    def now(self) -> float:
        return time.perf_counter() - self.t0


async def _send(session: Any, run: Run, level: float, scheduled: float, counted: bool) -> Record:
    answer = await driver.post(session, run.url, random.choice(run.payloads))
    return Record(level, scheduled, run.now() - scheduled, answer.status, run.items, counted, answer.error)


def _window(run: Run) -> Window:
    start = run.now()
    return Window(start, start + run.warmup_s, start + run.warmup_s + run.duration_s)


async def closed_loop(session: Any, run: Run, concurrency: int) -> tuple[list[Record], Window]:
    """``concurrency`` clients for warmup + duration seconds."""
    window = _window(run)

    def one(_client: int) -> Awaitable[Record]:
        begin = run.now()
        return _send(session, run, concurrency, begin, begin >= window.measured_from_s)

    return await driver.closed_loop(one, concurrency, run.t0 + window.stop_s), window


async def open_loop(session: Any, run: Run, rate: float, max_outstanding: int) -> tuple[list[Record], Window]:
    """Requests start every 1/rate s for warmup + duration seconds (skipped, and counted as
    errors with status 0, while ``max_outstanding`` are unanswered)."""
    window = _window(run)
    start, warm_until, stop_at = window.start_s, window.measured_from_s, window.stop_s
    records: list[Record] = []
    tasks: set[asyncio.Task[None]] = set()

    async def one(scheduled: float) -> None:
        records.append(await _send(session, run, rate, scheduled, scheduled >= warm_until))

    n = 0
    while (scheduled := start + n / rate) < stop_at:
        n += 1
        delay = scheduled - run.now()
        if delay > 0:
            await asyncio.sleep(delay)
        if len(tasks) >= max_outstanding:
            records.append(Record(rate, scheduled, 0.0, 0, run.items, scheduled >= warm_until, "overload"))
            continue
        task = asyncio.create_task(one(scheduled))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)
    return records, window


async def fetch_metadata(base: str, model: str, version: str | None, timeout_s: float) -> dict[str, Any]:
    import aiohttp

    suffix = f"/versions/{version}" if version else ""
    url = f"{base}/v2/models/{urllib.parse.quote(model, safe='')}{suffix}"
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as resp:
        if resp.status != 200:
            raise SystemExit(f"GET {url}: HTTP {resp.status}: {await resp.text()}")
        result: dict[str, Any] = await resp.json()
        return result


async def run_levels(args: argparse.Namespace, base: str) -> tuple[list[Summary], list[Record]]:
    import aiohttp

    metadata = await fetch_metadata(base, args.model, args.version, args.timeout)
    rng = random.Random(args.seed)
    names = [n.strip() for n in args.inputs.split(",") if n.strip()]
    payloads = [build_payload(metadata, args.protocol, args.batch, names, rng) for _ in range(64)]
    mode = "rate" if args.rate else "concurrency"
    levels = args.rate or args.concurrency
    summaries: list[Summary] = []
    records: list[Record] = []
    t0 = time.perf_counter()
    for level in levels:
        limit = int(level) if mode == "concurrency" else args.max_outstanding
        connector = aiohttp.TCPConnector(limit=limit)
        timeout = aiohttp.ClientTimeout(total=args.timeout)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            run = Run(
                url=endpoint(base, args.protocol, args.model, args.version),
                payloads=payloads,
                items=args.batch,
                warmup_s=args.warmup,
                duration_s=args.duration,
                t0=t0,
            )
            if mode == "concurrency":
                level_records, window = await closed_loop(session, run, int(level))
            else:
                level_records, window = await open_loop(session, run, level, args.max_outstanding)
        shown = int(level) if level.is_integer() else level
        summary = summarize(mode, shown, level_records, window)
        summaries.append(summary)
        records.extend(level_records)
        print(_row(summary), flush=True)
        errors = sorted({r.error for r in level_records if r.error})
        if errors:
            print(f"  errors, e.g.: {errors[:3]}", flush=True)
    return summaries, records


def _row(s: Summary) -> str:
    return (
        f"{s.mode}={s.level:g}: {s.requests} requests, {s.errors} errors, {s.requests_per_s:.1f} req/s, "
        f"{s.items_per_s:.1f} items/s, p50 {s.p50_ms:.1f} ms, p95 {s.p95_ms:.1f} ms, p99 {s.p99_ms:.1f} ms"
    )


def plot(out: Path, summaries: Sequence[Summary], hist: Sequence[dict[str, float]], title: str) -> list[Path]:
    """``throughput_latency.png`` and ``latency_over_time.png``; needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mode = summaries[0].mode
    x_label = "concurrent clients" if mode == "concurrency" else "offered rate (requests/s)"
    levels = [s.level for s in summaries]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    top.plot(levels, [s.items_per_s for s in summaries], "o-", label="items/s")
    top.plot(levels, [s.requests_per_s for s in summaries], "s--", label="requests/s")
    top.set_ylabel("throughput (per second)")
    top.legend()
    top.grid(alpha=0.3)
    for q, style in (("p50", "o-"), ("p95", "^-"), ("p99", "v-")):
        bottom.plot(levels, [getattr(s, f"{q}_ms") for s in summaries], style, label=q)
    bottom.set_ylabel("latency (ms)")
    bottom.set_xlabel(x_label)
    bottom.legend()
    bottom.grid(alpha=0.3)
    if mode == "concurrency":
        bottom.set_xscale("log", base=2)
        bottom.set_xticks(levels, [f"{lv:g}" for lv in levels])
    fig.suptitle(title)
    fig.tight_layout()
    first = out / "throughput_latency.png"
    fig.savefig(first, dpi=110)
    plt.close(fig)

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    times = [h["time_s"] + 0.5 for h in hist]  # bucket middles
    for q in ("p50", "p95", "p99"):
        top.plot(times, [h[f"{q}_ms"] for h in hist], label=q)
    top.set_ylabel("latency (ms)")
    top.legend(loc="upper left")
    top.grid(alpha=0.3)
    bottom.plot(times, [h["requests_per_s"] for h in hist], color="tab:green")
    bottom.set_ylabel("requests/s")
    bottom.set_xlabel("time (s); shaded: warmup, not counted")
    bottom.grid(alpha=0.3)
    for s in summaries:
        for ax in (top, bottom):
            ax.axvspan(s.start_s, s.measured_from_s, color="grey", alpha=0.15, lw=0)
            ax.axvline(s.start_s, color="grey", lw=0.8)
        top.annotate(f"{s.level:g}", (s.start_s, 1.0), xycoords=("data", "axes fraction"),
                     xytext=(2, 2), textcoords="offset points", fontsize=8)  # fmt: skip
    fig.suptitle(f"{title}: per second, each level's {x_label} at the top")
    fig.tight_layout()
    second = out / "latency_over_time.png"
    fig.savefig(second, dpi=110)
    plt.close(fig)
    return [first, second]


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Load test a running scoring server (loopback only by default).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL")
    parser.add_argument("--model", required=True, help="model name")
    parser.add_argument("--version", default=None, help="model version (V2 only; default: latest)")
    parser.add_argument("--protocol", choices=("v1", "v2"), default="v2")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=parse_levels, default=None, help="closed-loop clients per level")
    load.add_argument("--rate", type=parse_levels, default=None, help="open-loop requests/s per level")
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per level")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each level")
    parser.add_argument("--batch", type=int, default=1, help="items per request")
    parser.add_argument("--inputs", default="", help="comma-separated input names to send; empty = all")
    parser.add_argument("--timeout", type=float, default=30.0, help="per-request timeout, seconds")
    parser.add_argument(
        "--max-outstanding", type=int, default=1000, help="open loop: most unanswered requests"
    )
    parser.add_argument("--seed", type=int, default=0, help="payload random seed")
    parser.add_argument("--out", type=Path, default=Path("loadtest-results"), help="output folder")
    parser.add_argument("--raw", action="store_true", help="also write requests.csv (one row per request)")
    parser.add_argument("--no-plots", action="store_true", help="CSV only (no matplotlib needed)")
    parser.add_argument("--title", default="", help="plot title (default: model, protocol, batch)")
    parser.add_argument("--allow-remote", action="store_true", help="allow a host other than loopback")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.concurrency is None and args.rate is None:
        args.concurrency = [1.0, 2.0, 4.0, 8.0, 16.0]
    if args.concurrency and any(c != int(c) for c in args.concurrency):
        parser.error("--concurrency levels must be whole numbers")
    if args.duration <= 0 or args.warmup < 0 or args.batch < 1:
        parser.error("need --duration > 0, --warmup >= 0, --batch >= 1")
    try:
        base = check_target(args.url, args.allow_remote)
    except ValueError as exc:
        parser.error(str(exc))
    summaries, records = asyncio.run(run_levels(args, base))
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "summary.csv", [asdict(s) for s in summaries])
    hist = history(records, end_s=summaries[-1].measured_from_s + summaries[-1].seconds)
    write_csv(args.out / "history.csv", hist)
    written = [args.out / "summary.csv", args.out / "history.csv"]
    if args.raw:
        write_csv(args.out / "requests.csv", [asdict(r) for r in sorted(records, key=lambda r: r.start_s)])
        written.append(args.out / "requests.csv")
    if not args.no_plots:
        title = args.title or f"{args.model} ({args.protocol.upper()}, {args.batch} item(s)/request)"
        written += plot(args.out, summaries, hist, title)
    print("wrote", ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
