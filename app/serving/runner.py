"""The model runner: one loaded model on its device (its handler and ``model.toml``).

**Stages.** A batch goes through three (:meth:`ModelRunner.prepare`, :meth:`~ModelRunner.predict`,
:meth:`~ModelRunner.finish`: the handler's ``preprocess`` -> ``predict`` -> ``postprocess``, each
under ``torch.inference_mode()``), which the executor (:mod:`app.serving.executor`) runs on
three threads or all on the inference thread (:meth:`ModelRunner.run_batch`). On CUDA each stage
has a stream (:class:`Streams`, ordered by events): one batch's copies overlap another's kernels.

**Failures contained** in :meth:`ModelRunner.run_batch`: when the device runs out of memory it
halves the batch and retries each half (recursively), so only an item that fails alone is
reported as too large; when the handler raises on a batch of several requests it runs each
request's items alone, so only the requests the handler cannot take fail. Both slice every
input alike, the items' preparations (``PREPARED``) included.

**Pricing and calibration.** A handler may price a request's items (``item_costs``: tokens, and
with :class:`app.models.base.Priced` each item's preparation); :meth:`ModelRunner.item_costs`
checks what it returns. After warmup :meth:`ModelRunner.calibrate` times a small and a large
batch, seeding admission's service rate (overhead, cost per unit) before the first request.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from app.datatypes import NUMPY_DTYPES, ragged
from app.errors import InferenceFailed, InvalidInput, ModelLoadError, ScoringError
from app.models.base import PREPARED, Handler, Priced, Segment, distinct_rows, shared_rows
from app.models.loading import resolve_handler
from app.models.memory import trim_heap
from app.models.repository import ModelConfig, TensorSpec

log = logging.getLogger(__name__)

#: Timings of each calibration batch, the best kept: a batch descheduled once (another worker
#: loading on the same cores) does not become the model's speed.
CALIBRATION_ROUNDS = 2


def is_out_of_memory(exc: BaseException) -> bool:
    """True for a device out-of-memory error (CUDA OOM, or a RuntimeError saying so)."""
    oom_type = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    return isinstance(exc, oom_type) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


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
    """A batch between stages: the handler's own object, the event that says it is ready, and
    its items (each output must have as many rows)."""

    __slots__ = ("event", "items", "value")

    def __init__(self, value: Any, event: Any, items: int) -> None:
        self.value = value
        self.event = event
        self.items = items


def _output(name: str, spec: TensorSpec, value: Any, items: int) -> np.ndarray:
    """One output of ``postprocess`` as the server carries it: an array ``[items, ...]`` of the
    declared datatype, or for a ragged output (``TensorSpec.ragged``) an object array ``[items]``
    of arrays ``[n_i, *shape[1:]]`` of it.

    Raises:
        InferenceFailed: a row count other than ``items``, or a ragged row of another shape
            (500: the handler broke its contract; the message names the output).
    """
    dtype = NUMPY_DTYPES[spec.datatype]
    if not spec.ragged:
        array = np.asarray(value, dtype=dtype)
        if array.ndim == 0 or len(array) != items:
            shape = list(array.shape)
            raise InferenceFailed(f"model {name}: output {spec.name!r} has shape {shape}, model.toml "
                                  f"declares [batch, *{spec.shape}] (a batch of {items})")  # fmt: skip
        return array
    if len(value) != items:
        raise InferenceFailed(f"model {name}: ragged output {spec.name!r} has {len(value)} rows for "
                              f"{items} items")  # fmt: skip
    rows = [np.asarray(row, dtype=dtype) for row in value]
    inner = tuple(spec.shape[1:])
    for row in rows:
        if row.ndim != len(spec.shape) or row.shape[1:] != inner:
            raise InferenceFailed(f"model {name}: ragged output {spec.name!r} has an item of shape "
                                  f"{list(row.shape)}; model.toml declares {spec.shape}")  # fmt: skip
    return ragged(rows)


def _longest(costs: np.ndarray) -> float:
    """Every item padded to the costliest: ``max * N``."""
    return float(costs.max()) * len(costs)


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
        #: Inputs the handler takes once per run of equal rows (``shared = "once"``).
        self._once = [s.name for s in config.inputs if s.shared == "once"]
        #: What a batch of items costing ``costs`` (``item_costs``, int64 ``[N]``, N >= 1)
        #: computes, padding included: the handler's own ``batch_cost`` (called directly), else
        #: every item padded to the costliest (``max * N``). Runs on the event loop once per
        #: batch, and on a prepare thread once per request (its own batches, for admission).
        self.batch_cost: Callable[[np.ndarray], float] = getattr(self.handler, "batch_cost", None) or _longest
        #: The tokens such a batch computes, padding included (the metrics' padded tokens): the
        #: handler's ``padded_tokens``, else :attr:`batch_cost` (whose unit is then tokens).
        self.padded_tokens: Callable[[np.ndarray], float] = (
            getattr(self.handler, "padded_tokens", None) or self.batch_cost
        )

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

    def calibrate(self) -> list[tuple[float, float]]:
        """Time one batch of the smallest and one of the largest warmup size, after warmup (no
        first-call costs), priced and prepared as requests are, each the best of
        :data:`CALIBRATION_ROUNDS` taken in turn: ``(cost, seconds)`` each (cost: ``batch_cost``
        of the items' costs for a priced model, else items), the seed of admission's service
        rate (:meth:`app.serving.admission.ServiceRate.seed`). Two sizes give the per-batch overhead
        apart from the cost per unit, so that a long request is judged at what its cost takes,
        not at what a short batch's overhead made each unit cost."""
        batches = []
        for items in sorted({min(self.config.warmup_batch_sizes), max(self.config.warmup_batch_sizes)}):
            inputs = synthetic_inputs(self.config.inputs, items)
            priced = self.item_costs(inputs)
            if isinstance(priced, Priced):
                inputs[PREPARED] = priced.prepared
                priced = priced.costs
            batches.append((self.batch_cost(priced) if priced is not None else float(items), inputs))
        best = [math.inf] * len(batches)
        for _ in range(CALIBRATION_ROUNDS):
            for i, (_, inputs) in enumerate(batches):
                start = time.perf_counter()
                self.run_batch(inputs)
                best[i] = min(best[i], time.perf_counter() - start)
        return [(cost, seconds) for (cost, _), seconds in zip(batches, best, strict=True)]

    def prefix_cache(self) -> Any:
        """The handler's prefix cache (its optional ``prefix_cache`` attribute,
        ``app.models.base``), or None."""
        return getattr(self.handler, "prefix_cache", None)

    def open_prefix_cache(self, observer: Any) -> None:
        """After warmup and calibration: the handler's prefix cache (where it has one) emptied of
        their synthetic prefixes and its work told to ``observer`` (the model version's
        ``app.observability.metrics.PrefixCacheMetrics``; None: nobody)."""
        cache = self.prefix_cache()
        if cache is not None:
            cache.clear()
            cache.observe(observer)

    def _check_outputs(self, outputs: Mapping[str, np.ndarray], batch_size: int) -> None:
        for spec in self.config.outputs:
            arr = outputs.get(spec.name)
            if arr is None:
                raise ModelLoadError(f"model {self.config.name}: output {spec.name!r} missing")
            if spec.ragged:  # _output checked each item's shape against [-1, *rest]
                continue
            want = (batch_size, *spec.shape)
            ok = arr.ndim == len(want) and all(w in (-1, a) for w, a in zip(want, arr.shape, strict=True))
            if not ok:
                raise ModelLoadError(
                    f"model {self.config.name}: output {spec.name!r} has shape {list(arr.shape)}, "
                    f"model.toml declares [batch, *{spec.shape}]"
                )

    # --- per request --------------------------------------------------------------------

    def item_costs(self, inputs: Mapping[str, np.ndarray]) -> np.ndarray | Priced | None:
        """What each of one request's items costs the model (int64 ``[B]``, >= 1), from the
        handler's ``item_costs``, with each item's preparation where the handler returned a
        :class:`~app.models.base.Priced` (``prepared``: object ``[B]``); None when it does not
        price its items. ``inputs`` may hold ``PREPARED`` already (an item stage's). Runs on a
        prepare thread, before the request's items join the queue.

        Raises:
            InvalidInput: the handler refused an item (its ``ValueError``/``UnicodeError``).
            ScoringError: what the handler raised of these (``PayloadTooLarge``: 413).
            InferenceFailed: the handler raised anything else, or returned a wrong shape.
        """
        if self._item_costs is None:
            return None
        name = self.config.name
        size = len(next(iter(inputs.values())))
        try:
            priced = self._item_costs(inputs)
        except (ValueError, UnicodeError) as exc:
            raise InvalidInput(f"model {name}: {exc}") from None
        except ScoringError:  # the handler's own outcome (PayloadTooLarge: too many windows)
            raise
        except Exception as exc:
            log.exception("model %s: item_costs failed", name)
            raise InferenceFailed(f"model {name} could not price the request: {exc!r}") from exc
        prepared = priced.prepared if isinstance(priced, Priced) else None
        costs = np.asarray(priced.costs if isinstance(priced, Priced) else priced, dtype=np.int64).reshape(-1)
        if costs.shape != (size,):
            raise InferenceFailed(f"model {name}: item_costs gave {costs.shape[0]} costs for {size} items")
        costs = np.maximum(costs, 1)
        if prepared is None:
            return costs
        if not isinstance(prepared, np.ndarray) or prepared.dtype != object or prepared.shape != (size,):
            raise InferenceFailed(
                f"model {name}: item_costs' prepared is not an object array of {size} items"
            )
        return Priced(costs, prepared)

    # --- the three stages of a batch ------------------------------------------------------

    def prepare(self, inputs: Mapping[str, np.ndarray]) -> Staged:
        """Stage 1 (a prepare thread): ``preprocess``, on the copy stream; an input declared
        ``shared = "once"`` handed over as its distinct rows and each item's row
        (``app.models.base.distinct_rows``)."""
        streams = self.streams
        if self._once:
            inputs = dict(inputs)
            for name in self._once:
                inputs[name], inputs[shared_rows(name)] = distinct_rows(inputs[name])
        with torch.inference_mode(), streams.on(streams.copy_in):
            batch = self.handler.preprocess(inputs)
            return Staged(batch, streams.mark(streams.copy_in), len(next(iter(inputs.values()))))

    def predict(self, prepared: Staged) -> Staged:
        """Stage 2 (the inference thread): ``predict``, on the compute stream once the inputs
        are on the device; returns without waiting for the device."""
        streams = self.streams
        with torch.inference_mode(), streams.on(streams.compute):
            streams.after(streams.compute, prepared.event)
            raw = self.handler.predict(prepared.value)
            return Staged(raw, streams.mark(streams.compute), prepared.items)

    def finish(self, predicted: Staged) -> dict[str, np.ndarray]:
        """Stage 3 (a finish thread): ``postprocess`` once the kernels are done, on the
        copy-back stream: numpy arrays of the declared dtypes, ``[B, ...]`` per output (a ragged
        output: an object array ``[B]`` of its items' arrays).

        Raises:
            InferenceFailed: an output without one row per item (:func:`_output`).
        """
        streams = self.streams
        with torch.inference_mode(), streams.on(streams.copy_out):
            streams.after(streams.copy_out, predicted.event)
            outputs = self.handler.postprocess(predicted.value)
            if streams.copy_out is not None:
                streams.copy_out.synchronize()
        name, items = self.config.name, predicted.items
        return {s.name: _output(name, s, outputs[s.name], items) for s in self.config.outputs}

    def forward(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The three stages in turn on this thread: inputs [B, ...] per input name -> outputs
        [B, ...] per output (numpy, the dtypes ``model.toml`` declares). An optional input left
        out is filled as a request's would be (``TensorSpec.filled``: zeros, or ``b""``).

        Raises:
            Exception: whatever the handler raised, device out-of-memory included.
        """
        omitted = [s for s in self.config.inputs if s.optional and s.name not in inputs]
        if omitted and inputs:
            batch = len(next(iter(inputs.values())))
            inputs = {**inputs, **{s.name: s.filled(batch) for s in omitted}}
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
        if isinstance(exc, InferenceFailed):  # the contract checks' own message (_output)
            return exc
        return InferenceFailed(f"model {self.config.name} failed on the batch: {type(exc).__name__}")

    def close(self, collect: bool = True) -> int:
        """Free the model: the handler's references dropped, then (``collect``) the collector
        run and the C heap trimmed (:func:`collect_freed`). Returns the device bytes freed (0 on
        the CPU, or without ``collect``). Call it on the model's inference thread, after its
        last batch; a worker that frees all its models at exit passes ``collect=False`` to each
        and runs :func:`collect_freed` once (a full collection of a worker's heap takes 0.2-0.4 s
        on a CPU core)."""
        before = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0
        close = getattr(self.handler, "close", None)
        if callable(close):
            close()
        self.handler = None  # type: ignore[assignment]
        if not collect:
            return 0
        collect_freed()
        if self.device.type != "cuda":
            return 0
        return int(before - torch.cuda.memory_reserved(self.device))


def collect_freed() -> None:
    """Give back what closed models held: the boot froze what it loaded
    (``app.serving.boot.collect_less``), so the models' objects become the collector's again and
    one full collection frees them; what their loads malloc'd goes back to the system
    (``trim_heap``), and CUDA's cached blocks to the device (a no-op where CUDA never started)."""
    gc.unfreeze()
    gc.collect()
    trim_heap()
    torch.cuda.empty_cache()


def describe(runner: ModelRunner) -> dict[str, Any]:
    """Load/warmup figures for logs: seconds, device."""
    return {
        "model": runner.config.name,
        "version": runner.config.version,
        "device": str(runner.device),
        "load_s": round(runner.load_seconds, 3),
        "warmup_s": round(runner.warmup_seconds, 3),
    }
