"""How a model version's batches run: the model runner and the executor.

:class:`ModelRunner` is one loaded model on one device (a handler plus its ``model.toml``) and
the stages a batch goes through; :class:`BatchExecutor` runs one model version's batches, and its
requests' pricing, on the model's threads (:class:`Threads`).

**Stages.** A batch goes through three stages (:meth:`ModelRunner.prepare`,
:meth:`~ModelRunner.predict`, :meth:`~ModelRunner.finish`: the handler's ``preprocess`` ->
``predict`` -> ``postprocess``, each under ``torch.inference_mode()``). The serving unit's
executor runs them on three threads (the staged pipeline: the GPU never waits for the CPU work of
the next or previous batch) or all three on the inference thread (:meth:`ModelRunner.run_batch`).

**Streams.** On a CUDA device each stage runs on a CUDA stream of its own (copies in, kernels,
copies out), ordered by events, so the copies of one batch overlap the kernels of another
(:class:`Streams`).

**Failures contained.** :meth:`ModelRunner.run_batch` is where failures stay contained: when the
device runs out of memory it halves the batch and retries each half (recursively), so only an
item that fails alone is reported as too large; when the handler raises on a batch of several
requests it runs each request's items alone, so only the requests the handler cannot take fail.

**Where a batch runs.** Inline, all three stages on the model's inference thread
(:meth:`BatchExecutor.run` awaits ``run_batch``: the CPU default, where stages would only share
the same cores), or through the **staged pipeline** (a CUDA device's default): ``preprocess`` on
a prepare thread, ``predict`` on the inference thread, ``postprocess`` on a finish thread, so
that while batch N runs on the device, batch N+1 is prepared and batch N-1 copied back and
finished. One batch at a time is prepared ahead of the one predicting, so batches still grow
under load. A batch whose stage fails, or that runs out of device memory, runs again inline on
the inference thread, where out-of-memory halves it and a handler's failure on a batch of
several requests is retried per request (:meth:`ModelRunner.run_batch`).

**Pricing.** A model whose handler prices its items (``item_costs``: tokens) has each request
priced on a prepare thread before it is queued (:meth:`BatchExecutor.price`,
:meth:`ModelRunner.item_costs`).

**Threads.** :class:`InferenceThread` is a ``concurrent.futures.Executor`` of daemon threads:
``ThreadPoolExecutor`` joins its threads when the interpreter exits, so a worker whose model
never returns could never exit, and only a SIGKILL would free its GPU; with a daemon thread the
worker drains, exits and is replaced, and the stuck call dies with the process.

**Sources.** Infinity's staged model worker (tokenise, forward, postprocess on three threads) and
text-embeddings-inference's tokenisation workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import importlib.util
import itertools
import logging
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from app.datatypes import NUMPY_DTYPES
from app.errors import InferenceFailed, InvalidInput, ModelLoadError, ScoringError
from app.models.base import Handler, Segment
from app.models.repository import ModelConfig, TensorSpec
from app.models.torch_formats import TorchExportHandler, TorchScriptHandler
from app.serving.queue import Chunk, QueuedRequest, Tensors, padded_to_longest

log = logging.getLogger(__name__)
T = TypeVar("T")
_Work = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]

# --- the model runner: one loaded model on its device -------------------------------------


def is_out_of_memory(exc: BaseException) -> bool:
    """True for a device out-of-memory error (CUDA OOM, or a RuntimeError saying so)."""
    oom_type = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    return isinstance(exc, oom_type) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


def resolve_handler(config: ModelConfig) -> Handler:
    """Instantiate the handler for ``config``'s format.

    ``handler = "module:Class"``: a ``module.py`` inside the model folder wins
    over an importable module of that name. Importing a handler runs its code:
    a model repository is trusted like the server's own code.

    Raises:
        ModelLoadError: module or class not found, the module raised while importing, or the
            class lacks a hook.
    """
    if config.format == "torch_export":
        return TorchExportHandler()
    if config.format == "torchscript":
        return TorchScriptHandler()
    if config.format == "onnx":
        from app.models.onnx_format import OnnxHandler  # onnxruntime is imported when a session opens

        return OnnxHandler()
    assert config.handler is not None
    module_name, _, class_name = config.handler.partition(":")
    local = config.path / (module_name.replace(".", "/") + ".py")
    try:
        if local.is_file():
            qualified = f"_scoring_model_{config.name.replace('-', '_')}_{module_name}"
            spec = importlib.util.spec_from_file_location(qualified, local)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[qualified] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        cls = getattr(module, class_name)
    except Exception as exc:  # a handler module may raise anything while it imports
        shown = exc if isinstance(exc, (ImportError, AttributeError)) else f"{type(exc).__name__}: {exc}"
        raise ModelLoadError(
            f"model {config.name}: cannot import handler {config.handler!r}: {shown}"
        ) from exc
    handler = cls()
    missing = [h for h in ("load", "preprocess", "predict", "postprocess") if not hasattr(handler, h)]
    if missing:
        raise ModelLoadError(f"model {config.name}: handler {config.handler!r} lacks {', '.join(missing)}")
    return handler  # type: ignore[no-any-return]


def synthetic_inputs(specs: list[TensorSpec], batch_size: int) -> dict[str, np.ndarray]:
    """Warmup inputs: zeros (numeric) or distinct short texts ``b"warmup item <i>"`` (BYTES:
    distinct, so that a handler that encodes each distinct string once still computes every
    item, and the service rate timed on them is not a single string's), variable dims 8."""
    out = {}
    for spec in specs:
        array = spec.filled(batch_size, text=b"warmup", variable_dim=8)
        if array.dtype == object:
            flat = array.reshape(-1)
            flat[:] = [b"warmup item %d" % i for i in range(flat.size)]
        out[spec.name] = array
    return out


class Streams:
    """The CUDA streams of the three stages, and the events that order them (None on the CPU).

    ``prepare`` copies to the device on the copy stream and records ``ready``; ``predict``
    makes the compute stream wait for it, launches the kernels and records ``done``;
    ``finish`` makes the copy-back stream wait for ``done`` and copies to the host. Tensors
    stay referenced (by the batch in flight) until ``finish`` has synchronised, so the caching
    allocator never hands their memory to another stream too early.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.copy_in = torch.cuda.Stream(device) if self.cuda else None  # type: ignore[no-untyped-call]
        self.compute = torch.cuda.Stream(device) if self.cuda else None  # type: ignore[no-untyped-call]
        self.copy_out = torch.cuda.Stream(device) if self.cuda else None  # type: ignore[no-untyped-call]

    def on(self, stream: Any) -> Any:
        """A context manager making ``stream`` current (nothing on the CPU)."""
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def mark(self, stream: Any) -> Any:
        """An event recorded on ``stream`` now (None on the CPU)."""
        if stream is None:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
        return event

    @staticmethod
    def after(stream: Any, event: Any) -> None:
        """Make ``stream`` wait for ``event`` (device-side; the host does not block)."""
        if stream is not None and event is not None:
            stream.wait_event(event)


class Staged:
    """A batch between stages: the handler's own object, and the event that says it is ready."""

    __slots__ = ("event", "value")

    def __init__(self, value: Any, event: Any) -> None:
        self.value = value
        self.event = event


class ModelRunner:
    """A model's handler plus its config; the stages run on the threads the executor gives them
    (module docstring)."""

    def __init__(self, config: ModelConfig, handler: Handler | None = None) -> None:
        self.config = config
        self.handler: Handler = handler if handler is not None else resolve_handler(config)
        self.device = torch.device("cpu")
        self.streams = Streams(self.device)
        self.load_seconds = 0.0
        self.warmup_seconds = 0.0
        self._item_costs = getattr(self.handler, "item_costs", None)
        self._batch_cost = getattr(self.handler, "batch_cost", None)

    @property
    def prices_items(self) -> bool:
        """Whether the handler prices its items (``item_costs``): batches are then formed by
        ``max_batch_tokens`` and admission reasons in that cost."""
        return self._item_costs is not None

    def load(self, device: torch.device) -> None:
        """Load onto ``device``; raises ``ModelLoadError`` (with the cause) on failure."""
        start = time.perf_counter()
        self.device = device
        self.streams = Streams(device)
        graphs = self.config.format == "handler" and self.config.cuda_graph_batch_sizes
        if graphs and not hasattr(self.handler, "cuda_graph_shapes"):
            raise ModelLoadError(
                f"model {self.config.name}: handler {self.config.handler!r} does not capture CUDA graphs; "
                "remove cuda_graph_batch_sizes from its model.toml"
            )
        try:
            self.handler.load(device, self.config)
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"model {self.config.name}: load failed: {exc!r}") from exc
        self.load_seconds = time.perf_counter() - start

    def warmup(self) -> None:
        """Run one batch per ``warmup_batch_sizes`` entry and check the outputs' shapes.

        Raises:
            ModelLoadError: the model fails on synthetic input or returns
                outputs that do not match ``model.toml``.
        """
        start = time.perf_counter()
        for batch_size in self.config.warmup_batch_sizes:
            try:
                outputs = self.forward(synthetic_inputs(self.config.inputs, batch_size))
            except Exception as exc:
                raise ModelLoadError(
                    f"model {self.config.name}: warmup at batch size {batch_size} failed: {exc!r}"
                ) from exc
            self._check_outputs(outputs, batch_size)
        self.warmup_seconds = time.perf_counter() - start

    def _check_outputs(self, outputs: Mapping[str, np.ndarray], batch_size: int) -> None:
        for spec in self.config.outputs:
            arr = outputs.get(spec.name)
            if arr is None:
                raise ModelLoadError(f"model {self.config.name}: output {spec.name!r} missing")
            want = (batch_size, *spec.shape)
            ok = arr.ndim == len(want) and all(w in (-1, a) for w, a in zip(want, arr.shape, strict=True))
            if not ok:
                raise ModelLoadError(
                    f"model {self.config.name}: output {spec.name!r} has shape {list(arr.shape)}, "
                    f"model.toml declares [batch, *{spec.shape}]"
                )

    # --- per request --------------------------------------------------------------------

    def item_costs(self, inputs: Mapping[str, np.ndarray]) -> np.ndarray | None:
        """What each of one request's items costs the model (int64 ``[B]``, >= 1), from the
        handler's ``item_costs``; None when it does not price its items. Runs on a prepare
        thread, before the request's items join the queue.

        Raises:
            InvalidInput: the handler refused an item (its ``ValueError``/``UnicodeError``).
            ScoringError: what the handler raised of these (``PayloadTooLarge``: 413).
            InferenceFailed: the handler raised anything else, or returned a wrong shape.
        """
        if self._item_costs is None:
            return None
        size = len(next(iter(inputs.values())))
        try:
            costs = np.asarray(self._item_costs(inputs), dtype=np.int64).reshape(-1)
        except (ValueError, UnicodeError) as exc:
            raise InvalidInput(f"model {self.config.name}: {exc}") from None
        except ScoringError:  # the handler's own outcome (PayloadTooLarge: too many windows)
            raise
        except Exception as exc:
            log.exception("model %s: item_costs failed", self.config.name)
            raise InferenceFailed(f"model {self.config.name} could not price the request: {exc!r}") from exc
        if costs.shape != (size,):
            raise InferenceFailed(
                f"model {self.config.name}: item_costs gave {costs.shape[0]} costs for {size} items"
            )
        return np.maximum(costs, 1)

    def batch_cost(self, costs: np.ndarray) -> float:
        """What a batch of items costing ``costs`` (``item_costs``, int64 ``[N]``, N >= 1)
        computes, padding included: the handler's ``batch_cost``, else every item padded to the
        costliest (``max * N``). Runs on the event loop, once per batch."""
        if self._batch_cost is not None:
            return float(self._batch_cost(costs))
        return float(costs.max()) * len(costs)

    # --- the three stages of a batch ------------------------------------------------------

    def prepare(self, inputs: Mapping[str, np.ndarray]) -> Staged:
        """Stage 1 (a prepare thread): ``preprocess``, on the copy stream."""
        streams = self.streams
        with torch.inference_mode(), streams.on(streams.copy_in):
            batch = self.handler.preprocess(inputs)
            return Staged(batch, streams.mark(streams.copy_in))

    def predict(self, prepared: Staged) -> Staged:
        """Stage 2 (the inference thread): ``predict``, on the compute stream once the inputs
        are on the device; returns without waiting for the device."""
        streams = self.streams
        with torch.inference_mode(), streams.on(streams.compute):
            streams.after(streams.compute, prepared.event)
            raw = self.handler.predict(prepared.value)
            return Staged(raw, streams.mark(streams.compute))

    def finish(self, predicted: Staged) -> dict[str, np.ndarray]:
        """Stage 3 (a finish thread): ``postprocess`` once the kernels are done, on the
        copy-back stream: numpy arrays of the declared dtypes, ``[B, ...]`` per output."""
        streams = self.streams
        with torch.inference_mode(), streams.on(streams.copy_out):
            streams.after(streams.copy_out, predicted.event)
            outputs = self.handler.postprocess(predicted.value)
            if streams.copy_out is not None:
                streams.copy_out.synchronize()
        return {
            s.name: np.asarray(outputs[s.name], dtype=NUMPY_DTYPES[s.datatype]) for s in self.config.outputs
        }

    def forward(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The three stages in turn on this thread: inputs [B, ...] per input name -> outputs
        [B, ...] per output (numpy, the dtypes ``model.toml`` declares).

        Raises:
            Exception: whatever the handler raised, device out-of-memory included.
        """
        return self.finish(self.predict(self.prepare(inputs)))

    def run_batch(
        self, inputs: Mapping[str, np.ndarray], groups: Sequence[tuple[int, int]] = ()
    ) -> list[Segment]:
        """Run one batch on this thread, halving it on device out-of-memory errors and, when the
        handler raises on a batch of several requests (``groups``: each request's items
        ``[start, stop)``), running each request's items alone.

        Returns:
            Segments covering items [0, B) in order; a segment's ``outputs`` is None when its
            items failed: ``error`` says why (None: one item that does not fit in memory alone).
        """
        return self._run_split(inputs, 0, groups)

    def _run_split(
        self, inputs: Mapping[str, np.ndarray], offset: int, groups: Sequence[tuple[int, int]] = ()
    ) -> list[Segment]:
        batch_size = len(next(iter(inputs.values())))
        stage = "preprocess"
        try:
            prepared = self.prepare(inputs)
            stage = "predict"
            return [Segment(offset, offset + batch_size, self.finish(self.predict(prepared)))]
        except Exception as exc:
            if not is_out_of_memory(exc):
                if len(groups) > 1:
                    return self._run_alone(inputs, offset, groups)
                return [Segment(offset, offset + batch_size, None, error=self.failure(exc, stage))]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if batch_size == 1:
            log.warning("model %s: one item does not fit in %s memory", self.config.name, self.device)
            return [Segment(offset, offset + 1, None)]
        half = batch_size // 2
        log.warning(
            "model %s: out of memory at batch size %d, retrying as %d + %d",
            self.config.name,
            batch_size,
            half,
            batch_size - half,
        )
        return self._run_split({k: v[:half] for k, v in inputs.items()}, offset) + self._run_split(
            {k: v[half:] for k, v in inputs.items()}, offset + half
        )

    def _run_alone(
        self, inputs: Mapping[str, np.ndarray], offset: int, groups: Sequence[tuple[int, int]]
    ) -> list[Segment]:
        log.warning(
            "model %s: a batch of %d requests failed; running each request alone",
            self.config.name, len(groups),
        )  # fmt: skip
        segments: list[Segment] = []
        for start, stop in groups:
            part = {k: v[start:stop] for k, v in inputs.items()}
            segments += self._run_split(part, offset + start)
        return segments

    def failure(self, exc: BaseException, stage: str) -> ScoringError:
        """The error the requests of a failed batch get: 400 for a ``ValueError`` (or
        ``UnicodeError``, ``TypeError``) of ``preprocess`` (the handler cannot take these
        items), else 500 naming the model (the traceback goes to the log)."""
        if stage == "preprocess" and isinstance(exc, (ValueError, UnicodeError, TypeError)):
            log.info("model %s: preprocess refused items: %s", self.config.name, exc)
            return InvalidInput(f"model {self.config.name} cannot take these items: {exc}")
        log.error("model %s failed in %s", self.config.name, stage, exc_info=exc)
        return InferenceFailed(f"model {self.config.name} failed on the batch: {type(exc).__name__}")

    def close(self) -> int:
        """Drop the handler's references so the model's memory can be freed; on a CUDA device
        give the cached blocks back (``torch.cuda.empty_cache``). Returns the device bytes freed
        (0 on the CPU). Call it on the model's inference thread, after its last batch."""
        before = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0
        close = getattr(self.handler, "close", None)
        if callable(close):
            close()
        self.handler = None  # type: ignore[assignment]
        if self.device.type != "cuda":
            return 0
        gc.collect()
        torch.cuda.empty_cache()
        return int(before - torch.cuda.memory_reserved(self.device))


def describe(runner: ModelRunner) -> dict[str, Any]:
    """Load/warmup figures for logs: seconds, device."""
    return {
        "model": runner.config.name,
        "version": runner.config.version,
        "device": str(runner.device),
        "load_s": round(runner.load_seconds, 3),
        "warmup_s": round(runner.warmup_seconds, 3),
    }


# --- the executor: a model version's batches on its threads --------------------------------


class Batch:
    """One batch formed from ``chunks`` at loop time ``formed_at``: its inputs (``[items, ...]``
    per input name; no copy for a batch that is one whole request), its requests and their item
    ranges within it (``groups``), its size and its cost (for a priced model ``batch_cost`` of
    its items' costs: the padded tokens it computes; else its items)."""

    __slots__ = (
        "chunks", "cost", "formed_at", "groups", "inputs", "items", "queue_s", "real_tokens",
        "requests", "trace",
    )  # fmt: skip

    def __init__(
        self,
        chunks: list[Chunk],
        formed_at: float,
        batch_cost: Callable[[np.ndarray], float] = padded_to_longest,
    ) -> None:
        self.chunks = chunks
        self.formed_at = formed_at
        first = chunks[0]
        if len(chunks) == 1 and first.start == 0 and first.stop == first.request.size:
            self.inputs = dict(first.request.inputs)
        else:
            self.inputs = {
                n: np.concatenate([c.request.inputs[n][c.start : c.stop] for c in chunks])
                for n in first.request.inputs
            }
        self.requests = {id(c.request): c.request for c in chunks}
        self.queue_s = formed_at - min(r.arrival for r in self.requests.values())
        sizes = [c.stop - c.start for c in chunks]
        self.items = sum(sizes)
        self.groups = list(itertools.pairwise(np.cumsum([0, *sizes]).tolist()))
        priced = [c.request.tokens[c.start : c.stop] for c in chunks if c.request.tokens is not None]
        self.real_tokens = sum(int(t.sum()) for t in priced)
        self.cost = batch_cost(np.concatenate(priced)) if priced else float(self.items)
        #: Its ``batch`` span (``app.observability.tracing``), when a request in it is traced.
        self.trace: Any = None


def assemble(request: QueuedRequest) -> Tensors:
    """A request's outputs from its parts ``(first item, outputs)``, in the order its items
    were sent (the sort by cost undone)."""
    parts = request.parts
    if len(parts) == 1:
        out = parts[0][1]
    else:
        ordered = sorted(parts, key=lambda p: p[0])
        out = {k: np.concatenate([p[1][k] for p in ordered]) for k in ordered[0][1]}
    order = request.order
    if order is None:
        return out
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    return {k: v[inverse] for k, v in out.items()}


def outputs_between(segments: list[Segment], start: int, stop: int) -> Tensors | Segment:
    """Outputs for batch items ``[start, stop)`` across a batch's segments, or the first failed
    segment among them."""
    pieces: list[Tensors] = []
    for seg in segments:
        lo, hi = max(start, seg.start), min(stop, seg.stop)
        if lo >= hi:
            continue
        if seg.outputs is None:
            return seg
        pieces.append({k: v[lo - seg.start : hi - seg.start] for k, v in seg.outputs.items()})
    if len(pieces) == 1:
        return pieces[0]
    return {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]}


