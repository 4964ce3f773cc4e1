"""SPLADE and inference-free SPLADE as sentence-transformers' ``SparseEncoder`` defines them, read
from the library's folder layout and run without importing the library.

A folder's ``modules.json`` names one of two pipelines (:func:`read_folder`):

- **SPLADE**: a masked-language-model transformer (``MLMTransformer``, or ``Transformer`` with
  ``transformer_task = "fill-mask"``) then ``SpladePooling``: each token's vocabulary logits,
  ``log(1 + ReLU(x))`` (``"log1p_relu"``: twice), pooled over the text's real tokens by max
  (SPLADE v2 and later) or sum. Formal et al., "SPLADE v2" (2021), arXiv:2109.10086.
- **inference-free SPLADE**: a ``Router`` whose routes (``"query"``, ``"document"``) each hold
  either that SPLADE pipeline or a ``SparseStaticEmbedding``: a learned weight per vocabulary
  term, a text's vector the weights of the distinct terms it holds (tokenized without special
  tokens), so that one side needs no forward at all. Geng et al., "Towards Competitive
  Search Relevance for Inference-Free Learned Sparse Representations" (2024), arXiv:2411.04403;
  OpenSearch's ``opensearch-neural-sparse-encoding-doc-*`` models (the query side static).

The transformer runs as :mod:`app.handlers.bert_encoder`'s BERT encoder with BERT's masked-LM
head (:class:`app.handlers.bert_encoder.BertMaskedLMHead`) where the folder is a BERT, else as
transformers' ``AutoModelForMaskedLM``; the pooling is the library's arithmetic
(:func:`splade_pool`), over chunks of tokens so that no batch holds more than
:data:`LOGITS_BYTES` of logits at once (a vocabulary of 30,522 float32 logits is 122 KB a token).

Anything else (a ``SparseAutoEncoder``, a module or pooling this module does not know) is
refused with the modules named: the library's own ``SparseEncoder`` is not loaded in its place.
"""

from __future__ import annotations

import ast
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from tokenizers import Tokenizer

from app.handlers.bert_encoder import load_bert_mlm, unsupported
from app.handlers.folder_json import read_json
from app.handlers.tokenizing import Ids, TextTokenizer, load_tokenizer

__all__ = [
    "LOGITS_BYTES",
    "MaskedLM",
    "SparsePlan",
    "SpladeRoute",
    "StaticRoute",
    "StaticWeights",
    "load_masked_lm",
    "nonzero_rows",
    "read_folder",
    "splade_pool",
]

log = logging.getLogger(__name__)

#: Logits one forward call's pooling holds at once, bytes (chunks of tokens beyond it).
LOGITS_BYTES = 256 * 2**20
_TRANSFORMERS = {"Transformer", "MLMTransformer"}
_POOLING_STRATEGIES = ("max", "sum")
_ACTIVATIONS = ("relu", "log1p_relu")


@dataclass(frozen=True)
class SpladeRoute:
    """A masked-LM transformer (its folder) and its ``SpladePooling`` (``strategy``: ``"max"`` or
    ``"sum"``; ``activation``: ``"relu"`` or ``"log1p_relu"``)."""

    folder: Path
    strategy: str = "max"
    activation: str = "relu"


@dataclass(frozen=True)
class StaticRoute:
    """A ``SparseStaticEmbedding`` (its folder: ``model.safetensors`` holding ``weight`` ``[V]``,
    and its tokenizer)."""

    folder: Path


