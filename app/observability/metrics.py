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

Every metric is listed in ``docs/observability.md``. GPU figures are read
through NVML (:func:`gpu_stat.query_gpus`), never through CUDA, by a small task
per worker every ``gpu_metrics_interval_s``; in CPU mode there are none.

Source: prometheus_client's "Multiprocess Mode (E.g. Gunicorn)" documentation;
metric names follow Prometheus' naming guide (base units, ``_total``, ``_info``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    values,
)
from prometheus_client.multiprocess import MultiProcessCollector

import gpu_stat
from app.errors import ModelNotFound
from app.serving.state import REGISTRY as MODELS
from app.serving.state import SETTINGS, WORKER_INFO

log = logging.getLogger(__name__)

ENV_MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"
#: Seconds; dense from 0.5 ms to 100 ms, where a batched model's latency lives, up to 10 s.
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.075,
    0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
#: Items or requests per batch (powers of two up to the largest sensible max_batch_size).
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


def multiprocess_dir() -> str | None:
    """The multiprocess directory, or None for in-process collection.

    Raises:
        RuntimeError: the variable is set but ``prometheus_client`` was imported
            before it was, so samples would stay in this process.
    """
    path = os.environ.get(ENV_MULTIPROC_DIR)
    in_files = values.ValueClass is not values.MutexValue
    if path and not in_files:
        raise RuntimeError(
            f"{ENV_MULTIPROC_DIR}={path} was set after prometheus_client was imported; "
            "set it before (gunicorn.conf.py does) so every worker's metrics reach /metrics"
        )
    return path if path and in_files else None


class ServerMetrics:
    """The metrics of one worker process (multiprocess mode) or one app (in-process).

    Args:
        registry: where the metrics register for a scrape; None in multiprocess
            mode, where a scrape reads the files of every process instead.
    """

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.registry = registry
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
        self.queue_depth = Gauge(
            "scoring_queue_depth", "Items waiting in the batch queue (all workers).",
            model, multiprocess_mode="livesum", registry=r,
        )  # fmt: skip
        self.in_flight = Gauge(
            "scoring_requests_in_flight", "Inference requests being handled (all workers).",
            model, multiprocess_mode="livesum", registry=r,
        )  # fmt: skip
        self.rejected = Counter(
            "scoring_rejected", "Requests refused by the batcher: queue_full (503), deadline (504), "
            "out_of_memory (507), disconnected.",
            [*model, "reason"], registry=r,
        )  # fmt: skip
        self.hung_batches = Counter(
            "scoring_hung_batches", "Batches still running after SCORING_HUNG_INFERENCE_S; each "
            "one makes its worker restart itself.",
            model, registry=r,
        )  # fmt: skip
        self.load_seconds = Gauge(
            "scoring_model_load_seconds", "Time the worker took to load the model.",
            [*model, "pid"], multiprocess_mode="liveall", registry=r,
        )  # fmt: skip
        self.warmup_seconds = Gauge(
            "scoring_model_warmup_seconds", "Time the worker took to warm the model up.",
            [*model, "pid"], multiprocess_mode="liveall", registry=r,
        )  # fmt: skip
        self.binding = Gauge(
            "scoring_worker_binding_info", "1 per live worker, labelled with its GPU binding.",
            ["pid", "device", "gpu", "gpu_uuid", "slot"], multiprocess_mode="liveall", registry=r,
        )  # fmt: skip
        gpu = ["gpu", "gpu_uuid"]
        self.gpu_memory_used = Gauge(
            "scoring_gpu_memory_used_bytes", "Memory in use on a bound GPU (all processes), per NVML.",
            gpu, multiprocess_mode="livemostrecent", registry=r,
        )  # fmt: skip
        self.gpu_memory_total = Gauge(
            "scoring_gpu_memory_total_bytes", "Memory of a bound GPU, per NVML.",
            gpu, multiprocess_mode="livemostrecent", registry=r,
        )  # fmt: skip
        self.gpu_utilization = Gauge(
            "scoring_gpu_utilization_percent",
            "Percent of the last sample period a kernel ran on a bound GPU, per NVML.",
            gpu, multiprocess_mode="livemostrecent", registry=r,
        )  # fmt: skip

    def observer(self, model: str, version: str) -> BatchMetrics:
        """A :class:`app.serving.observer.BatchObserver` that records one model version's batches."""
        return BatchMetrics(self, model, version)

    def model_ready(self, model: str, version: str, load_s: float, warmup_s: float) -> None:
        pid = str(os.getpid())
        self.load_seconds.labels(model, version, pid).set(load_s)
        self.warmup_seconds.labels(model, version, pid).set(warmup_s)

    def set_binding(self, labels: Mapping[str, str]) -> None:
        """Publish this worker's binding (``gpu_stat.Binding.as_labels()`` keys)."""
        self.binding.labels(
            str(os.getpid()),
            labels.get("device", ""),
            labels.get("gpu", ""),
            labels.get("gpu_uuid", ""),
            labels.get("slot", ""),
        ).set(1)

    def set_gpus(self, gpus: Sequence[gpu_stat.GpuInfo], index: str) -> None:
        """Record memory and utilisation of the bound GPU(s), labelled ``gpu=index`` (the
        binding's index, in the master's view: the worker's own view numbers its GPU 0)."""
        for gpu in gpus:
            labels = (index, gpu.uuid)
            self.gpu_memory_used.labels(*labels).set(gpu.memory_used)
            self.gpu_memory_total.labels(*labels).set(gpu.memory_total)
            if gpu.utilization_percent is not None:
                self.gpu_utilization.labels(*labels).set(gpu.utilization_percent)

    def render(self) -> bytes:
        """The Prometheus text exposition of every worker (multiprocess) or this app."""
        path = multiprocess_dir()
        if path is not None:
            registry = CollectorRegistry()
            MultiProcessCollector(registry, path)  # type: ignore[no-untyped-call]
            return generate_latest(registry)
        assert self.registry is not None
        return generate_latest(self.registry) + generate_latest(REGISTRY)


