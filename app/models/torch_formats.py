"""Built-in handlers for tensor models: ``torch.export`` archives and TorchScript.

Both take the model's inputs in ``model.toml`` order as positional tensors and
map the returned tensor (or tuple of tensors) to the declared outputs in order.
Neither unpickles anything: ``torch.export.load`` reads a zip of tensors and a
serialized graph, ``torch.jit.load`` reads TorchScript code and tensors.

On a CUDA device a model with ``cuda_graph_batch_sizes`` in its ``model.toml`` runs its
batches as CUDA graphs captured at load, one per batch size (:class:`GraphBuckets`): one
graph launch replaces the module's Python code and its kernel launches, where a small model's
time goes. Source: Triton's TensorRT backend captures graphs per batch size at load
(``optimization.cuda.graphs``, ``graph_spec``) and, given a ``graph_lower_bound``, runs a
smaller batch in a larger graph with its padding uninitialised (here the padding is zeros);
PyTorch's CUDA Graphs notes for the capture itself.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from app.errors import ModelLoadError
from app.models.repository import ModelConfig, TensorSpec

log = logging.getLogger(__name__)

#: Held while a model's graphs are captured, and while a model's graphs are dropped: PyTorch
#: allows one capture at a time in a process (``torch.cuda.graph``), and a device-wide
#: synchronisation during another thread's capture would break it. Two models can load at once
#: (a failed load retried beside another).
CAPTURE_LOCK = threading.Lock()

#: Eager runs of each batch size before its capture, on the capture stream: lazy
#: initialisation (cuBLAS handles and workspaces, TorchScript's profiling runs) must not
#: happen inside a capture. PyTorch's CUDA Graphs notes and ``make_graphed_callables`` use 3.
CAPTURE_WARMUP_RUNS = 3


@contextlib.contextmanager
def capturing(device: torch.device) -> Iterator[tuple[Any, Any]]:
    """Where graphs are captured on CUDA ``device``: :data:`CAPTURE_LOCK` held, inference mode, a
    side stream that first waits for the current one and is made current; yields (memory pool,
    stream) for :func:`capture_graph`. After the block the current stream waits for the side
    stream. PyTorch's CUDA Graphs notes ("Whole-network capture")."""
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream(device))
    with CAPTURE_LOCK, torch.inference_mode(), torch.cuda.stream(stream):
        yield pool, stream
    torch.cuda.current_stream(device).wait_stream(stream)


def settle_graphs(device: torch.device) -> None:
    """Wait until ``device`` has run what its graphs launched, outside any capture
    (:data:`CAPTURE_LOCK`): after this a model's graphs may be dropped."""
    with CAPTURE_LOCK:
        torch.cuda.synchronize(device)


def capture_graph(call: Callable[[], Any], pool: Any, stream: Any) -> tuple[Any, Callable[[], object]]:
    """Run ``call`` :data:`CAPTURE_WARMUP_RUNS` times on ``stream``, then capture it as one CUDA
    graph into memory pool ``pool`` (``torch.cuda.graph_pool_handle()``), in ``thread_local``
    mode; returns what the captured call returned (the static outputs each replay overwrites)
    and the graph's ``replay``. Call it with :data:`CAPTURE_LOCK` held and ``stream`` current.

    Raises:
        RuntimeError: whatever CUDA or PyTorch raised when ``call`` cannot be captured.
    """
    for _ in range(CAPTURE_WARMUP_RUNS):
        call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        outputs = call()
    return outputs, graph.replay


def _map_outputs(fn: Callable[[torch.Tensor], torch.Tensor], outputs: Any) -> Any:
    """``fn`` applied to a module's outputs: a tensor, a mapping or a sequence of tensors (the
    shapes ``_TensorHandler.postprocess`` takes), keeping that shape."""
    if isinstance(outputs, torch.Tensor):
        return fn(outputs)
    if isinstance(outputs, Mapping):
        return {name: fn(t) for name, t in outputs.items()}
    return [fn(t) for t in outputs]


@dataclass(eq=False)
class Bucket:
    """One captured graph and the device tensors it reads and writes.

    Attributes:
        size: the batch size it was captured at (items).
        inputs: its static inputs, ``[size, *shape]`` per declared input, in ``model.toml``
            order: a batch is copied into these before a replay.
        outputs: its static outputs, as the module returned them during capture (tensor,
            mapping or sequence of ``[size, ...]`` tensors): each replay overwrites them.
        replay: launches the graph on the current CUDA stream (``CUDAGraph.replay``).
        dirty: rows ``[0, dirty)`` of ``inputs`` hold the last batch's items; the rows after
            them are zeros.
    """

    size: int
    inputs: list[torch.Tensor]
    outputs: Any
    replay: Callable[[], object]
    dirty: int = 0


