"""API keys at the HTTP edge (the keys and how they are checked: ``app.serving.auth``).

Open without a key: the health probes (``/v2/health/live``, ``/v2/health/ready``, KServe V1's
liveness ``GET /``), and
``/metrics`` when ``SCORING_METRICS_AUTH=false``. Everything else answers 401
``{"error": "unauthorized"}`` with ``WWW-Authenticate: Bearer``, the same for a missing
and a wrong key.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from app.errors import Unauthorized
from app.serving.auth import API_KEY_HEADER, ApiKeys, presented_key

_HEALTH_PREFIX = "/v2/health/"


def request_key(request: web.Request) -> str | None:
    """The key a request presents: ``Authorization: Bearer <key>``, else ``X-API-Key``."""
    return presented_key(request.headers.get("Authorization"), request.headers.get(API_KEY_HEADER))


def _is_open(request: web.Request, metrics_open: bool) -> bool:
    path = request.path
    return path.startswith(_HEALTH_PREFIX) or path == "/" or (metrics_open and path == "/metrics")


def authorizer(keys: ApiKeys, metrics_open: bool) -> Callable[[web.Request], None]:
    """The API key check ``app.http.edge.edge_middleware`` runs after the header limits
    and before reading the body. Health paths (and ``/metrics`` when ``metrics_open``) are open.

    Raises (from the returned check):
        Unauthorized: 401, no valid key presented.
    """

    def authorize(request: web.Request) -> None:
        if not _is_open(request, metrics_open) and not keys.check(request_key(request)):
            raise Unauthorized("unauthorized")

    return authorize
