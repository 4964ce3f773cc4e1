"""Scatter/gather pieces: the shard wire format (app.server.peers) and shard planning
(app.server.balance, app.server.router), deterministic and in-process."""

from __future__ import annotations

import itertools

import msgspec
import numpy as np
import pytest

from app import errors
from app.server import peers, wire
from app.server.balance import DRAINING, READY, Load, pick_siblings
from app.server.router import shard_bounds
from app.serving.context import RequestContext


def test_tensors_round_trip_without_pickle() -> None:
    numeric = np.arange(12, dtype=np.float16).reshape(3, 2, 2)
    texts = np.array([[b"a"], [b""], ["\u00e9"]], dtype=object)
    request = wire.ShardRequest(
        "m", "1", "rid-1", 0.5, {"x": wire.to_tensor(numeric), "t": wire.to_tensor(texts)}
    )
    decoded = wire.decode_request(wire.encode(request))
    assert (decoded.model, decoded.request_id, decoded.timeout_s) == ("m", "rid-1", 0.5)
    x, t = wire.from_tensor(decoded.inputs["x"]), wire.from_tensor(decoded.inputs["t"])
    assert x.dtype == np.float16 and np.array_equal(x, numeric) and x.flags.writeable
    assert t.dtype == object and t.tolist() == texts.tolist()


def test_a_shard_carries_the_requests_context() -> None:
    """Priority and id in the body, the deadline relative, the trace in the headers; the
    receiver's context is the sender's, forwarded, its deadline anchored on arrival."""
    sent = RequestContext("rid-9", 100.0, 2, (("traceparent", "00-ab-cd-01"),), pinned=True)
    body = wire.encode(wire.ShardRequest("m", "1", sent.request_id, 0.75, {}, sent.priority))
    shard = wire.decode_request(body)
    headers = {"X-Request-Id": "rid-9", **dict(sent.trace)}
    got = peers.shard_context(shard, 500.0, headers)
    assert got == RequestContext("rid-9", 500.75, 2, sent.trace, forwarded=True, arrival=500.0)
    # a sender without the field (priority 0: the model's default level)
    legacy = msgspec.msgpack.encode(
        {"model": "m", "version": "1", "request_id": "r", "timeout_s": 1.0, "inputs": {}}
    )
    assert wire.decode_request(legacy).priority == 0
    # a sender with a field this worker does not know (a newer worker beside it after a HUP)
    newer = msgspec.msgpack.encode(
        {
            "model": "m",
            "version": "1",
            "request_id": "r",
            "timeout_s": 1.0,
            "inputs": {},
            "priority": 3,
            "tenant": "x",
        }
    )
    assert wire.decode_request(newer).priority == 3
    with pytest.raises(errors.InvalidInput):
        peers.shard_context(wire.ShardRequest("m", "1", "r", 1.0, {}, -1), 0.0, {})
    with pytest.raises(errors.InvalidInput):
        wire.decode_request(
            msgspec.msgpack.encode(
                {
                    "model": "m",
                    "version": "1",
                    "request_id": "r",
                    "timeout_s": 1.0,
                    "inputs": {},
                    "priority": "high",
                }
            )
        )


@pytest.mark.parametrize(
    "tensor",
    [
        wire.Tensor("|O", [1], data=b"\0" * 8),  # an object buffer would be pointers
        wire.Tensor("<f4", [2], data=b"\0" * 4),  # size does not match the shape
        wire.Tensor("not-a-dtype", [1], data=b"\0"),
        wire.Tensor("object", [2], items=[b"a", 3]),  # not bytes/str
        wire.Tensor("<f4", [-1], data=b""),
    ],
)
def test_bad_tensors_are_invalid_input(tensor: wire.Tensor) -> None:
    with pytest.raises(errors.InvalidInput):
        wire.from_tensor(tensor)


def test_a_siblings_error_is_raised_as_the_same_class() -> None:
    reply = wire.decode_response(
        wire.encode(wire.ShardResponse(error="QueueFull", message="full", retry_after_s=2))
    )
    with pytest.raises(errors.QueueFull, match="full") as caught:
        wire.raise_error(reply)
    assert caught.value.retry_after_s == 2
    with pytest.raises(errors.InferenceFailed):
        wire.raise_error(wire.ShardResponse(error="SystemExit", message="?"))


def test_shard_bounds_are_contiguous_and_near_equal() -> None:
    assert shard_bounds(256, 2) == [(0, 128), (128, 256)]
    bounds = shard_bounds(10, 3)
    assert bounds[0][0] == 0 and bounds[-1][1] == 10
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert sorted(stop - start for start, stop in bounds) == [3, 3, 4]


def sibling(slot: int, recent: float, state: int = READY, beat: float = 10.0, items: int = 0) -> Load:
    return Load(slot, 100 + slot, 1, state, items, 1, recent, beat)


def test_pick_siblings_takes_the_least_loaded_live_ones_up_to_one_per_batch() -> None:
    siblings = [
        sibling(1, 5.0),
        sibling(2, 0.0),
        sibling(3, 1.0),
        sibling(4, 0.0, DRAINING),
        sibling(5, 0.0, beat=0),
    ]
    assert [s.slot for s in pick_siblings(siblings, 256, 32, 10.5)] == [2, 3, 1]
    assert [s.slot for s in pick_siblings(siblings, 64, 32, 10.5)] == [2]  # two batches: one sibling
    assert pick_siblings(siblings, 32, 32, 10.5) == []


def test_a_reply_with_a_field_this_worker_does_not_know_is_read() -> None:
    """A newer sibling's reply (after a HUP that upgraded the code) still decodes here."""
    body = msgspec.msgpack.encode({"outputs": None, "error": "QueueFull", "message": "full", "shed": True})
    reply = wire.decode_response(body)
    assert (reply.error, reply.message) == ("QueueFull", "full")
