"""ColBERT as PyLate defines it (``pylate.models.ColBERT``), read from PyLate's folder layout and run
without importing PyLate or sentence-transformers.

A PyLate folder is a sentence-transformers folder whose ``modules.json`` names a ``Transformer``
(at the folder's root) and one or more ``pylate.models.Dense.Dense`` projections, and whose
``config_sentence_transformers.json`` holds ColBERT's settings (:func:`read_folder`):

- the **markers** ``query_prefix`` / ``document_prefix`` (``"[Q] "``, ``"[D] "``: tokens PyLate
  added to the vocabulary), each inserted right after the first token (``[CLS]``);
- ``query_length`` (32) and ``document_length`` (180): tokens, the marker included;
- **query expansion** (``do_query_expansion``): a query is padded to ``query_length`` with the
  mask token (``[MASK]``), attended to only where ``attend_to_expansion_tokens``, and every one of
  its ``query_length`` rows is kept;
- the **skiplist** (``skiplist_words``, by default every ASCII punctuation character): a
  document's rows for those tokens are dropped, as are its padding rows.

A text's rows are the encoder's token states through the Dense projections (128 wide for most
models), each L2-normalised. The relevance of a document to a query is **MaxSim**: for each query
row its largest dot product with a document row, summed over the query rows (:func:`maxsim`;
PyLate's ``colbert_scores``). Khattab and Zaharia, "ColBERT" (SIGIR 2020); Santhanam et al.,
"ColBERTv2" (NAACL 2022).

The encoder is :func:`app.handlers.embedding_pipeline.load_encoder`'s (our BERT encoder, else
transformers' ``AutoModel``).
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from app.handlers.folder_json import read_json

__all__ = ["ColbertPlan", "DenseChain", "load_dense", "maxsim", "read_folder"]

_TRANSFORMER = "Transformer"
_DENSE = "pylate.models.Dense.Dense"
_IDENTITY = "torch.nn.modules.linear.Identity"


@dataclass(frozen=True)
class ColbertPlan:
    """What a PyLate folder says (module docstring); the defaults are PyLate's.

    Attributes:
        dense: the Dense projections' folders, in order.
        lowercase: ``sentence_bert_config.json``'s ``do_lower_case``.
        default_prompt: the prompt of ``default_prompt_name`` ("" for none).
    """

    dense: list[Path]
    query_prefix: str = "[Q] "
    document_prefix: str = "[D] "
    query_length: int = 32
    document_length: int = 180
    do_query_expansion: bool = True
    attend_to_expansion_tokens: bool = False
    skiplist_words: list[str] = field(default_factory=lambda: list(string.punctuation))
    lowercase: bool = False
    default_prompt: str = ""


def read_folder(folder: Path) -> ColbertPlan:
    """A PyLate ColBERT folder's modules and settings (module docstring).

    Raises:
        ValueError: no ``modules.json``, modules other than a root Transformer and Dense
            projections, or settings of the wrong type.
    """
    modules = read_json(folder / "modules.json")
    kinds = [(str(m.get("type", "")), str(m.get("path", ""))) for m in modules or []]
    if (
        len(kinds) < 2
        or kinds[0][0].rsplit(".", 1)[-1] != _TRANSFORMER
        or not kinds[0][0].startswith("sentence_transformers.")
        or kinds[0][1] != ""
        or any(kind != _DENSE for kind, _ in kinds[1:])
    ):
        raise ValueError(
            f"{folder}: modules {[k for k, _ in kinds]} are not a PyLate ColBERT "
            f"(a sentence-transformers Transformer at the root, then {_DENSE} projections)"
        )
    config = read_json(folder / "config_sentence_transformers.json")
    values: dict[str, Any] = {}
    fields: tuple[tuple[str, type], ...] = (
        ("query_prefix", str), ("document_prefix", str), ("query_length", int), ("document_length", int),
        ("do_query_expansion", bool), ("attend_to_expansion_tokens", bool), ("skiplist_words", list),
    )  # fmt: skip
    for name, kind in fields:
        value: Any = config.get(name)
        if value is None:
            continue
        short = kind is int and (isinstance(value, bool) or int(value) < 2)
        if not isinstance(value, kind) or short:
            raise ValueError(f"{folder}: config_sentence_transformers.json {name} = {value!r}")
        values[name] = value
    prompts = config.get("prompts") or {}
    name = config.get("default_prompt_name")
    settings = read_json(folder / "sentence_bert_config.json")
    plan = ColbertPlan(
        dense=[folder / path for _, path in kinds[1:]],
        lowercase=bool(settings.get("do_lower_case", False)),
        default_prompt=str(prompts.get(name, "")) if name else "",
        **values,
    )
    # as PyLate: without expansion there is nothing to attend to
    return plan if plan.do_query_expansion else replace(plan, attend_to_expansion_tokens=False)


class DenseChain(nn.Module):
    """PyLate's Dense projections, in order: each ``linear`` (with its bias where saved), an
    identity activation, and the ``residual`` of its input where ``use_residual`` (projected by
    ``residual`` where the widths differ). ``[..., in]`` -> ``[..., out]``."""

    def __init__(self, layers: list[tuple[nn.Linear, nn.Linear | None, bool]]) -> None:
        super().__init__()
        self.linears = nn.ModuleList([linear for linear, _, _ in layers])
        self.residuals = nn.ModuleList([r if r is not None else nn.Identity() for _, r, _ in layers])
        self.uses_residual = [use for _, _, use in layers]

    @property
    def out_features(self) -> int:
        """The width of a row."""
        last = self.linears[-1]
        assert isinstance(last, nn.Linear)
        return int(last.out_features)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project ``hidden`` ``[..., in]`` through every layer."""
        for linear, residual, use in zip(self.linears, self.residuals, self.uses_residual, strict=True):
            projected = linear(hidden)
            hidden = projected + residual(hidden) if use else projected
        return hidden


