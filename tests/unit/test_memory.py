"""app.models.memory: parameter counts equal transformers' own at the real sizes (built on the
meta device: no memory), the safetensors headers' counts equal the loaded models', the known
figures (Llama-2-7B: 6.74 B parameters, 13.5 GB in bfloat16), the activation terms, the
placement rule and its messages; and that the module never imports torch (the master uses it)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from app.models import memory, placement
from app.models.memory import Architecture, ModelMemory
from app.models.placement import WorkerMemory
from tests.support.decoder_models import KINDS
from tests.support.gunicorn import ROOT

GB = 10**9
GIB = 2**30
#: Llama-2-7B's config.json (meta-llama/Llama-2-7b-hf), the shape of RADAR-Vicuna-7B.
LLAMA_7B: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
QWEN3_06B = {
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151669,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
}
QWEN3_8B = QWEN3_06B | {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 151665,
    "tie_word_embeddings": False,
}
#: gpt2's config.json.
GPT2: dict[str, Any] = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "vocab_size": 50257,
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "n_positions": 1024,
}
#: NVML's total of an H100 80GB HBM3 (81,559 MiB).
H100_BYTES = 81559 * 2**20


def transformers_count(config: dict[str, Any]) -> int:
    """Parameters of the class transformers builds from ``config``, on the meta device."""
    import transformers

    cls = getattr(transformers, config["architectures"][0])
    with torch.device("meta"):
        model = cls(transformers.AutoConfig.for_model(**config))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "config",
    [
        LLAMA_7B,
        LLAMA_7B | {"architectures": ["LlamaForSequenceClassification"], "num_labels": 2},
        GPT2,
        QWEN3_06B | {"architectures": ["Qwen3Model"]},
        QWEN3_06B | {"architectures": ["Qwen3ForCausalLM"]},
        QWEN3_8B | {"architectures": ["Qwen3ForCausalLM"]},
        {
            "model_type": "qwen2",
            "architectures": ["Qwen2ForSequenceClassification"],
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "vocab_size": 151936,
            "num_labels": 3,
        },
        {
            "model_type": "mistral",
            "architectures": ["MistralForCausalLM"],
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 32000,
        },
    ],
    ids=[
        "llama-7b",
        "llama-7b-classifier",
        "gpt2",
        "qwen3-embedding-0.6b",
        "qwen3-0.6b",
        "qwen3-8b",
        "qwen2-0.5b-classifier",
        "mistral-7b",
    ],
)
def test_parameter_formula_equals_transformers_at_real_sizes(config: dict[str, Any]) -> None:
    assert memory.estimate_parameters(Architecture.from_config(config), config) == transformers_count(config)


def test_llama_7b_figures_are_the_known_ones() -> None:
    """6.74 B parameters, 13.5 GB of bfloat16 weights (meta-llama/Llama-2-7b-hf's model card:
    7B; its safetensors shards in float16: 13.5 GB)."""
    parameters = memory.estimate_parameters(Architecture.from_config(LLAMA_7B), LLAMA_7B)
    assert parameters == 6_738_415_616
    assert round(parameters * memory.DTYPE_BYTES["bfloat16"] / GB, 1) == 13.5
    assert round(parameters * memory.DTYPE_BYTES["float32"] / GB, 1) == 27.0


@pytest.mark.parametrize("kind", KINDS)
def test_safetensors_headers_count_the_loaded_model(decoder_models: dict[str, Path], kind: str) -> None:
    import transformers

    folder = decoder_models[kind]
    config = json.loads((folder / "config.json").read_text())
    model = getattr(transformers, config["architectures"][0]).from_pretrained(folder)
    loaded = sum(p.numel() for p in model.parameters())
    assert memory.safetensors_parameters(folder) == loaded
    assert memory.estimate_parameters(Architecture.from_config(config), config) == loaded


def test_a_reranker_planned_without_vocabulary_logits_needs_less(
    decoder_models: dict[str, Path], tmp_path: Path
) -> None:
    """Qwen3-Reranker's logits over 151,669 tokens dominate its activations; scored from the last
    hidden state (vLLM's way) they are gone, and the weights stay as stored."""
    folder = decoder_models["qwen3-reranker"]
    full = memory.plan_folder(folder, name="r", dtype="float32", max_batch_size=16, max_seq_length=1024)
    last = memory.plan_folder(
        folder, name="r", dtype="float32", max_batch_size=16, max_seq_length=1024, head="base"
    )
    assert last.weight_bytes == full.weight_bytes and last.parameters == full.parameters
    assert last.activation_bytes < full.activation_bytes
    untied = decoder_models["llama-lm"]  # its LM head is weights of its own
    (tmp_path / "config.json").write_text((untied / "config.json").read_text())  # no weights: by formula
    by_formula = memory.plan_folder(tmp_path, name="r", dtype="float32", max_batch_size=16, head="base")
    assert by_formula.parameters == memory.safetensors_parameters(untied)


def test_the_decoder_handlers_are_planned_by_what_they_compute(
    decoder_models: dict[str, Path], tmp_path: Path
) -> None:
    """A model.toml of the yes/no reranker plans no vocabulary logits; one of the causal-LM scorer
    plans one chunk of rows of them (its head runs in chunks of 256 MiB of float32 logits), not
    the batch's: a GPT-2-sized scorer at 32 x 1024 tokens would plan 6.6 GB of float32 logits.
    Both plan their prefix cache: ``prefix_cache_bytes`` (256 MiB unless given; none where
    ``shared_prefix = false``)."""
    from tests.support.decoder_models import write_causal_lm
    from tests.unit.test_decoder_embed_rerank import write_reranker

    write_reranker(tmp_path, "reranker", decoder_models["qwen3-reranker"])
    write_causal_lm(tmp_path, "lm", decoder_models["gpt2-lm"], "prefix_cache_bytes = 1048576")
    write_causal_lm(tmp_path, "lm-whole", decoder_models["gpt2-lm"], "shared_prefix = false")
    planned = {m.name: m for m in placement.plan_worker(tmp_path).models}
    folder = decoder_models["qwen3-reranker"]
    assert planned["reranker"] == dataclasses.replace(
        memory.plan_folder(folder, name="reranker", dtype="float32", max_batch_size=8, head="base"),
        cache_bytes=memory.PREFIX_CACHE_BYTES,
    )
    assert "0.25 GiB of prefix cache" in planned["reranker"].describe()
    assert planned["lm"].cache_bytes == 1048576 and planned["lm-whole"].cache_bytes == 0
    assert planned["lm"].total_bytes == planned["lm-whole"].total_bytes + 1048576
    gpt2 = Architecture.from_config(GPT2)
    whole = memory.activation_bytes(gpt2, 32, 1024, "float32", "sdpa")
    chunked = memory.activation_bytes(
        dataclasses.replace(gpt2, head="lm-chunked"), 32, 1024, "float32", "sdpa"
    )
    assert whole > 32 * 1024 * 50257 * 4 > 4 * chunked
    assert planned["lm-whole"] == memory.plan_folder(
        decoder_models["gpt2-lm"], name="lm-whole", dtype="float32", max_batch_size=8, max_seq_length=256,
        head="lm-chunked",
    )  # fmt: skip


def test_a_file_that_is_no_safetensors_is_refused(tmp_path: Path) -> None:
    assert memory.safetensors_parameters(tmp_path) is None
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(ValueError, match="not a safetensors file"):
        memory.safetensors_parameters(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x01")
    with pytest.raises(ValueError, match="not a safetensors file"):
        memory.safetensors_parameters(tmp_path)


def test_the_largest_batch_is_the_longest_rows_the_limits_allow() -> None:
    assert memory.largest_batch(32, None, 128) == (32, 128)
    assert memory.largest_batch(32, 2048, 128) == (16, 128)
    assert memory.largest_batch(32, 100, 512) == (1, 512)  # one item always runs


def test_activation_terms() -> None:
    arch = Architecture.from_config(LLAMA_7B | {"architectures": ["LlamaForSequenceClassification"]})
    sdpa = memory.activation_bytes(arch, 32, 128, "bfloat16", "sdpa")
    eager = memory.activation_bytes(arch, 32, 128, "bfloat16", "eager")
    # RADAR's batch: 32 pieces of <= 300 characters (<= 128 tokens) is about 0.3 GB: the
    # MLP's three [4096, 11008] products (3 x 4096 x 11008 x 2 bytes = 270 MB) dominate.
    assert 0.25 * GB < sdpa < 0.4 * GB
    assert sdpa < eager < sdpa + 0.2 * GB  # the scores: 32 x 32 heads x 128^2 x (2 + 4) bytes
    long_eager = memory.activation_bytes(arch, 8, 4096, "bfloat16", "eager")
    assert long_eager > 8 * 32 * 4096**2 * 6  # the scores of every head: 25.8 GB
    assert memory.activation_bytes(arch, 8, 4096, "bfloat16", "sdpa") < 3 * GB
    lm = Architecture.from_config(QWEN3_8B | {"architectures": ["Qwen3ForCausalLM"]})
    logits = 32 * 300 * 151665 * 2
    assert memory.activation_bytes(lm, 32, 300, "bfloat16", "sdpa") >= logits
    with pytest.raises(ValueError, match="dtype"):
        memory.activation_bytes(arch, 1, 1, "int8", "sdpa")
    with pytest.raises(ValueError, match="attn_implementation"):
        memory.activation_bytes(arch, 1, 1, "float32", "paged")


def test_a_7b_worker_fits_five_times_on_an_h100_and_says_so_when_asked_for_eight() -> None:
    arch_config = LLAMA_7B | {"architectures": ["LlamaForSequenceClassification"], "num_labels": 2}
    arch = Architecture.from_config(arch_config)
    parameters = memory.estimate_parameters(arch, arch_config)
    radar = ModelMemory(
        "radar",
        parameters,
        False,
        "bfloat16",
        parameters * 2,
        memory.activation_bytes(arch, 32, 128, "bfloat16", "sdpa"),
        32,
        128,
    )
    worker = WorkerMemory((radar,))
    assert 14 * GIB < worker.total_bytes < 15 * GIB
    eight = placement.place(
        worker, 8, total_bytes=H100_BYTES, free_bytes=H100_BYTES - 600 * 2**20, gpu="GPU 0 (H100)"
    )
    assert (eight.copies, eight.fits, eight.asked) == (5, 5, 8)
    assert eight.message is not None
    assert "SCORING_MAX_PROCESSES_PER_GPU=8" in eight.message and "starting 5" in eight.message
    assert "6.61 B parameters" in eight.message and "bfloat16" in eight.message
    assert placement.place(worker, 4, total_bytes=H100_BYTES, free_bytes=H100_BYTES).message is None
    busy = placement.place(worker, 1, total_bytes=H100_BYTES, free_bytes=10 * GIB, gpu="GPU 1")
    assert busy.copies == 0 and busy.message is not None and "cannot hold one worker" in busy.message
    float32 = placement.place(2 * parameters * 2, 1, total_bytes=H100_BYTES, free_bytes=H100_BYTES)
    assert float32.copies == 1
    with pytest.raises(ValueError, match=">= 1"):
        placement.place(worker, 0, total_bytes=H100_BYTES, free_bytes=H100_BYTES)


def test_the_refusal_suggests_bfloat16_only_for_a_model_in_float32() -> None:
    """A worker that does not fit is told what would make it fit: half precision where a model
    is served in float32 (named), never for a model that already is bfloat16."""
    arch = Architecture.from_config(LLAMA_7B | {"architectures": ["LlamaForSequenceClassification"]})
    parameters = memory.estimate_parameters(arch, LLAMA_7B)
    activations = memory.activation_bytes(arch, 32, 128, "bfloat16", "sdpa")
    half = ModelMemory("radar", parameters, False, "bfloat16", parameters * 2, activations, 32, 128)
    full = dataclasses.replace(half, name="radar-fp32", dtype="float32", weight_bytes=parameters * 4)
    for worker, free in ((WorkerMemory((half,)), 10 * GIB), (WorkerMemory((half,)), 40 * GIB)):
        placed = placement.place(worker, 4, total_bytes=H100_BYTES, free_bytes=free)
        assert placed.message is not None and placed.copies < 4
        assert "bfloat16 halves" not in placed.message and "smaller dtype" not in placed.message
        assert "max_batch_tokens" in placed.message
    placed = placement.place(WorkerMemory((full, half)), 1, total_bytes=H100_BYTES, free_bytes=10 * GIB)
    assert placed.message is not None and 'dtype = "bfloat16" for radar-fp32' in placed.message


def test_a_repository_is_planned_from_its_model_tomls(
    decoder_models: dict[str, Path], tmp_path: Path
) -> None:
    from tests.support.text_models import CLASSIFIER_TOML
    from tests.support.toy_models import write_tensor_model

    folder = tmp_path / "radar"
    folder.mkdir()
    toml = CLASSIFIER_TOML.format(
        name="radar",
        num_labels=2,
        labels='["human", "machine"]',
        parameters='dtype = "bfloat16"\nmax_seq_length = 128',
    ).replace('model_dir = "hf"', f'model_dir = "{decoder_models["llama-classifier"]}"')
    (folder / "model.toml").write_text(toml)
    write_tensor_model(tmp_path, "ranker", "torchscript")
    worker = placement.plan_worker(tmp_path)
    assert placement.plan_worker(tmp_path, ["radar"]).models == tuple(
        m for m in worker.models if m.name == "radar"
    )
    radar = next(m for m in worker.models if m.name == "radar")
    assert radar.exact and radar.dtype == "bfloat16" and (radar.rows, radar.seq_len) == (16, 128)
    assert radar.weight_bytes == 2 * radar.parameters
    other = next(m for m in worker.models if m.name != "radar")
    assert other.parameters == 0 and other.weight_bytes > 0 and other.activation_bytes == 0
    assert worker.total_bytes > placement.CUDA_CONTEXT_BYTES + radar.total_bytes
    assert "radar:" in worker.describe() and "CUDA context" in worker.describe()
    gpus = [("GPU 0", H100_BYTES, H100_BYTES), ("GPU 1", H100_BYTES, worker.total_bytes + GIB // 2)]
    plan = placement.plan_server(tmp_path, (), 2, gpus)
    assert plan.worker == worker and [p.copies for p in plan.placements] == [2, 1] and plan.workers == 3
    assert len(plan.messages) == 1 and plan.messages[0].startswith(
        "SCORING_MAX_PROCESSES_PER_GPU=2 asks for 2 workers on GPU 1"
    )


def test_the_plan_imports_no_torch(decoder_models: dict[str, Path]) -> None:
    """The gunicorn master plans before it forks: nothing it imports may pull torch (a CUDA
    context in the master would be inherited by every forked worker)."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from app.models import memory\n"
        "from app.models import placement\n"
        f"print(memory.plan_folder(Path({str(decoder_models['qwen3-reranker'])!r}), name='r', dtype='float16', max_batch_size=8).describe())\n"
        "print(placement.plan_worker(Path('model_repository'), ['all-MiniLM-L6-v2']).describe())\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'tokenizers'))\n"
        "assert not loaded, loaded\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "r: " in out.stdout and "all-MiniLM-L6-v2: 0.02 B parameters" in out.stdout


def test_a_handler_declares_its_memory_head_and_is_not_imported_to_read_it(tmp_path: Path) -> None:
    from app.models.memory import declared_head
    from tests.support.gunicorn import ROOT
    from tests.support.toy_models import unit_config

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "mine.py").write_text('import torch\n\nclass Mine:\n    MEMORY_HEAD = "base"\n')
    config = unit_config()
    config.handler, config.path = "mine:Mine", folder
    assert declared_head(config) == "base"
    config.handler = "mine:Other"
    assert declared_head(config) is None
    # the bundled decoder handlers, read in a process that must not import torch (the master's)
    probe = (
        "import sys; from app.models.memory import declared_head; from app.models.repository import "
        "ModelConfig as C, TensorSpec as T\n"
        "def u(h): return C(name='m', format='handler', handler=h, inputs=[T('x', 'FP32', [1])], "
        "outputs=[T('y', 'FP32', [1])])\n"
        "print(declared_head(u('app.handlers.causal_rerank:CausalRerankHandler')), "
        "declared_head(u('app.handlers.causal_lm:CausalLMHandler')), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["base", "lm-chunked", "False"]
