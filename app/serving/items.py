"""The item stage: the one seam between a validated inference request and the queue, and between
the results and the response.

:meth:`ItemStage.expand` turns a request's items into the items that are queued and a *plan*;
:meth:`ItemStage.assemble` turns the queued items' results and that plan back into one output
row per original item, in the original order. On the way an item may become several (the
windows of a long text, each priced, admitted and batched on its own) or none (a result a
response cache already holds). The data plane (``app.serving.dataplane.DataPlane.infer``) calls
both around everything that prices, admits, balances and batches, so:

- admission, the sibling router (scatter, forward) and the batcher see only the expanded items;
- a request whose stage leaves no item (``expand`` returns ``None`` to queue) never reaches the
  queue, a sibling or a loading model: ``assemble(plan, None)`` answers it;
- shards and requests forwarded by a sibling worker arrive expanded already
  (``DataPlane.run``): the stage runs once, on the worker the client called;
- stages decide on the model as loaded (its handler's windows, its files' identity): a request
  that reaches a worker while its model is still loading waits for the model before any stage
  runs, as it would before the queue;
- what the data plane needs of a stage besides its two steps is part of this protocol too:
  whether it may answer a model's requests without the model (:meth:`ItemStage.answers_without_model`:
  then ``DataPlane.admit`` does not refuse them early, before their body is decoded and their
  items looked up), and what a serving unit of this worker computed
  (:meth:`ItemStage.computed`: the items as queued, their outputs, and the identity of the
  files that unit was loaded from). The data plane calls stages through this protocol only.

Stages compose (:class:`Stages`): expand in order, assemble in the reverse order, so a window
stage and a cache stage stack either way round. Without a stage (the default) the data plane
calls nothing: one item is one item; :data:`IDENTITY` is that stage spelled out. Source: the
shape of Triton's response cache (lookup before the scheduler, insert after it;
``docs/user_guide/response_cache.md``) at item level, and vLLM's chunked processing of long
pooling inputs (split before the scheduler, pool after it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

if TYPE_CHECKING:
    from app.serving.context import RequestContext
    from app.serving.registry import ModelVersion

#: One array per tensor name, axis 0 = items.
Arrays = dict[str, np.ndarray]

Plan = TypeVar("Plan")


class ItemStage(Protocol[Plan]):
    """Expands a request's items before the queue and assembles their results after it.

    Implementations hold no per-request state: everything ``assemble`` needs travels in the
    plan. All run on the event loop; ``expand`` is a coroutine so that a stage's blocking work
    (tokenizing, a shared store on disk or over the network) runs on a thread while the loop
    serves others; the others must be quick. A stage that subclasses this protocol inherits
    :meth:`answers_without_model` (False) and :meth:`computed` (nothing).
    """

    #: Whether :meth:`computed` keeps anything (the data plane calls it only then).
    keeps: bool = False

    def applies(self, model: ModelVersion) -> bool:
        """Whether the stage may do anything for ``model`` as loaded (its runner and config): the
        data plane asks once per loaded runner and leaves a stage that does not apply out of
        that model's requests (:func:`for_model`). True where unsure."""
        ...

    def answers_without_model(self, model: ModelVersion) -> bool:
        """Whether the stage may answer some of ``model``'s requests whole, without the model
        (a response cache): the data plane then never refuses them before their body is
        decoded (``DataPlane.admit``'s early refusal); admission prices what :meth:`expand`
        leaves. False by default."""
        return False

    async def expand(
        self, model: ModelVersion, context: RequestContext, inputs: Arrays
    ) -> tuple[Arrays | None, Plan]:
        """The items to queue for one request, and the plan to put their results back.

        Args:
            model: the model version addressed (its ``config`` says what the stage does for it).
            context: the request's context (id, deadline, priority level...).
            inputs: the validated inputs, one array ``[B, ...]`` per model input, B >= 1.

        Returns:
            ``(items, plan)``: ``items`` one array ``[N, ...]`` per model input, N >= 1, or None
            when nothing is left to compute (then ``assemble`` gets None).

        Raises:
            ScoringError: a request the stage refuses (e.g. InvalidInput, 400).
        """
        ...

    def assemble(self, plan: Plan, results: Arrays | None) -> Arrays:
        """One output row per original item, in the original order.

        Args:
            plan: what :meth:`expand` returned beside the items.
            results: one array ``[N, ...]`` per model output, row i the result of queued item i
                (None when :meth:`expand` queued nothing).

        Returns:
            One array ``[B, ...]`` per model output.
        """
        ...

    def computed(self, model: ModelVersion, fingerprint: str, items: Arrays, outputs: Arrays) -> None:
        """What a serving unit of this worker computed for ``model``: called by the data plane
        once the unit returns, for every batch of items it ran here (a request's own, a shard or
        a request a sibling worker sent), before the outputs go anywhere else. Nothing by
        default.

        Args:
            model: the model version the unit serves.
            fingerprint: the fingerprint of the files that unit was loaded from, read with the
                unit (``ModelVersion.fingerprint`` when the request took it): results stored
                under it are those of those files, even where the version was reloaded since.
            items: the items as queued (after every stage's expansion), ``[N, ...]`` per input.
            outputs: their outputs, ``[N, ...]`` per model output; the stage must copy what it
                keeps (the unit may reuse the arrays).
        """
        return None


