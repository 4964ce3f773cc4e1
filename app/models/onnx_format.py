"""``format = "onnx"``: an ONNX graph served by ONNX Runtime.

The graph takes the inputs ``model.toml`` declares, by name, and gives (at least) the outputs
it declares, by name; axis 0 of each is the batch, dynamic in the graph (``dynamic_shapes`` /
``dynamic_axes`` at export) so that the batcher's batches of 1 to ``max_batch_size`` items run
as they come. At load the graph's inputs and outputs are checked against ``model.toml``
(:func:`check_signature`): a file that disagrees is refused with a message naming the file and
the tensor, before any batch runs, and the model is UNAVAILABLE with that reason while the
others serve. What the graph leaves dynamic (an output size computed at run time) is checked by
the warmup batches, like any model's.

Execution providers, threads and session options: :mod:`app.onnx_session`. The intra-op
threads are ``torch.get_num_threads()`` read in :meth:`OnnxHandler.load`, which runs on the
model's inference thread: the server has set there the one per-worker rule
(``Settings.effective_torch_threads``), so an ONNX model and a torch model of the same server
use the same cores, and the handler contract needs no new argument.

On a CUDA device the handler uses ONNX Runtime's I/O binding: ``preprocess`` (a prepare
thread) copies the inputs to the device as ``OrtValue``s, ``predict`` (the inference thread)
runs the graph with its outputs left on the device, and ``postprocess`` (a finish thread)
copies them back; so the staged pipeline overlaps one batch's copies with another's kernels,
as it does for the torch formats, and ``predict`` never copies. On the CPU the numpy arrays
go to ``InferenceSession.run`` as they are (no copy when they already have the graph's dtype
and are contiguous).

``[parameters]`` it reads: ``tensorrt`` (bool, default false: on a CUDA device, put ONNX
Runtime's TensorRT provider before CUDA; it builds an engine per input shape, at the first
batch of that shape). ``cuda_graph_batch_sizes`` does not apply (refused by ``model.toml``
validation).

Source: Triton's ``onnxruntime`` backend (platform ``onnxruntime_onnx``; the model
configuration's inputs and outputs checked against the graph at load; a dynamic batch axis
where ``max_batch_size > 0``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from app.datatypes import NUMPY_DTYPES
from app.errors import ModelLoadError
from app.models.repository import ModelConfig, TensorSpec
from app.onnx_session import ORT_TYPES, GraphTensor, graph_inputs, graph_outputs, open_session

#: The ``[parameters]`` this format reads.
PARAMETERS = ("tensorrt",)


def _check_tensor(kind: str, spec: TensorSpec, graph: GraphTensor, shown: str, max_batch_size: int) -> None:
    """One declared tensor against the graph's tensor of that name (see :func:`check_signature`)."""
    where = f"{kind} {spec.name!r}"
    if ORT_TYPES[spec.datatype] != graph.type:
        raise ModelLoadError(
            f"{where} is {spec.datatype} in model.toml but {graph.datatype} ({graph.type}) in {shown}"
        )
    declared = ["batch", *(str(d) for d in spec.shape)]
    if len(graph.shape) != 1 + len(spec.shape):
        raise ModelLoadError(
            f"{where} has shape {graph.shown()} in {shown} (rank {len(graph.shape)}), but model.toml "
            f"declares [{', '.join(declared)}] (rank {1 + len(spec.shape)}: the batch axis, then shape)"
        )
    batch = graph.fixed(0)
    if batch is not None and not batch == max_batch_size == 1:
        raise ModelLoadError(
            f"{where} has a fixed batch axis of {batch} in {shown} ({graph.shown()}): export it with "
            "a dynamic batch axis (torch.onnx.export dynamic_shapes or dynamic_axes)"
            + (", or set max_batch_size = 1" if batch == 1 else "")
        )
    for axis, declared_dim in enumerate(spec.shape, start=1):
        fixed = graph.fixed(axis)
        if fixed is not None and fixed != declared_dim:
            wanted = [fixed if a == axis else graph.fixed(a) or -1 for a in range(1, len(graph.shape))]
            raise ModelLoadError(
                f"{where} has shape {graph.shown()} in {shown}, but model.toml declares "
                f"[batch, {', '.join(map(str, spec.shape))}]: axis {axis} is fixed at {fixed} in the "
                f"graph (declare shape = {wanted})"
            )