@dataclass(frozen=True)
class SparsePlan:
    """What a ``SparseEncoder`` folder says (:func:`read_folder`).

    Attributes:
        routes: route name -> its pipeline, in the folder's order (one route named ``""`` where
            the folder has no ``Router``).
        default_route: the route of a text whose request names no task (the Router's).
        route_mappings: the Router's ``(task, modality) -> route`` (modality None or "text").
        prompts: the folder's prompts by name; ``default_prompt_name``: the one ``encode`` uses.
    """

    routes: dict[str, SpladeRoute | StaticRoute]
    default_route: str
    route_mappings: dict[tuple[str | None, str | None], str] = field(default_factory=dict)
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None

    def route(self, task: str) -> str:
        """The route of a text of ``task`` ("", "query" or "document"), as the library's
        ``Router`` resolves it for text: ``(task, "text")``, ``(task, None)``, ``(None, "text")``,
        ``(None, None)`` among the mappings, the route named ``task``, else the default route.

        Raises:
            ValueError: a task the folder has no route for.
        """
        if len(self.routes) == 1:
            return next(iter(self.routes))
        name = task or None
        for key in ((name, "text"), (name, None), (None, "text"), (None, None)):
            if key in self.route_mappings:
                return self.route_mappings[key]
        if name is None:
            return self.default_route
        if name in self.routes:
            return name
        raise ValueError(f"input_type {task!r}: the model's routes are {sorted(self.routes)}")

    def prompt(self, task: str) -> str:
        """The prompt the library puts before a text of ``task``: ``encode_query`` the
        ``"query"`` prompt, ``encode_document`` the first of ``"document"``, ``"passage"``,
        ``"corpus"``, ``encode`` the default prompt; "" where the folder has none."""
        names = {"query": ("query",), "document": ("document", "passage", "corpus")}.get(task)
        if names is None:
            names = (self.default_prompt_name,) if self.default_prompt_name else ()
        return next((self.prompts[n] for n in names if n in self.prompts), "")


def _class(kind: str) -> str:
    """A module's class name from its ``modules.json`` type (e.g.
    ``sentence_transformers.sparse_encoder.modules.splade_pooling.SpladePooling``); "" for a
    class outside sentence-transformers."""
    return kind.rsplit(".", 1)[-1] if kind.startswith("sentence_transformers.") else ""


def _pipeline(folder: Path, modules: Sequence[tuple[str, str]]) -> SpladeRoute | StaticRoute:
    """One route's modules, ``(type, path)`` each, as the pipeline they make.

    Raises:
        ValueError: modules that are not SPLADE's nor a static embedding's.
    """
    kinds = [_class(kind) for kind, _ in modules]
    if kinds == ["SparseStaticEmbedding"]:
        return StaticRoute(folder / modules[0][1])
    if len(kinds) == 2 and kinds[0] in _TRANSFORMERS and kinds[1] == "SpladePooling":
        transformer = folder / modules[0][1]
        task = read_json(transformer / "sentence_bert_config.json").get("transformer_task", "fill-mask")
        if kinds[0] == "Transformer" and task != "fill-mask":
            raise ValueError(f'{transformer}: transformer_task {task!r}; SPLADE needs "fill-mask"')
        pooling = read_json(folder / modules[1][1] / "config.json")
        strategy = pooling.get("pooling_strategy", "max")
        activation = pooling.get("activation_function", "relu")
        if strategy not in _POOLING_STRATEGIES or activation not in _ACTIVATIONS:
            raise ValueError(
                f"{folder / modules[1][1]}: SpladePooling {strategy!r}/{activation!r}; served: "
                f"{list(_POOLING_STRATEGIES)} x {list(_ACTIVATIONS)}"
            )
        return SpladeRoute(transformer, strategy, activation)
    raise ValueError(
        f"{folder}: modules {[kind for kind, _ in modules]} are not a SPLADE pipeline "
        "(a fill-mask Transformer then SpladePooling) nor a SparseStaticEmbedding"
    )


def read_folder(folder: Path) -> SparsePlan:
    """The pipeline of a ``SparseEncoder`` folder (module docstring): its routes, the Router's
    rules and the prompts of ``config_sentence_transformers.json``.

    Raises:
        ValueError: no ``modules.json``, unreadable JSON, or modules this module does not run
            (named in the message).
    """
    modules = read_json(folder / "modules.json")
    if not modules:
        raise ValueError(f"{folder}: no modules.json; a SparseEncoder folder (SPLADE) is expected")
    settings = read_json(folder / "config_sentence_transformers.json")
    prompts = {str(k): str(v) for k, v in (settings.get("prompts") or {}).items()}
    default_prompt = settings.get("default_prompt_name")
    pairs = [(str(m.get("type", "")), str(m.get("path", ""))) for m in modules]
    if len(pairs) != 1 or _class(pairs[0][0]) != "Router":
        route = _pipeline(folder, pairs)
        return SparsePlan({"": route}, "", prompts=prompts, default_prompt_name=default_prompt)
    root = folder / pairs[0][1]
    router = read_json(root / "router_config.json")
    types, structure = router.get("types") or {}, router.get("structure") or {}
    parameters = router.get("parameters") or {}
    routes = {
        str(name): _pipeline(root, [(str(types.get(m, "")), str(m)) for m in ids])
        for name, ids in structure.items()
    }
    if not routes:
        raise ValueError(f"{root}: router_config.json names no routes")
    default = parameters.get("default_route")
    if default is None and parameters.get("allow_empty_key", True):
        default = next(iter(routes))
    if default not in routes:
        raise ValueError(f"{root}: the Router's default route {default!r} is not among {sorted(routes)}")
    mappings: dict[tuple[str | None, str | None], str] = {}
    for key, target in (parameters.get("route_mappings") or {}).items():
        task, modality = ast.literal_eval(key) if isinstance(key, str) else key
        if modality in (None, "text") and target in routes:
            mappings[(task, modality)] = str(target)
    encoders = {r.folder for r in routes.values() if isinstance(r, SpladeRoute)}
    if len(encoders) > 1:
        raise ValueError(
            f"{root}: routes with two SPLADE encoders ({sorted(map(str, encoders))}) are not served"
        )
    return SparsePlan(routes, str(default), mappings, prompts, default_prompt)


