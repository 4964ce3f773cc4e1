"""Long texts in windows, as an item stage (``app.serving.items``): a text longer than its model's
``max_seq_length`` becomes several items, one per window, each priced, admitted and batched with
other requests' items (possibly on a sibling worker); their results are put back together per
text before the response.

The model's handler says how (``app.handlers.windows.Windowed``: ``window_policy`` and
``text_windows``); a model whose handler does not, or whose ``truncation`` is ``"truncate"``,
passes through unchanged. The stage reads the ``text`` input (and ``query``, repeated for each
of its text's windows; every other input is repeated too) and puts the outputs back together:

- ``embedding``: the token-weighted mean of the windows' vectors, renormalised;
- ``tokens`` and ``windows``: summed (a window's ``windows`` is 1: the text's is its count);
- any other output (class probabilities, scores): the model's ``aggregate``, ``"max"`` by
  default (for (query, text) pairs MaxP: Dai and Callan, SIGIR 2019), or ``"mean"``.

Splitting runs on the event loop, and only for texts that may be too long: a text whose UTF-8
bytes (plus its query's and 4 special tokens) fit in ``max_seq_length`` cannot have more tokens
than that with a WordPiece or byte-level BPE tokenizer, and is not tokenised here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from app.errors import InvalidInput
from app.handlers.windows import WindowPolicy, aggregate, weighted_mean
from app.serving.context import RequestContext
from app.serving.items import Arrays, ItemStage
from app.serving.registry import ModelVersion

__all__ = ["WindowPlan", "WindowStage"]

TEXT, QUERY = "text", "query"
_SUMMED = ("tokens", "windows")


@dataclass(frozen=True)
class WindowPlan:
    """What :meth:`WindowStage.assemble` needs: ``counts`` int64 ``[B]`` (windows per text, >= 1;
    a text's windows are consecutive items), ``weights`` int64 ``[W]`` (text tokens per window)
    and the model's ``aggregate``."""

    counts: npt.NDArray[np.int64]
    weights: npt.NDArray[np.int64]
    aggregate: str


def _decode(name: str, array: np.ndarray) -> list[str]:
    texts = []
    for i, item in enumerate(array.reshape(-1)):
        try:
            texts.append(bytes(item).decode("utf-8") if isinstance(item, bytes | bytearray) else str(item))
        except UnicodeDecodeError as exc:
            raise InvalidInput(
                f"input {name!r} item {i} is not valid UTF-8 ({exc.reason} at byte {exc.start})"
            ) from None
    return texts


class WindowStage(ItemStage[WindowPlan | None]):
    """The item stage of windows (module docstring); holds no per-request state."""

    @staticmethod
    def _policy(model: ModelVersion) -> WindowPolicy | None:
        """``model``'s window policy where its handler splits texts (not "truncate"); else None."""
        handler = model.runner.handler if model.runner is not None else None
        policy: WindowPolicy | None = getattr(handler, "window_policy", None)
        return policy if policy is not None and policy.truncation != "truncate" else None

    def applies(self, model: ModelVersion) -> bool:
        """Whether ``model``'s handler splits texts (a ``window_policy`` other than "truncate")
        and it has a ``text`` input."""
        has_text = any(spec.name == TEXT for spec in model.config.inputs)
        return has_text and self._policy(model) is not None

    async def expand(
        self, model: ModelVersion, context: RequestContext, inputs: Arrays
    ) -> tuple[Arrays | None, WindowPlan | None]:
        """The window items of a request whose texts need them; ``(inputs, None)`` otherwise.

        Raises:
            InvalidInput: invalid UTF-8; a text too long for ``truncation = "error"``; a query
                too long for a window.
            PayloadTooLarge: more windows than ``max_windows`` for a text, or tokens than
                ``max_request_tokens`` for the request.
        """
        policy = self._policy(model)
        if policy is None or TEXT not in inputs:
            return inputs, None
        handler = model.runner.handler if model.runner is not None else None
        text_array = inputs[TEXT]
        query_array = inputs.get(QUERY)
        sizes = np.fromiter((len(t) for t in text_array.reshape(-1)), np.int64, len(text_array))
        if query_array is not None:
            sizes += np.fromiter((len(q) for q in query_array.reshape(-1)), np.int64, len(query_array))
        if int(sizes.max()) + 4 <= policy.max_length:
            return inputs, None
        texts = _decode(TEXT, text_array)
        queries = _decode(QUERY, query_array) if query_array is not None else None
        try:
            windows = handler.text_windows(texts, queries)  # type: ignore[union-attr]
        except ValueError as exc:
            raise InvalidInput(f"model {model.config.name}: {exc}") from None
        counts = np.array([len(w) for w in windows], dtype=np.int64)
        if int(counts.max()) == 1:
            return inputs, None
        owner = np.repeat(np.arange(len(texts)), counts)
        pieces = [texts[i][s.start : s.stop].encode() for i, w in enumerate(windows) for s in w]
        items = {name: array[owner] for name, array in inputs.items()}
        new_text = np.empty(len(pieces), dtype=object)
        new_text[:] = pieces
        items[TEXT] = new_text.reshape((-1, *text_array.shape[1:]))
        weights = np.array([s.tokens for w in windows for s in w], dtype=np.int64)
        return items, WindowPlan(counts, weights, policy.aggregate)

    def assemble(self, plan: WindowPlan | None, results: Arrays | None) -> Arrays:
        """One row per text (module docstring for each output).

        Raises:
            ValueError: no results (this stage always queues items).
        """
        if results is None:
            raise ValueError("the window stage queued items but got no results")
        if plan is None:
            return results
        out: dict[str, Any] = {}
        for name, values in results.items():
            if name == "embedding":
                out[name] = weighted_mean(values, plan.weights, plan.counts)
            elif name in _SUMMED or values.dtype.kind not in "fc":
                out[name] = (
                    aggregate(values, plan.counts, "sum")
                    if name in _SUMMED
                    else values[np.cumsum(plan.counts) - 1]
                )
            else:
                out[name] = aggregate(values, plan.counts, plan.aggregate)
        return out
