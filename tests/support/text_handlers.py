"""A text handler run in process as the server runs it: its items' inputs as the data plane hands
them (:func:`texts`, :func:`input_types`), a batch priced and then run from the preparations the
pricing made (:func:`run`: ``item_costs``, then ``preprocess`` of ``inputs[PREPARED]``, as
``app.serving`` does), and long texts as the window stage takes them (:func:`run_in_windows`:
``window_items``, each window an item, the outputs merged by the handler's rules)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from app.handlers.text_config import INPUT_TYPES
from app.models.base import PREPARED, Handler, Priced
from app.models.windows import Windowed, merge_outputs

__all__ = ["TextModel", "WindowRun", "input_types", "run", "run_in_windows", "texts"]


class TextModel(Handler, Windowed, Protocol):
    """A text handler: the server's handler contract, windows, and priced items."""

    def item_costs(self, inputs: Mapping[str, np.ndarray]) -> Priced: ...


def texts(*values: str) -> np.ndarray:
    """A BYTES input: an ``object`` array ``[B]`` of the texts' UTF-8 bytes."""
    array = np.empty(len(values), dtype=object)
    array[:] = [value.encode() for value in values]
    return array


def input_types(*tasks: str) -> np.ndarray:
    """The ``input_type`` input, int64 ``[B, 1]``, of tasks "" (0), "query" (1), "document" (2)."""
    return np.array([[INPUT_TYPES.index(task)] for task in tasks], dtype=np.int64)


def run(handler: TextModel, inputs: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """The handler's outputs for one batch of ``inputs``: priced first, then prepared from what
    the pricing made (``inputs[PREPARED]``), predicted in inference mode, postprocessed."""
    priced = handler.item_costs(inputs)
    batch = handler.preprocess({**inputs, PREPARED: priced.prepared})
    with torch.inference_mode():
        return dict(handler.postprocess(handler.predict(batch)))


@dataclass(frozen=True)
class WindowRun:
    """:func:`run_in_windows`'s answer.

    Attributes:
        items: the window items' inputs (``text``: each window's slice of its text; every other
            input repeated; ``PREPARED``: each window's preparation), the windows of a text
            consecutive.
        counts: int64 ``[B]``, the windows of each text.
        per_window: :func:`run` of ``items``, ``[W, ...]``.
        merged: the outputs per text, ``[B, ...]``, merged as the window stage merges them.
    """

    items: dict[str, np.ndarray]
    counts: np.ndarray
    per_window: dict[str, Any]
    merged: dict[str, Any]


def run_in_windows(handler: TextModel, inputs: Mapping[str, np.ndarray]) -> WindowRun:
    """``inputs`` split into window items (``handler.window_items``), run as one batch
    (:func:`run`), and each text's windows put back together by the plan's merge rules
    (``app.models.windows.merge_outputs``): the window stage's path (``app.serving.windows``)."""
    items, plan = handler.window_items(dict(inputs))
    per_window = run(handler, items)
    if plan is None:  # every text one window
        return WindowRun(dict(items), np.ones(len(items[PREPARED]), np.int64), per_window, per_window)
    merged = merge_outputs(per_window, plan.merges, plan.counts, plan.weights)
    return WindowRun(dict(items), plan.counts, per_window, merged)
