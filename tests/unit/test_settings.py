"""Settings: env parsing and validation. The README table generated from them:
tests/deploy/test_settings.py."""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from app.settings import Settings


def test_env_vars_with_prefix_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCORING_PORT", "9001")
    monkeypatch.setenv("SCORING_MODELS", "a, b")
    monkeypatch.setenv("SCORING_GPUS", "0,GPU-abc")
    s = Settings()
    assert s.port == 9001 and s.model_names == ("a", "b") and s.gpu_allow_list == ("0", "GPU-abc")
    assert s.host == "127.0.0.1"  # loopback unless told otherwise


def test_invalid_values_are_rejected_with_the_field_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCORING_PORT", "70000")
    with pytest.raises(ValidationError, match="port"):
        Settings()
    monkeypatch.delenv("SCORING_PORT")
    monkeypatch.setenv("SCORING_FOREIGN_PROCESS_POLICY", "maybe")
    with pytest.raises(ValidationError, match="foreign_process_policy"):
        Settings()


def test_the_workers_settings_resolve_torch_threads_for_the_servers_worker_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gunicorn worker builds its one Settings with gunicorn's worker count (GPUs x
    max_processes_per_gpu): torch threads fit the cores for that count, unless set."""
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.delenv("SCORING_TORCH_THREADS", raising=False)
    assert Settings().for_workers(4).torch_threads == 4
    assert Settings().for_workers(32).torch_threads == 1
    assert Settings(torch_threads=3).for_workers(4).torch_threads == 3


def test_client_certificates_need_tls() -> None:
    with pytest.raises(ValidationError, match="SCORING_CLIENT_CA_FILE needs TLS"):
        Settings(client_ca_file="ca.pem")
    assert Settings(certfile="c.pem", keyfile="k.pem", client_ca_file="ca.pem").client_ca_file is not None


def test_readiness_is_strict_by_default() -> None:
    """As in Triton (--strict-readiness): a model that cannot load keeps the server unready."""
    assert Settings().strict_readiness is True