def splade_pool(logits: torch.Tensor, mask: torch.Tensor, strategy: str, activation: str) -> torch.Tensor:
    """sentence-transformers' ``SpladePooling`` at inference: ``logits`` ``[U, T, V]`` (overwritten)
    times ``mask`` ``[U, T]`` (1 on real tokens), ``ReLU``, ``log1p`` (twice for
    ``"log1p_relu"``), then the max (or sum) over T: ``[U, V]`` in the logits' dtype.

    For the max, the maximum is taken first and ``ReLU`` and ``log1p`` applied to ``[U, V]``
    alone: both are non-decreasing, so ``f(max x) == max f(x)`` bit for bit, and two of the
    three passes over the ``T x V`` logits (122 KB a token for a 30,522-term vocabulary) go."""
    masked = logits.mul_(mask.unsqueeze(-1).to(logits.dtype))
    if strategy == "max":
        weights = torch.amax(masked, dim=1).relu_().log1p_()
        return weights.log1p_() if activation == "log1p_relu" else weights
    weights = masked.relu_().log1p_()
    if activation == "log1p_relu":
        weights = weights.log1p_()
    return torch.sum(weights, dim=1)


class MaskedLM:
    """A SPLADE route's transformer: tokenized strings to their pooled vocabulary weights.

    Args:
        encoder: token ids to ``last_hidden_state`` (our BERT encoder), with ``head`` the
            masked-LM head; or, ``head`` None, transformers' ``AutoModelForMaskedLM`` (its
            ``logits``).
        route: the pooling.
    """

    def __init__(self, encoder: Any, head: Any, route: SpladeRoute) -> None:
        self.encoder, self.head, self.route = encoder, head, route

    @property
    def config(self) -> Any:
        """The transformer's config (``max_position_embeddings``, ``vocab_size``...)."""
        return self.encoder.config

    @property
    def vocab_size(self) -> int:
        """V, the width of a sparse vector."""
        return int(self.config.vocab_size)

    def __call__(self, features: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The SPLADE vectors ``[U, V]`` (float32) of tokenized strings (``input_ids``,
        ``attention_mask``, ``token_type_ids`` where taken: int64 ``[U, T]`` on the device)."""
        mask = features["attention_mask"]
        rows, length = mask.shape
        step = max(1, LOGITS_BYTES // max(1, rows * self.vocab_size * 4))
        strategy, activation = self.route.strategy, self.route.activation
        if self.head is not None:
            hidden = self.encoder(**features)["last_hidden_state"]
            parts = (
                splade_pool(self.head(hidden[:, t : t + step]), mask[:, t : t + step], strategy, activation)
                for t in range(0, length, step)
            )
        else:  # transformers' model computes every token's logits at once
            logits = self.encoder(**features, return_dict=True).logits
            parts = (
                splade_pool(logits[:, t : t + step], mask[:, t : t + step], strategy, activation)
                for t in range(0, length, step)
            )
        pooled = next(parts)
        for part in parts:
            pooled = torch.maximum(pooled, part) if strategy == "max" else pooled + part
        return pooled.float()


def load_masked_lm(route: SpladeRoute, device: torch.device, model_kwargs: Mapping[str, Any]) -> MaskedLM:
    """The route's transformer on ``device``, eval mode: our BERT encoder and masked-LM head where
    they run the folder (:func:`app.handlers.bert_encoder.load_bert_mlm`), else transformers'
    ``AutoModelForMaskedLM`` (``use_cache`` off, as the library loads it).

    Args:
        model_kwargs: for ``from_pretrained``: ``dtype``, optionally ``attn_implementation``.

    Raises:
        Exception: what transformers raises for a folder it cannot load.
    """
    config = read_json(route.folder / "config.json")
    why = unsupported(config, dict(model_kwargs))
    own = load_bert_mlm(route.folder, model_kwargs.get("dtype")) if why is None else None
    if own is not None:
        container = torch.nn.ModuleDict({"encoder": own[0], "head": own[1]}).to(device)  # tied stay tied
        return MaskedLM(container["encoder"], container["head"], route)
    log.debug("%s: transformers runs the masked-LM model (%s)", route.folder, why or "not a BERT's weights")
    from transformers import AutoConfig, AutoModelForMaskedLM  # only where such a model loads
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    loaded = AutoConfig.from_pretrained(str(route.folder), local_files_only=True)
    if hasattr(loaded, "use_cache"):
        loaded.use_cache = False
    model = AutoModelForMaskedLM.from_pretrained(
        str(route.folder), config=loaded, local_files_only=True, **model_kwargs
    )
    return MaskedLM(model.to(device).eval(), None, route)


class StaticWeights:
    """A ``SparseStaticEmbedding``: its weight per vocabulary term ``[V]`` on the device and its
    tokenizer (no special tokens; truncated at its ``model_max_length``, as the library's
    ``preprocess`` calls it).

    Raises:
        ValueError: a folder without ``model.safetensors`` holding a 1-D ``weight``.
    """

    def __init__(self, route: StaticRoute, device: torch.device) -> None:
        from safetensors.torch import load_file

        file = route.folder / "model.safetensors"
        weights = load_file(str(file)) if file.is_file() else {}
        weight = weights.get("weight")
        if weight is None or weight.ndim != 1:
            raise ValueError(
                f"{route.folder}: a SparseStaticEmbedding's model.safetensors holds a 1-D 'weight'"
            )
        self.weight = weight.to(device)
        self._tokenizer: Tokenizer = load_tokenizer(route.folder)
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        #: Tokens a text keeps (the tokenizer's ``model_max_length``; 512 where it names none).
        self.max_length = TextTokenizer.model_max_length(route.folder) or 512

    def encode(self, texts: Sequence[str], keep: Sequence[int] | None = None) -> list[Ids]:
        """Each text's ids without special tokens: its first :attr:`max_length`, or its last
        ``keep[i]`` where that is >= 1 (vLLM's ``truncate_prompt_tokens``; -1: :attr:`max_length`).
        Thread-safe (the tokenizer is never reconfigured).

        Raises:
            ValueError: a ``keep`` over :attr:`max_length`.
        """
        out = []
        for i, e in enumerate(self._tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)):
            ids = np.array(e.ids, dtype=np.int32)
            k = keep[i] if keep is not None else 0
            k = self.max_length if k == -1 else k
            if k > self.max_length:
                raise ValueError(f"truncate_prompt_tokens {k} is over the model's {self.max_length} tokens")
            out.append(ids[-k:] if k > 0 else ids[: self.max_length])
        return out

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The library's forward, op for op: the presence of each term (``input_ids``,
        ``attention_mask``: int64 ``[U, T]``) times its weight: ``[U, V]`` float32."""
        presence = torch.zeros(len(input_ids), len(self.weight), device=input_ids.device, dtype=torch.int64)
        presence.scatter_(1, input_ids, attention_mask)
        return (presence * self.weight).float()


def nonzero_rows(
    vectors: npt.NDArray[np.float32],
) -> tuple[list[npt.NDArray[np.int64]], list[npt.NDArray[np.float32]]]:
    """Each row of ``vectors`` ``[B, V]`` as its non-zero terms: ids (int64, ascending) and their
    weights (float32), as the library's sparse (COO) tensors and text-embeddings-inference's
    ``/embed_sparse`` give them."""
    ids = [np.flatnonzero(row).astype(np.int64) for row in vectors]
    return ids, [row[i].astype(np.float32, copy=False) for row, i in zip(vectors, ids, strict=True)]