def check_signature(
    config: ModelConfig, inputs: Sequence[GraphTensor], outputs: Sequence[GraphTensor], shown: str
) -> None:
    """Check a graph's inputs and outputs against ``model.toml``.

    Each declared input must be a graph input of that name, and the graph must need no input
    that is not declared; each declared output must be a graph output of that name (the graph
    may give more: they are not fetched). For each pair: the same element type, rank 1 + the
    declared shape's, a dynamic batch axis (a fixed one of 1 only with ``max_batch_size = 1``),
    and every fixed graph dimension equal to the declared one (a declared -1 against a fixed
    graph dimension is refused too: the graph takes only that size).

    Args:
        config: the model's ``model.toml``.
        inputs, outputs: the graph's (:func:`app.onnx_session.graph_inputs`, ``graph_outputs``).
        shown: the file as messages name it (``<folder>/<file>``).

    Raises:
        ModelLoadError: naming the model, the file, the tensor and what disagrees.
    """
    prefix = f"model {config.name}: "
    try:
        text = [s.name for s in (*config.inputs, *config.outputs) if s.datatype == "BYTES"]
        if text:
            raise ModelLoadError(
                f"BYTES tensors {text} are not served by format 'onnx' (string tensors run on the "
                "CPU only in ONNX Runtime); serve a text model through a handler, e.g. "
                "app.handlers.sentence_embedding with backend = 'onnx'"
            )
        by_name = {g.name: g for g in inputs}
        for spec in config.inputs:
            if spec.name not in by_name:
                raise ModelLoadError(
                    f"model.toml declares input {spec.name!r}, but {shown} has no input of that name "
                    f"(its inputs: {sorted(by_name)})"
                )
            _check_tensor("input", spec, by_name[spec.name], shown, config.max_batch_size)
        undeclared = [g.name for g in inputs if config.input(g.name) is None]
        if undeclared:
            raise ModelLoadError(
                f"{shown} needs inputs {undeclared} that model.toml does not declare "
                f"(the graph's inputs: {sorted(by_name)})"
            )
        given = {g.name: g for g in outputs}
        for spec in config.outputs:
            if spec.name not in given:
                raise ModelLoadError(
                    f"model.toml declares output {spec.name!r}, but {shown} has no output of that "
                    f"name (its outputs: {sorted(given)})"
                )
            _check_tensor("output", spec, given[spec.name], shown, config.max_batch_size)
    except ModelLoadError as exc:
        raise ModelLoadError(prefix + str(exc)) from None


class OnnxHandler:
    """Serves an ONNX file (``format = "onnx"``; see the module docstring)."""

    def __init__(self) -> None:
        self._session: Any = None
        self._device = torch.device("cpu")
        self._device_id = 0
        self._inputs: list[tuple[str, np.dtype[Any]]] = []
        self._outputs: list[str] = []

    @property
    def session(self) -> Any:
        """The ``onnxruntime.InferenceSession`` (after :meth:`load`)."""
        if self._session is None:
            raise RuntimeError("OnnxHandler.load() has not been called")
        return self._session

    @property
    def io_binding(self) -> bool:
        """Whether batches run through ONNX Runtime's I/O binding (on a CUDA device)."""
        return self._device.type == "cuda"

    def load(self, device: torch.device, config: ModelConfig) -> None:
        """Open ``config.file`` on ``device`` with ``torch.get_num_threads()`` intra-op threads
        and check it against ``model.toml`` (:func:`check_signature`).

        Raises:
            ModelLoadError: unknown or mistyped ``[parameters]``; the file missing, outside the
                model's folder or not loadable (truncated, unknown operators); an onnxruntime
                without the CUDA provider on a CUDA device; a graph that disagrees with
                ``model.toml``. Messages name the file relative to the repository.
        """
        unknown = sorted(set(config.parameters) - set(PARAMETERS))
        if unknown:
            raise ModelLoadError(
                f"model {config.name}: unknown [parameters] {unknown}; format 'onnx' reads {list(PARAMETERS)}"
            )
        tensorrt = config.parameters.get("tensorrt", False)
        if not isinstance(tensorrt, bool):
            raise ModelLoadError(f"model {config.name}: parameters.tensorrt must be true or false")
        path = config.weights_path()
        shown = f"{config.path.name}/{config.file}"
        try:
            session = open_session(path, shown, device, torch.get_num_threads(), tensorrt=tensorrt)
        except ModelLoadError as exc:
            raise ModelLoadError(f"model {config.name}: {exc}") from None
        check_signature(config, graph_inputs(session), graph_outputs(session), shown)
        self._inputs = [(s.name, NUMPY_DTYPES[s.datatype]) for s in config.inputs]
        self._outputs = [s.name for s in config.outputs]
        self._device = device
        self._device_id = device.index or 0
        self._session = session

    def preprocess(self, inputs: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """numpy ``[B, ...]`` per declared input -> what ``run`` takes: C-contiguous arrays of
        the declared dtype on the CPU, ``OrtValue``s on the device (copied here) on CUDA."""
        feeds = {name: np.ascontiguousarray(inputs[name], dtype=dtype) for name, dtype in self._inputs}
        if not self.io_binding:
            return feeds
        ort_value = self._ort().OrtValue
        return {name: ort_value.ortvalue_from_numpy(a, "cuda", self._device_id) for name, a in feeds.items()}

    def predict(self, batch: dict[str, Any]) -> list[Any]:
        """Run the graph: the declared outputs in ``model.toml`` order, numpy arrays on the CPU,
        ``OrtValue``s left on the device on CUDA (I/O binding; ONNX Runtime allocates them)."""
        session = self.session
        if not self.io_binding:
            return list(session.run(self._outputs, batch))
        binding = session.io_binding()
        for name, value in batch.items():
            binding.bind_ortvalue_input(name, value)
        for name in self._outputs:
            binding.bind_output(name, "cuda", self._device_id)
        session.run_with_iobinding(binding)
        return list(binding.get_outputs())

    def postprocess(self, outputs: list[Any]) -> dict[str, np.ndarray]:
        """The outputs by declared name, as host numpy arrays ``[B, ...]`` (the copy back from
        the device happens here on CUDA)."""
        arrays = [o if isinstance(o, np.ndarray) else o.numpy() for o in outputs]
        return dict(zip(self._outputs, arrays, strict=True))

    def close(self) -> None:
        """Drop the session (ONNX Runtime frees its memory, device memory included)."""
        self._session = None

    @staticmethod
    def _ort() -> Any:
        import onnxruntime

        return onnxruntime
