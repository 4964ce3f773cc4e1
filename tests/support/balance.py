"""What the balancing tests read of a real gunicorn server (HTTP and gRPC): the items each
worker computed, their shares between two scrapes, and whether both workers are live in the
load table."""

from __future__ import annotations

import time

from app.server.balance import LoadTable
from tests.support.gunicorn import Gunicorn, worker_items, worker_shares


def items_per_worker(srv: Gunicorn) -> dict[int, float]:
    """Items computed per worker pid, from one /metrics scrape."""
    return worker_items(srv.scrape())


def shares(before: dict[int, float], after: dict[int, float], pids: list[int]) -> dict[int, float]:
    """Each of ``pids``' share of the items computed between the two scrapes (every one of
    them named, and some items computed)."""
    share = worker_shares(before, {pid: after.get(pid, 0.0) for pid in pids})
    assert sum(share.values()) > 0, (before, after)
    return share


def both_live(srv: Gunicorn) -> bool:
    """Both workers of ``srv`` are live in its load table."""
    table = LoadTable(srv.run_dir, readonly=True)
    try:
        now = time.monotonic()
        return sum(load.live(now) for load in table.snapshot()) == 2
    finally:
        table.close()