class InferenceThread(Executor):
    """Runs submitted calls on ``threads`` daemon threads, in order of submission (one thread:
    one at a time, in order).

    Args:
        name: the thread's name (shows in py-spy dumps and logs); ``name-<i>`` with several.
        initializer: called once on each thread before any work, like ``ThreadPoolExecutor``'s;
            if it raises, every call submitted raises that exception.
        threads: how many threads take calls from the queue.
    """

    def __init__(
        self, name: str = "inference", initializer: Callable[[], None] | None = None, threads: int = 1
    ) -> None:
        self._initializer = initializer
        self._queue: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._shutdown = False
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, name=name if threads == 1 else f"{name}-{i}", daemon=True)
            for i in range(max(1, threads))
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Queue ``fn(*args, **kwargs)``; raises RuntimeError after ``shutdown``."""
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new calls after shutdown")
            future: Future[T] = Future()
            self._queue.put((future, fn, args, kwargs))
            return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking calls; ``wait`` joins the threads (never when a call may be stuck)."""
        with self._lock:
            self._shutdown = True
            if cancel_futures:
                while True:
                    try:
                        work = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if work is not None:
                        work[0].cancel()
            for _ in self._threads:
                self._queue.put(None)
        if wait:
            for thread in self._threads:
                thread.join()

    @property
    def alive(self) -> bool:
        """True while a thread runs (they end after ``shutdown`` and the queued calls)."""
        return any(thread.is_alive() for thread in self._threads)

    def _run(self) -> None:
        failure: BaseException | None = None
        if self._initializer is not None:
            try:
                self._initializer()
            except BaseException as exc:
                failure = exc
        while True:
            work = self._queue.get()
            if work is None:
                return
            future, fn, args, kwargs = work
            if not future.set_running_or_notify_cancel():
                continue
            if failure is not None:
                future.set_exception(failure)
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)


