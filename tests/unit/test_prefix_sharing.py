"""Shared-prefix scoring wired through the decoder handlers (app.handlers.prefix_sharing) on the
small folders of tests/support/decoder_models.py: the causal reranker (one query x N documents),
the causal-LM scorer (one context x N continuations, found from the token ids) and a decoder
classifier given a ``prefix`` input answer each item as the same model does with sharing off
(each item run whole) within 1e-5 in float32; the next request with the same prefix does not run
it again (the tokens the model runs are counted) and is priced without it; requests without a
shared part take the path they always took. Served: ``/v1/completions`` and V2 with the prefix
sent once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification

from app.handlers.causal_lm import CausalLMHandler
from app.handlers.prefix_sharing import MIN_FOUND_TOKENS
from app.handlers.sequence_classification import SequenceClassificationHandler
from app.models.base import PREPARED, distinct_rows, shared_rows
from tests.support.decoder_models import LABELS, write_causal_lm, write_handler_model
from tests.unit.test_causal_lm import load as causal_lm
from tests.unit.test_decoder_classification import posts, run
from tests.unit.test_decoder_embed_rerank import QUERIES, reranker
from tests.unit.test_sequence_classification import Config, Spec, _bytes

TOLERANCE = 1e-5
#: The cost model fixed: no timing at load.
FIXED: dict[str, Any] = {"call_overhead_tokens": 16.0, "attention_knee_tokens": 1000.0}


def forwards(handler: Any) -> list[tuple[int, ...]]:
    """The shape of the token ids of every forward the handler's model runs from now on."""
    shapes: list[tuple[int, ...]] = []
    embeddings = handler.model.base_model.get_input_embeddings()
    embeddings.register_forward_pre_hook(lambda _, args: shapes.append(tuple(args[0].shape)))
    return shapes


