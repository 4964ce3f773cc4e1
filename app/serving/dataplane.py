"""The data plane: the one serving path every protocol front end calls (HTTP V1/V2, gRPC,
OpenAI embeddings).

A front end decodes its wire format into an :class:`~app.protocols.infer.InferRequest`, builds
the request's :class:`~app.serving.context.RequestContext` (its id, its arrival and the deadline
its transport named, both on the event loop's clock, its trace, client, connection and metrics),
and encodes the :class:`~app.protocols.infer.InferResponse` it gets back. Between the two, once for every
protocol: :meth:`DataPlane.admit` (the model version, 404; early refusal before the body is
decoded, 503), :meth:`DataPlane.infer` (validation against the model, 4xx; the outputs asked for;
the one absolute deadline; the priority level; balancing among sibling workers; the serving unit;
the response) and :meth:`DataPlane.run` (the array-level step, where shards and requests
forwarded by sibling workers enter). Between validation and :meth:`DataPlane.run`, and between
its outputs and the response, the item stage (``app.serving.items``) expands a request's items
and assembles their results. The data plane also names requests (:func:`request_id`): the rule
both front ends apply. Source: KServe's ``DataPlane``
(kserve/protocol/dataplane.py: ``infer`` takes an ``InferRequest``, returns an ``InferResponse``).
"""

from __future__ import annotations

import asyncio
import math
import os
import weakref
from collections.abc import Awaitable
from typing import Any, TypeVar

import msgspec
import numpy as np

from app.errors import InvalidInput, ModelNotReady, PayloadTooLarge, ScoringError
from app.models.repository import ModelConfig
from app.observability.tracing import Tracing
from app.protocols import triton
from app.protocols.codec import Call
from app.protocols.infer import InferRequest, InferResponse, OutputTensor, RawData
from app.protocols.tensors import (
    RequestLimits,
    check_against_spec,
    check_elements,
    check_shape,
    complete_inputs,
    decode_raw,
    to_array,
    typed_array,
)
from app.serving.context import RequestContext
from app.serving.items import ItemStage, for_model
from app.serving.registry import ModelRegistry, ModelVersion
from app.serving.siblings import Alone, Balancer, Siblings
from app.settings import Settings

Arrays = dict[str, np.ndarray]
_NO_VERSIONS: dict[str, ModelVersion] = {}
#: What a front end's call encodes a response into.
Answer = TypeVar("Answer")
_LIMITS = RequestLimits()


def parameters_timeout_s(parameters: dict[str, Any]) -> float | None:
    """``parameters.timeout`` (microseconds, Triton's convention) as seconds; None when absent.

    Raises:
        InvalidInput: not a positive finite number.
    """
    value = parameters.get("timeout")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise InvalidInput("parameters.timeout must be a positive number of microseconds")
    return float(value) / 1e6


def parameters_priority(config: ModelConfig, parameters: dict[str, Any]) -> int:
    """``parameters.priority`` (Triton's: 1 = the highest level, 0 = the model's default), checked
    against the model's ``priority_levels`` (any for a model without levels: the unit ignores
    it); 0 when absent. Settled here once, before the request is balanced: the serving unit maps it to its
    queue level and trusts it.

    Raises:
        InvalidInput: not a whole number >= 0, or above the model's levels.
    """
    value = parameters.get("priority")
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInput("parameters.priority must be a whole number >= 0 (1 = the highest level)")
    levels = config.priority_levels
    if levels > 1 and value > levels:
        raise InvalidInput(f"priority {value}: model {config.name} has priority levels 1..{levels}")
    return value


