"""The handler contract: how the server talks to a model, and which thread runs what.

A handler is a class referenced from ``model.toml`` as ``handler = "module:Class"``
(the module may also be a ``.py`` file inside the model's folder). The server
creates one instance per worker with no arguments and calls:

``load(device, config)``  -- the model's *inference thread*, once
    Load weights onto ``device`` (``cpu`` or ``cuda:0`` after GPU binding).
``item_costs(inputs)``  -- optional; a *prepare thread*, once per request, before its items
    join the queue (several may run at once, and beside ``preprocess``)
    ``inputs`` as for ``preprocess`` but one request's items. Returns int64 ``[B]``: what
    each item costs the model, in the unit the model's ``max_batch_tokens`` counts (tokens
    for a text model); batches are then formed within the model's ``max_batch_tokens`` of that
    cost (requests in arrival order, each one's items sorted by cost), and admission reasons in
    it. Raises ``ValueError`` (or
    ``UnicodeError``) for an item the model cannot take: that request alone gets a 400 /
    INVALID_ARGUMENT with the message, before it can share a batch with anyone.
    May return a :class:`Priced` instead: the costs and, per item, what the handler made of it
    while pricing it (a text model's token ids), so that the work is not done twice: the server
    keeps ``prepared`` beside the request's inputs under the reserved name :data:`PREPARED`
    (reordered, split into batches, concatenated and halved with them, never looked into) and
    ``preprocess`` finds it there. ``inputs`` may already hold :data:`PREPARED` (items an item
    stage made, such as a text's windows, tokenized there): the costs then come from it.
``batch_cost(costs)``  -- optional, with ``item_costs``; the event loop, once per batch formed,
    and a prepare thread, once per request (the request's own batches, which admission judges)
    ``costs``: the ``item_costs`` of a batch's items, int64 ``[N]``. Returns what the batch
    computes in that unit, padding included (an ``int``; it must be quick and may run on two
    threads at once). Admission takes a batch's time as ``o + c * batch_cost``, so a cost
    proportional to time across lengths is what makes its first estimates right. Without it a
    batch costs its costliest item times N (every item padded to the longest); a handler that
    runs a batch in length groups (``app.handlers.sentence_embedding``) says what they cost.
``padded_tokens(costs)``  -- optional, with ``batch_cost`` where that is not in tokens (a
    modelled time); the event loop, once per batch run. Returns the tokens the batch computes,
    padding included (``scoring_batch_tokens_total{kind="padded"}``); without it the metric
    counts ``batch_cost``.
``preprocess(inputs)``  -- a *prepare thread* (staged pipeline) or the inference thread
    ``inputs`` maps every declared input name to a numpy array whose axis 0 is
    the batch (B items, 1 <= B <= max_batch_size); BYTES inputs are ``object``
    arrays of ``bytes``; optional inputs a request omitted are filled with
    ``b""`` (BYTES) or zeros; ``inputs[PREPARED]``, where the items were priced with a
    :class:`Priced` (absent otherwise, e.g. at warmup: the handler then does that work
    itself). Returns whatever ``predict`` takes (device tensors: the copy to the device
    belongs here). May run while ``predict`` runs the previous batch.
    An input declared ``shared = "once"`` (a request's items share it: its user, its prefix)
    arrives as its distinct rows ``[U, ...]`` in batch order (consecutive items with equal rows
    share one: each request's items are consecutive), and ``inputs[shared_rows(name)]``, int64
    ``[B]``, gives each item's row; ``shared = "repeat"`` arrives repeated, ``[B, ...]``, like any
    input.
``predict(batch)``  -- the inference thread only, one batch at a time, in batch order
    Runs the model; the server wraps it in ``torch.inference_mode()``. On a GPU it should only
    launch work (no ``.cpu()``, no ``.item()``): the server waits for the device elsewhere.
``postprocess(outputs)``  -- a *finish thread* (staged pipeline) or the inference thread
    Returns one numpy array per declared output, axis 0 = the B items (the copy back to the
    host belongs here). May run while ``predict`` runs the next batch.
``prefix_cache``  -- optional attribute; a handler that keeps prefixes' keys and values across
    requests (``app.handlers.prefix_cache.PrefixCache``, or None). The server empties it after
    warmup and calibration (their synthetic prefixes would only take room) and has it report its
    work as the model version's ``scoring_prefix_cache_*`` metrics.
``close()``  -- optional; the inference thread, once
    After the version's last batch (it is unloaded, or the worker stops), and after a load or
    warmup that failed. Free what the garbage collector cannot (open files, sessions); the
    server then drops its reference and, on a GPU, empties torch's cache.

Which of these may run at once: with the staged pipeline (``pipeline`` in ``model.toml``; on
by default on a GPU) ``item_costs``, ``preprocess`` of batch N+1, ``predict`` of batch N and
``postprocess`` of batch N-1 run on different threads at the same time; ``predict`` never
runs twice at once. A handler whose ``preprocess`` or ``item_costs`` share a non-thread-safe
object (a Hugging Face tokenizer: "Already borrowed") keeps one per thread. Without the
pipeline every call but ``item_costs`` runs on the inference thread in turn.

A ``preprocess`` (or ``predict``) that raises on a batch of several requests is run again
per request, so only the requests whose items it cannot take fail (400 for a ``ValueError``
of ``preprocess``, else 500).

Source: TorchServe's ``BaseHandler`` (initialize/preprocess/inference/postprocess),
LitServe's ``LitAPI`` (setup/decode_request/predict/encode_response), and the staged data
paths of text-embeddings-inference and Infinity (tokenise, forward and postprocess on
separate workers; batches formed by a token budget).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from app.errors import ScoringError

if TYPE_CHECKING:
    import torch

    from app.models.repository import ModelConfig


@runtime_checkable
class Handler(Protocol):
    """What a model handler implements (see the module docstring for the contract)."""

    def load(self, device: torch.device, config: ModelConfig) -> None: ...

    def preprocess(self, inputs: Mapping[str, np.ndarray]) -> Any: ...

    def predict(self, batch: Any) -> Any: ...

    def postprocess(self, outputs: Any) -> Mapping[str, np.ndarray]: ...


#: The reserved input name of the items' preparations (:class:`Priced`); never a declared input
#: (``model.toml`` names cannot start with ``#``) and never read from a client.
PREPARED = "#prepared"


def shared_rows(name: str) -> str:
    """The reserved input name of the row each item of a batch takes of input ``name``, declared
    ``shared = "once"`` (module docstring): int64 ``[B]`` into ``inputs[name]``'s distinct rows."""
    return f"#rows:{name}"


