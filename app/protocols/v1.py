"""KServe V1 (TensorFlow-Serving row format): ``{"instances": [...]}`` or ``{"inputs": [...]}``
-> ``{"predictions": [...]}``.

Each instance is one item. For a model with one required input an instance is
that input's value (``"a sentence"``, ``[0.1, 0.2, ...]``); otherwise it is an
object keyed by input name. Each prediction is the single output's row, or an
object keyed by output name when the model has several outputs.

``inputs`` is accepted as a synonym of ``instances``, as KServe's own model server does
(``kserve.utils.utils.get_predict_input``: ``payload["inputs"] if "inputs" in payload``).

Source: KServe "V1 Inference Protocol" and TF-Serving's REST "row format".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import orjson

from app.errors import InvalidInput
from app.models.repository import ModelConfig
from app.protocols.codec import JSON, Answer, Api, Call, Route
from app.protocols.infer import InferInput, InferRequest, InferResponse
from app.protocols.tensors import RequestLimits, decode_json


class PredictRequest(msgspec.Struct):
    """The V1 predict request body: one entry per item in ``instances`` or in ``inputs``."""

    instances: list[Any] | None = None
    inputs: list[Any] | None = None


class PredictResponse(msgspec.Struct):
    """The V1 predict response body: one entry per item, in request order."""

    predictions: list[Any]


_decoder = msgspec.json.Decoder(PredictRequest)
_DEFAULT_LIMITS = RequestLimits()


def decode_request(config: ModelConfig, body: bytes, limits: RequestLimits = _DEFAULT_LIMITS) -> InferRequest:
    """Parse a V1 predict body into an :class:`InferRequest` with one input per model input
    named in the instances (shape inferred from the nesting; validate with
    :func:`app.serving.dataplane.validate_inputs`).

    Raises:
        InvalidInput: malformed JSON, nesting deeper than ``limits.max_json_depth``, no
            instances, an instance of the wrong form, or values that do not fit the model's inputs.
        PayloadTooLarge: more than ``limits.max_items`` instances, or a string longer than
            ``limits.max_string_bytes``.
    """
    request = decode_json(_decoder, body, limits.max_json_depth, "predict request")
    if request.instances is not None and request.inputs is not None:
        raise InvalidInput("give either instances or inputs, not both")
    instances = request.instances if request.instances is not None else request.inputs
    if not instances:
        raise InvalidInput("instances: empty; send at least one instance")
    limits.check_items(len(instances), "instances")
    required = [s for s in config.inputs if not s.optional]
    columns: dict[str, list[Any]] = {}
    if len(required) == 1 and not any(isinstance(i, dict) for i in instances):
        columns[required[0].name] = instances
    else:
        for n, inst in enumerate(instances):
            if not isinstance(inst, dict):
                raise InvalidInput(
                    f"instances[{n}]: model {config.name} takes several inputs "
                    f"{[s.name for s in config.inputs]}; each instance must be an object"
                )
            for key, value in inst.items():
                columns.setdefault(key, []).append(value)
        uneven = {k: len(v) for k, v in columns.items() if len(v) != len(instances)}
        if uneven:
            raise InvalidInput(f"instances: every instance must give the same inputs ({uneven})")
    tensors = []
    for name, values in columns.items():
        spec = config.input(name)
        if spec is None:
            raise InvalidInput(
                f"instances: unknown input {name!r}; model {config.name} takes "
                f"{[s.name for s in config.inputs]}"
            )
        if spec.shape == [1]:
            values = [v if isinstance(v, list) else [v] for v in values]
        tensors.append(InferInput(name, spec.datatype, None, values))
    return InferRequest(model_name=config.name, model_version=config.version, inputs=tensors)


def _row(value: np.ndarray) -> Any:
    if value.dtype == object:
        return [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in value.ravel()]
    return value


def encode_response(response: InferResponse) -> bytes:
    """``{"predictions": [...]}`` as JSON bytes, one entry per instance: the single output's
    row, or an object keyed by output name when the response has several outputs."""
    outputs = response.outputs
    batch = len(outputs[0].array)
    if len(outputs) == 1:
        only = outputs[0].array
        predictions: list[Any] = [_row(only[i]) for i in range(batch)]
    else:
        predictions = [{o.name: _row(o.array[i]) for o in outputs} for i in range(batch)]
    return orjson.dumps({"predictions": predictions}, option=orjson.OPT_SERIALIZE_NUMPY)


@dataclass(frozen=True)
class V1Codec:
    """KServe V1 as a codec (``app.protocols.codec``): ``{"instances": [...]}`` in,
    ``{"predictions": [...]}`` out; the model named in the path."""

    named_in_path: bool = True

    def call(self, body: bytes, headers: Mapping[str, str], limits: RequestLimits) -> Call[Answer]:
        """Decode the instances against the model's inputs once it is known."""
        return Call(
            lambda config: decode_request(config, body, limits),
            lambda config, response: (encode_response(response), JSON, {}),
        )


#: KServe V1's predict (``app.protocols.codec.Api``).
API = Api(
    protocol="v1",
    title="KServe V1",
    routes=(Route("/v1/models/{name:[^/:]+}:predict", "v1Predict"),),
    codec=V1Codec(),
    summary="Predict (KServe V1)",
    request=PredictRequest,
    response=PredictResponse,
    answer="One prediction per instance.",
)
