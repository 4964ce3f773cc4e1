"""ONNX Runtime sessions as the server opens them: execution providers per device, threads, and
what the graph says of its inputs and outputs.

Two users: ``format = "onnx"`` (:mod:`app.models.onnx_format`, any tensor graph) and the
sentence-embedding handler's ONNX backend (:mod:`app.handlers.onnx_encoder`). It sits on the
floor beside :mod:`app.errors` because both of them import it (``app/handlers`` imports nothing
of ``app/models``).

No pickle: :class:`onnxruntime.InferenceSession` parses the ONNX protobuf (and any external
data file beside it, which ONNX Runtime refuses outside the model's folder); nothing in the
file is executed as Python.

Sources: ONNX Runtime's Python API (``SessionOptions``, ``InferenceSession``, ``IOBinding``,
``OrtValue``), its "Thread management" page (``intra_op_num_threads``, ``inter_op_num_threads``,
``session.intra_op.allow_spinning``) and its CUDA and TensorRT execution provider pages
(``device_id``); Triton's ``onnxruntime`` backend for the platform name ``onnxruntime_onnx``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.errors import ModelLoadError

if TYPE_CHECKING:
    import onnxruntime
    import torch

log = logging.getLogger(__name__)

#: Open Inference Protocol datatype -> ONNX Runtime's element type name (``NodeArg.type``).
ORT_TYPES: dict[str, str] = {
    "BOOL": "tensor(bool)",
    "UINT8": "tensor(uint8)",
    "UINT16": "tensor(uint16)",
    "UINT32": "tensor(uint32)",
    "UINT64": "tensor(uint64)",
    "INT8": "tensor(int8)",
    "INT16": "tensor(int16)",
    "INT32": "tensor(int32)",
    "INT64": "tensor(int64)",
    "FP16": "tensor(float16)",
    "FP32": "tensor(float)",
    "FP64": "tensor(double)",
    "BYTES": "tensor(string)",
}
#: ONNX Runtime's element type name -> Open Inference Protocol datatype (for messages).
V2_TYPES: dict[str, str] = {ort: v2 for v2, ort in ORT_TYPES.items()}

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
TENSORRT = "TensorrtExecutionProvider"

#: A dimension of a graph's input or output: an int (fixed), or a name / None (dynamic).
Dim = int | str | None


@dataclass(frozen=True)
class GraphTensor:
    """One input or output of a graph as ONNX Runtime reports it.

    Attributes:
        name: its name in the graph.
        type: ONNX Runtime's element type, e.g. ``"tensor(float)"``.
        shape: one entry per axis, batch axis first where the graph has one: an int for a
            fixed size, a symbolic name or None for a dynamic one.
    """

    name: str
    type: str
    shape: tuple[Dim, ...]

    @property
    def datatype(self) -> str:
        """The Open Inference Protocol datatype of ``type`` (``type`` itself where none fits)."""
        return V2_TYPES.get(self.type, self.type)

    def fixed(self, axis: int) -> int | None:
        """The fixed size of ``axis``, or None where it is dynamic (ONNX Runtime also reports
        an unknown size as 0 or a negative number)."""
        dim = self.shape[axis]
        return dim if isinstance(dim, int) and dim > 0 else None

    def shown(self) -> str:
        """The shape as messages show it: ``[batch, 32]``."""
        return "[" + ", ".join("?" if d is None else str(d) for d in self.shape) + "]"


def import_onnxruntime() -> Any:
    """``onnxruntime``, imported on first use.

    Raises:
        ModelLoadError: it is not installed (the message says which package to install).
    """
    try:
        import onnxruntime
    except ImportError as exc:
        raise ModelLoadError(
            "ONNX models need onnxruntime: pip install 'scoring-server[onnx]' "
            "(or onnxruntime-gpu on a CUDA machine)"
        ) from exc
    return onnxruntime


def providers(device: torch.device, *, tensorrt: bool = False) -> list[Any]:
    """The execution providers of a session on ``device``, in ONNX Runtime's order of preference.

    ``cpu``: the CPU provider. ``cuda:N``: TensorRT (only when ``tensorrt``; its engines are
    built per input shape, at the first batch of each shape), then CUDA, both on device N (0
    in a worker, whose ``CUDA_VISIBLE_DEVICES`` names its bound GPU only), then the CPU
    provider for the nodes CUDA does not implement.

    Raises:
        ModelLoadError: a CUDA device but an onnxruntime without the CUDA (or, asked for, the
            TensorRT) provider.
    """
    if device.type != "cuda":
        return [CPU]
    available = import_onnxruntime().get_available_providers()
    index = device.index or 0
    chosen: list[Any] = []
    wanted = [TENSORRT, CUDA] if tensorrt else [CUDA]
    for name in wanted:
        if name not in available:
            raise ModelLoadError(
                f"the model runs on {device} but this onnxruntime has no {name} "
                f"(it has {available}): install onnxruntime-gpu instead of onnxruntime"
            )
        chosen.append((name, {"device_id": index}))
    return [*chosen, CPU]


def session_options(threads: int) -> onnxruntime.SessionOptions:
    """Options of every session the server opens: ``threads`` intra-op threads (the calling
    thread included), one inter-op thread (nodes run in sequence), every graph optimisation,
    and no spinning of idle intra-op threads (they would burn the cores that the event loop,
    the tokenizers and the sibling workers share, as MKL's spinning did: docs/benchmarks.md),
    errors logged only (ONNX Runtime writes its log to stderr itself; its warnings at load, such
    as shape nodes placed on the CPU beside a CUDA graph, are expected)."""
    ort = import_onnxruntime()
    options = ort.SessionOptions()
    options.intra_op_num_threads = max(1, threads)
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3
    return options


def open_session(
    path: Path, shown: str, device: torch.device, threads: int, *, tensorrt: bool = False
) -> onnxruntime.InferenceSession:
    """An inference session of the ONNX file ``path`` on ``device``.

    Args:
        path: the ``.onnx`` file.
        shown: how messages name it (relative to the repository, e.g. ``feed-ranker/model.onnx``).
        device: ``cpu`` or ``cuda:N`` (:func:`providers`).
        threads: intra-op threads (:func:`session_options`).
        tensorrt: put TensorRT before CUDA on a CUDA device.

    Raises:
        ModelLoadError: the file is missing, is not an ONNX model ONNX Runtime can load
            (truncated, an operator or opset it does not implement), or the session did not get
            the CUDA provider it was asked for; ``path`` itself never appears in the message.
    """
    if not path.is_file():
        raise ModelLoadError(f"weights file {shown} not found")
    ort = import_onnxruntime()
    chosen = providers(device, tensorrt=tensorrt)
    try:
        session = ort.InferenceSession(str(path), sess_options=session_options(threads), providers=chosen)
    except Exception as exc:  # onnxruntime's own exception types (Fail, InvalidProtobuf, ...)
        reason = str(exc).replace(str(path), shown).strip()
        raise ModelLoadError(f"cannot load {shown} with onnxruntime: {reason}") from exc
    if device.type == "cuda" and CUDA not in session.get_providers():
        raise ModelLoadError(
            f"cannot run {shown} on {device}: onnxruntime fell back to {session.get_providers()} "
            "(are the CUDA and cuDNN libraries that onnxruntime-gpu needs installed?)"
        )
    log.debug("%s: providers %s, %d intra-op threads", shown, session.get_providers(), threads)
    return session


def graph_inputs(session: onnxruntime.InferenceSession) -> list[GraphTensor]:
    """The inputs a run of ``session`` must be fed (initializers excluded), in graph order."""
    return [GraphTensor(a.name, a.type, tuple(a.shape)) for a in session.get_inputs()]


def graph_outputs(session: onnxruntime.InferenceSession) -> list[GraphTensor]:
    """The outputs of ``session``'s graph, in graph order."""
    return [GraphTensor(a.name, a.type, tuple(a.shape)) for a in session.get_outputs()]
