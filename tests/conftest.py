"""The environment of in-process tests, the shared fixtures (defined in tests/support/fixtures.py)
and the skip of the ``gpu``-marked tests without a CUDA device."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.support.decoder_models import decoder_models
from tests.support.fixtures import demo_server, make_client, scale_repo, tensor_repo

__all__ = ["decoder_models", "demo_server", "make_client", "scale_repo", "tensor_repo"]

# In-process apps record metrics into a registry of their own: a PROMETHEUS_MULTIPROC_DIR
# inherited from the environment (the Docker image sets one) must go before anything imports
# prometheus_client, which picks its mode at import (app.main imports it: in make_client, lazily).
os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
# In-process apps serve no gRPC unless a test starts it (tests/unit/test_grpc.py binds 127.0.0.1:0).
os.environ["SCORING_GRPC_PORT"] = "0"


#: The groups (a module, or a named group) that take longest, longest first: under ``scripts/test``
#: (``--dist loadgroup --no-loadscope-reorder``) they are handed out first, so that none of them
#: starts last and runs on while the other processes have nothing left (longest processing time
#: first). From ``scripts/test --durations=80`` on the 2-core VM (seconds per group, about): the
#: order only moves the end of the parallel pass; a group missing here just starts later.
LONGEST_FIRST = (
    "tests/e2e/test_reliability.py",  # 165
    "tests/e2e/test_balance.py",  # 90
    "tests/e2e/test_binding.py",  # 80
    "tests/e2e/test_response_cache.py",  # 50
    "tests/e2e/test_model_control.py",  # 50
    "tests/e2e/test_fuzz_routes.py",  # 45
    "tests/unit/test_benchmarks.py",  # 35
    "tests/unit/test_reload_memory.py",  # 35
    "demo-server",  # 35
    "tests/unit/test_text_graphs.py",  # 30
    "tests/e2e/test_openapi.py",  # 25
    "tests/e2e/test_onnx.py",  # 25
    "tests/unit/test_gpu_bundle.py",  # 25
    "tests/e2e/test_gunicorn_config.py",  # 25
    "tests/e2e/test_retrieval_models.py",  # 20
    "tests/e2e/test_grpc_balance.py",  # 20
    "tests/e2e/test_serving.py",  # 20
    "tests/e2e/test_drain.py",  # 20
    "tests/deploy/test_systemd_unit.py",  # 20
    "tests/e2e/test_lm_eval.py",  # 15
    "tests/e2e/test_text_models.py",  # 15
    "tests/e2e/test_package.py",  # 15
    "tests/e2e/test_deploy.py",  # 15
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--alone",
        choices=("all", "skip", "only"),
        default="all",
        help="the tests marked alone (a time held to a bound, or a tool that fails on a shared "
        "CPU: they must not share it with other tests): run them with the rest (all), leave them "
        "out (skip: the parallel pass of scripts/test), or run only them (only: its pass after, "
        "in one process)",
    )


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the groups marked here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep or leave out the ``alone`` tests (``--alone``); under pytest-xdist (``scripts/test``:
    ``-n``, ``--dist loadgroup``) keep each module's tests in one process (its module-scoped
    servers start once), those of a named group together (the shared demo server:
    ``tests.support.fixtures.demo_server``); and skip the ``gpu``-marked tests (tests/gpu/) where
    torch sees no CUDA device: they check what only a real GPU can show, and a CPU machine (CI)
    has nothing to check them on."""
    import torch

    alone = config.getoption("--alone")
    if alone != "all":
        wanted = alone == "only"
        kept: list[pytest.Item] = []
        dropped: list[pytest.Item] = []
        for item in items:
            (kept if (item.get_closest_marker("alone") is not None) == wanted else dropped).append(item)
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    if config.pluginmanager.hasplugin("xdist"):
        for item in items:
            if item.get_closest_marker("xdist_group") is None:
                item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
        if getattr(config.option, "loadgroup", False):  # a worker of ``--dist loadgroup``
            items[:] = longest_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not the keyword: tests/gpu/ names one
            item.add_marker(skip)


def longest_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """``items`` by group (``xdist_group``): the groups of :data:`LONGEST_FIRST` in its order,
    then the others by their number of tests, most first (pytest-xdist's own reorder), each
    group's tests in their collected order."""
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        marker = item.get_closest_marker("xdist_group")
        name = str(marker.args[0]) if marker is not None and marker.args else item.nodeid
        groups.setdefault(name, []).append(item)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    order = sorted(groups, key=lambda name: (rank.get(name, len(rank)), -len(groups[name])))
    return [item for name in order for item in groups[name]]


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown where xdist is not loaded
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """Under ``--dist loadgroup`` (pytest-xdist's controller, as each process reports what it
    collected): stop the run unless every test's node id carries its group (the suffix the
    scheduler groups by), rather than let a pytest or pytest-xdist upgrade scatter each
    module's tests again, silently, over every process (each then starting the module's
    servers: pytest-dev/pytest-xdist#1386)."""
    if node.config.getvalue("dist") != "loadgroup":
        return
    lost = [nodeid for nodeid in ids if "@" not in nodeid.rpartition("]")[2]]
    if lost:
        pytest.exit(
            f"pytest-xdist's loadgroup lost the group of {len(lost)} of {len(ids)} tests (e.g. "
            f"{lost[0]}): a pytest and pytest-xdist pair that cannot group (setup.py pins pytest)",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )
