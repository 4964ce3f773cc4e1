"""How many worker copies fit a GPU, planned before anything loads.

What one worker holds on its GPU (it loads every model the repository serves at start):

- the **CUDA context** of its process (:data:`CUDA_CONTEXT_BYTES`);
- each model's weights and the activations of its largest batch (:mod:`app.models.memory`);
- a margin (:data:`ALLOCATOR_MARGIN`) for the caching allocator's rounding and fragmentation.

:func:`place` says how many copies of that worker fit a GPU, and what to tell the operator when
``SCORING_MAX_PROCESSES_PER_GPU`` asks for more: fewer start, with the reason, rather than
workers that run out of memory while loading and are forked again and again.
:func:`plan_server` is what the gunicorn master calls before it forks.

Imports no torch (as :mod:`app.models.memory`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from app.models.memory import GIB, MIB, ModelMemory, plan_model
from app.models.repository import scan, serving

__all__ = [
    "ALLOCATOR_MARGIN",
    "CUDA_CONTEXT_BYTES",
    "GPU_RESERVE_FRACTION",
    "Placement",
    "ServerPlan",
    "WorkerMemory",
    "place",
    "plan_server",
    "plan_worker",
]

#: A worker's CUDA context, cuBLAS workspace and the kernels it loads, beside torch's tensors:
#: 600 MiB. PyTorch measured 287 MB for a bare context with lazy module loading (its default
#: since 1.13, CUDA >= 11.7) against 667 MB without (pytorch/pytorch#86509); cuBLAS handles,
#: workspaces and the attention and GEMM kernels loaded at the first forward add to it. The
#: GPU check (``benchmarks.decoder_check``) measures it on the card it runs on.
CUDA_CONTEXT_BYTES = 600 * MIB
#: Planned bytes of weights and activations are raised by this fraction: the caching allocator
#: rounds blocks up (to 2 MiB segments for large ones) and fragments over mixed batch shapes.
ALLOCATOR_MARGIN = 0.10
#: The share of a GPU's memory left unplanned (other tools, the driver, growth), as vLLM plans
#: on ``gpu_memory_utilization`` = 0.9 of a card; less here, since nothing grows like a KV cache.
GPU_RESERVE_FRACTION = 0.05


@dataclass(frozen=True)
class WorkerMemory:
    """What one worker needs on its GPU: its ``models`` and the CUDA context."""

    models: tuple[ModelMemory, ...]
    context_bytes: int = CUDA_CONTEXT_BYTES
    margin: float = ALLOCATOR_MARGIN

    @property
    def total_bytes(self) -> int:
        """Context + (weights + activations) x (1 + margin), bytes."""
        return self.context_bytes + math.ceil(sum(m.total_bytes for m in self.models) * (1 + self.margin))

    def describe(self) -> str:
        """The total and its parts, for the operator."""
        parts = "; ".join(m.describe() for m in self.models) or "no models"
        return (
            f"{self.total_bytes / GIB:.1f} GiB per worker ({parts}; CUDA context "
            f"{self.context_bytes / GIB:.1f} GiB; allocator margin {self.margin:.0%})"
        )


def plan_worker(repository: Path, names: Sequence[str] = ()) -> WorkerMemory:
    """The memory a worker needs to serve ``repository``: :func:`plan_model` of every model
    version it loads at start (all models, or those of ``names``; the versions their
    ``version_policy`` selects). A model whose ``model.toml`` does not read is left out: it will
    not load either (the repository index says why). Raises ``ModelLoadError`` (no repository,
    a named model missing), ``ValueError`` and ``OSError`` as :func:`plan_folder`."""
    return WorkerMemory(
        tuple(plan_model(config) for config in serving(scan(repository, tuple(names))).configs)
    )


@dataclass(frozen=True)
class Placement:
    """How many worker copies start on one GPU: ``copies`` = min(``asked``, ``fits``);
    ``message``: why fewer than asked (None when all fit)."""

    copies: int
    asked: int
    fits: int
    worker_bytes: int
    message: str | None


def place(
    worker: WorkerMemory | int,
    asked: int,
    *,
    total_bytes: int,
    free_bytes: int,
    gpu: str = "the GPU",
    reserve_fraction: float = GPU_RESERVE_FRACTION,
) -> Placement:
    """How many copies of ``worker`` (a plan, or its bytes) fit a GPU of ``total_bytes`` with
    ``free_bytes`` free now (NVML's figures), keeping ``reserve_fraction`` of the total
    unplanned; ``asked``: ``SCORING_MAX_PROCESSES_PER_GPU``. Fewer than asked start when fewer
    fit, and ``message`` says why and what to change (no copy: the GPU takes no worker).
    Raises ``ValueError`` for ``asked`` < 1 or a worker of no bytes."""
    need = worker.total_bytes if isinstance(worker, WorkerMemory) else worker
    if asked < 1 or need < 1:
        raise ValueError(f"asked ({asked}) and the worker's bytes ({need}) must be >= 1")
    usable = min(free_bytes, total_bytes - int(total_bytes * reserve_fraction))
    fits = max(0, usable) // need
    copies = min(asked, fits)
    if copies == asked:
        return Placement(copies, asked, fits, need, None)
    detail = worker.describe() if isinstance(worker, WorkerMemory) else f"{need / GIB:.1f} GiB per worker"
    room = (
        f"{gpu} has {free_bytes / GIB:.1f} GiB free of {total_bytes / GIB:.1f} GiB "
        f"({reserve_fraction:.0%} kept in reserve) and each worker needs {detail}"
    )
    remedies = "lower max_batch_size or max_batch_tokens, serve fewer models per worker"
    if isinstance(worker, WorkerMemory):
        full = [m.name for m in worker.models if m.dtype == "float32" and m.parameters]
        if full:  # half precision only where a model is not in it already
            remedies = f'serve dtype = "bfloat16" for {", ".join(full)} (half float32\'s weights), {remedies}'
    if copies == 0:
        message = (
            f"{gpu} cannot hold one worker: {room}. No worker starts on it; {remedies}, or use a "
            "larger GPU"
        )
    else:
        message = (
            f"SCORING_MAX_PROCESSES_PER_GPU={asked} asks for {asked} workers on {gpu}, but {room}: "
            f"starting {copies}. For more copies: {remedies}"
        )
    return Placement(copies, asked, fits, need, message)


@dataclass(frozen=True)
class ServerPlan:
    """The master's plan: ``worker`` (one worker's memory), ``placements`` (one per GPU, in the
    order given), ``workers`` (the copies that start, all GPUs together) and ``messages`` (a
    warning per GPU that takes fewer than asked)."""

    worker: WorkerMemory
    placements: tuple[Placement, ...]

    @property
    def workers(self) -> int:
        """Worker processes to fork: the sum of the copies that fit."""
        return sum(p.copies for p in self.placements)

    @property
    def messages(self) -> list[str]:
        """Why fewer than asked start, per GPU concerned."""
        return [p.message for p in self.placements if p.message is not None]


def plan_server(
    repository: Path, names: Sequence[str], asked: int, gpus: Sequence[tuple[str, int, int]]
) -> ServerPlan:
    """What the gunicorn master calls before it forks: the worker's memory for ``repository``
    (:func:`plan_worker`) placed on each of ``gpus``, given as ``(label, total_bytes,
    free_bytes)`` from an NVML snapshot, ``asked`` = ``SCORING_MAX_PROCESSES_PER_GPU``.
    Raises as :func:`plan_worker`; :func:`place`'s ``ValueError`` for a repository that plans
    no bytes at all (none is possible: the CUDA context is always counted)."""
    worker = plan_worker(repository, names)
    return ServerPlan(
        worker,
        tuple(
            place(worker, asked, total_bytes=total, free_bytes=free, gpu=label) for label, total, free in gpus
        ),
    )
