"""This worker's binding: made once by ``create_app`` (``ServingCore.binding``), read by whoever needs it.

Under gunicorn, ``post_fork`` binds the worker to a (GPU, slot) before the app is imported
(``gpu_stat.binding.bind_worker``); the app, in the same process, takes that fact from
:func:`gpu_stat.binding.current_binding` and nothing travels through environment variables.
Outside gunicorn (in-process tests, ``python -m aiohttp.web``) the worker is unbound: a CPU
binding, or whatever device the settings name.

Readers: ``GET /v2`` (``worker``), the ``scoring_worker_binding_info`` metric and the GPU
poller, the "worker ready" log line and the after-load NVML check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpu_stat.binding import Binding, current_binding

__all__ = ["WorkerBinding"]


@dataclass(frozen=True)
class WorkerBinding:
    """This worker: ``binding``, where its GPU binding put it (pid, rank, GPU index and uuid,
    slot, the binding's device), and ``device``, the torch device its models run on. The two
    devices differ only where the binding names a GPU torch cannot see (a fake NVML in tests)
    or where ``SCORING_DEVICE`` forces one."""

    binding: Binding
    device: str

    @classmethod
    def current(cls, device: str) -> WorkerBinding:
        """This process's binding (unbound outside gunicorn: ``device``, no GPU) with ``device``."""
        binding = current_binding()
        if binding is None:
            binding = Binding(device, None, None, None, None, 0, "unbound: not started by gunicorn")
        return cls(binding, device)

    @property
    def pid(self) -> int:
        return self.binding.pid

    def labels(self) -> dict[str, str]:
        """Metric and log labels: gpu, gpu_uuid, slot ("" on CPU) and the binding's device."""
        return self.binding.as_labels()

    def describe(self) -> dict[str, Any]:
        """JSON for ``GET /v2`` and logs: ``{"pid", "device", "binding": {labels, "rank"}}``."""
        return {
            "pid": self.pid,
            "device": self.device,
            "binding": {**self.labels(), "rank": self.binding.rank},
        }

