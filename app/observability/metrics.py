"""Prometheus metrics of the serving path, correct under gunicorn's many processes.

Multiprocess mode: ``gunicorn.conf.py`` sets ``PROMETHEUS_MULTIPROC_DIR`` in the
master before anything imports ``prometheus_client`` and wipes the folder at
start. Every worker then writes its samples to mmap files there, any worker
answers a scrape with the whole server's figures (``MultiProcessCollector``),
and the master deletes a dead worker's live gauges (``child_exit`` ->
``mark_process_dead``); its counters and histograms stay, so totals never go
backwards when a worker is replaced. Without the variable (in-process tests,
``python -m aiohttp.web``) each app records into a registry of its own and a
scrape adds prometheus_client's default registry (process and GC collectors).

Every metric is listed in ``docs/observability.md``. This module holds the definitions and one
request's recording (:class:`Recording`, both front ends'); ``app.http.routes`` answers
``/metrics``; ``app.observability.gpu`` holds the worker's binding and GPU gauges and polls the
bound GPU through NVML (never through CUDA); in CPU mode there are no GPU figures.

Source: prometheus_client's "Multiprocess Mode (E.g. Gunicorn)" documentation;
metric names follow Prometheus' naming guide (base units, ``_total``, ``_info``).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

ENV_MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"
# prometheus_client decides once, when it is first imported, whether samples stay in the
# process or go to files under PROMETHEUS_MULTIPROC_DIR (its "Multiprocess Mode" documentation:
# the variable must be set before). Where this module makes that first import, what the
# variable was then is what prometheus_client saw; None where it was imported before this module.
_DIR_AT_FIRST_IMPORT: str | None = (
    None if "prometheus_client" in sys.modules else os.environ.get(ENV_MULTIPROC_DIR, "")
)

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest  # noqa: E402
from prometheus_client.multiprocess import MultiProcessCollector  # noqa: E402

#: Seconds; dense from 0.5 ms to 100 ms, where a batched model's latency lives, up to 10 s.
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.075,
    0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
#: Items or requests per batch (powers of two up to the largest sensible max_batch_size).
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


def multiprocess_dir() -> str | None:
    """The multiprocess directory, or None for in-process collection.

    Where something imported ``prometheus_client`` before this module (the gunicorn master's
    ``child_exit`` hook does, after setting the variable), the variable is trusted as it is.

    Raises:
        RuntimeError: the variable is set but was not when this module first imported
            ``prometheus_client``, so samples would stay in this process.
    """
    path = os.environ.get(ENV_MULTIPROC_DIR)
    if path and _DIR_AT_FIRST_IMPORT == "":
        raise RuntimeError(
            f"{ENV_MULTIPROC_DIR}={path} was set after prometheus_client was imported; "
            "set it before (gunicorn.conf.py does) so every worker's metrics reach /metrics"
        )
    return path or None


class ServerMetrics:
    """The metrics of one worker process (multiprocess mode) or one app (in-process).

    Args:
        registry: where the metrics register for a scrape; None in multiprocess
            mode, where a scrape reads the files of every process instead.
    """

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.registry = registry
        self._per_route: dict[tuple[str, str, str], RequestMetrics] = {}
        model = ["model", "version"]
        r = registry
        self.requests = Counter(
            "scoring_requests", "Inference requests answered, by HTTP status code.",
            [*model, "protocol", "code"], registry=r,
        )  # fmt: skip
        self.request_seconds = Histogram(
            "scoring_request_duration_seconds",
            "Inference request latency in the worker, from routing to the response.",
            [*model, "protocol"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_seconds = Histogram(
            "scoring_queue_duration_seconds",
            "Per batch: how long its oldest request waited in the queue before the batch formed.",
            model, buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.compute_seconds = Histogram(
            "scoring_compute_duration_seconds",
            "Per batch: model time on the inference thread (preprocess, forward, postprocess).",
            model, buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_size = Histogram(
            "scoring_batch_size", "Items per batch run.", model, buckets=BATCH_BUCKETS, registry=r
        )
        self.batch_requests = Histogram(
            "scoring_batch_requests", "Requests with items in a batch run.",
            model, buckets=BATCH_BUCKETS, registry=r,
        )  # fmt: skip
        self.tokens = Counter(
            "scoring_batch_tokens", "Tokens of the items a priced model (item_costs) ran: kind="
            '"real" their own, kind="padded" what the padded batches computed; padded / real is '
            "the padding waste (1 = none).",
            [*model, "kind"], registry=r,
        )  # fmt: skip
        self.queue_depth = Gauge(
            "scoring_queue_depth",
            "Items waiting in the batch queue (all workers), as of the last batch formed.",
            model, multiprocess_mode="livesum", registry=r,
        )  # fmt: skip
        self.in_flight = Gauge(
            "scoring_requests_in_flight", "Inference requests being handled (all workers).",
            model, multiprocess_mode="livesum", registry=r,
        )  # fmt: skip
        self.rejected = Counter(
            "scoring_rejected", "Requests refused by a model's serving unit: queue_full (503), "
            "admission (503), deadline (504), out_of_memory (507), disconnected.",
            [*model, "reason"], registry=r,
        )  # fmt: skip
        self.priority_requests = Counter(
            "scoring_priority_requests", "Requests to a model with priority levels, by level "
            "(Triton's: 1 = the highest) and outcome: admitted or refused.",
            [*model, "priority", "outcome"], registry=r,
        )  # fmt: skip
        self.priority_queue_seconds = Histogram(
            "scoring_priority_queue_duration_seconds", "Per request of a model with priority levels: "
            "how long it waited in the queue before its first batch, by level.",
            [*model, "priority"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self._define_worker_metrics(model, r)
        self._define_balancing_metrics(model, r)
        self._define_prefix_cache_metrics(model, r)

    def _define_worker_metrics(self, model: list[str], r: CollectorRegistry | None) -> None:
        """Per worker: hung batches, model loads (its binding and GPU: ``app.observability.gpu``)."""
        self.hung_batches = Counter(
            "scoring_hung_batches", "Batches still running after SCORING_HUNG_INFERENCE_S; each "
            "one makes its worker restart itself.",
            model, registry=r,
        )  # fmt: skip
        self.unit_restarts = Counter(
            "scoring_serving_loop_restarts", "Times a model version's serving loop stopped on a "
            "failure and was started again (its requests then waiting got 503 + Retry-After).",
            model, registry=r,
        )  # fmt: skip
        self.model_loads = Counter(
            "scoring_model_loads", "Loads of a model version in a worker (at start, retried, or by "
            "model control), by outcome: success or failure.",
            [*model, "outcome"], registry=r,
        )  # fmt: skip
        self.load_seconds = Gauge(
            "scoring_model_load_seconds", "Time the worker took to load the model.",
            [*model, "pid"], multiprocess_mode="liveall", registry=r,
        )  # fmt: skip
        self.warmup_seconds = Gauge(
            "scoring_model_warmup_seconds", "Time the worker took to warm the model up.",
            [*model, "pid"], multiprocess_mode="liveall", registry=r,
        )  # fmt: skip

    def _define_balancing_metrics(self, model: list[str], r: CollectorRegistry | None) -> None:
        """Balancing among sibling workers (app.server.siblings), the response cache."""
        self.worker_load_items = Gauge(
            "scoring_worker_load_items", "Inference items queued + in flight in one worker.",
            ["pid"], multiprocess_mode="liveall", registry=r,
        )  # fmt: skip
        self.worker_connections = Gauge(
            "scoring_worker_connections", "Open HTTP connections of one worker.",
            ["pid"], multiprocess_mode="liveall", registry=r,
        )  # fmt: skip
        self.worker_items = Counter(
            "scoring_worker_items", "Inference items one worker computed (counted per batch).",
            ["pid"], registry=r,
        )  # fmt: skip
        self.scattered = Counter(
            "scoring_scattered_requests", "Large requests split into shards over sibling workers "
            "(app.server.router), counted by the worker that received them.",
            model, registry=r,
        )  # fmt: skip
        self.forwarded_shards = Counter(
            "scoring_forwarded_shards", "Shards of scattered requests sent to sibling workers.",
            model, registry=r,
        )  # fmt: skip
        self.forwarded_requests = Counter(
            "scoring_forwarded_requests", "Whole requests on pinned (gRPC) connections sent to a "
            "less-loaded sibling worker (app.server.router), counted by the worker that received them.",
            model, registry=r,
        )  # fmt: skip
        self.connections_shed = Counter(
            "scoring_connections_shed", "Keep-alive connections a worker closed (Connection: close) "
            "so that a less-loaded sibling takes them.",
            ["pid"], registry=r,
        )  # fmt: skip
        # --- the response cache (app.serving.response_cache, app.serving.item_cache) ---
        self.cache_items = Counter(
            "scoring_response_cache_items", "Items of requests to a model with [response_cache] "
            "enable = true, by result: hit (answered from the host's store) or miss (not in it: "
            "computed, or refused with its request).",
            [*model, "result"], registry=r,
        )  # fmt: skip
        self.cache_evictions = Counter(
            "scoring_response_cache_evictions", "Entries of a model evicted from the host's "
            "response cache (oldest first) to keep it under its byte bound.",
            ["model"], registry=r,
        )  # fmt: skip
        self.cache_bytes = Gauge(
            "scoring_response_cache_bytes", "Bytes of a model's entries in the host's response "
            "cache (keys and values, as of the last write of any worker).",
            ["model"], multiprocess_mode="mostrecent", registry=r,
        )  # fmt: skip
        self.cache_dropped = Counter(
            "scoring_response_cache_dropped_writes", "Computed items of a model not written to the "
            "response cache, by reason: queue_full (the write queue was full), store_full (no room "
            "even after evicting), store_error (the store failed), redis_error (the Redis tier "
            "failed or was paused), unencodable (an output the cache cannot hold).",
            ["model", "reason"], registry=r,
        )  # fmt: skip
        self.cache_late = Counter(
            "scoring_response_cache_late_items", "Items of a model whose response cache lookup "
            "passed SCORING_RESPONSE_CACHE_LOOKUP_TIMEOUT_MS, by the tier that had not answered "
            "(host, redis): computed, and counted as misses.",
            ["model", "tier"], registry=r,
        )  # fmt: skip

    def _define_prefix_cache_metrics(self, model: list[str], r: CollectorRegistry | None) -> None:
        # --- the prefix cache (app.handlers.prefix_cache): one per model version and worker ---
        self.prefix_cache_lookups = Counter(
            "scoring_prefix_cache_lookups", "Prefixes of a shared-prefix model looked up in its "
            "workers' prefix caches, by result: hit (its keys and values reused, not run again) or "
            "miss (run, then kept).",
            [*model, "result"], registry=r,
        )  # fmt: skip
        self.prefix_cache_tokens = Counter(
            "scoring_prefix_cache_tokens", "Tokens of the prefixes looked up in the prefix caches, "
            "by result: hit (not run again) or miss (run).",
            [*model, "result"], registry=r,
        )  # fmt: skip
        self.prefix_cache_evictions = Counter(
            "scoring_prefix_cache_evictions", "Prefixes evicted from a prefix cache, least "
            "recently used first, to keep it under its model's prefix_cache_bytes.",
            model, registry=r,
        )  # fmt: skip
        self.prefix_cache_bytes = Gauge(
            "scoring_prefix_cache_bytes", "Bytes of keys and values the prefix caches of a model "
            "hold on their devices, summed over workers.",
            model, multiprocess_mode="livesum", registry=r,
        )  # fmt: skip

    def prefix_cache(self, model: str, version: str) -> PrefixCacheMetrics:
        """The observer of one model version's prefix cache in this worker
        (``app.handlers.prefix_cache.PrefixCache``'s ``observer``)."""
        return PrefixCacheMetrics(self, model, version)

    def for_requests(self, model: str, version: str, protocol: str) -> RequestMetrics:
        """The request metrics of one (model, version, protocol), made on first use and kept
        (a few per model: protocols x versions)."""
        key = (model, version, protocol)
        found = self._per_route.get(key)
        if found is None:
            found = self._per_route[key] = RequestMetrics(self, model, version, protocol)
        return found

    def model_ready(self, model: str, version: str, load_s: float, warmup_s: float) -> None:
        pid = str(os.getpid())
        self.load_seconds.labels(model, version, pid).set(load_s)
        self.warmup_seconds.labels(model, version, pid).set(warmup_s)

    def render(self) -> bytes:
        """The Prometheus text exposition of every worker (multiprocess) or this app."""
        path = multiprocess_dir()
        if path is not None:
            registry = CollectorRegistry()
            MultiProcessCollector(registry, path)  # type: ignore[no-untyped-call]
            return generate_latest(registry)
        assert self.registry is not None
        return generate_latest(self.registry) + generate_latest(REGISTRY)


class PrefixCacheMetrics:
    """The Prometheus side of one model version's prefix cache in this worker: what
    ``app.handlers.prefix_cache.PrefixCache`` tells its observer, its label children looked up
    once (the cache calls it on the inference thread, once a batch)."""

    def __init__(self, metrics: ServerMetrics, model: str, version: str) -> None:
        self._hits = metrics.prefix_cache_lookups.labels(model, version, "hit")
        self._misses = metrics.prefix_cache_lookups.labels(model, version, "miss")
        self._hit_tokens = metrics.prefix_cache_tokens.labels(model, version, "hit")
        self._miss_tokens = metrics.prefix_cache_tokens.labels(model, version, "miss")
        self._evictions = metrics.prefix_cache_evictions.labels(model, version)
        self._bytes = metrics.prefix_cache_bytes.labels(model, version)

    def looked_up(self, hits: int, misses: int, hit_tokens: int, miss_tokens: int) -> None:
        """Prefixes found and not found, and their tokens."""
        if hits:
            self._hits.inc(hits)
            self._hit_tokens.inc(hit_tokens)
        if misses:
            self._misses.inc(misses)
            self._miss_tokens.inc(miss_tokens)

    def evicted(self, entries: int) -> None:
        """Entries evicted to keep the cache under its bound."""
        self._evictions.inc(entries)

    def held(self, nbytes: int) -> None:
        """The bytes the cache holds now."""
        self._bytes.set(nbytes)


class RequestMetrics:
    """The request metrics of one (model, version, protocol), their label children looked up
    once: prometheus_client's ``labels()`` takes a lock and builds a key on every call, three
    calls per request on the hot path otherwise."""

    def __init__(self, metrics: ServerMetrics, model: str, version: str, protocol: str) -> None:
        self._requests = metrics.requests
        self._labels = (model, version, protocol)
        self.in_flight = metrics.in_flight.labels(model, version)
        self._seconds = metrics.request_seconds.labels(model, version, protocol)
        self._by_code: dict[int | str, Counter] = {}

    def answered(self, code: int | str, seconds: float, in_flight: bool = True) -> None:
        """One request left, ``seconds`` after it came in; ``in_flight`` goes down by one (unless
        it was never counted in). ``code``: the HTTP status (499 = the client went away) or the
        gRPC status name."""
        if in_flight:
            self.in_flight.dec()
        self._seconds.observe(seconds)
        counter = self._by_code.get(code)
        if counter is None:
            counter = self._by_code[code] = self._requests.labels(*self._labels, str(code))
        counter.inc()


class Recording:
    """One inference request's metrics, whatever its front end (HTTP's edge middleware, the gRPC
    servicer): made on arrival (``start``, ``time.perf_counter()`` seconds), labelled with its
    model once known (:meth:`model`), answered once with its code (HTTP status, gRPC status name).
    ``protocol``: an HTTP API's label (``app.protocols.codec.Api``) or ``grpc``."""

    __slots__ = ("metrics", "protocol", "recorded", "start")

    def __init__(self, metrics: ServerMetrics, protocol: str) -> None:
        self.metrics, self.protocol = metrics, protocol
        self.recorded: RequestMetrics | None = None
        self.start = time.perf_counter()

    def model(self, name: str, version: str) -> None:
        """The request addresses ``name`` ``version``: it counts in flight from now (once)."""
        if self.recorded is None:
            self.recorded = self.metrics.for_requests(name, version, self.protocol)
            self.recorded.in_flight.inc()

    def answered(self, code: int | str) -> None:
        """It left with ``code``, now (not counted in flight when its model was never known:
        labelled model "")."""
        seconds = time.perf_counter() - self.start
        if self.recorded is not None:
            self.recorded.answered(code, seconds)
        else:
            self.metrics.for_requests("", "", self.protocol).answered(code, seconds, in_flight=False)


@dataclass
class Duration:
    """Triton's ``$duration_stat``: how many, and their cumulative nanoseconds."""

    count: int = 0
    ns: int = 0

    def add(self, count: int, seconds: float) -> None:
        """Count ``count`` events that took ``seconds`` in all."""
        self.count += count
        self.ns += int(seconds * 1e9)


@dataclass
class ModelStats:
    """Cumulative Triton statistics of one model version in this worker (the statistics
    extension; ``app.protocols.triton.model_statistics`` renders them).

    One batch of ``items`` items from ``requests`` requests, waiting ``queue_s`` for its oldest
    request and computing ``compute_s``: ``inference_count`` += items, ``execution_count`` += 1;
    ``success`` += requests, requests x (queue + compute); ``queue`` += requests, requests x
    queue_s (the oldest request's wait: an upper bound); ``compute_infer`` += requests,
    requests x compute_s; ``batches[items]`` += 1, compute_s. A refused request: ``fail`` += 1.
    A request larger than ``max_batch_size`` spans several batches and counts in each. Counts
    are per worker process; Prometheus (``/metrics``) sums over workers.
    Source: triton-inference-server/server ``docs/protocol/extension_statistics.md``.
    """

    inference_count: int = 0
    execution_count: int = 0
    #: Milliseconds since the epoch of the last batch run; 0 = never.
    last_inference_ms: int = 0
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    #: Items found in / missing from the response cache, and their share of the lookups' time.
    cache_hit: Duration = field(default_factory=Duration)
    cache_miss: Duration = field(default_factory=Duration)
    #: Batch size (items) -> model calls of that size and their compute time.
    batches: dict[int, Duration] = field(default_factory=dict)


#: Why a serving unit refuses or drops a request (``scoring_rejected_total``'s ``reason``).
REJECT_REASONS = ("admission", "queue_full", "deadline", "out_of_memory", "disconnected")
#: ``scoring_response_cache_items_total``'s ``result``.
CACHE_RESULTS = ("hit", "miss")


class ModelObserver:
    """What one model version's serving unit reports (``app.serving.unit.UnitObserver``): its
    Triton statistics always, and its Prometheus metrics when ``metrics`` is given (their label
    children looked up once).

    Made when the version loads, it makes the series whose labels are known then, at 0: each
    :data:`REJECT_REASONS` of ``scoring_rejected_total`` and, for a model with a response cache
    (``cached``), its ``scoring_response_cache_items_total`` by result and its
    ``scoring_response_cache_bytes``. A dashboard's panel over them then reads 0 from the start,
    not "No data" until the first event. (The bytes gauge is only made, never set: its
    ``mostrecent`` aggregation keeps a sibling's later figure.)

    Args:
        stats: the version's Triton statistics.
        metrics: this process's metrics; None when metrics are off.
        model, version: the labels.
        cached: the model has ``[response_cache] enable = true``.
    """

    def __init__(
        self,
        stats: ModelStats,
        metrics: ServerMetrics | None,
        model: str,
        version: str,
        *,
        cached: bool = False,
    ) -> None:
        self.stats = stats
        self._metrics = metrics
        self._labels = (model, version)
        if metrics is not None:
            for reason in REJECT_REASONS:
                metrics.rejected.labels(model, version, reason)
            if cached:
                for result in CACHE_RESULTS:
                    metrics.cache_items.labels(model, version, result)
                metrics.cache_bytes.labels(model)
            self._queue = metrics.queue_seconds.labels(model, version)
            self._compute = metrics.compute_seconds.labels(model, version)
            self._items = metrics.batch_size.labels(model, version)
            self._requests = metrics.batch_requests.labels(model, version)
            self._depth = metrics.queue_depth.labels(model, version)
            self._worker_items = metrics.worker_items.labels(str(os.getpid()))
            self._real_tokens = metrics.tokens.labels(model, version, "real")
            self._padded_tokens = metrics.tokens.labels(model, version, "padded")

    def batch_done(self, items: int, requests: int, queue_s: float, compute_s: float) -> None:
        """One batch ran (items, requests with items in it, the oldest's wait, compute, seconds)."""
        stats = self.stats
        stats.inference_count += items
        stats.execution_count += 1
        stats.last_inference_ms = int(time.time() * 1000)
        stats.success.add(requests, requests * (queue_s + compute_s))
        stats.queue.add(requests, requests * queue_s)
        stats.compute_infer.add(requests, requests * compute_s)
        stats.batches.setdefault(items, Duration()).add(1, compute_s)
        if self._metrics is not None:
            self._worker_items.inc(items)
            self._items.observe(items)
            self._requests.observe(requests)
            self._queue.observe(queue_s)
            self._compute.observe(compute_s)

    def padding(self, real_tokens: int, padded_tokens: int) -> None:
        """A priced model's batch: its items' own tokens and what it computed."""
        if self._metrics is not None:
            self._real_tokens.inc(real_tokens)
            self._padded_tokens.inc(padded_tokens)

    def rejected(self, reason: str) -> None:
        """One request refused or dropped (``reason``: queue_full, admission, deadline, ...)."""
        self.stats.fail.add(1, 0.0)
        if self._metrics is not None:
            self._metrics.rejected.labels(*self._labels, reason).inc()

    def queue_depth(self, items: int) -> None:
        """Items waiting in the queue now."""
        if self._metrics is not None:
            self._depth.set(items)

    def restarted(self) -> None:
        """The version's serving loop stopped on a failure; it starts again after a backoff."""
        if self._metrics is not None:
            self._metrics.unit_restarts.labels(*self._labels).inc()

    def prioritized(self, level: int, outcome: str, waited_s: float | None = None) -> None:
        """A request at queue ``level`` (0 = Triton's priority 1) was ``admitted`` or ``refused``;
        or, with ``waited_s``, its first batch began after that many seconds in the queue."""
        if self._metrics is None:
            return
        priority = str(level + 1)
        if waited_s is not None:
            self._metrics.priority_queue_seconds.labels(*self._labels, priority).observe(waited_s)
        else:
            self._metrics.priority_requests.labels(*self._labels, priority, outcome).inc()


def create_metrics() -> ServerMetrics:
    """This process's metrics: file-backed under gunicorn, else in a registry of their own."""
    return ServerMetrics(None if multiprocess_dir() is not None else CollectorRegistry())
