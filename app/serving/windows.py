"""Long items in windows, as an item stage (``app.serving.items``): an item longer than its model
can see whole (a text over its ``max_seq_length``) becomes several items, one per window, each
priced, admitted and batched with other requests' items (possibly on a sibling worker); their
results are put back together per item before the response.

The model's handler says how, by implementing ``app.models.windows.Windowed``: whether the
request may need windows at all (a bound, on the event loop), the window items with their
preparations and the plan that merges their outputs (on this stage's threads), and each output's
merge rule (``app.models.windows.merge_outputs``: the token-weighted mean of embeddings, MaxP of
scores, a multi-vector's rows in order, the union of a sparse vector's terms...). What an item
is, how it is cut and what a window carries are the handler's: this stage knows no model kind.

Splitting runs on this stage's threads (:data:`THREADS`: a text model's Rust tokenizer releases
the GIL), never on the event loop, and only for requests the handler says may need it.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import cast

from app.errors import InvalidInput
from app.models.windows import Windowed, WindowPlan, merge_outputs
from app.serving.context import RequestContext
from app.serving.items import Arrays, ItemStage
from app.serving.registry import ModelVersion

__all__ = ["THREADS", "WindowStage"]

#: Threads per worker that split items into windows (a 1,500-word post: a few ms of Rust).
THREADS = 2


#: Whether a handler type implements ``Windowed``, by type: ``isinstance`` of a runtime-checkable
#: protocol walks the protocol's attributes on every call, and a handler's type never changes.
_WINDOWED_TYPES: dict[type, bool] = {}


def _windowed(model: ModelVersion) -> Windowed | None:
    """``model``'s handler where it splits items (a policy other than "truncate"); else None."""
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
        threads: the threads that split items (:data:`THREADS`).
    """

    def __init__(self, threads: int = THREADS) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="windows")

    def applies(self, model: ModelVersion) -> bool:
        """Whether ``model``'s handler splits items (``Windowed``, a policy other than
        "truncate")."""
        return _windowed(model) is not None

    async def expand(
        self, model: ModelVersion, context: RequestContext, inputs: Arrays
    ) -> tuple[Arrays | None, WindowPlan | None]:
        """The window items of a request that needs them, made on a thread; else ``(inputs,
        None)``, with their preparations (``PREPARED``) where the handler made them.

        Raises:
            InvalidInput: a request the handler refuses (its ``ValueError``).
            PayloadTooLarge: more windows or tokens than the model takes.
        """
        handler = _windowed(model)
        if handler is None or not handler.may_need_windows(inputs):
            return inputs, None
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, handler.window_items, inputs)
        except ValueError as exc:
            raise InvalidInput(f"model {model.config.name}: {exc}") from None

    def assemble(self, plan: WindowPlan | None, results: Arrays | None) -> Arrays:
        """One row per original item, each output by its merge rule
        (``app.models.windows.merge_outputs``).

        Raises:
            ValueError: no results (this stage always queues items); an output without a rule.
        """
        if results is None:
            raise ValueError("the window stage queued items but got no results")
        if plan is None:
            return results
        return merge_outputs(results, plan.merges, plan.counts, plan.weights)
