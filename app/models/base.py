"""The handler contract: how the server talks to a model.

A handler is a class referenced from ``model.toml`` as ``handler = "module:Class"``
(the module may also be a ``.py`` file inside the model's folder). The server
creates one instance per worker with no arguments and calls, always on the
worker's single inference thread:

``load(device, config)``
    Load weights onto ``device`` (``cpu`` or ``cuda:0`` after GPU binding).
``preprocess(inputs)``
    ``inputs`` maps every declared input name to a numpy array whose axis 0 is
    the batch (B items, 1 <= B <= max_batch_size); BYTES inputs are ``object``
    arrays of ``bytes``; optional inputs a request omitted are filled with
    ``b""`` (BYTES) or zeros. Returns whatever ``predict`` takes.
``predict(batch)``
    Runs the model; the server wraps it in ``torch.inference_mode()``.
``postprocess(outputs)``
    Returns one numpy array per declared output, axis 0 = the B items.

Source: TorchServe's ``BaseHandler`` (initialize/preprocess/inference/postprocess)
and LitServe's ``LitAPI`` (setup/decode_request/predict/encode_response).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

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
