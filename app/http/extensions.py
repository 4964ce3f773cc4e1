"""HTTP handlers of Triton's extensions beside the core V2 protocol: model configuration,
statistics, the model repository's index, load and unload (the JSON shapes live in
:mod:`app.protocols.triton`; model control in :mod:`app.serving.control`).

These routes are added before :mod:`app.http.routes`'s, so ``/v2/models/stats`` is not taken
for the metadata of a model called "stats".
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from app.errors import InvalidInput
from app.http.state import CORE
from app.protocols import triton
from app.serving.control import LOAD, UNLOAD

routes = web.RouteTableDef()


def _json(body: Any) -> web.Response:
    return web.Response(body=orjson.dumps(body), content_type="application/json")


@routes.get("/v2/models/{name}/config")
@routes.get("/v2/models/{name}/versions/{version}/config")
async def model_config(request: web.Request) -> web.Response:
    """``GET .../config``: Triton's model configuration (dims without the batch dimension)."""
    entry = request.app[CORE].registry.get(request.match_info["name"], request.match_info.get("version"))
    return _json(triton.model_config(entry.config, request.app[CORE].binding.device))


@routes.get("/v2/models/stats")
async def all_model_stats(request: web.Request) -> web.Response:
    """``GET /v2/models/stats``: the server's statistics of every model version (every worker's,
    summed: ``app.serving.dataplane.DataPlane.statistics``)."""
    return _json(await request.app[CORE].dataplane.statistics())


@routes.get("/v2/models/{name}/stats")
@routes.get("/v2/models/{name}/versions/{version}/stats")
async def model_stats(request: web.Request) -> web.Response:
    """``GET /v2/models/{name}[/versions/{version}]/stats``: the server's statistics of one model
    (every version of it when no version is named); 404 for an unknown model."""
    plane = request.app[CORE].dataplane
    return _json(await plane.statistics(request.match_info["name"], request.match_info.get("version")))


@routes.post("/v2/repository/index")
async def repository_index(request: web.Request) -> web.Response:
    """``POST /v2/repository/index``: every model version with its state (READY, LOADING,
    UNAVAILABLE + reason); body ``{"ready": true}`` (optional) keeps only the ready ones."""
    body = await request.read()
    only_ready = False
    if body.strip():
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise InvalidInput("repository index request: body must be JSON") from None
        if not isinstance(parsed, dict) or not isinstance(parsed.get("ready", False), bool):
            raise InvalidInput('repository index request: expected {"ready": true|false}')
        only_ready = parsed.get("ready", False)
    rows = request.app[CORE].registry.index(only_ready)
    return _json([triton.repository_entry(*row) for row in rows])


async def _repository_parameters(request: web.Request, what: str) -> dict[str, Any]:
    """The ``parameters`` of a repository load/unload body (optional JSON object).

    Raises:
        InvalidInput: a body that is not ``{"parameters": {...}}``.
    """
    body = await request.read()
    if not body.strip():
        return {}
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise InvalidInput(f"{what} request: body must be JSON") from None
    parameters = parsed.get("parameters", {}) if isinstance(parsed, dict) else None
    if not isinstance(parameters, dict):
        raise InvalidInput(f'{what} request: expected {{"parameters": {{...}}}}')
    return parameters


@routes.post("/v2/repository/models/{name}/load")
async def repository_load(request: web.Request) -> web.Response:
    """``POST /v2/repository/models/{name}/load``: load the model on every worker, or reload
    what changed in its folders (``app.serving.control``); 200 once every worker serves it.
    A configuration override (``parameters.config``, Triton's) is refused: the repository holds
    the configuration."""
    parameters = await _repository_parameters(request, "repository load")
    if "config" in parameters or any(k.startswith("file:") for k in parameters):
        raise InvalidInput("this server loads models from their folder in the repository; "
                           "parameters.config and file: overrides are not supported")  # fmt: skip
    await request.app[CORE].control.request(LOAD, request.match_info["name"])
    return _json({})


@routes.post("/v2/repository/models/{name}/unload")
async def repository_unload(request: web.Request) -> web.Response:
    """``POST /v2/repository/models/{name}/unload``: unload the model on every worker; its
    requests get 404 from then on, those already queued finish; 200 once every worker has
    freed it."""
    await _repository_parameters(request, "repository unload")
    await request.app[CORE].control.request(UNLOAD, request.match_info["name"])
    return _json({})