def validate_inputs(config: ModelConfig, request: InferRequest, limits: RequestLimits = _LIMITS) -> Arrays:
    """The request's tensors checked against ``config``, each in this order: its shape (at most
    ``MAX_DIMS`` non-negative dimensions, ``limits.max_items`` items), its name (a model input,
    once), its datatype, its element count (all before any per-element work: a hostile tensor
    costs a few comparisons), then its data, decoded or converted and checked against the spec.

    Returns:
        One array ``[B, *item_shape]`` per model input (omitted optional inputs filled), one B >= 1.

    Raises:
        InvalidInput: a malformed shape, unknown/missing/duplicate input, wrong datatype or shape,
            element count mismatch, malformed raw data, non-finite floats the model forbids.
        PayloadTooLarge: over ``limits.max_items`` items or ``limits.max_string_bytes`` per string.
    """
    specs = {s.name: s for s in config.inputs}
    arrays: Arrays = {}
    for i, tensor in enumerate(request.inputs):
        where = f"inputs[{i}] ({tensor.name!r})"
        shape = check_shape(tensor.shape, where) if tensor.shape is not None else None
        if shape:
            limits.check_items(shape[0], where)
        if tensor.name in arrays:
            raise InvalidInput(f"{where}: input given twice")
        spec = specs.get(tensor.name)
        if spec is None:
            raise InvalidInput(f"{where}: unknown input; model {config.name} takes {list(specs)}")
        if tensor.datatype != spec.datatype:
            raise InvalidInput(
                f"{where}: datatype {tensor.datatype} but model {config.name} expects {spec.datatype}"
            )
        data = tensor.data
        if data is None:
            raise InvalidInput(f"{where}: no data: give data or parameters.binary_data_size")
        if shape is not None:
            check_elements(shape, spec, limits.max_items, where)
        if isinstance(data, RawData):
            if shape is None:
                raise InvalidInput(f"{where}: raw data needs a shape")
            arr = decode_raw(tensor.datatype, shape, data.data, where, limits.max_string_bytes).reshape(shape)
        elif isinstance(data, np.ndarray):
            arr = typed_array(tensor, shape if shape is not None else list(data.shape), where, limits)
        else:
            if shape is not None and shape and len(data) > math.prod(shape):
                raise InvalidInput(f"{where}: shape {shape} needs {math.prod(shape)} elements, data has more")
            arr = to_array(data, tensor.datatype, shape, where, limits.max_string_bytes)
        arrays[tensor.name] = check_against_spec(arr, spec, config.allow_non_finite, where)
    if not arrays and all(s.optional for s in config.inputs):
        raise InvalidInput(f"inputs: empty; model {config.name} takes {list(specs)}")
    return complete_inputs(config, arrays, "inputs")


def check_capacity(config: ModelConfig, items: int) -> None:
    """The one cap on a request's size at its model: ``items`` (what it will queue, its texts'
    windows included) at most the model's ``queue_capacity``. Checked before the request is
    balanced, so that it does not depend on how many workers would share it (a scattered
    request's shards each fit a queue that the whole does not).

    Raises:
        PayloadTooLarge: more items than ``queue_capacity`` (413, naming the setting).
    """
    if items > config.queue_capacity:
        raise PayloadTooLarge(
            f"request has {items} items to run (its texts' windows included); model {config.name} "
            f"queues at most {config.queue_capacity} (queue_capacity in its model.toml)"
        )


def requested_outputs(config: ModelConfig, request: InferRequest) -> list[str]:
    """Names of the outputs to return: the request's ``outputs`` in its order, or all in model
    order.

    Raises:
        InvalidInput: an unknown output name, or one asked for twice.
    """
    names = [s.name for s in config.outputs]
    if not request.outputs:
        return names
    wanted = [o.name for o in request.outputs]
    unknown = [n for n in wanted if n not in names]
    if unknown:
        raise InvalidInput(f"outputs: unknown output(s) {unknown}; model {config.name} has {names}")
    if len(set(wanted)) != len(wanted):
        twice = sorted({n for n in wanted if wanted.count(n) > 1})
        raise InvalidInput(f"outputs: {twice} asked for more than once")
    for o in request.outputs:
        if o.parameters and triton.CLASSIFICATION in o.parameters:
            datatype = next(s.datatype for s in config.outputs if s.name == o.name)
            triton.classification_count(o.parameters[triton.CLASSIFICATION], o.name, datatype)
    return wanted


def build_response(
    config: ModelConfig, request: InferRequest, outputs: Arrays, wanted: list[str]
) -> InferResponse:
    """The response to ``request``: the outputs ``wanted``, in that order, each marked binary when
    the request wants it so (per output ``binary_data``, else ``binary_data_output``); an output
    asked for with ``"classification": k`` becomes its top k classes (Triton's classification
    extension, :func:`app.protocols.triton.classification`)."""
    datatypes = {s.name: s.datatype for s in config.outputs}
    labels = {s.name: s.labels for s in config.outputs}
    ragged = {s.name for s in config.outputs if s.ragged}
    binary = {o.name: o.binary_data for o in request.outputs or ()}
    classify = {
        o.name: o.parameters[triton.CLASSIFICATION]
        for o in request.outputs or ()
        if o.parameters and triton.CLASSIFICATION in o.parameters
    }
    tensors = []
    for name in wanted:
        wants = binary.get(name)
        datatype, array = datatypes[name], outputs[name]
        if name in classify:  # Triton's classification extension: top k as "score:index:label"
            datatype, array = "BYTES", triton.classification(array, classify[name], labels[name])
        as_binary = request.binary_data_output if wants is None else wants
        tensors.append(OutputTensor(name, datatype, array, as_binary, name in ragged))
    return InferResponse(config.name, config.version, tensors, request.id)


