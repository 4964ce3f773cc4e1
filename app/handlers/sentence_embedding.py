"""Sentence embeddings and query-to-text cosine scores from a sentence-transformers folder.

``SentenceEmbeddingHandler`` serves any folder that ``sentence_transformers.SentenceTransformer``
loads (its ``modules.json`` pipeline, e.g. *Transformer -> Pooling -> Normalize*, or a plain
Hugging Face model folder, mean-pooled), from local files only: the pipeline runs as
:mod:`app.handlers.embedding_pipeline` loads it (transformers' ``AutoModel`` and the folder's
pooling, bit-identical to the library's; the library itself for modules we do not run), the
tokenizing is :mod:`app.handlers.tokenizing`'s (each text once, when the request is priced), and
this handler adds the server's contract (batched UTF-8 inputs, each distinct string encoded once
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

``[parameters]`` of ``model.toml``: those of :mod:`app.handlers.text_config` (``max_seq_length``
defaults to the folder's ``sentence_bert_config.json``), the window parameters of
:mod:`app.models.windows` (``truncation = "truncate"`` by default for embeddings), and:

``cuda_graph_sequence_lengths`` (list of int, tokens)
    With ``cuda_graph_batch_sizes`` in ``model.toml`` (strings per forward call) and a CUDA
    device, the torch pipeline is captured as CUDA graphs at load, one per (strings, tokens)
    pair, and a batch runs padded to the smallest that holds it (:mod:`app.handlers.text_graphs`):
    these are the token buckets, ascending, each <= ``max_seq_length``; default 16, 32, 64, ...
    up to ``max_seq_length``. Ignored on the CPU; not with ``backend = "onnx"``.
``prompt_name``, ``query_prompt_name`` (str; or ``prompt``, ``query_prompt``, the strings)
    Instruction prefixes of texts and of queries (:func:`app.handlers.embedding_pipeline.read_prompts`).
``backend`` (str)
    ``"torch"`` (default) or ``"onnx"``: the transformer runs as an ONNX graph in ONNX Runtime
    (:mod:`app.handlers.onnx_encoder`: ``onnx_file``, ``min_cosine``, ``tensorrt``).

**Length groups.** A batch's distinct strings are sorted by length and cut into groups, each
one forward call padded to its own longest string, where that costs less than padding them
all to the batch's longest (:mod:`app.handlers.text_cost`, measured at load). ``batch_cost``
tells the queue what a batch's calls cost, in short tokens' time.

Threads (``app.models.base``): ``item_costs`` decodes and tokenizes each distinct string of a
request once and returns the token ids as the items' preparation; ``preprocess`` pads them. Both
run on the prepare threads, several at once, sharing one tokenizer that is never reconfigured.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from app.handlers import onnx_encoder
from app.handlers.decoders import pad_decoder
from app.handlers.embedding_pipeline import (
    PROMPT_PARAMETERS,
    EmbeddingPipeline,
    Prompts,
    load_pipeline,
    read_prompts,
)
from app.handlers.text_base import TextHandler, max_length, model_kwargs
from app.handlers.text_config import (
    SHARED_PARAMETERS,
    ModelConfigLike,
    check_shared_parameters,
    declares_truncation,
    decode_texts,
    resolve_model_dir,
)
from app.handlers.text_cost import length_groups, padded_tokens
from app.handlers.text_graphs import TextGraphs, capture_for
from app.handlers.tokenizing import Ids, Parts, TextTokenizer, Window, pad, prepared_array
from app.models import windows as windowing
from app.models.base import Priced
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

_PARAMETERS = (
    *SHARED_PARAMETERS,
    *PROMPT_PARAMETERS,
    "cuda_graph_sequence_lengths",
    *onnx_encoder.PARAMETERS,
    *windowing.PARAMETERS,
)
_NO_QUERY: Ids = np.zeros(0, dtype=np.int32)
#: What ``postprocess`` returns.
_OUTPUTS = ("embedding", "score", "tokens", "windows")


@dataclass(frozen=True)
class EncodedBatch:
    """``preprocess`` output: each distinct string of the batch once, on the device, in length
    groups.

    Attributes:
        groups: one forward call each: the model's inputs (``input_ids``, ``attention_mask``,
            ...), int64 ``[U_g, T_g]`` (U_g strings, padded to the group's longest, T_g
            tokens); the groups' strings in ascending length, U = sum of U_g.
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


def _check_parameters(name: str, parameters: Mapping[str, Any]) -> None:
    check_shared_parameters(name, "SentenceEmbeddingHandler", parameters, _PARAMETERS)
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


