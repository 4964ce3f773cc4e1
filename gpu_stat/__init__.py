"""GPU inventory through NVML, and worker-to-GPU binding (gpu_stat.binding).

Imports neither torch nor aiohttp; the NVML binding (nvidia-ml-py, else py3nvml) is imported on
the first query. ``python -m gpu_stat [--json] [--all]`` prints the GPUs.
"""

from gpu_stat.query import ENV_BACKEND, ENV_DISABLE, ENV_FAKE, backend_name, query_gpus
from gpu_stat.snapshot import GpuInfo, GpuProcess, NvmlUnavailable
from gpu_stat.visible import apply_visible_devices, parse_visible_devices

__all__ = [
    "ENV_BACKEND",
    "ENV_DISABLE",
    "ENV_FAKE",
    "GpuInfo",
    "GpuProcess",
    "NvmlUnavailable",
    "apply_visible_devices",
    "backend_name",
    "parse_visible_devices",
    "query_gpus",
]