class GraphBuckets:
    """A module's forward pass as CUDA graphs, one per batch size ("bucket"), with the module
    itself for batches larger than the largest bucket.

    Calling it with a batch of B items (positional tensors ``[B, ...]`` on the device, as
    ``_TensorHandler.predict`` gets them) picks the smallest bucket of size >= B, copies the
    batch into that bucket's static inputs, zeroes the rows after it that an earlier, larger
    batch left there (the padding is always zeros), replays the graph and returns the first B
    rows of each output, **cloned**: the next replay overwrites the static outputs while the
    finish stage may still be copying this batch's to the host. A batch above the largest
    bucket runs the module eagerly. Everything is launched on the current CUDA stream (the
    runner's compute stream): ``CUDAGraph.replay`` launches on the current stream whatever
    stream captured it ("graph_exec_ may be replayed in any stream", ATen's CUDAGraph.cpp),
    so the copies in, the replay and the clones are ordered by that one stream.

    Not thread-safe: ``predict`` runs on the inference thread only, one batch at a time.
    """

    def __init__(self, buckets: Sequence[Bucket], eager: Callable[..., Any]) -> None:
        self._buckets = sorted(buckets, key=lambda b: b.size)
        self.sizes = [b.size for b in self._buckets]
        self._eager = eager

    def bucket_for(self, items: int) -> Bucket | None:
        """The smallest bucket holding ``items`` items, or None (above the largest)."""
        i = bisect.bisect_left(self.sizes, items)
        return self._buckets[i] if i < len(self._buckets) else None

    def __call__(self, *batch: torch.Tensor) -> Any:
        items = int(batch[0].shape[0])
        bucket = self.bucket_for(items)
        if bucket is None:
            return self._eager(*batch)
        for static, tensor in zip(bucket.inputs, batch, strict=True):
            static[:items].copy_(tensor)
            if bucket.dirty > items:
                static[items : bucket.dirty].zero_()
        bucket.dirty = items
        bucket.replay()
        return _map_outputs(lambda t: t[:items].clone(), bucket.outputs)

    @classmethod
    def capture(
        cls,
        module: Callable[..., Any],
        sizes: Sequence[int],
        specs: Sequence[TensorSpec],
        device: torch.device,
    ) -> GraphBuckets:
        """Capture ``module`` at each batch size of ``sizes`` on CUDA ``device``, inputs of zeros
        shaped and typed as ``specs`` declare (``[size, *spec.shape]``; no -1 dimension).

        The recipe of PyTorch's CUDA Graphs notes ("Whole-network capture", "Graph memory
        management"): eager warmup runs on a side stream, then ``torch.cuda.graph`` on that
        same stream, every capture sharing one memory pool (``graph_pool_handle``), largest
        size first, so the smaller graphs' intermediates fit in the blocks the larger ones
        freed (vLLM's model runner captures in that order for the same reason). PyTorch calls
        a shared pool safe when the graphs replay in capture order; :meth:`__call__` replays
        them in any order, which is safe here because a bucket's outputs are read (cloned)
        right after its own replay on the same stream, before any other replay can reuse
        their memory, and the static inputs are allocated outside the pool.

        Captures run in ``thread_local`` mode: other models' threads keep allocating device and
        pinned memory while this one captures (the "global" default would fail them).

        Raises:
            RuntimeError: the module cannot be captured (it synchronises with the host, uses
                the default stream, or changes shape with the data): whatever CUDA or
                PyTorch raised.
        """
        buckets = []
        with capturing(device) as (pool, stream):
            for size in sorted(sizes, reverse=True):
                inputs = [torch.from_numpy(spec.filled(size)).to(device) for spec in specs]
                outputs, replay = capture_graph(lambda: module(*inputs), pool, stream)  # noqa: B023
                buckets.append(Bucket(size, inputs, outputs, replay))
        return cls(buckets, module)