def load_dense(folders: Sequence[Path], dtype: torch.dtype, device: torch.device) -> DenseChain:
    """The Dense projections saved in ``folders`` (``config.json``, ``model.safetensors``), cast to
    ``dtype`` on ``device``.

    Raises:
        ValueError: an activation other than the identity, or weights that do not fit the config.
    """
    from safetensors.torch import load_file

    layers: list[tuple[nn.Linear, nn.Linear | None, bool]] = []
    for folder in folders:
        config = read_json(folder / "config.json")
        activation = config.get("activation_function", _IDENTITY)
        if activation != _IDENTITY:
            raise ValueError(f"{folder}: activation_function {activation!r}; PyLate's Dense is {_IDENTITY!r}")
        width_in, width_out = int(config["in_features"]), int(config["out_features"])
        bias, use_residual = bool(config.get("bias", True)), bool(config.get("use_residual", False))
        linear = nn.Linear(width_in, width_out, bias=bias)
        residual = (
            nn.Linear(width_in, width_out, bias=False) if use_residual and width_in != width_out else None
        )
        saved = load_file(str(folder / "model.safetensors"))
        module = nn.ModuleDict({"linear": linear, **({"residual": residual} if residual is not None else {})})
        try:
            module.load_state_dict(saved, strict=True)
        except RuntimeError as exc:
            raise ValueError(f"{folder}: model.safetensors does not fit config.json ({exc})") from None
        layers.append((linear, residual, use_residual))
    return DenseChain(layers).to(device=device, dtype=dtype).eval()


def maxsim(
    queries: torch.Tensor, query_keep: torch.Tensor, documents: torch.Tensor, document_keep: torch.Tensor
) -> torch.Tensor:
    """Late-interaction relevance of pairs: for each kept query row the largest dot product with a
    kept row of its document, summed over the query's kept rows (PyLate's ``colbert_scores`` of
    each pair alone).

    Args:
        queries: float ``[S, Tq, D]``; ``query_keep``: bool ``[S, Tq]``.
        documents: float ``[S, Td, D]``; ``document_keep``: bool ``[S, Td]`` (at least one row each).

    Returns:
        float ``[S]``.
    """
    sims = torch.einsum("sqd,std->sqt", queries, documents)
    sims = sims.masked_fill(~document_keep.unsqueeze(1), float("-inf"))
    best = sims.max(dim=-1).values
    return best.masked_fill(~query_keep, 0.0).sum(dim=-1)
