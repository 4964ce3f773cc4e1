"""Causal-LM scoring (``app.handlers.causal_lm``) on the small GPT-2 and Llama folders of
``tests/support/decoder_models.py``: the log-likelihood equals transformers' own loss on the same
token ids, a batch of mixed lengths equals the texts one by one, the per-token log-probs and their
alternatives equal a full log-softmax, and the chunked head changes nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.handlers import causal_lm
from app.handlers.causal_lm import CausalLMHandler
from tests.support.decoder_models import write_causal_lm
from tests.unit.test_decoder_classification import posts, run
from tests.unit.test_sequence_classification import Config, Spec, _bytes

OUTPUTS = [
    Spec("log_likelihood", [1]),
    Spec("mean_log_likelihood", [1]),
    Spec("perplexity", [1]),
    Spec("scored_tokens", [1], datatype="INT64"),
    Spec("tokens", [1], datatype="INT64"),
    Spec("token_logprobs", [1], datatype="BYTES"),
]
INPUTS = [
    Spec("text", [1], datatype="BYTES"),
    Spec("return_token_logprobs", [1], datatype="INT64"),
    Spec("top_logprobs", [1], datatype="INT64"),
]


def load(folder: Path, **parameters: Any) -> CausalLMHandler:
    handler = CausalLMHandler()
    config = Config(folder.parent, {"model_dir": folder.name, **parameters}, OUTPUTS, "lm", INPUTS)
    handler.load(torch.device("cpu"), config)
    return handler


def reference(folder: Path, text: str, prefix: int | None) -> tuple[float, int, torch.Tensor, list[int]]:
    """transformers' own: the loss of the folder's model on the text's ids (``prefix`` first),
    the tokens it averaged over, the log-softmax of every position, the ids."""
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    ids = ([prefix] if prefix is not None else []) + tokenizer(text)["input_ids"]
    with torch.inference_mode():
        out = model(torch.tensor([ids]), labels=torch.tensor([ids]))
    return float(out.loss), len(ids) - 1, torch.log_softmax(out.logits[0].float(), -1), ids


@pytest.mark.parametrize(("kind", "prefix"), [("gpt2-lm", "<|endoftext|>"), ("llama-lm", None)])
def test_log_likelihood_equals_transformers_loss(
    decoder_models: dict[str, Path], kind: str, prefix: Any
) -> None:
    folder = decoder_models[kind]
    handler = load(folder)
    prefix_id = handler.tokenizer.token_to_id(prefix) if prefix else None
    assert handler.prefix.tolist() == ([prefix_id] if prefix else [])  # Llama's BOS comes first already
    texts = posts(4, seed=7)
    out = run(handler, {"text": _bytes(*texts)})
    for i, text in enumerate(texts):
        loss, count, _, ids = reference(folder, text, prefix_id)
        assert abs(-float(out["mean_log_likelihood"][i, 0]) - loss) <= 1e-4
        assert abs(float(out["log_likelihood"][i, 0]) + loss * count) <= 1e-4 * count
        assert abs(float(out["perplexity"][i, 0]) - np.exp(loss)) <= 1e-4 * np.exp(loss)
        assert int(out["scored_tokens"][i, 0]) == count and int(out["tokens"][i, 0]) == len(ids)


def test_the_first_token_unscored_without_the_prefix(decoder_models: dict[str, Path]) -> None:
    folder = decoder_models["gpt2-lm"]
    handler = load(folder, score_first_token=False)
    assert handler.prefix.size == 0
    text = posts(1, seed=8)[0]
    out = run(handler, {"text": _bytes(text)})
    loss, count, _, _ = reference(folder, text, None)
    assert (
        abs(-float(out["mean_log_likelihood"][0, 0]) - loss) <= 1e-4 and out["scored_tokens"][0, 0] == count
    )


@pytest.mark.parametrize("kind", ["gpt2-lm", "llama-lm"])
def test_a_batch_of_mixed_lengths_equals_one_by_one(decoder_models: dict[str, Path], kind: str) -> None:
    handler = load(decoder_models[kind], call_overhead_tokens=4.0, attention_knee_tokens=1000.0)
    texts = posts(12, seed=9)
    batched = run(handler, {"text": _bytes(*texts)})
    for name in ("log_likelihood", "mean_log_likelihood", "perplexity"):
        alone = np.concatenate([run(handler, {"text": _bytes(t)})[name] for t in texts])
        assert np.abs(batched[name] - alone).max() <= 1e-4 * max(1.0, float(np.abs(alone).max()))


def test_per_token_logprobs_and_alternatives(decoder_models: dict[str, Path], monkeypatch: Any) -> None:
    """OpenAI's legacy ``logprobs`` object per text; the head's chunks of one row each (a
    smaller chunk budget) give the same figures."""
    folder = decoder_models["gpt2-lm"]
    handler = load(folder)
    texts = posts(3, seed=10)
    asked = np.array([[1], [0], [1]], dtype=np.int64)
    inputs = {"text": _bytes(*texts), "return_token_logprobs": asked, "top_logprobs": np.full((3, 1), 3)}
    out = run(handler, inputs)
    assert out["token_logprobs"][1, 0] == b""
    prefix_id = int(handler.prefix[0])
    for i in (0, 2):
        body = json.loads(out["token_logprobs"][i, 0])
        _, _, log_softmax, ids = reference(folder, texts[i], prefix_id)
        own = ids[1:]
        assert body["tokens"] == handler.tokenizer.token_texts(own)
        assert "".join(body["tokens"]) == texts[i]
        want = [float(log_softmax[t, ids[t + 1]]) for t in range(len(own))]
        assert np.abs(np.array(body["token_logprobs"]) - want).max() <= 1e-4
        assert abs(sum(want) - float(out["log_likelihood"][i, 0])) <= 1e-3
        best = [float(log_softmax[t].max()) for t in range(len(own))]
        assert np.abs(np.array([max(d.values()) for d in body["top_logprobs"]]) - best).max() <= 1e-4
        # the 3 most likely and the token itself (OpenAI's and vLLM's rows: up to logprobs + 1)
        assert all(len(d) <= 4 and body["tokens"][t] in d for t, d in enumerate(body["top_logprobs"]))
        assert body["text_offset"][1] == len(body["tokens"][0])
    monkeypatch.setattr(causal_lm, "LOG_SOFTMAX_CHUNK_BYTES", 1)
    again = run(handler, inputs)
    assert np.abs(again["log_likelihood"] - out["log_likelihood"]).max() <= 1e-4
    assert (
        json.loads(again["token_logprobs"][0, 0])["tokens"]
        == json.loads(out["token_logprobs"][0, 0])["tokens"]
    )


def test_bad_options_and_modes_are_refused(decoder_models: dict[str, Path], tmp_path: Path) -> None:
    handler = load(decoder_models["gpt2-lm"])
    with pytest.raises(ValueError, match="top_logprobs"):
        handler.item_costs({"text": _bytes("hi"), "return_token_logprobs": np.ones((1, 1), np.int64),
                            "top_logprobs": np.full((1, 1), 21)})  # fmt: skip
    with pytest.raises(ValueError, match="truncation"):
        load(decoder_models["gpt2-lm"], truncation="window")
    with pytest.raises(ValueError, match="not a decoder"):
        from tests.support.text_models import write_classifier_folder

        folder = write_classifier_folder(tmp_path / "hf", ["a"])
        load(folder)


async def test_v2_and_the_openai_completions_route_agree(
    make_client: Any, decoder_models: dict[str, Path], tmp_path: Path
) -> None:
    """The stock ``openai`` client's ``completions.create(echo=True, max_tokens=0, logprobs=1)``
    (what lm-evaluation-harness sends) gets each prompt's token log-probs, summing to V2's
    log-likelihood; a request that would generate is a 400 in OpenAI's shape."""
    import openai

    write_causal_lm(tmp_path, "gpt2", decoder_models["gpt2-lm"])
    http = await make_client(tmp_path)
    texts = posts(3, seed=11)
    body = {"inputs": [{"name": "text", "shape": [3, 1], "datatype": "BYTES", "data": texts}],
            "outputs": [{"name": "log_likelihood"}, {"name": "perplexity"}]}  # fmt: skip
    resp = await http.post("/v2/models/gpt2/infer", json=body)
    assert resp.status == 200, await resp.text()
    v2 = {o["name"]: o["data"] for o in (await resp.json())["outputs"]}
    client = openai.AsyncOpenAI(api_key="unused", base_url=str(http.make_url("/v1")))
    got = await client.completions.create(model="gpt2", prompt=texts, echo=True, max_tokens=0, logprobs=1)
    assert [c.text for c in got.choices] == texts and [c.index for c in got.choices] == [0, 1, 2]
    for choice, total in zip(got.choices, v2["log_likelihood"], strict=True):
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        assert abs(sum(choice.logprobs.token_logprobs) - total) <= 1e-3
        assert "".join(choice.logprobs.tokens or []) == choice.text
        tokens, tops = choice.logprobs.tokens or [], choice.logprobs.top_logprobs or []
        assert all(1 <= len(top) <= 2 and token in top for token, top in zip(tokens, tops, strict=True))
    assert got.usage is not None and got.usage.completion_tokens == 0 and got.usage.prompt_tokens > 0
    bare = await client.completions.create(model="gpt2", prompt="Hello.", echo=True, max_tokens=0)
    assert bare.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="echo=true"):
        await client.completions.create(model="gpt2", prompt="Hello.", max_tokens=5)
    await client.close()