@dataclass(frozen=True)
class Threads:
    """The threads of one model version: its inference thread, and for the staged pipeline and
    item pricing a prepare pool and a finish thread (None: the inference thread does that)."""

    inference: Executor
    prepare: Executor | None = None
    finish: Executor | None = None

    def shutdown(self, wait: bool) -> None:
        """Shut every thread down (``wait=False`` and the queued calls cancelled: a call may be
        stuck)."""
        for pool in {id(p): p for p in (self.inference, self.prepare, self.finish) if p is not None}.values():
            pool.shutdown(wait=wait, cancel_futures=not wait)


class BatchRunner(Protocol):
    """What an executor runs (:class:`ModelRunner`): one batch inline, with out-of-memory
    halving and per-request retries (``groups``: each request's items)."""

    def run_batch(
        self, inputs: Mapping[str, np.ndarray], groups: Sequence[tuple[int, int]] = ()
    ) -> list[Segment]: ...


@dataclass(frozen=True)
class RunningBatch:
    """A batch on the model's threads: when it started (``loop.time()``), its size and cost,
    and its requests' ids (read by the hung-inference watchdog and by admission)."""

    started: float
    items: int
    cost: float
    request_ids: tuple[str, ...]


#: What the executor hands back per batch: (batch, its segments, compute seconds) or, when the
#: whole batch failed, (batch, the exception).
Done = Callable[[Batch, list[Segment], float], None]
Failed = Callable[[Batch, BaseException], None]


