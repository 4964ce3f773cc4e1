"""The environment of in-process tests, the shared fixtures (defined in tests/support/fixtures.py)
and the skip of the ``gpu``-marked tests without a CUDA device."""

from __future__ import annotations

import os

import pytest

from tests.support.fixtures import make_client, scale_repo, tensor_repo

__all__ = ["make_client", "scale_repo", "tensor_repo"]

# In-process apps record metrics into a registry of their own: a PROMETHEUS_MULTIPROC_DIR
# inherited from the environment (the Docker image sets one) must go before anything imports
# prometheus_client, which picks its mode at import (app.main imports it: in make_client, lazily).
os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
# In-process apps serve no gRPC unless a test starts it (tests/unit/test_grpc.py binds 127.0.0.1:0).
os.environ["SCORING_GRPC_PORT"] = "0"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the ``gpu``-marked tests (tests/gpu/) where torch sees no CUDA device: they
    check what only a real GPU can show, and a CPU machine (CI) has nothing to check them on."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not the keyword: tests/gpu/ names one
            item.add_marker(skip)
