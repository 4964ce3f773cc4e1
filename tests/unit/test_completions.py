"""``POST /v1/completions`` as lm-evaluation-harness calls it (``app.protocols.completions`` and
``app.handlers.causal_lm``), on the small GPT-2 folder of ``tests/support/decoder_models.py``,
in process: today's ``local-completions`` payload (``echo``, ``max_tokens = 1``, ``logprobs``)
gets the prompt's token log-probs and the greedy next token, as vLLM answers it, and lm_eval's
own parser reads from it what transformers computes; every cut is refused or asked for (a prompt
over the context, an empty prompt, a flag that is not one); lm_eval 0.4.2-0.4.3's payload is
refused with a message that says what to send."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.handlers.causal_lm import CausalLMHandler
from tests.support.decoder_models import CORPUS, write_causal_lm
from tests.unit.test_causal_lm import INPUTS, OUTPUTS, load
from tests.unit.test_decoder_classification import posts
from tests.unit.test_sequence_classification import Config, Spec, _bytes


def reference(folder: Path, text: str, prefix: int) -> tuple[list[int], torch.Tensor]:
    """transformers' own: the ids the model runs (``prefix`` first) and the log-softmax of the
    logits at every position, ``[T, V]``."""
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    ids = [prefix, *tokenizer(text)["input_ids"]]
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    return ids, torch.log_softmax(logits, -1)


async def completions(http: Any, **body: Any) -> tuple[int, dict[str, Any]]:
    resp = await http.post("/v1/completions", json={"model": "gpt2", **body})
    return resp.status, await resp.json()


async def test_lm_eval_payload_gets_the_prompt_and_the_greedy_next_token(
    make_client: Any, decoder_models: dict[str, Path], tmp_path: Path
) -> None:
    """lm_eval 0.4.13's ``LocalCompletionsAPI._create_payload`` for a loglikelihood request
    (``echo``, ``max_tokens = 1``, ``logprobs``, ``temperature = 0``): each choice is the
    prompt's tokens plus the greedy next one, with its log-prob, alternatives and offset (as
    vLLM answers it); each position's ``top_logprobs`` holds the N most likely tokens and the
    token itself, so that ``token_logprob == max(top)`` says exactly whether it was the greedy
    one; ``parse_logprobs`` of lm_eval reads transformers' figures from it."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    folder = decoder_models["gpt2-lm"]
    write_causal_lm(tmp_path, "gpt2", folder)
    http = await make_client(tmp_path)
    texts = posts(3, seed=21)
    payload = {"prompt": texts, "temperature": 0, "max_tokens": 1, "logprobs": 10, "seed": 1234, "echo": True}
    status, body = await completions(http, **payload)
    assert status == 200, body
    prefix = AutoTokenizer.from_pretrained(folder).eos_token_id
    choices = sorted(body["choices"], key=lambda c: c["index"])
    names = AutoTokenizer.from_pretrained(folder)
    for choice, text in zip(choices, texts, strict=True):
        ids, log_softmax = reference(folder, text, prefix)
        lp, own = choice["logprobs"], len(ids) - 1
        assert [len(lp[k]) for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")] == [own + 1] * 4
        greedy = int(log_softmax[-1].argmax())
        assert lp["tokens"][-1] == names.decode([greedy])
        assert choice["text"] == text + lp["tokens"][-1] and choice["finish_reason"] == "length"
        want = [float(log_softmax[t, ids[t + 1]]) for t in range(own)] + [float(log_softmax[-1].max())]
        assert np.abs(np.array(lp["token_logprobs"]) - want).max() <= 1e-4
        assert lp["text_offset"] == np.concatenate(([0], np.cumsum([len(t) for t in lp["tokens"]])[:-1])).tolist()
        for t, top in enumerate(lp["top_logprobs"]):
            # tokens that decode to the same text (byte pieces) share a key: fewer than 11
            assert len(top) <= 11 and lp["tokens"][t] in top
            assert abs(max(top.values()) - float(log_softmax[t].max())) <= 1e-4
            is_greedy = t == own or ids[t + 1] == int(log_softmax[t].argmax())
            assert (lp["token_logprobs"][t] == max(top.values())) == is_greedy
        results = LocalCompletionsAPI.parse_logprobs(outputs={"choices": [choice | {"index": 0}]}, ctxlens=[3])
        assert abs(results[0][0] - sum(want[3:own])) <= 1e-4
    assert body["usage"]["completion_tokens"] == 3
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 3
    status, bare = await completions(http, prompt=texts[0], echo=True, max_tokens=1)
    assert status == 200 and bare["choices"][0]["logprobs"] is None
    assert bare["choices"][0]["text"] == choices[0]["text"]
    status, zero = await completions(http, prompt=texts[0], echo=True, max_tokens=0, logprobs=1)
    assert status == 200 and zero["choices"][0]["text"] == texts[0]
    assert zero["choices"][0]["logprobs"]["token_logprobs"] == choices[0]["logprobs"]["token_logprobs"][:-1]


async def test_cuts_and_generation_are_refused_with_what_to_send(
    make_client: Any, decoder_models: dict[str, Path], tmp_path: Path
) -> None:
    """A prompt over the model's context is a 400 naming the limit and its tokens (as vLLM
    answers), unless ``truncate_prompt_tokens`` cuts it (its last tokens, listed); an empty
    prompt is a 400 (vLLM: "The decoder prompt cannot be empty"); lm_eval 0.4.2-0.4.3's payload
    (no echo, ``logprobs = 10``, token arrays), more than one token, sampling and streaming are
    refused, each saying what to send."""
    write_causal_lm(tmp_path, "gpt2", decoder_models["gpt2-lm"])
    write_causal_lm(tmp_path, "gpt2-error", decoder_models["gpt2-lm"], 'truncation = "error"')
    http = await make_client(tmp_path)
    long = " ".join(CORPUS * 4)
    status, body = await completions(http, prompt=["short", long], echo=True, max_tokens=0, logprobs=1)
    message = body["error"]["message"]
    assert status == 400 and "256" in message and "tokens" in message and "truncate_prompt_tokens" in message
    count = int(message.split(" has ")[1].split()[0])
    assert count > 256
    # a model that refuses long texts itself says the same: the text's tokens and the limit
    status, body = await completions(http, model="gpt2-error", prompt=long, echo=True, max_tokens=0)
    assert status == 400 and f"has {count - 1} tokens, over the model's 255" in body["error"]["message"], body
    status, body = await completions(
        http, prompt=long, echo=True, max_tokens=0, logprobs=1, truncate_prompt_tokens=100
    )
    assert status == 200, body
    assert len(body["choices"][0]["logprobs"]["tokens"]) == 100
    assert long.endswith("".join(body["choices"][0]["logprobs"]["tokens"]))
    for prompt in ("", ["a post", ""]):
        status, body = await completions(http, prompt=prompt, echo=True, max_tokens=0)
        assert status == 400 and "empty" in body["error"]["message"], body
    refused = [
        ({"prompt": [[1, 2, 3]], "max_tokens": 0, "temperature": 0.0, "logprobs": 10, "seed": 1234}, "echo"),
        ({"prompt": "a post", "max_tokens": 0, "logprobs": 10}, "echo"),
        ({"prompt": "a post", "echo": True, "max_tokens": 2}, "max_tokens"),
        ({"prompt": "a post", "echo": True, "max_tokens": 1, "temperature": 0.8}, "temperature"),
        ({"prompt": "a post", "echo": True, "max_tokens": 0, "stream": True}, "stream"),
        ({"prompt": "a post", "echo": True, "max_tokens": 0, "n": 2}, "n"),
        ({"prompt": "a post", "echo": True, "max_tokens": 0, "logprobs": 21}, "logprobs"),
    ]
    for body, word in refused:
        status, answer = await completions(http, **body)
        assert status == 400 and word in answer["error"]["message"], (body, answer)


def test_token_lists_are_whole_or_refused_and_flags_are_zero_or_one(decoder_models: dict[str, Path]) -> None:
    """Over V2: a text whose token log-probs are asked is scored whole or refused (400 naming
    its tokens and the limit); without the list it is cut and says so in ``scored_tokens``;
    ``return_token_logprobs`` and ``next_token`` are 0 or 1, nothing else; an empty text's list
    is empty in every field."""
    outputs = [*OUTPUTS, Spec("scored_tokens", [1], datatype="INT64")]
    folder = decoder_models["gpt2-lm"]
    handler = CausalLMHandler()
    inputs = [*INPUTS, Spec("next_token", [1], datatype="INT64")]
    handler.load(
        torch.device("cpu"),
        Config(folder.parent, {"model_dir": folder.name, "max_seq_length": 64}, outputs, "lm", inputs),
    )
    long = " ".join(CORPUS)
    one, zero = np.ones((1, 1), np.int64), np.zeros((1, 1), np.int64)
    with pytest.raises(ValueError, match=r"has \d+ tokens.*64"):
        handler.item_costs({"text": _bytes(long), "return_token_logprobs": one})
    priced = handler.item_costs({"text": _bytes(long), "return_token_logprobs": zero})
    assert int(priced.costs[0]) == 64
    for name in ("return_token_logprobs", "next_token"):
        with pytest.raises(ValueError, match=f"{name} must be 0 or 1, got 7"):
            handler.item_costs({"text": _bytes("hi"), "return_token_logprobs": one, name: np.full((1, 1), 7)})
    with pytest.raises(ValueError, match="next_token"):
        handler.item_costs({"text": _bytes("hi"), "return_token_logprobs": zero, "next_token": one})
    plain = load(folder)
    with torch.inference_mode():
        out = plain.postprocess(plain.predict(plain.preprocess({"text": _bytes(""), "return_token_logprobs": one})))
    assert json.loads(out["token_logprobs"][0, 0]) == {"tokens": [], "token_logprobs": [], "text_offset": []}
