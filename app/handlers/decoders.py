"""What the text handlers need to serve decoder-only (causal) models: telling one from an encoder,
a pad token where the folder ships none, and the inputs a padded batch of a decoder takes.

- :func:`is_decoder`: a transformers model whose family is a causal LM and not a masked LM
  (Llama, Mistral, Qwen2/3, Gemma, Phi, GPT-2; not BERT, RoBERTa, ELECTRA, which have both heads,
  nor encoder-decoders);
- :func:`pad_token`: the token to pad with: the folder's own, else the model config's
  ``pad_token_id``, else the **EOS token** (the documented fallback: what transformers' docs
  and vLLM do for Llama and GPT-2 tokenizers, which ship none). Padding positions are masked
  out and a decoder's result is read at the last *real* token found from the attention mask
  (:func:`app.handlers.decoder_math.last_token_indices`), so the pad id changes no result, even
  where it is a real token of the text (Qwen3-Embedding appends its pad token); the handler
  tells the model config (``config.pad_token_id``) so that transformers' own pooling agrees;
- :func:`decoder_features`: a padded group's inputs with ``position_ids`` counted from each row's
  first real token (:func:`app.handlers.decoder_math.position_ids`), so a row's result does not
  depend on the padding side or the batch it ran in (GPT-2's learned positions would otherwise
  shift under left padding).

Source: transformers 5.x ``GenericForSequenceClassification`` (the pad-id pooling this replaces
by the mask's), ``GenerationMixin`` (position ids from the mask); vLLM's pooling adapters for
causal LMs (``vllm/model_executor/models/adapters.py``: last-token pooling, no pad token needed).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from app.handlers.decoder_math import position_ids
from app.handlers.tokenizing import TextTokenizer

__all__ = [
    "DTYPES",
    "decoder_features",
    "decoder_length",
    "first_id",
    "is_decoder",
    "load_decoder",
    "open_causal_lm",
    "pad_decoder",
    "pad_token",
]

log = logging.getLogger(__name__)

#: ``[parameters] dtype`` -> torch's.
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def is_decoder(hf_config: Any) -> bool:
    """Whether a transformers config is a decoder-only model's (module docstring): its
    ``model_type`` has a causal-LM class and no masked-LM class, and it is no encoder-decoder."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    kind = str(getattr(hf_config, "model_type", ""))
    return (
        not getattr(hf_config, "is_encoder_decoder", False)
        and kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        and kind not in MODEL_FOR_MASKED_LM_MAPPING_NAMES
    )