class BatchMetrics:
    """Batch events of one model version (implements ``app.serving.observer.BatchObserver``)."""

    def __init__(self, metrics: ServerMetrics, model: str, version: str) -> None:
        self._metrics = metrics
        self._labels = (model, version)
        self._queue = metrics.queue_seconds.labels(model, version)
        self._compute = metrics.compute_seconds.labels(model, version)
        self._items = metrics.batch_size.labels(model, version)
        self._requests = metrics.batch_requests.labels(model, version)
        self._depth = metrics.queue_depth.labels(model, version)

    def batch_done(self, items: int, requests: int, queue_s: float, compute_s: float) -> None:
        self._items.observe(items)
        self._requests.observe(requests)
        self._queue.observe(queue_s)
        self._compute.observe(compute_s)

    def rejected(self, reason: str) -> None:
        self._metrics.rejected.labels(*self._labels, reason).inc()

    def queue_depth(self, items: int) -> None:
        self._depth.set(items)


METRICS = web.AppKey("metrics", ServerMetrics)


def create_metrics() -> ServerMetrics:
    """This process's metrics: file-backed under gunicorn, else in a registry of their own."""
    return ServerMetrics(None if multiprocess_dir() is not None else CollectorRegistry())


def binding_labels(device: str) -> dict[str, str]:
    """The worker's binding labels from ``SCORING_BINDING`` (set by gunicorn.conf.py's
    ``post_fork``); outside gunicorn: ``device`` and empty GPU fields."""
    labels = {"device": device, "gpu": "", "gpu_uuid": "", "slot": ""}
    raw = os.environ.get("SCORING_BINDING")
    if raw:
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError:
            log.warning("SCORING_BINDING is not JSON: %r", raw)
        else:
            if isinstance(parsed, dict):
                labels.update({k: str(v) for k, v in parsed.items() if k in labels})
    return labels


def _inference_protocol(request: web.Request) -> str | None:
    """"v1" or "v2" for a routed inference request, else None (health, metadata, /metrics)."""
    if request.method != "POST" or request.match_info.http_exception is not None:
        return None
    path = request.path
    if path.startswith("/v2/models/") and path.endswith("/infer"):
        return "v2"
    if path.startswith("/v1/models/") and path.endswith(":predict"):
        return "v1"
    return None


def _model_labels(request: web.Request) -> tuple[str, str]:
    """(model, version) of the request; ("", "") for a model this worker does not serve."""
    info = request.match_info
    try:
        config = request.app[MODELS].get(info["name"], info.get("version")).config
    except (ModelNotFound, KeyError):
        return "", ""
    return config.name, config.version


@web.middleware
async def metrics_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Count and time inference requests; sits outside the error middleware, so it sees
    the status the client gets."""
    protocol = _inference_protocol(request)
    if protocol is None:
        return await handler(request)
    metrics = request.app[METRICS]
    model, version = _model_labels(request)
    in_flight = metrics.in_flight.labels(model, version)
    in_flight.inc()
    start = time.perf_counter()
    code = 500
    try:
        response = await handler(request)
        code = response.status
        return response
    except web.HTTPException as exc:
        code = exc.status
        raise
    except asyncio.CancelledError:
        code = 499  # the client went away (nginx's code; nothing was sent)
        raise
    finally:
        in_flight.dec()
        metrics.request_seconds.labels(model, version, protocol).observe(time.perf_counter() - start)
        metrics.requests.labels(model, version, protocol, str(code)).inc()


async def metrics_handler(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text format, the whole server's figures."""
    body = await asyncio.get_running_loop().run_in_executor(None, request.app[METRICS].render)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _bound_gpus(uuid: str) -> list[gpu_stat.GpuInfo]:
    """The GPU (or MIG instance) with this uuid, from a fresh NVML snapshot."""
    found: list[gpu_stat.GpuInfo] = []
    for gpu in gpu_stat.query_gpus():
        found.extend(g for g in (gpu, *gpu.mig_instances) if g.uuid == uuid)
    return found


async def _poll_gpus(metrics: ServerMetrics, uuid: str, index: str, interval_s: float) -> None:
    loop = asyncio.get_running_loop()
    failing = False
    while True:
        try:
            # NVML calls take milliseconds: off the event loop and off the inference thread.
            gpus = await loop.run_in_executor(None, _bound_gpus, uuid)
            metrics.set_gpus(gpus, index)
        except Exception as exc:  # best effort: GPU figures must never take the worker down
            if not failing:
                expected = isinstance(exc, (gpu_stat.NvmlUnavailable, OSError, ValueError))
                log.warning("GPU metrics unavailable for %s: %s", uuid, exc, exc_info=not expected)
            failing = True
        else:
            if failing:
                log.info("GPU metrics for %s available again", uuid)
            failing = False
        await asyncio.sleep(interval_s)


async def gpu_metrics_ctx(app: web.Application) -> AsyncIterator[None]:
    """``cleanup_ctx``: publish the binding; poll the bound GPU through NVML (GPU mode only)."""
    metrics = app[METRICS]
    labels = binding_labels(str(app[WORKER_INFO]["device"]))
    metrics.set_binding(labels)
    task: asyncio.Task[None] | None = None
    if labels["gpu_uuid"]:
        task = asyncio.get_running_loop().create_task(
            _poll_gpus(metrics, labels["gpu_uuid"], labels["gpu"], app[SETTINGS].gpu_metrics_interval_s),
            name="gpu-metrics",
        )
    try:
        yield
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
