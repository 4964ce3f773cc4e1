"""CUDA_VISIBLE_DEVICES, read the way the CUDA runtime reads it, applied to NVML snapshots.

CUDA's rules: unset means every GPU; the empty string means none; otherwise a comma-separated
sequence of entries, each an integer index, ``GPU-<uuid>`` (full, or a prefix that names exactly
one GPU) or ``MIG-<uuid>`` (same, for MIG instances); the devices are enumerated in the order
given, and an invalid entry ends the list (``0,2,-1,1`` shows 0 and 2). We treat a repeated device
like an invalid entry (CUDA does not document that case). Indices are NVML's (PCI bus) order,
which is CUDA's only with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or identical GPUs; UUIDs are never
ambiguous. The pre-R470 MIG syntax ``MIG-GPU-<uuid>/<gi>/<ci>`` is not supported.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from dataclasses import replace

from gpu_stat.snapshot import GpuInfo

log = logging.getLogger(__name__)

ENV_VISIBLE = "CUDA_VISIBLE_DEVICES"
_INDEX = re.compile(r"[0-9]+")
_warned: set[str] = set()


def parse_visible_devices(value: str | None) -> list[str] | None:
    """Split a CUDA_VISIBLE_DEVICES value into stripped entries: None when unset (all devices),
    ``[]`` for the empty string (no device). Entries are not validated here."""
    if value is None:
        return None
    if not value.strip():
        return []
    return [entry.strip() for entry in value.split(",")]


def resolve_entry(entry: str, gpus: Sequence[GpuInfo]) -> GpuInfo | None:
    """The GPU or MIG instance one CUDA_VISIBLE_DEVICES entry names among ``gpus`` (physical
    GPUs, ``nvml_index`` set), or None when it names none or is ambiguous."""
    if _INDEX.fullmatch(entry):
        index = int(entry)
        return next((g for g in gpus if g.nvml_index == index), None)
    prefix = entry.lower()
    if prefix.startswith("gpu-"):
        candidates = [g for g in gpus if g.uuid.lower().startswith(prefix)]
    elif prefix.startswith("mig-"):
        candidates = [m for g in gpus for m in g.mig_instances if m.uuid.lower().startswith(prefix)]
    else:
        candidates = []
    return candidates[0] if len(candidates) == 1 else None


def apply_visible_devices(gpus: Sequence[GpuInfo], value: str | None) -> list[GpuInfo]:
    """The view a CUDA process started with ``CUDA_VISIBLE_DEVICES=value`` gets: the selected
    GPUs (or MIG instances) in the given order, ``index`` renumbered from 0 (the CUDA ordinal);
    ``nvml_index`` keeps the physical index. ``value=None`` returns ``gpus`` unchanged."""
    entries = parse_visible_devices(value)
    if entries is None:
        return list(gpus)
    view: list[GpuInfo] = []
    seen: set[str] = set()
    for position, entry in enumerate(entries):
        found = resolve_entry(entry, gpus)
        if found is None or found.uuid in seen:
            _warn_once(
                f"{ENV_VISIBLE}={value!r}: entry {entry!r} "
                + ("repeats a device" if found is not None else "names no GPU (or is ambiguous)")
                + f"; it and the {len(entries) - position - 1} entries after it are ignored,"
                " as CUDA does"
            )
            break
        seen.add(found.uuid)
        view.append(replace(found, index=len(view)))
    if any(_INDEX.fullmatch(e) for e in entries) and os.environ.get("CUDA_DEVICE_ORDER") != (
        "PCI_BUS_ID"
    ) and len({g.name for g in gpus}) > 1:
        _warn_once(
            f"{ENV_VISIBLE}={value!r} uses indices on a machine with different GPU models: CUDA "
            "numbers them fastest-first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, NVML by PCI bus; "
            "use GPU UUIDs (python -m gpu_stat) to be unambiguous"
        )
    return view


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)
