"""The embedding pipeline of a sentence-transformers folder, loaded without sentence-transformers
where every module is one we know.

A folder's ``modules.json`` names its pipeline, almost always *Transformer -> Pooling ->
Normalize*. :func:`load_pipeline` reads it with ``sentence_bert_config.json`` and
``1_Pooling/config.json`` and runs the transformer (a BERT encoder: our own,
:mod:`app.handlers.bert_encoder`, with no transformers import; any other: transformers'
``AutoModel``, as the library's Transformer module loads it, ``use_cache`` off), the folder's
pooling (mean, CLS, max or last-token, the library's own arithmetic: :func:`pool`) and L2
normalisation, so the embeddings are bit-identical to ``SentenceTransformer``'s on the same
token ids (``tests/unit/test_embedding_pipeline.py``, max abs difference 0). A worker then
never imports sentence-transformers, whose import pulls in scikit-learn, SciPy and more (about
4 CPU-s of a worker's start on the 2-core VM: docs/text-models.md), nor, for a BERT folder,
transformers' modeling code (about 3 CPU-s more). Anything else (another module type, a
pooling mode or config key we do not know, an encoder-decoder model, a PEFT adapter) loads with
``SentenceTransformer`` itself, with a log line saying why; the tokenizing is ours either way
(:mod:`app.handlers.tokenizing`).

Both pipelines take the tokenized strings (``input_ids``, ``attention_mask``, and
``token_type_ids`` where the model takes them: int64 ``[U, T]`` on the device) and return the
sentence embeddings ``[U, dim]`` in the weights' dtype.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from app.handlers.bert_encoder import BertEncoder, load_bert, unsupported
from app.handlers.folder_json import read_json

__all__ = [
    "PROMPT_PARAMETERS",
    "EmbeddingPipeline",
    "FolderPlan",
    "Prompts",
    "load_encoder",
    "load_pipeline",
    "pool",
    "read_folder",
    "read_prompts",
    "takes_type_ids",
]

log = logging.getLogger(__name__)

#: The module types we run ourselves, by ``modules.json``'s names (old and new packages).
_TRANSFORMER = {
    "sentence_transformers.models.Transformer",
    "sentence_transformers.base.modules.transformer.Transformer",
}
_POOLING = {
    "sentence_transformers.models.Pooling",
    "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
}
_NORMALIZE = {
    "sentence_transformers.models.Normalize",
    "sentence_transformers.base.modules.normalize.Normalize",
}
#: ``1_Pooling/config.json``'s legacy flags, by mode.
_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
#: The pooling modes :func:`pool` computes.
POOLING_MODES = ("mean", "cls", "max", "lasttoken")
_TRANSFORMER_KEYS = {"max_seq_length", "do_lower_case"}


@dataclass(frozen=True)
class FolderPlan:
    """What a folder's sentence-transformers files say (:func:`read_folder`).

    Attributes:
        max_seq_length: ``sentence_bert_config.json``'s (None: the tokenizer's limit).
        lowercase: ``do_lower_case`` (the library adds a Lowercase normalizer).
        pooling: the pooling mode, one of :data:`POOLING_MODES`.
        normalize: whether a Normalize module ends the pipeline.
        fallback: why the library itself must load the folder (None: we run it).
        include_prompt: whether a prompt's tokens are pooled with the text's (the pooling
            config's ``include_prompt``).
    """

    max_seq_length: int | None = None
    lowercase: bool = False
    pooling: str = "mean"
    normalize: bool = False
    fallback: str | None = None
    include_prompt: bool = True


def _pooling_mode(config: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """The one pooling mode of ``1_Pooling/config.json`` and, when it is not one we compute, why."""
    known = {"word_embedding_dimension", "pooling_mode", "include_prompt", *_FLAGS}
    unknown = sorted(set(config) - known)
    if unknown:
        return None, f"pooling config keys {unknown}"
    modes = (
        config.get("pooling_mode") or [mode for flag, mode in _FLAGS.items() if config.get(flag)] or ["mean"]
    )
    modes = [modes] if isinstance(modes, str) else list(modes)
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        return None, f"pooling modes {modes}"
    return modes[0], None


def takes_type_ids(transformer: Any) -> bool:
    """Whether ``transformer``'s ``forward`` takes ``token_type_ids`` (BERT's does; most others'
    do not)."""
    return "token_type_ids" in inspect.signature(transformer.forward).parameters


def read_folder(folder: Path) -> FolderPlan:
    """The pipeline ``modules.json`` names; a folder without one is a plain Hugging Face model,
    mean-pooled (as the library treats it).

    Raises:
        ValueError: a ``modules.json`` or config file that is not valid JSON.
    """
    modules = read_json(folder / "modules.json")
    settings = read_json(folder / "sentence_bert_config.json")
    if not modules:
        return FolderPlan()
    types = [str(m.get("type")) for m in modules]
    paths = [str(m.get("path", "")) for m in modules]
    shape_ok = (
        len(types) in (2, 3)
        and types[0] in _TRANSFORMER
        and paths[0] == ""
        and types[1] in _POOLING
        and (len(types) == 2 or types[2] in _NORMALIZE)
    )
    if not shape_ok:
        return FolderPlan(fallback=f"modules {types}")
    extra = sorted(
        k for k, v in settings.items() if k not in _TRANSFORMER_KEYS and v not in (None, {}, [], "")
    )
    if extra:
        return FolderPlan(fallback=f"sentence_bert_config.json keys {extra}")
    pooling = read_json(folder / paths[1] / "config.json")
    mode, why = _pooling_mode(pooling)
    length = settings.get("max_seq_length")
    return FolderPlan(
        include_prompt=bool(pooling.get("include_prompt", True)),
        max_seq_length=int(length) if isinstance(length, int) else None,
        lowercase=bool(settings.get("do_lower_case", False)),
        pooling=mode or "mean",
        normalize=len(types) == 3,
        fallback=why,
    )


def pool(token_embeddings: torch.Tensor, attention_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """One embedding per string ``[U, hidden]`` from ``token_embeddings`` ``[U, T, hidden]`` and
    ``attention_mask`` ``[U, T]``, by ``mode`` (:data:`POOLING_MODES`), with the arithmetic of
    sentence-transformers' Pooling module (``_forward_padded``: the same operations in the same
    order and dtypes, so the results are bit-identical; accumulation in float32 for half
    precision)."""
    dtype = token_embeddings.dtype
    if mode == "mean":
        accumulate = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        mask = attention_mask.unsqueeze(-1).to(dtype)
        total = (token_embeddings * mask).sum(dim=1, dtype=accumulate)
        count = torch.clamp(mask.sum(dim=1, dtype=accumulate), min=1e-9)
        return (total / count).to(dtype)
    hidden = token_embeddings.shape[-1]
    if mode == "cls":
        first = attention_mask.to(torch.int).argmax(dim=1)
        return torch.gather(
            token_embeddings, 1, first.unsqueeze(-1).unsqueeze(1).expand(-1, 1, hidden)
        ).squeeze(1)
    if mode == "max":
        mask = attention_mask.unsqueeze(-1).expand_as(token_embeddings).to(dtype)
        return token_embeddings.masked_fill(mask == 0, float("-inf")).max(dim=1).values
    if mode == "lasttoken":
        length = token_embeddings.shape[1]
        values, indices = attention_mask.flip(1).max(1)
        indices = torch.where(values == 0, length - 1, indices)
        gather = (length - indices - 1).unsqueeze(-1).unsqueeze(1).expand(-1, 1, hidden)
        mask = attention_mask.unsqueeze(-1).expand_as(token_embeddings).to(dtype)
        return torch.gather(token_embeddings * mask, 1, gather).squeeze(dim=1)
    raise ValueError(f"pooling mode {mode!r} is not one of {list(POOLING_MODES)}")


class EmbeddingPipeline:
    """Token ids to sentence embeddings (module docstring): the transformer, then ``finish``.

    Attributes:
        transformer: the transformers model (``AutoModel``); its ``last_hidden_state`` are the
            token embeddings.
        library: the ``SentenceTransformer`` when the library loaded the folder, else None.
        max_seq_length: the folder's tokens per string (``sentence_bert_config.json``), or None.
        lowercase: whether texts are lowercased before tokenizing (``do_lower_case``).
    """

    def __init__(self, transformer: Any, plan: FolderPlan, library: Any = None) -> None:
        self.transformer = transformer
        self.library = library
        self.max_seq_length = plan.max_seq_length
        self.lowercase = plan.lowercase
        self._plan = plan
        self._modules = list(library)[1:] if library is not None else []

    @property
    def include_prompt(self) -> bool:
        """Whether a prompt's tokens are pooled with the text's (sentence-transformers' Pooling)."""
        return self._plan.include_prompt

    @property
    def hidden_size(self) -> int:
        """Width of the token embeddings."""
        return int(self.transformer.config.hidden_size)

    @property
    def embedding_dim(self) -> int:
        """Width of the sentence embeddings."""
        if self.library is not None:
            return int(self.library.get_embedding_dimension() or 0)
        return self.hidden_size

    @property
    def max_positions(self) -> int | None:
        """The model's ``max_position_embeddings`` (None: no such limit)."""
        limit = getattr(self.transformer.config, "max_position_embeddings", None)
        return limit if isinstance(limit, int) and limit > 0 else None

    @property
    def is_decoder(self) -> bool:
        """Whether the transformer is a decoder-only model's (:func:`app.handlers.decoders.is_decoder`;
        our own BERT encoder is not, and asks no transformers import to say so)."""
        if isinstance(self.transformer, BertEncoder):
            return False
        from app.handlers.decoders import is_decoder

        return is_decoder(self.transformer.config)

    @property
    def takes_type_ids(self) -> bool:
        """Whether the transformer's forward takes ``token_type_ids``."""
        return takes_type_ids(self.transformer)

    def __call__(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        """Sentence embeddings ``[U, dim]`` of tokenized strings (int64 ``[U, T]`` each)."""
        if self.library is not None:
            embedding: torch.Tensor = self.library(dict(features))["sentence_embedding"]
            return embedding
        out = self.transformer(**features, return_dict=True)
        return self.finish({**features, "token_embeddings": out["last_hidden_state"]})

    def finish(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        """The modules after the transformer (pooling, normalisation) on ``features`` holding
        ``token_embeddings`` ``[U, T, hidden]`` and ``attention_mask``: sentence embeddings."""
        if self.library is not None:
            for module in self._modules:
                features = module(features)
            embedding: torch.Tensor = features["sentence_embedding"]
            return embedding
        pooled = pool(features["token_embeddings"], features["attention_mask"], self._plan.pooling)
        return F.normalize(pooled, p=2, dim=-1) if self._plan.normalize else pooled

    def drop_transformer(self) -> None:
        """Free the transformer's weights (moved to the meta device): another backend runs it."""
        self.transformer.to("meta")


def _light_fallback(folder: Path, plan: FolderPlan) -> str | None:
    if plan.fallback is not None:
        return plan.fallback
    if (folder / "adapter_config.json").is_file():
        return "a PEFT adapter"
    config = read_json(folder / "config.json")
    if config.get("is_encoder_decoder"):
        return "an encoder-decoder model (the library loads its encoder alone)"
    return None


def _own_encoder(folder: Path, model_kwargs: Mapping[str, Any]) -> BertEncoder | None:
    """The folder's transformer as our own BERT encoder (:mod:`app.handlers.bert_encoder`), or
    None (with a DEBUG line saying why) where transformers' ``AutoModel`` must run it."""
    why = unsupported(read_json(folder / "config.json"), dict(model_kwargs))
    encoder = load_bert(folder, model_kwargs.get("dtype")) if why is None else None
    if encoder is None:
        log.debug("%s: transformers runs the encoder (%s)", folder, why or "its weights are not a BERT's")
    return encoder


def load_encoder(folder: Path, device: torch.device, model_kwargs: Mapping[str, Any]) -> Any:
    """The transformer of a Hugging Face folder on ``device`` in eval mode, its forward returning
    ``last_hidden_state`` (token embeddings ``[U, T, hidden]``): our own BERT encoder where it
    runs the folder (:func:`_own_encoder`), else transformers' ``AutoModel`` as the library's
    Transformer module loads it (``use_cache`` off).

    Args:
        model_kwargs: for ``from_pretrained``: ``dtype``, optionally ``attn_implementation``.

    Raises:
        Exception: what transformers raises for a folder it cannot load.
    """
    own = _own_encoder(folder, model_kwargs)
    if own is not None:
        return own.to(device)
    from transformers import AutoConfig, AutoModel  # the modeling code: only where a model loads
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # a worker logs one line per model load
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    if hasattr(config, "use_cache"):
        config.use_cache = False  # as the library's Transformer module loads it
    model = AutoModel.from_pretrained(str(folder), config=config, local_files_only=True, **model_kwargs)
    return model.to(device).eval()


def load_pipeline(folder: Path, device: torch.device, model_kwargs: Mapping[str, Any]) -> EmbeddingPipeline:
    """The folder's pipeline on ``device`` in eval mode: ours (module docstring), else the
    library's, with an INFO line saying why.

    Args:
        model_kwargs: for ``from_pretrained``: ``dtype``, optionally ``attn_implementation``.

    Raises:
        ValueError: unreadable sentence-transformers files.
        Exception: what transformers or sentence-transformers raise for a folder they cannot load.
    """
    plan = read_folder(folder)
    why = _light_fallback(folder, plan)
    if why is None:
        return EmbeddingPipeline(load_encoder(folder, device, model_kwargs), plan)
    log.info("%s: loaded with sentence-transformers (%s is not one we run ourselves)", folder, why)
    from sentence_transformers import SentenceTransformer

    library = SentenceTransformer(
        str(folder), device=str(device), local_files_only=True, model_kwargs=dict(model_kwargs)
    )
    library.eval()
    first = library[0]
    library_plan = FolderPlan(
        max_seq_length=int(library.max_seq_length) if library.max_seq_length else None,
        lowercase=bool(getattr(first, "do_lower_case", False)),
    )
    return EmbeddingPipeline(first.model if hasattr(first, "model") else first, library_plan, library)


#: ``[parameters]`` that name the instruction prefixes of texts and queries (:func:`read_prompts`).
PROMPT_PARAMETERS = ("prompt_name", "prompt", "query_prompt_name", "query_prompt")


@dataclass(frozen=True)
class Prompts:
    """The instruction prefixes put before each ``text`` and each ``query`` before tokenizing
    (sentence-transformers' prompts: ``encode(..., prompt_name=...)`` prepends the string)."""

    text: str = ""
    query: str = ""


def read_prompts(folder: Path, parameters: Mapping[str, Any], include_prompt: bool, cuts: bool) -> Prompts:
    """The prompts ``model.toml`` asks for: ``prompt_name`` / ``query_prompt_name``, a name among
    the folder's ``config_sentence_transformers.json`` ``prompts`` (Qwen3-Embedding's ``query``
    is its ``"Instruct: ...\nQuery:"``), or ``prompt`` / ``query_prompt``, the string itself;
    none by default (a folder's ``default_prompt_name`` is logged, not applied: the server's
    embeddings do not change under a model.toml that names none).

    Raises:
        ValueError: a name the folder does not have (the message lists them), a name and a
            string both given, a value that is not a string, or a prompt for a pooling that
            leaves prompts out (``include_prompt = false``: not run here), or a text prompt where
            texts may be cut or split (``cuts``: windows, pieces, ``truncate_prompt_tokens``
            would cut the prompt or leave it in one window alone).
    """
    known = read_json(folder / "config_sentence_transformers.json")
    prompts = known.get("prompts") or {}
    found = {}
    for kind, name_key, text_key in (
        ("text", "prompt_name", "prompt"),
        ("query", "query_prompt_name", "query_prompt"),
    ):
        name, given = parameters.get(name_key), parameters.get(text_key)
        if name is not None and given is not None:
            raise ValueError(f"parameters.{name_key} and parameters.{text_key}: give one")
        if given is not None and not isinstance(given, str):
            raise ValueError(f"parameters.{text_key} must be a string, got {given!r}")
        if name is not None and name not in prompts:
            raise ValueError(
                f"parameters.{name_key} {name!r} is not one of the folder's prompts {sorted(prompts)}"
            )
        found[kind] = prompts[name] if name is not None else (given or "")
    if any(found.values()) and not include_prompt:
        raise ValueError(
            "the folder's pooling leaves prompt tokens out (include_prompt = false): not served with prompts"
        )
    if found["text"] and cuts:
        raise ValueError(
            'a text prompt (prompt_name, prompt) needs truncation = "truncate" and no truncate_prompt_tokens '
            "input: a cut or a split would separate it from the text"
        )
    default = known.get("default_prompt_name")
    if default and not found["text"]:
        log.info(
            "%s: the folder's default prompt %r is not applied (prompt_name in model.toml applies it)",
            folder,
            default,
        )
    return Prompts(found["text"], found["query"])
