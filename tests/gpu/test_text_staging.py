"""The text handlers' host staging on a CUDA device (app.handlers.text_base): batches padded into
reused pinned buffers and copied asynchronously on a side stream arrive intact, however fast the
next batches reuse the buffers, from several preparing threads at once; the buffers are pinned
and reused (not allocated per batch). Marked ``gpu``: skipped without a CUDA device."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from app.handlers.text_base import SLOTS, HostStaging
from app.handlers.tokenizing import pad

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda:0")


def _batch(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 30_000, size=int(rng.integers(1, 300)), dtype=np.int32) for _ in range(32)]


def _staged(staging: HostStaging, seed: int) -> tuple[list[np.ndarray], dict[str, torch.Tensor]]:
    rows = _batch(seed)
    stream = torch.cuda.Stream(CUDA)  # type: ignore[no-untyped-call]
    with torch.cuda.stream(stream):
        (features,) = staging.to_device(
            lambda alloc: [pad(rows, 0, type_ids=True, alloc=alloc)], 3 * 32 * 300
        )
        # long kernels on the same stream after the copies: the host moves on to the next batch
        busy = torch.ones(2048, 2048, device=CUDA)
        for _ in range(8):
            busy = busy @ busy / 2048
    stream.synchronize()
    return rows, features


def test_batches_arrive_intact_while_the_buffers_are_reused() -> None:
    staging = HostStaging(CUDA)
    for seed in range(4 * SLOTS):
        rows, features = _staged(staging, seed)
        want = pad(rows, 0, type_ids=True)
        for name, tensor in features.items():
            assert tensor.device.type == "cuda" and np.array_equal(tensor.cpu().numpy(), want[name]), name
    buffers = [slot.buffer for slot in staging._local.ring]
    assert all(b is not None and b.is_pinned() for b in buffers)
    pointers = [b.data_ptr() for b in buffers if b is not None]
    _staged(staging, 99)
    again = [slot.buffer.data_ptr() for slot in staging._local.ring if slot.buffer is not None]
    assert again == pointers  # reused, not allocated again


def test_threads_have_buffers_of_their_own() -> None:
    staging = HostStaging(CUDA)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda seed: _staged(staging, seed), range(16)))
    for rows, features in results:
        want = pad(rows, 0, type_ids=True)
        assert all(np.array_equal(t.cpu().numpy(), want[name]) for name, t in features.items())
