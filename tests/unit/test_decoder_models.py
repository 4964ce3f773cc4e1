"""The small decoder models of tests/support/decoder_models.py: each folder loads offline with
transformers' Auto classes as the real family does, its tokenizer has no pad token, and the
Rust ``tokenizers.Tokenizer`` reads the same ids from ``tokenizer.json``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
)

from tests.support.decoder_models import CLASSES, KINDS, LABELS, build_decoder_folder

TEXTS = ["Hello world.", "Is this post written by a person?", "café 東京 12 yes no\n"]

AUTO_CLASS = {
    "classifier": AutoModelForSequenceClassification,
    "lm": AutoModelForCausalLM,
    "reranker": AutoModelForCausalLM,
    "embedder": AutoModel,
}


@pytest.mark.parametrize("kind", KINDS)
def test_each_folder_loads_offline_as_its_real_class_without_a_pad_token(
    decoder_models: dict[str, Path], kind: str
) -> None:
    folder = decoder_models[kind]
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AUTO_CLASS[kind.split("-")[1]].from_pretrained(folder, local_files_only=True).eval()
    assert type(model).__name__ == CLASSES[kind]
    assert tokenizer.pad_token is None and tokenizer.pad_token_id is None
    assert model.config.pad_token_id is None
    assert model.config.num_hidden_layers == 2
    assert (folder / "model.safetensors").is_file() and not list(folder.glob("*.bin"))
    if kind.endswith("classifier"):
        assert [model.config.id2label[i] for i in range(len(LABELS))] == list(LABELS)
    rust = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids == rust.encode(text).ids
        with torch.inference_mode():
            out = model(torch.tensor([ids]))
        assert out[0].shape[:1] == (1,)
    with pytest.raises(ValueError, match="padding token"):
        tokenizer(TEXTS, padding=True)


def test_special_tokens_are_those_the_real_families_ship(decoder_models: dict[str, Path]) -> None:
    llama = AutoTokenizer.from_pretrained(decoder_models["llama-classifier"])
    assert llama("hi")["input_ids"][0] == llama.bos_token_id  # BOS by the post-processor
    assert llama.convert_ids_to_tokens(llama.bos_token_id) == "<s>" and llama.eos_token == "</s>"
    gpt2 = AutoTokenizer.from_pretrained(decoder_models["gpt2-lm"])
    assert gpt2.bos_token == gpt2.eos_token == "<|endoftext|>"
    assert gpt2("hi")["input_ids"] == gpt2("hi", add_special_tokens=False)["input_ids"]  # nothing added
    embedder = Tokenizer.from_file(str(decoder_models["qwen3-embedder"] / "tokenizer.json"))
    assert embedder.encode("hi").tokens[-1] == "<|endoftext|>"  # Qwen3-Embedding's appended token
    reranker = Tokenizer.from_file(str(decoder_models["qwen3-reranker"] / "tokenizer.json"))
    chat = reranker.encode("<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>\n\n").tokens
    assert {"<|im_start|>", "<|im_end|>", "<think>", "</think>"} <= set(chat)
    assert reranker.token_to_id("yes") is not None and reranker.token_to_id("no") is not None
    for kind in ("qwen3-embedder", "qwen3-reranker"):
        assert AutoTokenizer.from_pretrained(decoder_models[kind]).padding_side == "left"
    sentence_transformers = json.loads(
        (decoder_models["qwen3-embedder"] / "config_sentence_transformers.json").read_text()
    )
    assert sentence_transformers["prompts"]["document"] == ""


def test_a_pad_token_can_be_given_and_the_config_agrees(tmp_path: Path) -> None:
    folder = build_decoder_folder(tmp_path / "qwen", "qwen3-embedder", pad_token="<|endoftext|>")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.pad_token == "<|endoftext|>"
    assert AutoConfig.from_pretrained(folder).pad_token_id == tokenizer.pad_token_id
    with pytest.raises(ValueError, match="not in the"):
        build_decoder_folder(tmp_path / "llama", "llama-lm", pad_token="<pad>")


def test_the_same_seed_builds_the_same_weights(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    one = load_file(build_decoder_folder(tmp_path / "a", "llama-lm") / "model.safetensors")
    two = load_file(build_decoder_folder(tmp_path / "b", "llama-lm") / "model.safetensors")
    other = load_file(build_decoder_folder(tmp_path / "c", "llama-lm", seed=1) / "model.safetensors")
    assert one.keys() == two.keys()
    assert all(torch.equal(one[k], two[k]) for k in one)
    assert not all(torch.equal(one[k], other[k]) for k in one)