class DataPlane:
    """This worker's serving path over its models.

    Args:
        registry: the model versions this worker serves (kept by ``app.serving.lifecycle``).
        settings: the server's settings (default and maximum deadlines).
        limits: the request limits the codecs and validation enforce.
        siblings: the other workers of the server (``app.serving.siblings``): their statistics.
        tracing: OpenTelemetry spans of the requests (``app.observability.tracing``); None: off.
        items: the item stages between a validated request and the queue, and what this
            worker's serving units compute is shown to them (``app.serving.items``: windows,
            the response cache); None: one item -> one item, and nothing is called.
        balancer: this worker's load among its siblings and the requests that leave it
            (``app.serving.siblings.Balancer``); None: all run here.
    """

    def __init__(
        self,
        registry: ModelRegistry,
        settings: Settings,
        limits: RequestLimits,
        siblings: Siblings,
        tracing: Tracing | None = None,
        items: ItemStage[Any] | None = None,
        balancer: Balancer | None = None,
    ) -> None:
        self.registry = registry
        self.items = items
        #: What of ``items`` applies, per loaded runner (``_stage_for``).
        self._stages: weakref.WeakKeyDictionary[Any, ItemStage[Any] | None] = weakref.WeakKeyDictionary()
        self.settings = settings
        self.limits = limits
        self.siblings = siblings
        self.balancer: Balancer = balancer or Alone()
        self.tracing = tracing

    def local_statistics(self) -> list[dict[str, Any]]:
        """This worker's Triton statistics (``$model_stat``) of every model version it has."""
        return [
            triton.model_statistics(e.config.name, e.config.version, e.stats) for e in self.registry.entries()
        ]

    async def statistics(self, name: str | None = None, version: str | None = None) -> dict[str, Any]:
        """Triton's ``$stats_model_response`` for the whole server: this worker's statistics and
        its siblings' (``Siblings.statistics``: each that answers in time), summed per model
        version (:func:`app.protocols.triton.sum_statistics`); of every model (``name`` None), of
        every version of one (``version`` None), or of one version. Triton's statistics are the
        server's; perf_analyzer subtracts two of them, which only works if they are.

        Raises:
            ModelNotFound: an unknown model or version (404).
        """
        if name is not None:
            self.registry.get(name, version)  # raises ModelNotFound
        others = await self.siblings.statistics()
        summed = triton.sum_statistics([self.local_statistics(), *others])
        if name is not None:
            summed = [s for s in summed if s["name"] == name and version in (None, s["version"])]
        return triton.statistics(summed, os.getpid(), workers=1 + len(others))

    def get_model(self, name: str, version: str | None) -> ModelVersion:
        """The model version a request addresses (None: the one requests without a version get).

        Raises:
            ModelNotFound: unknown name or version (404; the message lists what exists).
            ModelNotReady: a model of the repository that cannot be served (503 with why).
        """
        registry = self.registry
        found = (
            registry.latest.get(name)
            if version is None
            else registry.versions.get(name, _NO_VERSIONS).get(version)
        )
        if found is None:
            raise registry.missing(name, version)
        return found

    # --- deadlines ----------------------------------------------------------------------------

    def deadline(self, model: ModelVersion, arrival: float, requested: float | None) -> float:
        """The absolute deadline (loop time) a request that arrived at ``arrival`` runs under: the
        one its client named (``requested``: ``X-Request-Timeout-Ms``, ``parameters.timeout``, a
        gRPC deadline, the earliest of them), else the model's ``timeout_ms``, else the server's
        ``request_timeout_ms``; never later than ``arrival`` + the model's ``max_timeout_ms`` (or
        the server's ``max_request_timeout_ms``).

        Clipped rather than refused (as a gRPC deadline longer than the server's limit is); one at
        or before ``arrival`` counts as none (the parsers refuse those first), as does None or
        NaN (``app.serving.context.NO_DEADLINE``).
        """
        config, settings = model.config, self.settings
        cap = arrival + (config.max_timeout_ms or settings.max_request_timeout_ms) / 1000.0
        if requested is None or not requested > arrival:
            return min(arrival + (config.timeout_ms or settings.request_timeout_ms) / 1000.0, cap)
        return min(requested, cap)

    def settle(self, model: ModelVersion, context: RequestContext) -> RequestContext:
        """``context`` (as its front end built it) with the deadline it runs under at ``model``
        (:meth:`deadline` of its transport's), and its arrival (now, where the front end named
        none): settled once, by :meth:`admit`, before the body is decoded."""
        arrival = context.arrival if context.arrival is not None else asyncio.get_running_loop().time()
        requested = None if math.isnan(context.deadline) else context.deadline
        deadline = self.deadline(model, arrival, requested)
        return msgspec.structs.replace(context, deadline=deadline, arrival=arrival)

    def settle_parameters(
        self, model: ModelVersion, request: InferRequest, context: RequestContext
    ) -> RequestContext:
        """``context`` (settled: :meth:`settle`) with what ``request.parameters`` say, once
        decoded: its deadline brought forward to ``parameters.timeout`` (microseconds from its
        arrival, Triton's), its priority (:func:`parameters_priority`).

        Raises:
            InvalidInput: a malformed ``parameters.timeout`` or ``.priority``.
        """
        if not request.parameters:
            return context
        timeout_s = parameters_timeout_s(request.parameters)
        deadline = context.deadline
        if timeout_s is not None and context.arrival is not None:
            deadline = min(deadline, context.arrival + timeout_s)
        priority = parameters_priority(model.config, request.parameters)
        return msgspec.structs.replace(context, deadline=deadline, priority=priority)

    # --- the steps a front end calls ------------------------------------------------------------

    def admit(
        self, name: str, version: str | None, context: RequestContext
    ) -> tuple[ModelVersion, RequestContext]:
        """The model version a request addresses and its context settled for it (:meth:`settle`:
        its deadline), once it is clear the request is not refused early: with a full batch or
        more waiting and no request of the size recently seen able to finish in time, it is
        refused before its body is decoded (the full admission, with
        its own size, happens in :meth:`infer`). A model whose item stage may answer without it
        (``ItemStage.answers_without_model``: a response cache) is never refused here. The
        request's metrics (``context.recording``) are labelled with the version found, refused or
        not; one for a model this worker does not serve is labelled with the name the repository
        knows it by (``ModelRegistry.labels``: an unavailable model's), "" for an unknown name.

        Args:
            name, version: the model addressed (version None = the default one).
            context: the request's, as its front end built it (its arrival, and the deadline
                its transport named).

        Raises:
            ModelNotFound: unknown model or version (404).
            ModelNotReady: the model is unavailable (503 with why).
            QueueFull: refused early (503 + Retry-After); DeadlineExceeded: could not finish in
                time even alone (504).
        """
        recording = context.recording
        try:
            model = self.get_model(name, version)
        except ScoringError:  # not served: counted under its model all the same, if it has one
            if recording is not None and (labels := self.registry.labels(name, version)) is not None:
                recording.model(*labels)
            raise
        if recording is not None:
            recording.model(model.config.name, model.config.version)
        if model.error is not None and model.unit is None:
            raise ModelNotReady(f"model {model.config.name!r} is unavailable: {model.error}")
        unit = model.unit
        stage = self._stage_for(model)
        # a stage that may answer without the model (a cache) is asked first: what it answers
        # never reaches the queue, and admission in ``infer`` prices only what is left
        context = self.settle(model, context)
        if unit is not None and not (stage is not None and stage.answers_without_model(model)):
            refusal = unit.refuse_early(context.deadline)
            if refusal is not None:
                raise refusal
        return model, context

    async def serve(self, model: ModelVersion, call: Call[Answer], context: RequestContext) -> Answer:
        """Serve one decoded call (``app.protocols.codec.Call``) on an admitted model: build its
        inference request for the model's config, :meth:`infer` it, and encode the response (an
        ``encoding`` span where tracing is on). What every front end does once its transport has
        named the model.

        Args:
            model: what :meth:`admit` returned.
            call: the decoded call.
            context: the request's, as its front end built it.

        Returns:
            What the call's ``encode`` makes of the response (HTTP: bytes, content type and
            headers; gRPC: a ``ModelInferResponse``).

        Raises:
            What the call's ``build`` raises (InvalidInput, 400) and what :meth:`infer` raises.
        """
        response = await self.infer(call.build(model.config), context, model=model)
        if self.tracing is None:
            return call.encode(model.config, response)
        with self.tracing.encoding():
            return call.encode(model.config, response)

    async def infer(
        self, request: InferRequest, context: RequestContext, *, model: ModelVersion | None = None
    ) -> InferResponse:
        """Validate, admit, run and answer one inference request.

        Args:
            request: the decoded request (its tensors not yet validated).
            context: the request's, as :meth:`admit` settled it (its deadline); without
                ``model``, as its front end built it (settled here). Its priority is settled
                here, and its deadline brought forward to its ``parameters.timeout``, if any.
            model: the version :meth:`admit` returned (default: looked up from the request).

        Returns:
            The response: the outputs asked for, ``[B, ...]`` each, in the request's item order.

        Raises:
            ModelNotFound (404); InvalidInput: tensors that do not fit the model, unknown or
            repeated outputs, a malformed ``parameters.timeout`` or ``.priority`` (400);
            PayloadTooLarge: over an item, string or batch-cost limit, or more items to run (the
            windows of its texts included) than the model's ``queue_capacity`` (413, :meth:`run`);
            and what :meth:`app.serving.unit.ServingUnit.infer` raises.
        """
        if model is None or model.retired:  # not admitted, or unloaded while its body was read
            model = self.get_model(request.model_name, request.model_version)
            context = self.settle(model, context)
        config = model.config
        inputs = validate_inputs(config, request, self.limits)
        wanted = requested_outputs(config, request)  # an unknown output fails before the model runs
        context = self.settle_parameters(model, request, context)
        if model.runner is None and self.items is not None:
            # still loading: the stages decide on the model as loaded (windows, the cache's key)
            await self.registry.serving_unit(model, context.deadline)
        stage = self._stage_for(model)
        if stage is None:
            outputs = await self.run(model, inputs, context)
        else:
            queued, plan = await stage.expand(model, context, inputs)
            # none left: every item was answered by the stage, no queue, no model
            results = None if queued is None else await self.run(model, queued, context)
            outputs = stage.assemble(plan, results)
        return build_response(config, request, outputs, wanted)

    def _stage_for(self, model: ModelVersion) -> ItemStage[Any] | None:
        """What of the item stage applies to ``model`` (``app.serving.items.for_model``), asked
        once per loaded runner (a load or reload makes a new one, with its config); the whole
        stage while the model has no runner (only :meth:`admit` asks then)."""
        runner = model.runner
        if self.items is None or runner is None:
            return self.items
        try:
            return self._stages[runner]
        except KeyError:
            stage = self._stages[runner] = for_model(self.items, model)
            return stage

    def run(self, model: ModelVersion, inputs: Arrays, context: RequestContext) -> Awaitable[Arrays]:
        """Run validated arrays on ``model``'s serving unit, or, when its siblings say so, in
        shards on them and here, or whole on one of them (``Balancer.route``).

        Args:
            inputs: one array per model input, ``[B, *item_shape]``, B >= 1, validated.
            context: the request's (``app.serving.context``): the deadline by which the outputs
                are due, its priority, and whether it was forwarded (a shard or request from a
                sibling worker: never split or sent on again) or pinned.

        Returns:
            An awaitable (await it at once) of one array per model output, ``[B, ...]``, in item
            order: a coroutine of this module's, or the siblings' route.

        Raises:
            PayloadTooLarge: a request (not forwarded) of more items than the model's
                ``queue_capacity`` (:func:`app.serving.dataplane.check_capacity`), before it
                is balanced: the cap does not depend on how many workers would share it.
        """
        unit = model.unit
        items = len(next(iter(inputs.values())))
        if not context.forwarded:
            check_capacity(model.config, items)
        balancer = self.balancer
        if unit is not None and not context.forwarded and balancer.may_leave(unit, items, context.pinned):
            return self._routed(model, inputs, items, context)
        return self._here(model, inputs, items, context)

    async def _here(self, model: ModelVersion, inputs: Arrays, items: int, context: RequestContext) -> Arrays:
        balancer = self.balancer
        trace = self.tracing.queued() if self.tracing is not None else None
        balancer.add_load(items)  # published for the siblings' balancing
        try:
            unit = model.unit
            if unit is None:  # still loading: wait for it, within the deadline
                unit = await self.registry.serving_unit(model, context.deadline)
            fingerprint = model.fingerprint  # of the files ``unit`` was loaded from (set together)
            stage = self._stage_for(model)
            outputs = await unit.infer(inputs, context, trace=trace)
            if stage is not None:  # e.g. the response cache stores it, under that fingerprint
                stage.computed(model, fingerprint, inputs, outputs)
            return outputs
        finally:
            balancer.add_load(-items)

    async def _routed(
        self, model: ModelVersion, inputs: Arrays, items: int, context: RequestContext
    ) -> Arrays:
        """The siblings' route (scatter, or forward when pinned); here, whole, if they decline."""
        unit = model.unit
        assert unit is not None

        def local(arrays: Arrays) -> Any:
            return self._here(model, arrays, len(next(iter(arrays.values()))), context)

        outputs = await self.balancer.route(unit, inputs, context, local)
        if outputs is not None:
            return outputs
        return await self._here(model, inputs, items, context)
