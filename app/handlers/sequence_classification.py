"""Sequence classifiers and cross-encoders from a Hugging Face folder, with long texts in windows.

``SequenceClassificationHandler`` serves any folder that transformers'
``AutoModelForSequenceClassification`` loads (``config.json`` with ``id2label``, weights, a fast
tokenizer), from local files only: a classifier (single texts -> per-label probabilities, e.g. a
toxicity model) or a cross-encoder (``(query, text)`` pairs -> a relevance score, e.g.
cross-encoder/ms-marco-MiniLM-L-6-v2). A text longer than ``max_seq_length`` becomes several
windows, each an item of its own, put back together per text (:mod:`app.handlers.windows`,
:mod:`app.serving.windows`).

Inputs (per item):

``text``  BYTES, required
    UTF-8 text to classify or score.
``query`` BYTES, optional
    UTF-8 query: the item is then the pair (query, text), as a cross-encoder takes it. Omitted
    or empty: the text alone.

Outputs (declare those you serve):

``probabilities`` FP32 ``[num_labels]``, with ``labels`` in ``model.toml``
    Per label, in ``id2label`` order: softmax over the logits (sigmoid per label for a
    one-label model or a ``multi_label_classification`` one, as sentence-transformers'
    ``CrossEncoder`` and transformers' text-classification pipeline apply them). The output's
    ``labels`` must list the folder's ``id2label`` names in order (the load says so otherwise):
    the classify API and Triton's classification extension name labels from it.
``score`` FP32 ``[1]``
    The probability of label ``score_label`` (default: the last label; a cross-encoder has one):
    a relevance score for pairs, e.g. "toxic" for a moderation model.
``windows`` INT64 ``[1]``
    Windows the text took (1 unless it was longer than ``max_seq_length``).
``tokens`` INT64 ``[1]``
    Tokens the item made the model run, over all its windows, special tokens included.

Windows' results per text (put together by :mod:`app.serving.windows`): probabilities and
scores by ``aggregate`` (``"max"`` by default: MaxP for pairs, "flagged if any part is" for
moderation; ``"mean"`` selectable).

``[parameters]`` of ``model.toml``: ``model_dir`` / ``model_package``, ``dtype``,
``attn_implementation``, ``call_overhead_tokens``, ``backend`` (``"torch"`` or ``"onnx"``:
``onnx_file``, default ``model.onnx`` in the model's folder, a graph of the classifier whose
inputs are the tokenizer's and whose first output is the logits) and ``tensorrt`` as for
:mod:`app.handlers.sentence_embedding` (``call_overhead_tokens`` defaults to ``inf``: one forward
call per batch; it decides length groups as there); ``max_seq_length`` (tokens per window;
default the tokenizer's ``model_max_length``, capped by the model's positions); ``score_label``
(name or index); and the window parameters of :mod:`app.handlers.windows`
(``truncation = "window"`` by default).

Threads: as the embedding handler, a tokenizer per prepare thread (``item_costs`` and
``preprocess`` may run at once; a Hugging Face tokenizer shared by two threads raises "Already
borrowed").
"""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from transformers.utils import logging as transformers_logging

from app.handlers import windows as windowing
from app.handlers.sentence_embedding import decode_texts, length_groups, padded_tokens, resolve_model_dir

