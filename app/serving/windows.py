"""Long texts in windows, as an item stage (``app.serving.items``): a text longer than its model's
``max_seq_length`` becomes several items, one per window, each priced, admitted and batched with
other requests' items (possibly on a sibling worker); their results are put back together per
text before the response.

The model's handler says how by implementing ``app.handlers.windows.Windowed``: its
``window_policy`` (a model that truncates passes through unchanged), ``split_windows`` and, per
output, the rule that merges a text's windows (``window_merges``: the token-weighted mean of
embeddings, sums of ``tokens`` and ``windows``, the model's ``aggregate`` of probabilities and
scores: MaxP for (query, text) pairs, Dai and Callan, SIGIR 2019).

A text whose item asks for ``truncate_prompt_tokens`` (an input the model declares) is one item,
cut to its last tokens by the handler in the same pass, never windows.

Each window item carries its slice of the text as its ``text`` input (every other input repeated
for it: the response cache keys on them, a sibling worker may run it) and its own token ids as
its preparation (``app.models.base.PREPARED``), so it is tokenized once, here. Texts of a request
that fit in one window carry theirs too whenever the request was tokenized here.

Splitting runs on this stage's threads (:data:`THREADS`, the Rust tokenizer releases the GIL),
never on the event loop, and only for requests with a text that may be too long: a text whose
UTF-8 bytes (plus its query's and 4 special tokens) fit in ``max_seq_length`` cannot have more
tokens than that with a WordPiece or byte-level BPE tokenizer.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from app.errors import InvalidInput
from app.handlers.text_config import TRUNCATE
from app.handlers.windows import Span, Windowed, merge
from app.models.base import PREPARED
from app.serving.context import RequestContext
from app.serving.items import Arrays, ItemStage
from app.serving.registry import ModelVersion

__all__ = ["THREADS", "WindowPlan", "WindowStage"]

TEXT, QUERY = "text", "query"
#: Threads per worker that split texts into windows (a 1,500-word post: a few ms of Rust).
THREADS = 2


@dataclass(frozen=True)
class WindowPlan:
    """What :meth:`WindowStage.assemble` needs: ``counts`` int64 ``[B]`` (windows per text, >= 1;
    a text's windows are consecutive items), ``weights`` int64 ``[W]`` (text tokens per window)
    and each output's merge rule (``app.handlers.windows.MERGES``)."""

    counts: npt.NDArray[np.int64]
    weights: npt.NDArray[np.int64]
    merges: dict[str, str]


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


#: Whether a handler type implements ``Windowed``, by type: ``isinstance`` of a runtime-checkable
#: protocol with a data member walks the protocol's attributes on every call (typing's
#: ``_ProtocolMeta``: ~20 µs a request on the CPU VM), and a handler's type never changes.
_WINDOWED_TYPES: dict[type, bool] = {}


def _windowed(model: ModelVersion) -> Windowed | None:
    """``model``'s handler where it splits texts (a policy other than "truncate"); else None."""
    handler = model.runner.handler if model.runner is not None else None
    kind = type(handler)
    windowed = _WINDOWED_TYPES.get(kind)
    if windowed is None:
        windowed = _WINDOWED_TYPES[kind] = isinstance(handler, Windowed)
    if not windowed or cast(Windowed, handler).window_policy.truncation == "truncate":
        return None
    return cast(Windowed, handler)


class WindowStage(ItemStage[WindowPlan | None]):
    """The item stage of windows (module docstring); holds no per-request state.

    Args:
        threads: the threads that split texts (:data:`THREADS`).
    """

    def __init__(self, threads: int = THREADS) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="windows")

    def applies(self, model: ModelVersion) -> bool:
        """Whether ``model``'s handler splits texts (``Windowed``, a policy other than
        "truncate") and it has a ``text`` input."""
        has_text = any(spec.name == TEXT for spec in model.config.inputs)
        return has_text and _windowed(model) is not None

    async def expand(
        self, model: ModelVersion, context: RequestContext, inputs: Arrays
    ) -> tuple[Arrays | None, WindowPlan | None]:
        """The window items of a request whose texts need them, tokenized on a thread; else
        ``(inputs, None)``, with their token ids (``PREPARED``) where they were tokenized.

        Raises:
            InvalidInput: invalid UTF-8; a text too long for ``truncation = "error"``; a query
                too long for a window.
            PayloadTooLarge: more windows than ``max_windows`` for a text, or tokens than
                ``max_request_tokens`` for the request.
        """
        handler = _windowed(model)
        if handler is None or TEXT not in inputs:
            return inputs, None
        text_array = inputs[TEXT]
        query_array = inputs.get(QUERY)
        sizes = np.fromiter((len(t) for t in text_array.reshape(-1)), np.int64, len(text_array))
        if query_array is not None:
            sizes += np.fromiter((len(q) for q in query_array.reshape(-1)), np.int64, len(query_array))
        if int(sizes.max()) + 4 <= handler.window_policy.max_length:
            return inputs, None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, _split, handler, model.config.name, inputs)

    def assemble(self, plan: WindowPlan | None, results: Arrays | None) -> Arrays:
        """One row per text, each output by its merge rule.

        Raises:
            ValueError: no results (this stage always queues items); an output without a rule.
        """
        if results is None:
            raise ValueError("the window stage queued items but got no results")
        if plan is None:
            return results
        out: dict[str, Any] = {}
        for name, values in results.items():
            rule = plan.merges.get(name)
            if rule is None:
                raise ValueError(f"output {name!r} has no window merge rule (the handler's window_merges)")
            out[name] = merge(values, rule, plan.counts, plan.weights)
        return out


def _split(handler: Windowed, name: str, inputs: Arrays) -> tuple[Arrays, WindowPlan | None]:
    """:meth:`WindowStage.expand`'s work, on a window thread: decode, split (the handler's
    tokenizer), and the window items with their preparations."""
    from app.handlers.tokenizing import prepared_array  # loaded with a text model already

    text_array = inputs[TEXT]
    query_array = inputs.get(QUERY)
    texts = _decode(TEXT, text_array)
    queries = _decode(QUERY, query_array) if query_array is not None else None
    try:
        windows = handler.split_windows(texts, queries, inputs.get(TRUNCATE))
    except ValueError as exc:
        raise InvalidInput(f"model {name}: {exc}") from None
    counts = np.array([len(w) for w in windows], dtype=np.int64)
    spans: list[Span] = [s for w in windows for s in w]
    prepared = prepared_array([s.prepared for s in spans])
    if int(counts.max()) == 1:
        return {**inputs, PREPARED: prepared}, None
    owner = np.repeat(np.arange(len(texts)), counts)
    items = {key: array[owner] for key, array in inputs.items()}
    pieces = np.empty(len(spans), dtype=object)
    pieces[:] = [texts[i][s.start : s.stop].encode() for i, w in enumerate(windows) for s in w]
    items[TEXT] = pieces.reshape((-1, *text_array.shape[1:]))
    items[PREPARED] = prepared
    weights = np.array([s.tokens for s in spans], dtype=np.int64)
    return items, WindowPlan(counts, weights, dict(handler.window_merges))