class Identity(ItemStage[None]):
    """One item -> one item; the plan is nothing (the default stage)."""

    def applies(self, model: ModelVersion) -> bool:
        """Never: it does nothing."""
        return False

    async def expand(
        self, model: ModelVersion, context: RequestContext, inputs: Arrays
    ) -> tuple[Arrays | None, None]:
        """``inputs`` unchanged."""
        return inputs, None

    def assemble(self, plan: None, results: Arrays | None) -> Arrays:
        """``results`` unchanged.

        Raises:
            ValueError: no results (an identity stage always queues its items).
        """
        if results is None:
            raise ValueError("the identity item stage queued items but got no results")
        return results


IDENTITY = Identity()


def for_model(stage: ItemStage[Any] | None, model: ModelVersion) -> ItemStage[Any] | None:
    """What of ``stage`` applies to ``model`` (:meth:`ItemStage.applies`; :meth:`Stages.for_model`
    for several): the stage, some of its stages, or None (the request goes to the queue as it is,
    through none of the stages' code)."""
    if stage is None:
        return None
    if isinstance(stage, Stages):
        return stage.for_model(model)
    return stage if stage.applies(model) else None


class Stages(ItemStage[list[tuple[ItemStage[Any], Any]]]):
    """Several stages as one: each expands what the one before it left, and the results are
    assembled in the reverse order. A stage that leaves nothing ends the expansion (the stages
    after it see no request; only those that ran assemble).

    Args:
        stages: the stages, outermost (nearest the client) first.
    """

    def __init__(self, stages: Sequence[ItemStage[Any]]) -> None:
        self.stages = tuple(stages)
        self.keeps = any(stage.keeps for stage in self.stages)

    def applies(self, model: ModelVersion) -> bool:
        """Whether any of the stages applies."""
        return any(stage.applies(model) for stage in self.stages)

    def answers_without_model(self, model: ModelVersion) -> bool:
        """Whether any of the stages may answer without the model (its answer alone leaves no
        item to queue)."""
        return any(stage.answers_without_model(model) for stage in self.stages)

    def computed(self, model: ModelVersion, fingerprint: str, items: Arrays, outputs: Arrays) -> None:
        """Each stage's :meth:`ItemStage.computed`, in order."""
        for stage in self.stages:
            stage.computed(model, fingerprint, items, outputs)

    def for_model(self, model: ModelVersion) -> ItemStage[Any] | None:
        """The stages that apply to ``model``: None, the one, or those as one :class:`Stages`."""
        chosen = [stage for stage in self.stages if stage.applies(model)]
        if len(chosen) > 1:
            return Stages(chosen)
        return chosen[0] if chosen else None

    async def expand(
        self, model: ModelVersion, context: RequestContext, inputs: Arrays
    ) -> tuple[Arrays | None, list[tuple[ItemStage[Any], Any]]]:
        """Each stage's expansion in turn; the plan is each stage that ran with its plan."""
        plans: list[tuple[ItemStage[Any], Any]] = []
        items = inputs
        for stage in self.stages:
            expanded, plan = await stage.expand(model, context, items)
            plans.append((stage, plan))
            if expanded is None:
                return None, plans
            items = expanded
        return items, plans

    def assemble(self, plan: list[tuple[ItemStage[Any], Any]], results: Arrays | None) -> Arrays:
        """Each stage that ran assembles, the last first."""
        out = results
        for stage, stage_plan in reversed(plan):
            out = stage.assemble(stage_plan, out)
        if out is None:
            raise ValueError("no item stage ran: nothing to assemble")
        return out