class SentenceEmbeddingHandler(TextHandler):
    """Embeds ``text`` and scores it against ``query`` (see the module docstring for the I/O).

    An item's preparation is ``(text ids, query ids)`` (int32; the query's empty where it has
    none). Within a batch every distinct string, text or query, is encoded once.
    """

    kind = "SentenceEmbeddingHandler"

    def __init__(self) -> None:
        super().__init__()
        self._pipeline: EmbeddingPipeline | None = None
        #: Features (tokenized strings on the device) -> sentence embeddings [U, dim].
        self._encode: onnx_encoder.Encode = self._encode_torch
        #: The ONNX backend's encoder (None: backend = "torch").
        self.onnx: onnx_encoder.OnnxTextEncoder | None = None
        #: The torch pipeline's CUDA graphs (None: eager).
        self.graphs: TextGraphs | None = None
        #: The instruction prefixes of texts and queries (``prompt_name``, ``query_prompt_name``).
        self.prompts = Prompts()

    @property
    def pipeline(self) -> EmbeddingPipeline:
        """The loaded embedding pipeline."""
        if self._pipeline is None:
            raise RuntimeError("SentenceEmbeddingHandler.load() has not been called")
        return self._pipeline

    @property
    def embedding_dim(self) -> int:
        """Width of the ``embedding`` output."""
        return self.pipeline.embedding_dim

    @property
    def max_seq_length(self) -> int:
        """Tokens kept per string; longer strings are truncated (or windowed)."""
        return self.tokenizer.max_length

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
        The cost model is then measured (:meth:`TextHandler.calibrate`) unless ``model.toml``
        fixes it.

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
        pipeline = load_pipeline(path, torch.device("cpu") if onnx else device, model_kwargs(parameters))
        limit = pipeline.max_positions
        folder_default = pipeline.max_seq_length or TextTokenizer.model_max_length(path)
        length = max_length(parameters, folder_default, limit)
        policy = windowing.WindowPolicy.from_parameters(parameters, length, default_truncation="truncate")
        stride = policy.overflow_stride
        self.truncates = declares_truncation(config)
        self._tokenizer = TextTokenizer.from_folder(
            path, length, stride=stride, lowercase=pipeline.lowercase, pairs=False, keeps_last=self.truncates
        )
        if pipeline.is_decoder:  # last-token pooling reads the mask: any pad id
            pad_decoder(self._tokenizer, path, pipeline.transformer.config, config.name)
        cuts = policy.truncation != "truncate" or self.truncates
        self.prompts = read_prompts(path, parameters, pipeline.include_prompt, cuts)
        self.policy, self.type_ids = policy, pipeline.takes_type_ids
        self.merge_rules = windowing.merges(
            _OUTPUTS, policy, {"embedding": "weighted_mean", "tokens": "sum", "windows": "sum"}
        )
        self._check_outputs(config, pipeline.embedding_dim)
        self.set_device(device)
        self._pipeline = pipeline
        if onnx:
            self._load_onnx(device, config)
        self._capture_graphs(device, config)
        self.calibrate(parameters, self._encode)

    @staticmethod
    def _check_outputs(config: ModelConfigLike, embedding_dim: int) -> None:
        for spec in config.outputs:
            declared = list(spec.shape)
            if spec.name == "embedding" and declared != [-1] and declared != [embedding_dim]:
                raise ValueError(
                    f"model {config.name!r}: output 'embedding' is declared with shape "
                    f"{declared} but the model gives {embedding_dim} values per item; "
                    f"declare shape = [{embedding_dim}]"
                )

    def _capture_graphs(self, device: torch.device, config: ModelConfigLike) -> None:
        """The torch pipeline as CUDA graphs where ``model.toml`` asks and the device is a GPU
        (:func:`app.handlers.text_graphs.capture_for`).

        Raises:
            ValueError: graphs asked of the ONNX backend, or a bad token bucket.
            ModelLoadError: the pipeline cannot be captured.
        """
        if self.onnx is not None and getattr(config, "cuda_graph_batch_sizes", None):
            raise ValueError('cuda_graph_batch_sizes applies to backend = "torch", not "onnx"')
        graphs = capture_for(config, self._encode_torch, self.feature_names, self.max_seq_length, device)
        if graphs is not None:
            self.graphs = self._encode = graphs

    @property
    def feature_names(self) -> list[str]:
        """The model inputs a batch's groups hold, sorted."""
        return sorted(["input_ids", "attention_mask", *(["token_type_ids"] if self.type_ids else [])])

    def close(self) -> None:
        """Drop the CUDA graphs once the device has run what they launched (as
        ``app.models.torch_formats``' handlers do: never during another model's capture), the
        pipeline and the ONNX encoder, then :meth:`TextHandler.close`."""
        if self.graphs is not None:
            settle_graphs(self._device)
        self.graphs = self.onnx = self._pipeline = None
        self._encode = self._encode_torch
        super().close()

    def _load_onnx(self, device: torch.device, config: ModelConfigLike) -> None:
        """Encode with the ONNX graph (:func:`app.handlers.onnx_encoder.open_encoder`: checked
        against the torch pipeline where ``min_cosine`` asks), the torch weights dropped."""
        tokenizer, type_ids = self.tokenizer, self.type_ids

        def tokenize(strings: list[str]) -> dict[str, torch.Tensor]:  # on the CPU, as the pipeline
            arrays = pad(tokenizer.encode(strings), tokenizer.pad_id, side=tokenizer.padding_side,
                         single_type_id=tokenizer.single_type_id, type_ids=type_ids)  # fmt: skip
            return {name: torch.from_numpy(array) for name, array in arrays.items()}

        self.onnx = self._encode = onnx_encoder.open_encoder(
            self.pipeline, self.feature_names, tokenizer, tokenize, device, config
        )

    def _encode_torch(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        """The torch pipeline's sentence embeddings ``[U, dim]`` of tokenized strings."""
        return self.pipeline(features)

    # --- per request ------------------------------------------------------------------------

    def prepare_texts(
        self, texts: Sequence[str], queries: Sequence[str], keep: Sequence[int] | None
    ) -> list[Parts]:
        """Each item's ``(text ids, query ids)``, each distinct string tokenized once; a text cut
        to its last ``keep`` tokens where asked (:meth:`TextHandler.kept_windows`)."""
        cut = self.kept_windows(texts, None, keep)
        texts = [self.prompts.text + t for t in texts]
        queries = [self.prompts.query + q if q else q for q in queries]
        rows: dict[str, int] = {}
        for string in (*(t for i, t in enumerate(texts) if i not in cut), *(q for q in queries if q)):
            rows.setdefault(string, len(rows))
        ids = self.tokenizer.encode(list(rows)) if rows else []
        return [
            (cut[i].ids if i in cut else ids[rows[t]], ids[rows[q]] if q else _NO_QUERY)
            for i, (t, q) in enumerate(zip(texts, queries, strict=True))
        ]

    def item_costs(self, inputs: Mapping[str, npt.NDArray[Any]]) -> Priced:
        """The tokens each item makes the model run, int64 ``[B]``: its text's and, when it has
        one, its query's, special tokens included, each truncated to ``max_seq_length``; a
        string already priced for an earlier item of the request costs 0 there (:meth:`preprocess`
        encodes each distinct string once). With each item's ``(text ids, query ids)`` as its
        preparation; from ``inputs[PREPARED]`` where the window stage made it (nothing
        tokenized).

        Raises:
            ValueError: naming the input and item, for invalid UTF-8 or a wrong shape.
        """
        parts = self.item_parts(inputs)
        costs = np.zeros(len(parts), dtype=np.int64)
        priced: set[bytes] = set()
        for item, (text_ids, query_ids) in enumerate(parts):
            for ids in (text_ids, query_ids):
                key = ids.tobytes()
                if len(ids) and key not in priced:
                    priced.add(key)
                    costs[item] += len(ids)
        return Priced(costs, prepared_array(parts))

    def query_parts(self, queries: Sequence[str] | None, count: int) -> list[Ids | None]:
        """Each text's query ids, each distinct query tokenized once (empty: none)."""
        if queries is None:
            return [_NO_QUERY] * count
        queries = [self.prompts.query + q if q else q for q in queries]
        distinct = sorted({q for q in queries if q})
        ids = dict(zip(distinct, self.tokenizer.encode(distinct), strict=True)) if distinct else {}
        return [ids[q] if q else _NO_QUERY for q in queries]

    def window_queries(self, queries: Sequence[str] | None) -> None:
        """None: a window holds its text alone (the query is embedded on its own)."""
        return None

    def window_parts(self, window: Window, extra: Ids | None) -> Parts:
        """A window's ``(its ids, its text's query ids)``."""
        return (window.ids, extra if extra is not None else _NO_QUERY)

    def preprocess(self, inputs: Mapping[str, npt.NDArray[Any]]) -> EncodedBatch:
        """Pad the items' token ids (``inputs[PREPARED]``; tokenized here only where absent),
        each distinct string once, in length groups (:meth:`TextHandler.batch_cost`'s cost
        model), on the device.

        ``inputs["text"]`` and the optional ``inputs["query"]`` are object arrays of UTF-8
        ``bytes``, shape ``[B]`` or ``[B, 1]``.

        Raises:
            ValueError: naming the input, for invalid UTF-8, a wrong shape, or a ``query``
                whose length differs from ``text``'s (where the items are tokenized here).
        """
        parts = self.item_parts(inputs)
        rows: dict[bytes, int] = {}
        strings: list[Ids] = []

        def row(ids: Ids) -> int:
            key = ids.tobytes()
            found = rows.get(key)
            if found is None:
                found = rows[key] = len(strings)
                strings.append(ids)
            return found

        text_rows = [row(text) for text, _ in parts]
        query_rows = [row(query) if len(query) else -1 for _, query in parts]
        lengths = np.fromiter((len(s) for s in strings), dtype=np.int64, count=len(strings))
        groups = self.cost.groups(lengths)
        # position[r]: where distinct string r lands in the groups' rows, concatenated
        position = np.empty(len(strings), dtype=np.int64)
        position[np.concatenate(groups)] = np.arange(len(strings))
        queries = np.asarray(query_rows, dtype=np.int64)
        indices = {
            "text": position[text_rows],
            "query": np.where(queries >= 0, position[np.maximum(queries, 0)], -1),
        }
        *encoded, index = self.features([[strings[i] for i in g] for g in groups], indices=indices)
        return EncodedBatch(encoded, index["text"], index["query"], lengths[text_rows])

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
