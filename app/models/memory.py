"""GPU memory of one model, planned before it loads: its weights per dtype and the
activations of its largest batch (:mod:`app.models.placement` adds the CUDA context and says
how many worker copies fit a GPU).

- **Weights** in the serving ``dtype``: parameters x 4 (float32) or 2 (float16, bfloat16).
  Parameters are counted exactly from the ``safetensors`` headers of the model's folder (a JSON
  header before the tensors: read without loading a weight), else from ``config.json`` by the
  architecture's formula (:func:`estimate_parameters`, equal to transformers' own count for
  Llama, Mistral, Qwen2, Qwen3 and GPT-2).
- **Activations** of a forward with no KV cache (scoring) of the largest batch the model's
  limits allow (:func:`largest_batch`), by :func:`activation_bytes`, per attention
  implementation (``eager`` holds every head's ``T x T`` scores; ``sdpa`` and flash do not).

Imports no torch and no CUDA library (the gunicorn master plans before it forks, and must never
create a CUDA context; ``tests/unit/test_memory.py`` checks it): only the standard library and
:mod:`app.models.repository`.
"""

from __future__ import annotations

import ast
import ctypes
import ctypes.util
import functools
import json
import math
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from app.models.repository import ModelConfig

__all__ = [
    "DTYPE_BYTES",
    "GIB",
    "MIB",
    "Architecture",
    "ModelMemory",
    "activation_bytes",
    "declared",
    "declared_head",
    "estimate_parameters",
    "largest_batch",
    "plan_folder",
    "plan_model",
    "prefix_cache_bytes",
    "safetensors_parameters",
    "trim_heap",
]

MIB = 2**20
GIB = 2**30
#: Bytes per element of each serving dtype.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
#: A safetensors header above this is not a header (the format's own bound is 100 MB).
_MAX_HEADER_BYTES = 100_000_000


