"""A BERT encoder in plain PyTorch for the embedding pipeline, so that a worker serving a BERT
sentence-embedding folder (all-MiniLM-L6-v2, bge, e5, gte) never imports transformers' modeling
code.

Why: transformers 5's modeling import pulls in ``torch.distributed.tensor``, ``torch._dynamo``,
sympy and SciPy (about 3 CPU-s of a worker's start on the 2-core VM, twice the whole ``import
torch``; docs/benchmarks.md, "Start to ready"), and for an encoder of a dozen modules it buys
nothing the server uses. Serving engines keep their own encoders for the same reason:
text-embeddings-inference runs BERT from its own ``backends/candle/src/models/bert.rs``.

What it runs: transformers' ``BertModel.forward`` (``transformers/models/bert/modeling_bert.py``,
v5) op for op, as its default ``attn_implementation = "sdpa"`` runs it: word + token-type, then +
position embeddings, LayerNorm; per layer Q/K/V projections, ``scaled_dot_product_attention``
with no mask when no token is padding, else the padding mask as a boolean ``[U, 1, T, T]`` (as
``transformers.masking_utils.sdpa_mask`` builds it), the output projection and LayerNorm of the
residual sum, the GELU feed-forward and its LayerNorm. Same kernels in the same order, so its
``last_hidden_state`` is bit-identical to transformers' on the same folder and inputs
(``tests/unit/test_bert_encoder.py``). Dropout is absent (inference only).

:func:`load_bert` takes a folder only where every part of its config is one this module runs
(:func:`unsupported` says what is not); anything else loads with transformers' ``AutoModel``.
Weights load from ``model.safetensors`` (no pickle), cast to the asked dtype.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BertEncoder", "BertMaskedLMHead", "load_bert", "load_bert_mlm", "unsupported"]

#: ``config.json`` values this encoder runs (any other value of these keys: transformers runs it).
_REQUIRED = {
    "model_type": "bert",
    "hidden_act": "gelu",
    "position_embedding_type": "absolute",
    "is_decoder": False,
    "add_cross_attention": False,
    "chunk_size_feed_forward": 0,
}


class _Linear(nn.Linear):
    def reset_parameters(self) -> None:
        """Nothing: the weights are the folder's (:func:`load_bert` assigns them)."""


class _Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        """Nothing: the weights are the folder's (:func:`load_bert` assigns them)."""