class BatchExecutor:
    """Runs one model version's batches, inline or staged (module docstring).

    Args:
        name: the model, in messages.
        runner: the loaded model (:class:`ModelRunner`); for the staged pipeline it also has
            ``prepare``, ``predict`` and ``finish``.
        threads: its threads; an ``Executor`` alone is taken as the inference thread.
        staged: run batches through the staged pipeline (``threads`` then needs prepare and
            finish threads).
        item_costs: prices one request's items on a prepare thread (int64 ``[B]``), None when
            the model does not price them.
    """

    def __init__(
        self,
        name: str,
        runner: BatchRunner,
        threads: Threads | Executor,
        *,
        staged: bool = False,
        item_costs: Callable[[Mapping[str, np.ndarray]], np.ndarray | None] | None = None,
    ) -> None:
        self.name = name
        self.runner = runner
        self.threads = threads if isinstance(threads, Threads) else Threads(threads)
        if staged and (self.threads.prepare is None or self.threads.finish is None):
            raise ValueError("the staged pipeline needs prepare and finish threads")
        self.staged = staged
        self._item_costs = item_costs
        #: The batches running, oldest first (the hot path only appends and removes one each).
        self.running: deque[RunningBatch] = deque()
        self._ahead = asyncio.Semaphore(1)  # one batch prepared ahead of the one predicting
        self._in_flight = asyncio.Semaphore(3)  # the pipeline's three stages
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def prices(self) -> bool:
        """Whether requests are priced (``item_costs``) before they queue."""
        return self._item_costs is not None

    def price(self, inputs: Mapping[str, np.ndarray]) -> Awaitable[np.ndarray | None]:
        """One request's item costs, computed on a prepare thread (int64 ``[B]``)."""
        assert self._item_costs is not None
        return asyncio.get_running_loop().run_in_executor(self.threads.prepare, self._item_costs, inputs)

    async def room(self) -> None:
        """Wait until the pipeline can take another batch (inline: at once)."""
        if self.staged:
            await self._in_flight.acquire()
            await self._ahead.acquire()

    def no_batch(self) -> None:
        """Give back the room taken by :meth:`room` when no batch was formed."""
        if self.staged:
            self._ahead.release()
            self._in_flight.release()

    async def run(self, batch: Batch, done: Done, failed: Failed) -> None:
        """Run ``batch`` and report it to ``done`` or ``failed``: inline, this returns once it
        has run; staged, once it is handed to the inference thread (the rest goes on in a task)."""
        if not self.staged:
            await self._inline(batch, done, failed)
            return
        task = asyncio.get_running_loop().create_task(self._staged(batch, done, failed))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _start(self, batch: Batch) -> RunningBatch:
        running = RunningBatch(
            asyncio.get_running_loop().time(),
            batch.items,
            batch.cost,
            tuple(r.request_id for r in batch.requests.values()),
        )
        self.running.append(running)
        return running

    async def _inline(self, batch: Batch, done: Done, failed: Failed) -> None:
        loop = asyncio.get_running_loop()
        running = self._start(batch)
        start = time.perf_counter()
        try:
            segments = await loop.run_in_executor(
                self.threads.inference, self.runner.run_batch, batch.inputs, batch.groups
            )
        except Exception as exc:
            failed(batch, exc)
            return
        finally:
            self.running.remove(running)
        done(batch, segments, time.perf_counter() - start)

    async def _staged(self, batch: Batch, done: Done, failed: Failed) -> None:
        """Prepare (prepare thread), predict (inference thread, in batch order: the next batch
        forms only once this one is handed to it), finish (finish thread); on any failure, run
        it inline instead."""
        runner: Any = self.runner
        threads = self.threads
        loop = asyncio.get_running_loop()
        released = False
        running = None
        try:
            start = time.perf_counter()
            try:
                prepared = await loop.run_in_executor(threads.prepare, runner.prepare, batch.inputs)
                running = self._start(batch)
                predicting = loop.run_in_executor(threads.inference, runner.predict, prepared)
                self._ahead.release()
                released = True
                predicted = await predicting
                outputs = await loop.run_in_executor(threads.finish, runner.finish, predicted)
            except Exception as exc:
                if running is not None:
                    self.running.remove(running)
                    running = None
                if not released:
                    self._ahead.release()
                    released = True
                log.info("model %s: a pipelined batch failed (%r); running it inline", self.name, exc)
                await self._inline(batch, done, failed)
                return
            done(batch, [Segment(0, batch.items, outputs)], time.perf_counter() - start)
        except asyncio.CancelledError as exc:  # the unit stops: its requests fail
            failed(batch, exc)
            raise
        finally:
            if running is not None:
                self.running.remove(running)
            if not released:
                self._ahead.release()
            self._in_flight.release()

    async def stop(self) -> None:
        """Cancel the staged batches in flight (each reported to its ``failed``)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