__all__ = ["ClassifiedBatch", "SequenceClassificationHandler", "labels_of"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_PARAMETERS = (
    "model_dir",
    "model_package",
    "max_seq_length",
    "dtype",
    "attn_implementation",
    "call_overhead_tokens",
    "score_label",
    "backend",
    "onnx_file",
    "tensorrt",
    *windowing.PARAMETERS,
)


class TensorSpecLike(Protocol):
    """The part of a declared output that this handler reads."""

    @property
    def name(self) -> str: ...

    @property
    def shape(self) -> Sequence[int]: ...

    @property
    def labels(self) -> Sequence[str] | None: ...


class ModelConfigLike(Protocol):
    """The part of the server's parsed ``model.toml`` that this handler reads."""

    @property
    def name(self) -> str: ...

    @property
    def path(self) -> Path: ...

    @property
    def parameters(self) -> Mapping[str, Any]: ...

    @property
    def outputs(self) -> Sequence[TensorSpecLike]: ...


def labels_of(hf_config: Any) -> list[str]:
    """The label names of a transformers config, in index order (``id2label``)."""
    id2label = {int(k): str(v) for k, v in dict(hf_config.id2label).items()}
    return [id2label.get(i, f"LABEL_{i}") for i in range(int(hf_config.num_labels))]


@dataclass(frozen=True)
class ClassifiedBatch:
    """``preprocess`` output.

    Attributes:
        groups: one forward call each, the tokenizer's padded tensors on the device, int64
            ``[B_g, T_g]``; the groups' items in ascending length.
        position: int64 ``[B]`` on the device: item b's row in the groups' rows, concatenated.
        tokens: int64 ``[B]`` on the host: tokens per item.
    """

    groups: list[dict[str, torch.Tensor]]
    position: torch.Tensor
    tokens: npt.NDArray[np.int64]


class SequenceClassificationHandler:
    """Classifies ``text`` or scores (``query``, ``text``) pairs (see the module docstring)."""

    def __init__(self) -> None:
        self._device = torch.device("cpu")
        self._model: Any = None
        self._tokenizer: Any = None
        self._local = threading.local()  # a tokenizer per prepare thread
        self.labels: list[str] = []
        self.policy = windowing.WindowPolicy("window", 512, 64)
        self.score_index = 0
        self.sigmoid = False
        self.call_overhead_tokens = math.inf
        #: The ONNX Runtime session (``backend = "onnx"``); None: the torch model runs.
        self.session: Any = None
        self._onnx_inputs: list[str] = []

    @property
    def model(self) -> Any:
        """The loaded transformers model."""
        if self._model is None:
            raise RuntimeError("SequenceClassificationHandler.load() has not been called")
        return self._model

    def load(self, device: torch.device, config: ModelConfigLike) -> None:
        """Load the folder named in ``config.parameters`` onto ``device``, from local files only.

        Raises:
            ValueError: unknown or bad parameters; a ``max_seq_length`` over the model's
                positions; declared ``labels`` other than the folder's ``id2label`` (or none);
                a ``probabilities`` width other than the model's labels; an unknown
                ``score_label``; a tokenizer without overflow support with windows.
            FileNotFoundError: a missing folder.
        """
        parameters = dict(config.parameters)
        unknown = sorted(set(parameters) - set(_PARAMETERS))
        if unknown:
            raise ValueError(
                f"model {config.name!r}: unknown [parameters] {unknown}; "
                f"SequenceClassificationHandler reads {list(_PARAMETERS)}"
            )
        if parameters.get("dtype", "float32") not in _DTYPES:
            raise ValueError(f"parameters.dtype must be one of {list(_DTYPES)}, got {parameters['dtype']!r}")
        path = resolve_model_dir(parameters, config.path)
        transformers_logging.disable_progress_bar()
        kwargs: dict[str, Any] = {"dtype": _DTYPES[parameters.get("dtype", "float32")]}
        if "attn_implementation" in parameters:
            kwargs["attn_implementation"] = parameters["attn_implementation"]
        model = AutoModelForSequenceClassification.from_pretrained(str(path), local_files_only=True, **kwargs)
        model.to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        limit = getattr(model.config, "max_position_embeddings", None)
        default = min(int(getattr(tokenizer, "model_max_length", 512) or 512), int(limit or 512), 8192)
        max_length = parameters.get("max_seq_length", default)
        if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 8:
            raise ValueError(f"parameters.max_seq_length must be an integer >= 8, got {max_length!r}")
        if isinstance(limit, int) and max_length > limit:
            raise ValueError(f"max_seq_length {max_length} exceeds the model's {limit} tokens")
        self.policy = windowing.WindowPolicy.from_parameters(parameters, max_length)
        if self.policy.truncation == "window" and not getattr(tokenizer, "is_fast", False):
            raise ValueError('truncation = "window" needs a fast tokenizer (tokenizer.json in the folder)')
        self.labels = labels_of(model.config)
        self._check_outputs(config)
        self.score_index = self._score_index(parameters.get("score_label"))
        self.sigmoid = len(self.labels) == 1 or model.config.problem_type == "multi_label_classification"
        overhead = parameters.get("call_overhead_tokens", math.inf)
        if not isinstance(overhead, int | float) or isinstance(overhead, bool) or not overhead >= 0:
            raise ValueError(f"parameters.call_overhead_tokens must be a number >= 0, got {overhead!r}")
        self.call_overhead_tokens = float(overhead)
        self._device, self._model, self._tokenizer = device, model, tokenizer
        backend = parameters.get("backend", "torch")
        if backend not in ("torch", "onnx"):
            raise ValueError(f'parameters.backend must be "torch" or "onnx", got {backend!r}')
        if backend == "onnx":
            self._open_onnx(device, config, str(parameters.get("onnx_file", "model.onnx")))

    def _open_onnx(self, device: torch.device, config: ModelConfigLike, file: str) -> None:
        """Open the graph (inputs among the tokenizer's, first output the logits ``[batch,
        labels]``) on ``device`` and drop the torch model's weights: only the graph runs."""
        from app import onnx_session  # onnxruntime only for the models that ask for it

        shown = f"{config.path.name}/{file}"
        session = onnx_session.open_session(
            config.path / file,
            shown,
            device,
            torch.get_num_threads(),
            tensorrt=bool(config.parameters.get("tensorrt")),
        )
        names = [t.name for t in onnx_session.graph_inputs(session)]
        unknown = sorted(set(names) - {"input_ids", "attention_mask", "token_type_ids"})
        if unknown:
            raise ValueError(f"{shown}: graph inputs {unknown} are not the tokenizer's")
        self.session, self._onnx_inputs = session, names
        self.model.to("meta")

    def _logits(self, group: dict[str, torch.Tensor]) -> torch.Tensor:
        """The logits ``[U_g, labels]`` of one padded group, by the torch model or the graph."""
        if self.session is None:
            logits: torch.Tensor = self.model(**group).logits
            return logits.float()
        feed = {name: group[name].cpu().numpy() for name in self._onnx_inputs}
        return torch.from_numpy(self.session.run(None, feed)[0]).float().to(self._device)

    def _check_outputs(self, config: ModelConfigLike) -> None:
        for spec in config.outputs:
            if spec.name != "probabilities":
                continue
            if list(spec.shape) not in ([-1], [len(self.labels)]):
                raise ValueError(
                    f"model {config.name!r}: output 'probabilities' is declared with shape "
                    f"{list(spec.shape)} "
                    f"but the model has {len(self.labels)} labels; declare shape = [{len(self.labels)}]"
                )
            if list(spec.labels or []) != self.labels:
                raise ValueError(
                    f"model {config.name!r}: output 'probabilities' must declare the folder's labels "
                    f"in order: labels = {self.labels!r}"
                )

    def _score_index(self, label: Any) -> int:
        if label is None:
            return len(self.labels) - 1
        if isinstance(label, int) and not isinstance(label, bool) and 0 <= label < len(self.labels):
            return label
        if isinstance(label, str) and label in self.labels:
            return self.labels.index(label)
        raise ValueError(f"parameters.score_label {label!r} is not one of the model's labels {self.labels}")

    # --- per request ----------------------------------------------------------------------

    def _tokenizer_here(self) -> Any:
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._local.tokenizer = copy.deepcopy(self._tokenizer)
        return tokenizer

    @property
    def window_policy(self) -> windowing.WindowPolicy:
        """What this model does with long texts (:mod:`app.handlers.windows`)."""
        return self.policy

    def text_windows(self, texts: Sequence[str], queries: Sequence[str] | None) -> list[list[windowing.Span]]:
        """The windows of each text (:func:`app.handlers.windows.spans`), with this thread's
        tokenizer.

        Raises:
            ValueError, PayloadTooLarge: as :func:`app.handlers.windows.spans`.
        """
        return windowing.spans(self._tokenizer_here(), texts, queries, self.policy)

    def _encode(self, inputs: Mapping[str, npt.NDArray[Any]]) -> dict[str, list[list[int]]]:
        """The items tokenised (pairs where a query is given), truncated to ``max_seq_length``
        (a window of a long text fits: :mod:`app.serving.windows` cut it so)."""
        if "text" not in inputs:
            raise ValueError("required input 'text' is missing")
        texts = decode_texts("text", np.asarray(inputs["text"]))
        queries = [""] * len(texts)
        if inputs.get("query") is not None:
            queries = decode_texts("query", np.asarray(inputs["query"]))
            if len(queries) != len(texts):
                raise ValueError(f"input 'query' has {len(queries)} items but input 'text' has {len(texts)}")
        tokenizer = self._tokenizer_here()
        rows: dict[str, list[list[int]]] = {}
        paired = [i for i, q in enumerate(queries) if q]
        single = [i for i, q in enumerate(queries) if not q]
        order = single + paired
        for group, pairs in ((single, False), (paired, True)):
            if not group:
                continue
            args = (
                ([queries[i] for i in group], [texts[i] for i in group])
                if pairs
                else ([texts[i] for i in group],)
            )
            encoded = tokenizer(*args, truncation=True, max_length=self.policy.max_length)
            for key in ("input_ids", "attention_mask", "token_type_ids"):
                if key in encoded:
                    rows.setdefault(key, []).extend(encoded[key])
        back = np.argsort(np.asarray(order, dtype=np.int64), kind="stable")
        return {key: [values[i] for i in back] for key, values in rows.items()}

    def item_costs(self, inputs: Mapping[str, npt.NDArray[Any]]) -> npt.NDArray[np.int64]:
        """Tokens each item makes the model run, int64 ``[B]``, special tokens (and a pair's
        query) included, truncated to ``max_seq_length``.

        Raises:
            ValueError: invalid UTF-8, a wrong shape, a ``query`` of another length.
        """
        return np.asarray([len(ids) for ids in self._encode(inputs)["input_ids"]], dtype=np.int64)

    def batch_cost(self, costs: npt.NDArray[np.int64]) -> int:
        """Tokens a batch of items costing ``costs`` computes, padding included, in its length
        groups (``app.handlers.sentence_embedding.padded_tokens``)."""
        return padded_tokens(costs, self.call_overhead_tokens)

    def preprocess(self, inputs: Mapping[str, npt.NDArray[Any]]) -> ClassifiedBatch:
        """Decode and tokenise the items, pad them in length groups, move them to the device.

        Raises:
            ValueError: as :meth:`item_costs`.
        """
        rows = self._encode(inputs)
        lengths = [len(ids) for ids in rows["input_ids"]]
        groups = length_groups(lengths, self.call_overhead_tokens)
        position = np.empty(len(lengths), dtype=np.int64)
        position[np.concatenate(groups)] = np.arange(len(lengths))
        tokenizer = self._tokenizer_here()
        encoded = []
        for group in groups:
            padded = tokenizer.pad(
                {key: [values[i] for i in group] for key, values in rows.items()}, return_tensors="pt"
            )
            encoded.append({k: self._to_device(v) for k, v in padded.items()})
        return ClassifiedBatch(
            groups=encoded,
            position=self._to_device(torch.as_tensor(position)),
            tokens=np.asarray(lengths, dtype=np.int64),
        )

    def predict(self, batch: ClassifiedBatch) -> dict[str, Any]:
        """``probabilities`` float32 ``[B, L]`` and ``score`` ``[B, 1]`` (on the device),
        ``windows`` (1 each: a window is an item) and ``tokens`` int64 ``[B]``."""
        parts = [self._logits(group) for group in batch.groups]
        logits = (parts[0] if len(parts) == 1 else torch.cat(parts))[batch.position]
        probabilities = torch.sigmoid(logits) if self.sigmoid else torch.softmax(logits, dim=-1)
        return {
            "probabilities": probabilities,
            "score": probabilities[:, self.score_index : self.score_index + 1],
            "windows": np.ones((len(batch.tokens), 1), dtype=np.int64),
            "tokens": batch.tokens.reshape(-1, 1),
        }

    def postprocess(self, outputs: dict[str, Any]) -> dict[str, npt.NDArray[Any]]:
        """Host numpy arrays: FP32 ``probabilities`` ``[B, L]`` and ``score`` ``[B, 1]``, INT64
        ``windows`` and ``tokens`` ``[B, 1]``."""
        return {
            "probabilities": outputs["probabilities"].to("cpu", torch.float32).numpy(),
            "score": outputs["score"].to("cpu", torch.float32).numpy(),
            "windows": np.asarray(outputs["windows"], dtype=np.int64),
            "tokens": np.asarray(outputs["tokens"], dtype=np.int64),
        }

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._device.type == "cuda":
            return tensor.pin_memory().to(self._device, non_blocking=True)
        return tensor.to(self._device)