class _DenseNorm(nn.Module):
    """A projection and the LayerNorm of its sum with the residual (transformers' ``BertSelfOutput``
    and ``BertOutput``)."""

    def __init__(self, width_in: int, width_out: int, eps: float) -> None:
        super().__init__()
        self.dense = _Linear(width_in, width_out)
        self.LayerNorm = nn.LayerNorm(width_out, eps=eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``[U, T, width_in]`` and ``[U, T, width_out]`` -> ``[U, T, width_out]``."""
        out: torch.Tensor = self.LayerNorm(self.dense(hidden) + residual)
        return out


class _Projections(nn.Module):
    """Q, K and V (transformers' ``BertSelfAttention`` weights)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.query, self.key, self.value = (
            _Linear(hidden, hidden),
            _Linear(hidden, hidden),
            _Linear(hidden, hidden),
        )


class _Attention(nn.Module):
    """Self-attention and its output (transformers' ``BertAttention``: ``self`` and ``output``)."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.add_module("self", _Projections(hidden))
        self.output = _DenseNorm(hidden, hidden, eps)

    def projections(self) -> _Projections:
        """The Q, K, V projections (the submodule transformers names ``self``)."""
        found = self.get_submodule("self")
        assert isinstance(found, _Projections)
        return found


class _Intermediate(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.dense = _Linear(hidden, intermediate)


class _Layer(nn.Module):
    """One encoder layer; its submodules carry transformers' names, so its weights load as saved."""

    def __init__(self, hidden: int, intermediate: int, heads: int, eps: float) -> None:
        super().__init__()
        self.head_size = hidden // heads
        self.attention = _Attention(hidden, eps)
        self.intermediate = _Intermediate(hidden, intermediate)
        self.output = _DenseNorm(intermediate, hidden, eps)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``hidden`` ``[U, T, H]`` -> ``[U, T, H]``; ``mask``: bool ``[U, 1, T, T]`` or None."""
        shape = (*hidden.shape[:-1], -1, self.head_size)
        attend = self.attention.projections()
        query = attend.query(hidden).view(*shape).transpose(1, 2)
        key = attend.key(hidden).view(*shape).transpose(1, 2)
        value = attend.value(hidden).view(*shape).transpose(1, 2)
        context = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=0.0, scale=self.head_size**-0.5, is_causal=False
        )
        context = context.reshape(context.shape[0], -1, shape[1], value.shape[-1])
        context = context.transpose(1, 2).contiguous()
        context = context.reshape(*hidden.shape[:-1], -1).contiguous()
        attended = self.attention.output(context, hidden)
        inner = F.gelu(self.intermediate.dense(attended))
        out: torch.Tensor = self.output(inner, attended)
        return out


class _Embeddings(nn.Module):
    def __init__(self, vocab: int, positions: int, types: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.word_embeddings = _Embedding(vocab, hidden)
        self.position_embeddings = _Embedding(positions, hidden)
        self.token_type_embeddings = _Embedding(types, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)


class _Stack(nn.Module):
    def __init__(self, layers: list[_Layer]) -> None:
        super().__init__()
        self.layer = nn.ModuleList(layers)


class BertEncoder(nn.Module):
    """A BERT encoder (module docstring): token ids to token embeddings.

    Attributes:
        config: the folder's ``config.json`` as attributes (``hidden_size``,
            ``max_position_embeddings``, ``model_type``, ...), as transformers' config reads.
    """

    def __init__(self, config: SimpleNamespace) -> None:
        super().__init__()
        self.config = config
        hidden, eps = int(config.hidden_size), float(config.layer_norm_eps)
        self.embeddings = _Embeddings(
            int(config.vocab_size),
            int(config.max_position_embeddings),
            int(config.type_vocab_size),
            hidden,
            eps,
        )
        size, heads = int(config.intermediate_size), int(config.num_attention_heads)
        self.layers = [_Layer(hidden, size, heads, eps) for _ in range(int(config.num_hidden_layers))]
        self.encoder = _Stack(self.layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        return_dict: bool = True,
    ) -> dict[str, torch.Tensor]:
        """Token embeddings of tokenized strings.

        Args:
            input_ids, attention_mask, token_type_ids: int64 ``[U, T]`` on the weights' device
                (``attention_mask`` 1 for a token, 0 for padding; omitted: all tokens;
                ``token_type_ids`` omitted: zeros).
            return_dict: accepted for transformers' call signature; the answer is a dict always.

        Returns:
            ``{"last_hidden_state": [U, T, hidden]}`` in the weights' dtype.
        """
        del return_dict
        rows, length = input_ids.shape
        embed = self.embeddings
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        positions = torch.arange(length, device=input_ids.device).unsqueeze(0)
        hidden = embed.word_embeddings(input_ids) + embed.token_type_embeddings(token_type_ids)
        hidden = embed.LayerNorm(hidden + embed.position_embeddings(positions))
        mask = None
        capturing = input_ids.is_cuda and torch.cuda.is_current_stream_capturing()  # no sync in a graph
        if attention_mask is not None and (capturing or not attention_mask.all()):
            mask = attention_mask.bool()[:, None, None, :].expand(rows, 1, length, length)
        for layer in self.layers:
            hidden = layer(hidden, mask)
        return {"last_hidden_state": hidden}


class BertMaskedLMHead(nn.Module):
    """BERT's masked-language-model head (transformers' ``BertLMPredictionHead``, saved as
    ``cls.predictions``): token embeddings ``[..., hidden]`` to vocabulary logits ``[..., vocab]``
    by a dense layer, GELU and LayerNorm (``transform``), then the decoder (the word embeddings
    where tied) and its bias; the same ops in the same order as transformers'."""

    def __init__(self, hidden: int, vocab: int, eps: float) -> None:
        super().__init__()
        self.transform = _Transform(hidden, eps)
        self.decoder = _Decoder(vocab, hidden)
        self.bias = nn.Parameter(torch.empty(vocab), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` -> ``[..., vocab]`` in the weights' dtype."""
        return F.linear(self.transform(hidden), self.decoder.weight, self.bias)


class _Decoder(nn.Module):
    """The decoder's weight ``[vocab, hidden]`` (its bias is the head's)."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden), requires_grad=False)


class _Transform(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = _Linear(hidden, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.LayerNorm(F.gelu(self.dense(hidden)))
        return out


def unsupported(config: dict[str, Any], model_kwargs: dict[str, Any]) -> str | None:
    """Why this encoder does not run a folder (``config.json`` as read, ``from_pretrained``'s
    ``model_kwargs``), or None when it does: another ``model_type`` or activation, relative
    positions, a decoder, an attention kernel other than SDPA."""
    for key, value in _REQUIRED.items():
        if config.get(key, value) != value:
            return f"config {key} = {config.get(key)!r}"
    attention = model_kwargs.get("attn_implementation")
    if attention not in (None, "sdpa"):
        return f"attn_implementation = {attention!r}"
    if set(model_kwargs) - {"dtype", "attn_implementation"}:
        return f"loader options {sorted(set(model_kwargs) - {'dtype', 'attn_implementation'})}"
    return None


def load_bert(folder: Path, dtype: torch.dtype | None = None) -> BertEncoder | None:
    """The folder's BERT encoder in eval mode on the CPU, its weights from ``model.safetensors``
    cast to ``dtype`` (None: as saved); None when the folder has no single safetensors file or its
    tensors are not exactly a BERT encoder's (a pooler and ``position_ids`` are left out; a
    ``bert.`` prefix, as task checkpoints save it, is dropped).

    Raises:
        OSError, ValueError: an unreadable ``config.json`` or weights file.
    """
    loaded = _load(folder, dtype)
    return loaded[0] if loaded is not None else None


def load_bert_mlm(
    folder: Path, dtype: torch.dtype | None = None
) -> tuple[BertEncoder, BertMaskedLMHead] | None:
    """A ``BertForMaskedLM`` folder's encoder and masked-LM head (:class:`BertMaskedLMHead`) in
    eval mode on the CPU, as :func:`load_bert` loads the encoder; None where either is not
    exactly the folder's tensors (the decoder is the word embeddings unless the folder saved its
    own, ``tie_word_embeddings = false``).

    Raises:
        OSError, ValueError: an unreadable ``config.json`` or weights file.
    """
    loaded = _load(folder, dtype)
    if loaded is None:
        return None
    encoder, saved = loaded
    config = encoder.config
    head = BertMaskedLMHead(int(config.hidden_size), int(config.vocab_size), float(config.layer_norm_eps))
    prefix = "cls.predictions."
    found = {k.removeprefix(prefix): v for k, v in saved.items() if k.startswith(prefix)}
    tied = bool(getattr(config, "tie_word_embeddings", True))
    if tied and "decoder.weight" not in found:
        found["decoder.weight"] = encoder.embeddings.word_embeddings.weight
    found.pop("decoder.bias", None)  # transformers ties it to ``bias``
    if set(found) != set(head.state_dict()):
        return None
    head.load_state_dict(found, strict=True, assign=True)
    return encoder, head.eval()


def _load(folder: Path, dtype: torch.dtype | None) -> tuple[BertEncoder, dict[str, torch.Tensor]] | None:
    """The encoder of :func:`load_bert` and every tensor the folder saved (cast to ``dtype``, a
    ``bert.`` prefix dropped), or None."""
    from safetensors.torch import load_file

    weights_file = folder / "model.safetensors"
    if not weights_file.is_file():
        return None
    config = SimpleNamespace(**json.loads((folder / "config.json").read_text()))
    encoder = BertEncoder(config)  # uninitialised (torch.empty) until the folder's weights replace them
    saved = load_file(str(weights_file))
    if saved and all(k.startswith("bert.") for k in saved if not k.startswith(("cls.", "classifier."))):
        saved = {k.removeprefix("bert."): v for k, v in saved.items()}
    saved = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v) for k, v in saved.items()}
    wanted = encoder.state_dict().keys()
    kept = {k: v for k, v in saved.items() if k in wanted}
    if set(kept) != set(wanted):
        return None
    encoder.load_state_dict(kept, strict=True, assign=True)
    return encoder.eval(), saved