def _token(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def first_id(value: Any) -> int | None:
    """A config's token id: the first of a list (``eos_token_id`` may list several), None where
    it names none."""
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def pad_token(folder: Path, hf_config: Any, id_to_token: Any) -> str | None:
    """The name of the token a decoder's folder pads with where its tokenizer names none
    (``TextTokenizer.from_folder``'s ``pad_token``): the config's ``pad_token_id``, else the
    tokenizer's ``eos_token`` (``tokenizer_config.json``, ``special_tokens_map.json``), else the
    config's ``eos_token_id`` (the first, where it lists several); None where the folder has
    none of them. ``id_to_token``: the tokenizer's (``tokenizers.Tokenizer.id_to_token``)."""
    pad_id = first_id(getattr(hf_config, "pad_token_id", None))
    if pad_id is not None and id_to_token(pad_id) is not None:
        return str(id_to_token(pad_id))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = folder / name
        if path.is_file():
            found = _token(json.loads(path.read_text(encoding="utf-8")).get("eos_token"))
            if found is not None:
                return found
    eos_id = first_id(getattr(hf_config, "eos_token_id", None))
    return str(id_to_token(eos_id)) if eos_id is not None and id_to_token(eos_id) is not None else None


def pad_decoder(tokenizer: TextTokenizer, folder: Path, hf_config: Any, name: str) -> None:
    """Give a decoder's ``tokenizer`` a pad id where its folder names none (:func:`pad_token`),
    with one INFO line, and tell the model config (``hf_config.pad_token_id``) the id padding
    holds where it names none. Call it at load, before any thread uses the tokenizer."""
    if tokenizer.pad_id is None:
        token = pad_token(folder, hf_config, tokenizer.id_to_token)
        if token is not None:
            tokenizer.pad_id = tokenizer.token_to_id(token)
            log.info(
                "%s: the folder names no pad token; padding with %r (id %s), masked out, the last "
                "real token read from the attention mask", name, token, tokenizer.pad_id,
            )  # fmt: skip
    if tokenizer.pad_id is not None and first_id(getattr(hf_config, "pad_token_id", None)) is None:
        hf_config.pad_token_id = tokenizer.pad_id


def decoder_features(group: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A padded group's inputs (``input_ids``, ``attention_mask``: int64 ``[U, T]``) with
    ``position_ids`` int64 ``[U, T]`` added (module docstring); ``token_type_ids`` dropped (a
    decoder takes none: GPT-2's forward accepts them, but as extra embeddings its tokenizer
    never makes)."""
    out = {k: v for k, v in group.items() if k != "token_type_ids"}
    out["position_ids"] = position_ids(group["attention_mask"])
    return out


def load_decoder(
    path: Path, parameters: Mapping[str, Any], device: torch.device, name: str, auto_class: str
) -> Any:
    """The folder's model as transformers' ``auto_class`` (e.g. ``"AutoModelForCausalLM"``),
    local files only, in ``parameters.dtype`` (``attn_implementation`` where given), on
    ``device`` in eval mode, without a KV cache (scoring needs none).

    Raises:
        ValueError: the folder's model is not a decoder (:func:`is_decoder`).
        Exception: what transformers raises for a folder it cannot load.
    """
    import transformers
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    kwargs: dict[str, Any] = {"dtype": DTYPES[parameters.get("dtype", "float32")]}
    if "attn_implementation" in parameters:
        kwargs["attn_implementation"] = parameters["attn_implementation"]
    config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    if not is_decoder(config):
        raise ValueError(
            f"model {name!r}: {path} holds a {config.model_type!r} model, not a decoder-only one "
            "(Llama, Mistral, Qwen, GPT-2...)"
        )
    if hasattr(config, "use_cache"):
        config.use_cache = False
    model = getattr(transformers, auto_class).from_pretrained(
        str(path), config=config, local_files_only=True, **kwargs
    )
    return model.to(device).eval()


def decoder_length(model: Any, folder: Path, parameters: Mapping[str, Any]) -> int:
    """Tokens per text: ``parameters.max_seq_length``, else the tokenizer's ``model_max_length``
    capped by the model's positions (and 8,192).

    Raises:
        ValueError: as :func:`app.handlers.text_base.max_length`.
    """
    from app.handlers.text_base import max_length

    limit = getattr(model.config, "max_position_embeddings", None) or getattr(
        model.config, "n_positions", None
    )
    limit = limit if isinstance(limit, int) and limit > 0 else None
    default = min(TextTokenizer.model_max_length(folder) or 8192, limit or 8192, 8192)
    return max_length(parameters, default, limit, minimum=8)


def open_causal_lm(
    parameters: Mapping[str, Any], model_path: Path, device: torch.device, name: str
) -> tuple[Path, Any, int]:
    """The folder ``parameters`` name (:func:`app.handlers.text_config.resolve_model_dir`), its
    causal LM on ``device`` (:func:`load_decoder`) and its tokens per text (:func:`decoder_length`).

    Raises:
        ValueError, FileNotFoundError: as those functions.
    """
    from app.handlers.text_config import resolve_model_dir

    path = resolve_model_dir(parameters, model_path)
    model = load_decoder(path, parameters, device, name, "AutoModelForCausalLM")
    return path, model, decoder_length(model, path, parameters)
