"""A server's process family: the workers of a master (its live children) and every pid of
the server. The one place that answers "who are my siblings" for the GPU binding
(``gpu_stat.binding``), the workers' coordination (``app.server.worker``) and the flame-graph
script (``scripts/flamegraph``). psutil only; no torch, no aiohttp.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

__all__ = ["Family", "family", "live_children"]


def live_children(ppid: int) -> list[int]:
    """Pids of ``ppid``'s live children (zombies, dead but not yet reaped, left out), oldest
    first: ordered by (create_time, pid). Empty when ``ppid`` does not exist."""
    return [pid for _, pid in _children_by_age(ppid)]


def _children_by_age(ppid: int) -> list[tuple[float, int]]:
    try:
        children = psutil.Process(ppid).children()
    except psutil.Error:
        return []
    keyed: list[tuple[float, int]] = []
    for child in children:
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                keyed.append((child.create_time(), child.pid))
        except psutil.Error:
            continue  # exited meanwhile
    return sorted(keyed)


@dataclass(frozen=True)
class Family:
    """``siblings``: the live children of our parent, us included, oldest first (a worker's
    rank is its index here); ``ours``: our parent and all its descendants (pids)."""

    siblings: tuple[int, ...]
    ours: frozenset[int]


def family() -> Family:
    """This process's family as it stands now (a fresh look at the process table)."""
    me, ppid = os.getpid(), os.getppid()
    keyed = _children_by_age(ppid)
    ours: set[int] = {me}
    try:
        ours.update(p.pid for p in psutil.Process(ppid).children(recursive=True))
        ours.add(ppid)
    except psutil.Error:
        pass
    if me not in {pid for _, pid in keyed}:
        keyed = sorted([*keyed, (psutil.Process(me).create_time(), me)])
    return Family(tuple(pid for _, pid in keyed), frozenset(ours))