def priced(handler: Any, *requests: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    """Requests priced one by one (``item_costs``, as the server does before they queue), then
    one batch of them all, their preparations with them; and each request's costs."""
    costs, prepared = [], []
    for inputs in requests:
        made = handler.item_costs(inputs)
        costs.append(made.costs)
        prepared.append(made.prepared)
    batch = {name: np.concatenate([r[name] for r in requests]) for name in requests[0]}
    return {**batch, PREPARED: np.concatenate(prepared)}, costs


def test_the_reranker_runs_a_query_once_and_scores_each_document_as_alone(
    decoder_models: dict[str, Path],
) -> None:
    folder = decoder_models["qwen3-reranker"]
    shared, whole = reranker(folder, **FIXED), reranker(folder, shared_prefix=False, **FIXED)
    assert shared.sharing is not None and whole.sharing is None
    documents = posts(14, seed=21)
    pages = [
        {"text": _bytes(*documents[:8]), "query": _bytes(*[QUERIES[0]] * 8)},
        {"text": _bytes(*documents[8:]), "query": _bytes(*[QUERIES[1]] * 6)},
    ]
    ran = forwards(shared)
    batch, costs = priced(shared, *pages)
    got = run(shared, batch)
    want = run(whole, {name: batch[name] for name in ("text", "query")})
    assert np.abs(got["score"] - want["score"]).max() <= TOLERANCE
    assert (got["tokens"] == want["tokens"]).all()  # each pair's prompt, the query counted
    splits = [int(p[1][0]) for p in batch[PREPARED]]
    # each request is priced at the tokens it makes the model run: its query once, each document
    assert [int(c.sum()) for c in costs] == [
        splits[0] + int(want["tokens"][:8].sum()) - 8 * splits[0],
        splits[8] + int(want["tokens"][8:].sum()) - 6 * splits[8],
    ]
    # the two queries in one forward of their own, then the documents (each with the suffix)
    own = (want["tokens"][:, 0] - np.array(splits)).tolist()
    assert ran[0] == (2, max(splits[0], splits[8]))
    assert sum(rows for rows, _ in ran[1:]) <= 14 and all(width <= max(own) for _, width in ran[1:])
    # the next page of the first query: its prefix is not run again, nor priced
    ran.clear()
    page = {"text": _bytes(*documents[8:]), "query": _bytes(*[QUERIES[0]] * 6)}
    batch, (cost,) = priced(shared, page)
    again = run(shared, batch)
    assert ran and all(width <= max(own[8:]) for _, width in ran)
    assert int(cost.sum()) == int(again["tokens"].sum()) - 6 * splits[0]
    assert np.abs(again["score"] - run(whole, page)["score"]).max() <= TOLERANCE
    assert shared.prefix_cache is not None and shared.prefix_cache.stats().hit_tokens == splits[0]


def lists(out: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    return [json.loads(row) for row in out["token_logprobs"][:, 0]]


def greedy(listed: dict[str, Any]) -> list[bool]:
    """Whether each token (the first aside) is the most likely one: lm-evaluation-harness's test."""
    pairs = zip(listed["token_logprobs"][1:], listed["top_logprobs"][1:], strict=True)
    return [value == max(row.values()) for value, row in pairs]


@pytest.mark.parametrize("kind", ["gpt2-lm", "llama-lm"])
def test_one_context_and_n_continuations_score_as_each_text_alone(
    decoder_models: dict[str, Path], kind: str
) -> None:
    """Every figure of each text (its token log-probs, the alternatives after each token, the
    greedy next token, its log-likelihood) as the model gives it with sharing off; the context
    is found from the token ids of one request (not of a batch: the second request shares
    none, and runs whole)."""
    shared = causal_lm(decoder_models[kind], **FIXED)
    whole = causal_lm(decoder_models[kind], shared_prefix=False, **FIXED)
    context = posts(1, seed=22)[0]
    texts = [context + " " + ending for ending in posts(5, seed=23)]
    others = posts(3, seed=24)

    def request(items: list[str]) -> dict[str, np.ndarray]:
        n = len(items)
        ones = np.ones((n, 1), dtype=np.int64)
        return {"text": _bytes(*items), "return_token_logprobs": ones, "top_logprobs": 3 * ones}

    ran = forwards(shared)
    batch, _ = priced(shared, request(texts), request(others))
    splits = [int(p[1][0]) for p in batch[PREPARED]]
    assert splits[0] >= MIN_FOUND_TOKENS and len(set(splits[:5])) == 1 and splits[5:] == [0, 0, 0]
    got, want = run(shared, batch), run(whole, {"text": batch["text"], **{k: batch[k] for k in request([])}})
    assert (1, splits[0]) in ran  # the context alone, once
    assert (got["tokens"] == want["tokens"]).all() and (got["scored_tokens"] == want["scored_tokens"]).all()
    scale = max(1.0, float(np.abs(want["log_likelihood"]).max()))
    assert np.abs(got["log_likelihood"] - want["log_likelihood"]).max() <= TOLERANCE * scale
    for mine, theirs in zip(lists(got), lists(want), strict=True):
        assert mine["tokens"] == theirs["tokens"] and mine["text_offset"] == theirs["text_offset"]
        assert (mine["token_logprobs"][0] is None) == (theirs["token_logprobs"][0] is None)
        a, b = (np.array([v or 0.0 for v in row["token_logprobs"]]) for row in (mine, theirs))
        assert np.abs(a - b).max() <= TOLERANCE
        for x, y in zip(mine["top_logprobs"], theirs["top_logprobs"], strict=True):
            assert (x is None) == (y is None)
            if x is not None:
                assert x.keys() == y.keys() and max(abs(x[k] - y[k]) for k in x) <= TOLERANCE


def test_the_greedy_next_token_and_a_request_without_a_context_are_unchanged(
    decoder_models: dict[str, Path],
) -> None:
    """lm-evaluation-harness's request: each prompt's log-probs and the greedy next token after
    it; a continuation's sum and is-greedy flag (its log-prob the largest of its row) as each
    prompt scored alone."""
    folder = decoder_models["gpt2-lm"]
    outputs = [Spec("log_likelihood", [1]), Spec("tokens", [1], datatype="INT64"),
               Spec("token_logprobs", [1], datatype="BYTES")]  # fmt: skip
    inputs = [Spec(n, [1], datatype="INT64") for n in ("return_token_logprobs", "top_logprobs", "next_token")]

    def load(**parameters: Any) -> CausalLMHandler:
        handler = CausalLMHandler()
        config = Config(folder.parent, {"model_dir": folder.name, **FIXED, **parameters}, outputs, "lm",
                        [Spec("text", [1], datatype="BYTES"), *inputs])  # fmt: skip
        handler.load(torch.device("cpu"), config)
        return handler

    shared, whole = load(), load(shared_prefix=False)
    context = " ".join(posts(2, seed=25))
    texts = [f"{context} {word}" for word in ("Paris", "the bread", "a train to the coast")]
    ones = np.ones((3, 1), dtype=np.int64)
    request = {"text": _bytes(*texts), "return_token_logprobs": ones, "top_logprobs": ones, "next_token": ones}
    made = shared.item_costs(request)
    assert int(made.prepared[0][1][0]) >= MIN_FOUND_TOKENS
    got, want = lists(run(shared, {**request, PREPARED: made.prepared})), lists(run(whole, request))
    for mine, theirs in zip(got, want, strict=True):
        assert mine["tokens"] == theirs["tokens"]  # the greedy next token last
        assert abs(mine["token_logprobs"][-1] - theirs["token_logprobs"][-1]) <= TOLERANCE
        assert greedy(mine) == greedy(theirs)
    alone = {"text": _bytes("A text of its own."), "return_token_logprobs": ones[:1], "top_logprobs": ones[:1],
             "next_token": ones[:1]}  # fmt: skip
    made = shared.item_costs(alone)
    assert int(made.prepared[0][1][0]) == 0 and made.costs.tolist() == whole.item_costs(alone).costs.tolist()
    assert lists(run(shared, {**alone, PREPARED: made.prepared})) == lists(run(whole, alone))


def classifier(folder: Path, **parameters: Any) -> SequenceClassificationHandler:
    handler = SequenceClassificationHandler()
    outputs = [Spec("probabilities", [len(LABELS)], list(LABELS)), Spec("score", [1])]
    inputs = [Spec("text", [1], datatype="BYTES"), Spec("prefix", [1], datatype="BYTES")]
    config = Config(folder.parent, {"model_dir": folder.name, **FIXED, **parameters}, outputs, "clf", inputs)
    handler.load(torch.device("cpu"), config)
    return handler


PREFIXES = ["User follows astronomy and baking; posts in English.\nPost:", "Instruct: is this spam?\nPost:"]


@pytest.mark.parametrize("kind", ["llama-classifier", "qwen2-classifier"])
def test_a_classifier_prefix_runs_once_and_each_item_is_the_whole_sequence(
    decoder_models: dict[str, Path], kind: str
) -> None:
    """The item is the BOS (where the tokenizer puts one), the prefix, then the text: equal to
    transformers on those ids whole; the prefix sent once per request (``shared = "once"``: its
    distinct rows and each item's) or repeated, the same; each window of a long text is an item
    after the same prefix."""
    folder = decoder_models[kind]
    shared, whole = classifier(folder, max_seq_length=48, stride=8), classifier(folder, max_seq_length=48,
                                                                             stride=8, shared_prefix=False)  # fmt: skip
    texts = posts(6, seed=26)
    prefixes = [PREFIXES[0]] * 4 + [PREFIXES[1]] * 2
    inputs = {"text": _bytes(*texts), "prefix": _bytes(*prefixes)}
    windows = shared.split_windows(texts, None)
    assert max(len(w) for w in windows) > 1  # long texts in windows
    owner = np.repeat(np.arange(6), [len(w) for w in windows])
    spans = np.empty(len(owner), dtype=object)
    spans[:] = [s.prepared for w in windows for s in w]
    items = {"text": inputs["text"][owner], "prefix": inputs["prefix"][owner], PREPARED: spans}
    ran = forwards(shared)
    batch, _ = priced(shared, items)
    rows, index = distinct_rows(batch["prefix"])
    got = run(shared, {**batch, "prefix": rows, shared_rows("prefix"): index})
    want = run(whole, items)
    assert np.abs(got["probabilities"] - want["probabilities"]).max() <= TOLERANCE
    assert (got["tokens"] == want["tokens"]).all()
    assert ran[0][0] == 2  # the two prefixes, in one forward
    ids, splits = shared._prefixed(list(spans), items)
    model = AutoModelForSequenceClassification.from_pretrained(folder, local_files_only=True).eval()
    with torch.inference_mode():
        for b in (0, len(ids) - 1):
            logits = model(torch.from_numpy(ids[b].astype(np.int64))[None]).logits[0]
            assert np.abs(torch.softmax(logits, -1).numpy() - got["probabilities"][b]).max() <= TOLERANCE
    assert int(splits[0]) == shared.lead + len(shared.tokenizer.encode([PREFIXES[0]], special=False)[0])
    with pytest.raises(ValueError, match="over the model's max_prefix_tokens of 5"):
        classifier(folder, max_seq_length=48, max_prefix_tokens=5).item_costs(inputs)
    with pytest.raises(ValueError, match="max_seq_length 1024 leaves no room for a 'prefix'"):
        classifier(folder, max_seq_length=1024)


def test_a_prefix_is_a_decoders(tmp_path: Path) -> None:
    from tests.support.text_models import write_classifier_folder

    folder = write_classifier_folder(tmp_path / "hf", ["a", "b"])
    with pytest.raises(ValueError, match="input 'prefix' is a decoder's"):
        SequenceClassificationHandler().load(
            torch.device("cpu"),
            Config(folder.parent, {"model_dir": folder.name}, [Spec("score", [1])], "clf",
                   [Spec("text", [1], datatype="BYTES"), Spec("prefix", [1], datatype="BYTES")]),
        )  # fmt: skip


async def test_served_over_completions_and_v2_with_the_prefix_sent_once(
    make_client: Any, decoder_models: dict[str, Path], tmp_path: Path
) -> None:
    """``/v1/completions`` with a list of prompts that share a context, and a classifier's
    prefix sent once with V2 (batch dimension 1), each as the same model with sharing off."""
    write_causal_lm(tmp_path, "lm", decoder_models["gpt2-lm"])
    write_causal_lm(tmp_path, "lm-whole", decoder_models["gpt2-lm"], "shared_prefix = false")
    handler = "app.handlers.sequence_classification:SequenceClassificationHandler"
    outputs = [f"probabilities FP32 {len(LABELS)}"]
    for name, parameters in (("clf", ""), ("clf-whole", "shared_prefix = false")):
        path = write_handler_model(tmp_path, name, handler, decoder_models["qwen2-classifier"],
                                   ["text BYTES", "prefix BYTES optional once"], outputs, parameters)  # fmt: skip
        toml = path / "model.toml"
        toml.write_text(toml.read_text().replace('shape = [2]', f"shape = [2]\nlabels = {list(LABELS)!r}"))
    http = await make_client(tmp_path)
    context = " ".join(posts(2, seed=27))
    prompts = [f"{context} {word}" for word in ("Paris", "Beijing", "a train")]
    answers = []
    for model in ("lm", "lm-whole"):
        body = {"model": model, "prompt": prompts, "echo": True, "max_tokens": 1, "logprobs": 1, "temperature": 0}
        resp = await http.post("/v1/completions", json=body)
        assert resp.status == 200, await resp.text()
        answers.append((await resp.json())["choices"])
    for mine, theirs in zip(*answers, strict=True):
        assert mine["text"] == theirs["text"] and mine["logprobs"]["tokens"] == theirs["logprobs"]["tokens"]
        a, b = (np.array(c["logprobs"]["token_logprobs"][1:]) for c in (mine, theirs))
        assert np.abs(a - b).max() <= TOLERANCE
    texts = posts(3, seed=28)
    results = []
    for model in ("clf", "clf-whole"):
        infer = {"inputs": [{"name": "text", "shape": [3, 1], "datatype": "BYTES", "data": texts},
                            {"name": "prefix", "shape": [1, 1], "datatype": "BYTES", "data": [PREFIXES[0]]}]}  # fmt: skip
        resp = await http.post(f"/v2/models/{model}/infer", json=infer)
        assert resp.status == 200, await resp.text()
        results.append(np.array((await resp.json())["outputs"][0]["data"]))
    assert np.abs(results[0] - results[1]).max() <= TOLERANCE
    metrics = await (await http.get("/metrics")).text()
    assert 'scoring_prefix_cache_lookups_total{model="clf",result="miss",version="1"} 1.0' in metrics
