"""The environment of in-process tests, the shared fixtures (defined in tests/support/fixtures.py)
and the skip of the ``gpu``-marked tests without a CUDA device."""

from __future__ import annotations

import os

import pytest

from tests.support.fixtures import demo_server, make_client, scale_repo, tensor_repo

__all__ = ["demo_server", "make_client", "scale_repo", "tensor_repo"]

# In-process apps record metrics into a registry of their own: a PROMETHEUS_MULTIPROC_DIR
# inherited from the environment (the Docker image sets one) must go before anything imports
# prometheus_client, which picks its mode at import (app.main imports it: in make_client, lazily).
os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
# In-process apps serve no gRPC unless a test starts it (tests/unit/test_grpc.py binds 127.0.0.1:0).
os.environ["SCORING_GRPC_PORT"] = "0"


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
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not the keyword: tests/gpu/ names one
            item.add_marker(skip)