def distinct_rows(array: np.ndarray) -> tuple[np.ndarray, npt.NDArray[np.int64]]:
    """``array`` (``[B, ...]``) as its runs of equal consecutive rows: ``(rows [U, ...], index
    int64 [B])`` with ``rows[index] == array``; one comparison of each row with the one before,
    so a batch of R requests sharing a row each costs O(B) and gives U <= R."""
    if len(array) == 0:
        return array, np.zeros(0, np.int64)
    flat = array.reshape(len(array), -1)
    changes = (flat[1:] != flat[:-1]).any(axis=1) if flat.shape[1] else np.zeros(len(array) - 1, bool)
    index = np.concatenate(([0], np.cumsum(changes))).astype(np.int64)
    starts = np.flatnonzero(np.concatenate(([True], changes)))
    return array[starts], index


@dataclass(frozen=True)
class Priced:
    """What ``item_costs`` may return (module docstring): ``costs`` int64 ``[B]``, each item's
    cost in the model's unit (tokens), and ``prepared``, an ``object`` array ``[B]`` of what the
    handler made of each item while pricing it (for a text model its token ids), handed back to
    ``preprocess`` as ``inputs[PREPARED]`` for the same items in the batch's order. Source:
    text-embeddings-inference tokenizes once, before its queue, and batches the encodings."""

    costs: npt.NDArray[np.int64]
    prepared: npt.NDArray[np.object_]


@dataclass(frozen=True)
class Segment:
    """What a batch run returns for its items ``[start, stop)``: their outputs (``[stop - start,
    ...]`` per output name), or ``outputs`` None when they failed: ``error`` says how (None: one
    item that did not fit in device memory alone)."""

    start: int
    stop: int
    outputs: dict[str, np.ndarray] | None
    error: ScoringError | None = None
