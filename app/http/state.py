"""The HTTP front end's state on its aiohttp application: two typed keys, :data:`CORE` (the
serving core it reads) and :data:`SHEDDING` (the keep-alive side of balancing), and the hook that
turns readiness off as the app shuts down. ``app.main.create_app`` puts the core and the shedding
there; the HTTP handlers read ``request.app[CORE]`` (its registry, data plane, health, ...).
Nothing else reads them: the core runs beside the HTTP app, not inside it (``app.main``).
"""

from __future__ import annotations

from typing import Protocol

from aiohttp import web

from app.serving.core import ServingCore

__all__ = ["CORE", "SHEDDING", "NoShedding", "Shedding", "on_shutdown"]


class Shedding(Protocol):
    """Which keep-alive connection should move to a less-loaded sibling worker: a question of the
    transport (HTTP/1.1 connections are placed by the kernel and stay where they were accepted),
    asked by the keep-alive policy (``app.http.edge``) of every response. The gunicorn
    worker's is ``app.server.balance.WorkerConnections``."""

    def should_shed(self) -> bool:
        """Whether the response being prepared should close its connection (``Connection:
        close``) so that a less-loaded sibling takes the client's next one."""
        ...


class NoShedding:
    """No siblings: every connection stays."""

    def should_shed(self) -> bool:
        """Never."""
        return False


#: The worker's serving core (``app.serving.core``).
CORE = web.AppKey("core", ServingCore)
#: The worker's keep-alive shedding (:class:`Shedding`; :class:`NoShedding` without siblings).
SHEDDING: web.AppKey[Shedding] = web.AppKey("shedding")


async def on_shutdown(app: web.Application) -> None:
    """Turn readiness 503 when the app shuts down (under gunicorn the worker did it earlier,
    at SIGTERM, before its listener closed)."""
    app[CORE].registry.begin_drain("shutdown")