def _first(config: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    if default is None:
        raise ValueError(f"config.json has none of {list(keys)}")
    return default


@dataclass(frozen=True)
class Architecture:
    """The sizes of a transformer that its memory depends on, read from ``config.json``.

    ``family``: ``model_type`` (GPT-2, or Llama-like: llama, mistral, qwen2, qwen3 and others of
    the same block); ``head``: ``"lm"`` (logits over the vocabulary at every position: a causal
    LM), ``"classifier"`` (``labels`` logits) or ``"base"`` (hidden states: an embedder)."""

    family: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    positions: int
    tied: bool
    head: str
    labels: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Architecture:
        """From a ``config.json`` mapping. Raises ``ValueError`` for a config without the sizes."""
        family = str(config.get("model_type", ""))
        architecture = str((config.get("architectures") or [""])[0])
        if architecture.endswith("ForSequenceClassification"):
            head = "classifier"
        elif architecture.endswith(("ForCausalLM", "LMHeadModel")):
            head = "lm"
        else:
            head = "base"
        labels = len(config.get("id2label") or {}) or int(config.get("num_labels") or 2)
        hidden = int(_first(config, "hidden_size", "n_embd", "d_model"))
        heads = int(_first(config, "num_attention_heads", "n_head"))
        return cls(
            family=family,
            hidden=hidden,
            layers=int(_first(config, "num_hidden_layers", "n_layer")),
            heads=heads,
            kv_heads=int(_first(config, "num_key_value_heads", default=heads)),
            head_dim=int(_first(config, "head_dim", default=hidden // heads)),
            intermediate=int(_first(config, "intermediate_size", "n_inner", default=4 * hidden)),
            vocab=int(_first(config, "vocab_size")),
            positions=int(_first(config, "max_position_embeddings", "n_positions", default=2048)),
            tied=bool(config.get("tie_word_embeddings", family == "gpt2")),
            head=head,
            labels=labels,
        )


def estimate_parameters(arch: Architecture, config: Mapping[str, Any] | None = None) -> int:
    """Parameters of ``arch`` by its family's formula (tied embeddings counted once), as
    transformers builds the class: GPT-2, or a Llama-like block (Llama, Mistral, Qwen2 with its
    q/k/v biases, Qwen3 with its q/k norms). ``config``: for ``attention_bias`` and
    ``mlp_bias`` (Llama's options). E.g. Llama-2-7B: 6,738,415,616."""
    config = config or {}
    h, layers, v = arch.hidden, arch.layers, arch.vocab
    if arch.family == "gpt2":
        i = arch.intermediate
        block = 4 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h)
        body = v * h + arch.positions * h + layers * block + 2 * h
    else:
        q, kv = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
        attention = h * q + 2 * h * kv + q * h
        if arch.family == "qwen2" or config.get("attention_bias"):
            attention += q + 2 * kv + (h if config.get("attention_bias") else 0)
        if arch.family == "qwen3":
            attention += 2 * arch.head_dim  # q_norm and k_norm
        mlp = 3 * h * arch.intermediate + (2 * arch.intermediate + h if config.get("mlp_bias") else 0)
        body = v * h + layers * (attention + mlp + 2 * h) + h
    if arch.head == "lm":
        return body + (0 if arch.tied else v * h)
    if arch.head == "classifier":
        return body + arch.labels * h
    return body


def safetensors_parameters(folder: Path) -> int | None:
    """Parameters stored in the folder's safetensors files (``model.safetensors``, or the shards
    its ``model.safetensors.index.json`` names), counted from their headers; None where it has
    none. Raises ``ValueError`` for a file whose header is not one (truncated, too large)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({folder / name for name in json.loads(index.read_text())["weight_map"].values()})
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for path in files:
        with path.open("rb") as f:
            size = f.read(8)
            length = struct.unpack("<Q", size)[0] if len(size) == 8 else -1
            if not 0 < length <= _MAX_HEADER_BYTES:
                raise ValueError(f"{path.name}: not a safetensors file (header length {length})")
            header = json.loads(f.read(length))
        for name, tensor in header.items():
            if name != "__metadata__":
                total += math.prod(tensor["shape"])
    return total


def largest_batch(max_batch_size: int, max_batch_tokens: int | None, max_seq_length: int) -> tuple[int, int]:
    """``(rows, seq_len)`` of the batch that needs the most activation memory: sequences of the
    longest length, as many as the batch allows (``max_batch_size``, and ``max_batch_tokens``
    counting padding, at least 1). It maximises the terms linear in tokens and the eager
    attention's ``rows x seq_len^2`` at once."""
    rows = (
        max_batch_size
        if max_batch_tokens is None
        else min(max_batch_size, max_batch_tokens // max_seq_length)
    )
    return max(1, rows), max_seq_length


def activation_bytes(
    arch: Architecture, rows: int, seq_len: int, dtype: str, attn_implementation: str
) -> int:
    """Peak bytes of the activations of one forward of ``rows`` x ``seq_len`` tokens in
    ``dtype``, no KV cache, under ``torch.inference_mode`` (each layer's temporaries are freed
    before the next layer runs, so the peak is one layer's, beside the residual stream).

    Per layer: the residual stream, the normalised input and the block output (3 x N x H);
    attention's q, k, v (k and v repeated to every head), rotary copies of q and k and the
    context (N x (5 heads + 2 kv heads) x head_dim); ``eager`` also holds the scores of every
    head, ``rows x heads x T^2``, in ``dtype`` and in float32 (its softmax runs in float32) and a
    ``[rows, 1, T, T]`` mask in ``dtype``; ``sdpa`` (memory-efficient or flash kernels) keeps
    only a boolean ``[rows, 1, T, T]`` mask; the MLP's gate, up and product (3 x N x
    intermediate; GPT-2: 2). After the layers, the head: ``N x vocab`` logits for ``"lm"``
    (plus the 256 MiB of float32 work of :func:`app.handlers.decoder_math.token_log_likelihood`);
    for ``"lm-chunked"`` (``app.handlers.causal_lm``, which runs the LM head over chunks of rows
    of at most 256 MiB of float32 logits, one row at the least) one chunk's logits in ``dtype``
    and in float32; ``N x hidden`` otherwise. Source of the layer's tensors: transformers' ``LlamaAttention``,
    ``eager_attention_forward`` and ``LlamaMLP`` (5.x); GPT-2's block likewise.

    Raises:
        ValueError: an unknown dtype or attention implementation.
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    if attn_implementation not in ("eager", "sdpa", "flash_attention_2", "flash_attention_3"):
        raise ValueError(f"attn_implementation {attn_implementation!r}: eager, sdpa or flash_attention_2/3")
    size, tokens = DTYPE_BYTES[dtype], rows * seq_len
    residual = 3 * tokens * arch.hidden * size
    attention = tokens * (5 * arch.heads + 2 * arch.kv_heads) * arch.head_dim * size
    if attn_implementation == "eager":
        attention += rows * arch.heads * seq_len**2 * (size + 4) + rows * seq_len**2 * size
    elif attn_implementation == "sdpa":
        attention += rows * seq_len**2
    mlp = (2 if arch.family == "gpt2" else 3) * tokens * arch.intermediate * size
    if arch.head == "lm":
        head = tokens * arch.vocab * size + min(tokens * arch.vocab * 4, 256 * MIB)
    elif arch.head == "lm-chunked":
        chunk = min(rows, max(1, 256 * MIB // (seq_len * arch.vocab * 4))) * seq_len * arch.vocab
        head = chunk * (size + 4)
    else:
        head = tokens * arch.hidden * size
    return max(residual + max(attention, mlp), head + tokens * arch.hidden * size)


@dataclass(frozen=True)
class ModelMemory:
    """One model's planned memory: ``parameters`` (``exact``: from safetensors headers, else
    config.json's formula or, for a folder that is not a transformer, its files' bytes),
    ``weight_bytes`` in ``dtype``, ``activation_bytes`` for ``rows`` x ``seq_len`` tokens,
    ``cache_bytes``: its prefix cache's bound (:func:`prefix_cache_bytes`)."""

    name: str
    parameters: int
    exact: bool
    dtype: str
    weight_bytes: int
    activation_bytes: int
    rows: int
    seq_len: int
    cache_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        """Weights, activations and the prefix cache, bytes (the allocator's margin not
        included)."""
        return self.weight_bytes + self.activation_bytes + self.cache_bytes

    def describe(self) -> str:
        """One line for a log, e.g. ``radar: 6.74 B parameters, 12.6 GiB in bfloat16 + 0.4 GiB
        of activations at 32 x 128 tokens``."""
        if not self.parameters:
            return (
                f"{self.name}: {self.weight_bytes / GIB:.1f} GiB of files (not a transformer folder: "
                "activations not planned)"
            )
        count = f"{self.parameters / 1e9:.2f} B parameters"
        cache = f" + {self.cache_bytes / GIB:.2f} GiB of prefix cache" if self.cache_bytes else ""
        return (
            f"{self.name}: {count}, {self.weight_bytes / GIB:.1f} GiB in {self.dtype} + "
            f"{self.activation_bytes / GIB:.1f} GiB of activations at {self.rows} x {self.seq_len} tokens"
            f"{cache}"
        )


def plan_folder(
    folder: Path,
    *,
    name: str,
    dtype: str,
    max_batch_size: int,
    max_batch_tokens: int | None = None,
    max_seq_length: int | None = None,
    attn_implementation: str = "sdpa",
    head: str | None = None,
) -> ModelMemory:
    """The memory of the Hugging Face folder ``folder`` (``config.json``; safetensors weights
    counted exactly where present) served in ``dtype`` with these batch limits.
    ``max_seq_length`` None: the model's positions, capped by the tokenizer's
    ``model_max_length``. ``head``: what the handler computes after the layers, where it is not
    what the class suggests (a causal LM used as a yes/no reranker through
    :func:`app.handlers.decoder_math.yes_no_score_from_hidden` computes no vocabulary-wide
    logits: ``"base"``); the weights are counted as stored either way. Raises ``ValueError``
    (bad dtype, config without sizes), ``OSError`` (no ``config.json``)."""
    config = json.loads((folder / "config.json").read_text())
    arch = Architecture.from_config(config)
    counted = safetensors_parameters(folder)
    parameters = counted if counted is not None else estimate_parameters(arch, config)
    if head is not None:  # what runs after the layers; the weights are the class's all the same
        arch = replace(arch, head=head)
    if max_seq_length is None:
        max_seq_length = arch.positions
        tokenizer_config = folder / "tokenizer_config.json"
        if tokenizer_config.is_file():
            limit = json.loads(tokenizer_config.read_text()).get("model_max_length")
            if isinstance(limit, int | float) and 0 < limit < max_seq_length:
                max_seq_length = int(limit)
    rows, seq_len = largest_batch(max_batch_size, max_batch_tokens, max_seq_length)
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    return ModelMemory(
        name=name,
        parameters=parameters,
        exact=counted is not None,
        dtype=dtype,
        weight_bytes=parameters * DTYPE_BYTES[dtype],
        activation_bytes=activation_bytes(arch, rows, seq_len, dtype, attn_implementation),
        rows=rows,
        seq_len=seq_len,
    )


def _model_folder(config: ModelConfig) -> Path:
    """The folder of the model's weights: the one ``[parameters]`` names (``model_dir``,
    relative to the model's folder, or ``model_package``'s ``get_model_path()``: the package is
    imported, as the handler would), else the model's own folder."""
    parameters = config.parameters
    if isinstance(parameters.get("model_dir"), str):
        folder = Path(parameters["model_dir"]).expanduser()
        folder = folder if folder.is_absolute() else config.path / folder
    elif isinstance(parameters.get("model_package"), str):
        import importlib

        try:
            folder = Path(importlib.import_module(parameters["model_package"]).get_model_path())
        except (ImportError, AttributeError):
            return config.path
    else:
        return config.path
    return folder if folder.is_dir() else config.path


#: The class attribute by which a handler declares what runs after the layers when that is not
#: its folder class's work: ``"base"`` (the layers' states only: a causal LM as a yes/no reranker
#: reads two rows of its LM head, ``app.handlers.causal_rerank``), ``"lm-chunked"`` (the logits a
#: chunk of rows at a time, ``app.handlers.causal_lm``).
MEMORY_HEAD = "MEMORY_HEAD"
#: The class attribute by which a handler declares that it keeps a prefix cache
#: (``app.handlers.prefix_cache``) in the model's device memory: ``True``, or the name of the
#: input whose declaration in ``model.toml`` gives it one (a classifier's ``prefix``).
MEMORY_PREFIX_CACHE = "MEMORY_PREFIX_CACHE"
#: ``[parameters] prefix_cache_bytes`` where a model that keeps a prefix cache leaves it out
#: (``app.handlers.prefix_cache.DEFAULT_BYTES``): 256 MiB.
PREFIX_CACHE_BYTES = 256 * MIB


def declared(config: ModelConfig, attribute: str) -> str | bool | None:
    """A constant ``config``'s handler class declares (a string or a bool assigned to
    ``attribute`` in the class's own body), read from its module's source, not imported: memory
    is planned in the gunicorn master, which imports no handler (they import torch). The module
    is the model folder's own ``.py`` file, else the first found on ``sys.path``; None where none
    declares one."""
    if config.format != "handler" or not config.handler:
        return None
    module_name, _, class_name = config.handler.partition(":")
    relative = module_name.replace(".", "/") + ".py"
    candidates = [config.path / relative, *(Path(entry or ".") / relative for entry in sys.path)]
    source = next((c for c in candidates if c.is_file()), None)
    if source is None:
        return None
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError):
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for statement in node.body:
                targets = statement.targets if isinstance(statement, ast.Assign) else (
                    [statement.target] if isinstance(statement, ast.AnnAssign) else []
                )  # fmt: skip
                value = getattr(statement, "value", None)
                named = any(isinstance(t, ast.Name) and t.id == attribute for t in targets)
                if named and isinstance(value, ast.Constant) and isinstance(value.value, str | bool):
                    return value.value
    return None


def declared_head(config: ModelConfig) -> str | None:
    """What ``config``'s handler class declares runs after its layers (its :data:`MEMORY_HEAD`
    string, :func:`declared`); None where it declares none."""
    head = declared(config, MEMORY_HEAD)
    return head if isinstance(head, str) else None


def prefix_cache_bytes(config: ModelConfig) -> int:
    """The bytes of the prefix cache ``config``'s model keeps on its device: its ``[parameters]
    prefix_cache_bytes`` (default :data:`PREFIX_CACHE_BYTES`) where its handler declares a cache
    (:data:`MEMORY_PREFIX_CACHE`: always, or where the model declares the input it names) and
    ``shared_prefix`` is not false; else 0."""
    keeps = declared(config, MEMORY_PREFIX_CACHE)
    if isinstance(keeps, str):
        keeps = any(spec.name == keeps for spec in config.inputs)
    parameters = config.parameters
    if not keeps or parameters.get("shared_prefix", True) is False:
        return 0
    value = parameters.get("prefix_cache_bytes", PREFIX_CACHE_BYTES)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def plan_model(config: ModelConfig) -> ModelMemory:
    """The memory of one model of a repository, from its ``model.toml``: a handler's Hugging Face
    folder by :func:`plan_folder` (``[parameters]`` ``dtype``, default float32,
    ``attn_implementation``, default sdpa, ``max_seq_length``; ``max_batch_size`` and
    ``max_batch_tokens``; the head its handler declares, :func:`declared_head`; its prefix
    cache, :func:`prefix_cache_bytes`); any other model by the bytes of its files (weights as
    they are stored; activations not planned: 0). Raises as :func:`plan_folder`."""
    folder = _model_folder(config)
    if not (folder / "config.json").is_file():
        stored = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.name != "model.toml")
        return ModelMemory(config.name, 0, False, "as stored", stored, 0, config.max_batch_size, 0)
    parameters = config.parameters
    planned = plan_folder(
        folder,
        name=config.name,
        dtype=str(parameters.get("dtype", "float32")),
        max_batch_size=config.max_batch_size,
        max_batch_tokens=config.max_batch_tokens,
        max_seq_length=parameters.get("max_seq_length"),
        attn_implementation=str(parameters.get("attn_implementation", "sdpa")),
        head=declared_head(config),
    )
    return replace(planned, cache_bytes=prefix_cache_bytes(config))


@functools.cache
def _libc() -> Any:
    """The C library, where it has glibc's ``malloc_trim`` (None elsewhere: musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def trim_heap() -> bool:
    """Give the C heap's free pages back to the system: glibc's ``malloc_trim(0)``, which trims
    every malloc arena and releases the free pages inside them too. Returns whether it ran
    (False without glibc).

    Why: a model loads on its inference thread, which allocates from a malloc arena of its own
    (glibc makes up to 8 per core), and torch's tensors, the Rust tokenizers and transformers'
    buffers are malloc'd there; freed at unload, that memory stays in the arena, which glibc
    trims only from its top. Reload after reload the worker's anonymous memory rose by 3-12 MB
    per load, with no Python object of the old copies left (docs/reliability.md, *Memory
    growth*); a trim after the unload returns it. Source: glibc's ``malloc_trim(3)`` (since 2.8
    it releases whole free pages of every arena); Dask's "memory not released back to the OS"
    workaround does the same."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
