"""The data plane: the one serving path every protocol front end calls (HTTP V1/V2, gRPC,
OpenAI embeddings).

A front end decodes its wire format into an :class:`~app.protocols.infer.InferRequest`, with its
arrival time and the deadline its transport named (both on the event loop's clock), and encodes
the :class:`~app.protocols.infer.InferResponse` it gets back. Between the two, once for every
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

import math
import os
import random
import re
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np

from app.errors import InvalidInput, ModelNotReady
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
from app.serving.item_cache import ItemCache
from app.serving.items import ItemStage, for_model
from app.serving.registry import ModelRegistry, ModelVersion
from app.serving.siblings import Alone, Balancer, Siblings
from app.settings import Settings

Arrays = dict[str, np.ndarray]
_NO_VERSIONS: dict[str, ModelVersion] = {}
_LIMITS = RequestLimits()
#: What a front end's call encodes a response into.
Answer = TypeVar("Answer")
#: A request id a client may choose (HTTP ``X-Request-Id``, gRPC ``ModelInferRequest.id`` or
#: ``x-request-id`` metadata): 1 to 128 of these, echoed in responses and logs.
_VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def request_id(*candidates: str) -> str:
    """The data plane names requests: the rule both front ends apply (the HTTP edge to
    ``X-Request-Id``, gRPC to ``ModelInferRequest.id`` or ``x-request-id`` metadata). The first
    candidate that is a sane request id, else a new one: 128 random bits as 32 hex digits. An
    id names a request in logs and errors; it is no secret, so it comes from ``random``
    (reseeded in each forked worker), not a syscall."""
    for candidate in candidates:
        if candidate and _VALID_REQUEST_ID.match(candidate):
            return candidate
    return f"{random.getrandbits(128):032x}"


class DataPlane:
    """This worker's serving path over its models.

    Args:
        registry: the model versions this worker serves (kept by ``app.serving.lifecycle``).
        settings: the server's settings (default and maximum deadlines).
        limits: the request limits the codecs and validation enforce.
        siblings: the other workers of the server (``app.serving.siblings``): their statistics.
        tracing: OpenTelemetry spans of the requests (``app.observability.tracing``); None: off.
        items: the item stage between a validated request and the queue (``app.serving.items``);
            None: one item -> one item, and nothing is called.
        cache: the response cache (``app.serving.item_cache``), whose item stage is among
            ``items``: what this worker's serving units compute for a model that enables it is
            stored there; None: none.
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
        cache: ItemCache | None = None,
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
        self.cache = cache

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

    def version(self, name: str, version: str | None) -> ModelVersion:
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
        or before ``arrival`` counts as none (the parsers refuse those first).
        """
        config, settings = model.config, self.settings
        cap = arrival + (config.max_timeout_ms or settings.max_request_timeout_ms) / 1000.0
        if requested is None or not requested > arrival:
            return min(arrival + (config.timeout_ms or settings.request_timeout_ms) / 1000.0, cap)
        return min(requested, cap)

    def request_deadline(self, model: ModelVersion, request: InferRequest) -> float:
        """:meth:`deadline` of ``request``: the earlier of its transport's deadline and its
        ``parameters.timeout`` (microseconds from its arrival, Triton's).

        Raises:
            InvalidInput: a ``parameters.timeout`` that is not a positive number.
        """
        requested = request.deadline
        given = parameters_timeout_s(request.parameters) if request.parameters else None
        if given is not None and (requested is None or request.arrival + given < requested):
            requested = request.arrival + given
        return self.deadline(model, request.arrival, requested)

    # --- the steps a front end calls ------------------------------------------------------------

    def admit(self, name: str, version: str | None, arrival: float, deadline: float | None) -> ModelVersion:
        """The model version a request addresses, once it is clear the request is not refused
        early: with a full batch or more waiting and no request of the size recently seen able
        to finish in time, it is refused before its body is decoded (the full admission, with
        its own size, happens in :meth:`infer`). A model with a response cache is never refused
        here (its cached items cost nothing).

        Args:
            name, version: the model addressed (version None = the default one).
            arrival, deadline: when it arrived, and the deadline its transport named (a header,
                a gRPC deadline; None = none), loop time.

        Raises:
            ModelNotFound: unknown model or version (404).
            ModelNotReady: the model is unavailable (503 with why).
            QueueFull: refused early (503 + Retry-After); DeadlineExceeded: could not finish in
                time even alone (504).
        """
        model = self.version(name, version)
        if model.error is not None and model.unit is None:
            raise ModelNotReady(f"model {model.config.name!r} is unavailable: {model.error}")
        unit = model.unit
        # a model with a response cache is not refused before its items are looked up: those
        # cached never reach the queue, and admission in ``infer`` prices only the others
        if unit is not None and not (self.cache is not None and model.config.response_cache.enable):
            refusal = unit.refuse_early(self.deadline(model, arrival, deadline))
            if refusal is not None:
                raise refusal
        return model

    async def serve(
        self,
        model: ModelVersion,
        call: Call[Answer],
        *,
        arrival: float,
        deadline: float | None,
        request_id: str,
        is_disconnected: Callable[[], bool] | None = None,
        pinned: bool = False,
    ) -> Answer:
        """Serve one decoded call (``app.protocols.codec.Call``) on an admitted model: build its
        inference request for the model's config, stamp its arrival and deadline (the loop's
        clock, seconds), :meth:`infer`, and encode the response (an ``encoding`` span where
        tracing is on). What every front end does once its transport has named the model.

        Returns:
            What the call's ``encode`` makes of the response (HTTP: bytes, content type and
            headers; gRPC: a ``ModelInferResponse``).

        Raises:
            What the call's ``build`` raises (InvalidInput, 400) and what :meth:`infer` raises.
        """
        request = call.build(model.config)
        request.arrival, request.deadline = arrival, deadline
        response = await self.infer(
            request, request_id=request_id, model=model, is_disconnected=is_disconnected, pinned=pinned
        )
        if self.tracing is None:
            return call.encode(model.config, response)
        with self.tracing.encoding():
            return call.encode(model.config, response)

    async def infer(
        self,
        request: InferRequest,
        *,
        request_id: str,
        model: ModelVersion | None = None,
        is_disconnected: Callable[[], bool] | None = None,
        pinned: bool = False,
    ) -> InferResponse:
        """Validate, admit, run and answer one inference request.

        Args:
            request: the decoded request (its tensors not yet validated), with its ``arrival``.
            request_id: echoed in errors and logs.
            model: the version :meth:`admit` returned (default: looked up from the request).
            is_disconnected: True once the client has gone (its queued items are dropped).
            pinned: it arrived on a connection the worker cannot shed (gRPC's one HTTP/2
                connection per channel): it may be forwarded whole to a less-loaded sibling.

        Returns:
            The response: the outputs asked for, ``[B, ...]`` each, in the request's item order.

        Raises:
            ModelNotFound (404); InvalidInput: tensors that do not fit the model, unknown or
            repeated outputs, a malformed ``parameters.timeout`` or ``.priority`` (400);
            PayloadTooLarge: over an item, string or batch-cost limit (413); and what
            :meth:`app.serving.unit.ServingUnit.infer` raises.
        """
        if model is None or model.retired:  # not admitted, or unloaded while its body was read
            model = self.version(request.model_name, request.model_version)
        config = model.config
        inputs = validate_inputs(config, request, self.limits)
        wanted = requested_outputs(config, request)  # an unknown output fails before the model runs
        deadline = self.request_deadline(model, request)
        priority = parameters_priority(request.parameters) if request.parameters else None
        if priority and model.unit is not None:
            model.unit.level(priority)  # one above the model's levels fails before it is balanced
        context = RequestContext(
            request_id, deadline, priority or 0, self.tracing.carrier() if self.tracing is not None else (),
            pinned=pinned, is_disconnected=is_disconnected, arrival=request.arrival,
        )  # fmt: skip
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
        stage while the model has no runner (each stage then decides per request)."""
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
        """
        unit = model.unit
        items = len(next(iter(inputs.values())))
        balancer = self.balancer
        if unit is not None and not context.forwarded and balancer.considers(unit, items, context.pinned):
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
            outputs = await unit.infer(inputs, context, trace=trace)
            if self.cache is not None and model.config.response_cache.enable:
                self.cache.store_outputs(model, fingerprint, inputs, outputs)
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


# --- validation: the request's tensors and parameters against the model ------------------------


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


def parameters_priority(parameters: dict[str, Any]) -> int | None:
    """``parameters.priority`` (Triton's: 1 = the highest level, 0 = the model's default);
    None when absent.

    Raises:
        InvalidInput: not a whole number >= 0.
    """
    value = parameters.get("priority")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInput("parameters.priority must be a whole number >= 0 (1 = the highest level)")
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
        tensors.append(
            OutputTensor(name, datatype, array, request.binary_data_output if wants is None else wants)
        )
    return InferResponse(config.name, config.version, tensors, request.id)