class _TensorHandler:
    """Shared numpy <-> torch plumbing; subclasses implement ``_load_module``."""

    def __init__(self) -> None:
        self._module: Any = None
        #: What ``predict`` calls: the module, or its CUDA graphs (``GraphBuckets``).
        self._forward: Callable[..., Any] | None = None
        self._device = torch.device("cpu")
        self._input_names: list[str] = []
        self._output_names: list[str] = []

    @property
    def cuda_graph_batch_sizes(self) -> list[int]:
        """The batch sizes captured as CUDA graphs at load (empty: every batch runs eagerly)."""
        return list(self._forward.sizes) if isinstance(self._forward, GraphBuckets) else []

    def _load_module(self, path: str, device: torch.device) -> Any:
        raise NotImplementedError

    def load(self, device: torch.device, config: ModelConfig) -> None:
        """Load ``config.path / config.file`` onto ``device``; on a CUDA device, capture the
        ``cuda_graph_batch_sizes`` graphs (:meth:`GraphBuckets.capture`; ignored elsewhere,
        with an INFO line).

        Raises:
            ModelLoadError: the file is missing, outside the model's folder, or not a
                loadable archive; or the module cannot be captured as a CUDA graph.
        """
        path = config.weights_path()
        shown = f"{config.path.name}/{config.file}"
        if not path.is_file():
            raise ModelLoadError(f"model {config.name}: weights file {shown} not found")
        self._device = device
        self._input_names = [s.name for s in config.inputs]
        self._output_names = [s.name for s in config.outputs]
        try:
            self._module = self._load_module(str(path), device)
        except Exception as exc:
            raise ModelLoadError(f"model {config.name}: cannot load {shown}: {exc}") from exc
        self._forward = self._module
        sizes = config.cuda_graph_batch_sizes
        if sizes and device.type != "cuda":
            log.info("model %s: cuda_graph_batch_sizes ignored on %s (CUDA graphs need a CUDA device)",
                     config.name, device)  # fmt: skip
        elif sizes:
            try:
                self._forward = GraphBuckets.capture(self._module, sizes, config.inputs, device)
            except Exception as exc:
                raise ModelLoadError(
                    f"model {config.name}: cannot capture it as CUDA graphs ({exc}); remove "
                    "cuda_graph_batch_sizes from its model.toml to run it eagerly"
                ) from exc

    def preprocess(self, inputs: Mapping[str, np.ndarray]) -> list[torch.Tensor]:
        """numpy [B, ...] per input -> tensors on the device (pinned, async copy on CUDA)."""
        tensors = []
        for name in self._input_names:
            t = torch.from_numpy(np.ascontiguousarray(inputs[name]))
            if self._device.type == "cuda":
                t = t.pin_memory().to(self._device, non_blocking=True)
            tensors.append(t)
        return tensors

    def predict(self, batch: list[torch.Tensor]) -> Any:
        """Call the module (or replay its CUDA graph) with the input tensors, positionally."""
        assert self._forward is not None, "load() first"
        return self._forward(*batch)

    def close(self) -> None:
        """Drop the module and its CUDA graphs, the graphs once the device has run what they
        launched (their static tensors and memory pool go back to the allocator with them)."""
        if isinstance(self._forward, GraphBuckets):
            settle_graphs(self._device)
        self._module = self._forward = None

    def postprocess(self, outputs: Any) -> dict[str, np.ndarray]:
        """Tensor or tuple/list/dict of tensors -> numpy arrays by declared output name."""
        if isinstance(outputs, torch.Tensor):
            seq: Sequence[Any] = (outputs,)
        elif isinstance(outputs, Mapping):
            seq = [outputs[n] for n in self._output_names]
        else:
            seq = outputs
        if len(seq) != len(self._output_names):
            raise ValueError(
                f"model returned {len(seq)} outputs, model.toml declares {len(self._output_names)}"
            )
        return {n: t.detach().cpu().numpy() for n, t in zip(self._output_names, seq, strict=True)}


class TorchExportHandler(_TensorHandler):
    """Serves a ``torch.export`` archive (``.pt2`` written by ``torch.export.save``)."""

    def _load_module(self, path: str, device: torch.device) -> Any:
        program = torch.export.load(path)
        if device.type != "cpu":
            from torch.export.passes import move_to_device_pass

            program = move_to_device_pass(program, device)
        return program.module()


class TorchScriptHandler(_TensorHandler):
    """Serves a TorchScript archive (``torch.jit.save``)."""

    def _load_module(self, path: str, device: torch.device) -> Any:
        module = torch.jit.load(path, map_location=device)  # type: ignore[no-untyped-call]
        module.eval()
        return module
