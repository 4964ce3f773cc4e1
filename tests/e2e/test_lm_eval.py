"""lm-evaluation-harness as it calls an OpenAI-compatible server today: its ``local-completions``
model (``echo``, ``max_tokens = 1``, ``logprobs``; strings, ``tokenized_requests=False``) on a
real gunicorn server serving the small GPT-2 folder of ``tests/support/decoder_models.py``, over
a multiple-choice task of our own (a YAML task over a local JSON file), gives per request the
log-likelihood and is-greedy flag its ``hf`` model computes in process on the same folder: within
1e-4, and the same flags (one continuation is the model's greedy token, so both values occur).
The model entry is the one docs/text-models.md gives for lm-evaluation-harness."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.decoder_models import write_causal_lm
from tests.support.gunicorn import Gunicorn

lm_eval = pytest.importorskip("lm_eval")
pytestmark = pytest.mark.e2e

TASK = "scoring_tiny_mc"
QUESTIONS = [
    ("The capital of France is", ["Paris", "Beijing", "a train"]),
    ("Bake the bread for forty", ["minutes", "letters"]),
    ("Gravity is a force that", ["attracts two bodies", "leaves at seven"]),
    ("", ["Rivers carve valleys", "Moderators review reports"]),  # no context: the prefix token
]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, decoder_models: dict[str, Path]) -> Iterator[tuple[Gunicorn, Path]]:
    """A server of one model, "gpt2", as docs/text-models.md writes it for lm-evaluation-harness
    (the prompt scored as vLLM scores it: ``score_first_token = false``)."""
    tmp = tmp_path_factory.mktemp("lm-eval")
    repo = tmp / "repo"
    folder = decoder_models["gpt2-lm"]
    write_causal_lm(repo, "gpt2", folder, "score_first_token = false")
    with Gunicorn(tmp, {"SCORING_MODEL_REPOSITORY": str(repo), "SCORING_WORKERS": "1"}) as srv:
        srv.wait_ready(180)
        yield srv, folder


def greedy_word(folder: Path, context: str) -> str:
    """A continuation of ``context`` that is the model's greedy next token (a token that starts
    a word, so that lm_eval's context and continuation split on it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([tokenizer(context)["input_ids"]])).logits[0, -1]
    for token in logits.argsort(descending=True).tolist():
        text = str(tokenizer.decode([token]))
        if text.startswith(" ") and text[1:].isalpha():
            return text
    raise AssertionError("no word-starting token")


def write_task(tmp: Path, folder: Path) -> Path:
    """The task's folder: a YAML task (multiple choice, ``acc``) over a JSON-lines file."""
    docs: list[dict[str, Any]] = [
        {"question": q, "choices": [f" {c}" for c in choices], "answer": 0} for q, choices in QUESTIONS
    ]
    docs[1]["choices"].append(greedy_word(folder, QUESTIONS[1][0]))
    (tmp / "docs.jsonl").write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    (tmp / "task.yaml").write_text(
        "\n".join(
            [
                f"task: {TASK}",
                "dataset_path: json",
                "dataset_kwargs:",
                "  data_files:",
                f"    test: {tmp / 'docs.jsonl'}",
                f"  cache_dir: {tmp / 'datasets'}",  # whenever datasets read its environment
                "test_split: test",
                "output_type: multiple_choice",
                'doc_to_text: "{{question}}"',
                'doc_to_choice: "{{choices}}"',
                'doc_to_target: "{{answer}}"',
                'target_delimiter: ""',
                "metric_list:",
                "  - metric: acc",
                "    aggregation: mean",
                "    higher_is_better: true",
            ]
        )
        + "\n"
    )
    return tmp


def per_request(model: str, model_args: dict[str, Any], tasks: Path) -> list[tuple[float, bool]]:
    """``simple_evaluate`` with ``log_samples``: each request's (log-likelihood, is greedy), in
    document and choice order."""
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        log_samples=True,
        batch_size=4,
        device="cpu",
    )
    assert results is not None
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    return [(float(r[0][0]), bool(r[0][1])) for sample in samples for r in sample["resps"]]


def test_local_completions_equals_the_hf_model(
    served: tuple[Gunicorn, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    srv, folder = served
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks = write_task(tmp_path, folder)
    # the command docs/text-models.md gives, as model_args
    remote = per_request(
        "local-completions",
        {
            "model": "gpt2",
            "base_url": f"{srv.url}/v1/completions",
            "tokenizer_backend": "huggingface",
            "tokenizer": str(folder),
            "tokenized_requests": False,
            "max_length": 256,
        },
        tasks,
    )
    local = per_request("hf", {"pretrained": str(folder), "dtype": "float32"}, tasks)
    assert len(remote) == len(local) == sum(len(c) for _, c in QUESTIONS) + 1
    assert max(abs(a[0] - b[0]) for a, b in zip(remote, local, strict=True)) <= 1e-4, (remote, local)
    assert [r[1] for r in remote] == [r[1] for r in local]
    assert any(r[1] for r in local) and not all(r[1] for r in local)
