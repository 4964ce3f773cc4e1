"""The model repository a stress run, the memory-growth benchmark and the route fuzzer serve:
the demo models, two small BERT text models and three small decoder models of real architecture
classes, each API's model.

=================  ============================================  ===============================
model              what                                          APIs
=================  ============================================  ===============================
feed-ranker        the demo MLP (``scripts/export_ranking_model.py``, seed 0)  V2 JSON, V1, gRPC
all-MiniLM-L6-v2   the demo sentence embedder, response cache on   V2 binary, ``/v1/embeddings``
clf                a 3-label BERT classifier, windows, response cache on  ``/v1/classify``, gRPC
ce                 a BERT cross-encoder, windows                  ``/v1/rerank``
radar              a Llama classifier in pieces of 300 characters  V2 JSON with each piece's
                   and 128 tokens (docs/text-models.md's RADAR    result (``pieces``)
                   model.toml)
lm                 a GPT-2 causal LM scorer                       ``/v1/completions`` (echo,
                                                                  ``max_tokens`` 0 or 1,
                                                                  ``logprobs``)
causal-rr          a Qwen3-Reranker-style causal reranker         ``/v1/rerank``, ``/score``
=================  ============================================  ===============================

The decoder folders are :mod:`benchmarks.decoder_folders`' (random weights from a fixed seed,
tokenizers trained here: under a second each); their ``model.toml`` files are
docs/text-models.md's, with batches of 8.

Beside the repository, ``spares/`` holds the folders the schedule's actions copy in: the
feed-ranker as version 2 (the same weights: its answers equal version 1's) and a broken
version 2 of ``clf`` (labels that do not match its weights: a load that fails the same way
every time).

Building imports torch and transformers; the stress run calls it in a child process
(``python -m benchmarks.stress.repository <folder>``) so that its own process stays light.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from tests.support.gunicorn import ROOT

RANKER, MINILM, CLF, CE = "feed-ranker", "all-MiniLM-L6-v2", "clf", "ce"
RADAR, LM, CAUSAL_RR = "radar", "lm", "causal-rr"
MODELS = (RANKER, MINILM, CLF, CE, RADAR, LM, CAUSAL_RR)
LABELS = ["ok", "insult", "threat"]
#: Short windows, so that a post of a few hundred words takes several (the window stage).
TEXT_PARAMETERS = "max_seq_length = 64\nstride = 8\nmax_windows = 32"
CACHE = "\n[response_cache]\nenable = true\n"
#: The pieces of ``radar``: at most this many characters (and 128 tokens) each.
PIECE_CHARS = 300
#: Tokens a text of ``lm`` may take (prefix included): the stress run's prompts stay under it.
LM_MAX_TOKENS = 1024

#: Each decoder model: its folder's kind, handler, inputs, outputs and ``[parameters]``, as
#: :func:`benchmarks.decoder_folders.write_handler_model` takes them.
DECODERS = {
    RADAR: (
        "llama-classifier",
        "app.handlers.sequence_classification:SequenceClassificationHandler",
        ["text BYTES"],
        ["probabilities FP32 2", "score FP32", "windows INT64", "tokens INT64", "pieces BYTES"],
        f'max_seq_length = 128\ntruncation = "pieces"\npiece_chars = {PIECE_CHARS}\nmax_windows = 64\n'
        'aggregate = "max"',
    ),
    LM: (
        "gpt2-lm",
        "app.handlers.causal_lm:CausalLMHandler",
        [
            "text BYTES",
            "return_token_logprobs INT64 optional",
            "top_logprobs INT64 optional",
            "next_token INT64 optional",
        ],
        ["log_likelihood FP32", "perplexity FP32", "tokens INT64", "token_logprobs BYTES"],
        f"max_seq_length = {LM_MAX_TOKENS}",
    ),
    CAUSAL_RR: (
        "qwen3-reranker",
        "app.handlers.causal_rerank:CausalRerankHandler",
        ["text BYTES", "query BYTES"],
        ["score FP32", "tokens INT64"],
        "max_seq_length = 512",
    ),
}


def repository_of(folder: Path) -> Path:
    """The repository folder inside a built ``folder``."""
    return folder / "repo"


def spares_of(folder: Path) -> Path:
    """The spare model folders inside a built ``folder``."""
    return folder / "spares"


def tokenizer_file(folder: Path) -> Path:
    """The MiniLM tokenizer (``tokenizer.json``) whose vocabulary the text pools draw words from."""
    return repository_of(folder) / CLF / "hf" / "tokenizer.json"


def write_decoder_model(repo: Path, name: str, seed: int) -> Path:
    """The folder ``repo/name`` of one of :data:`DECODERS`: its Hugging Face folder in ``hf/``
    (weights from ``seed``) and its ``model.toml`` (a classifier's ``probabilities`` named by
    the folder's labels)."""
    from benchmarks.decoder_folders import LABELS as FOLDER_LABELS
    from benchmarks.decoder_folders import build_decoder_folder, write_handler_model

    kind, handler, inputs, outputs, parameters = DECODERS[name]
    folder = build_decoder_folder(repo / name / "hf", kind, seed=seed)
    labels = {"probabilities": FOLDER_LABELS}
    return write_handler_model(repo, name, handler, folder, inputs, outputs, parameters, labels)


def build(folder: Path) -> Path:
    """Write the repository (``folder/repo``) and the spares (``folder/spares``); return
    ``folder``. Deterministic: the same seeds give the same weights."""
    from tests.support.demo_repo import demo_repository
    from tests.support.text_models import write_classifier_model

    folder.mkdir(parents=True, exist_ok=True)
    repo = demo_repository(folder)  # feed-ranker exported, MiniLM linked
    (repo / MINILM).unlink()
    (repo / MINILM).mkdir()
    toml = (ROOT / "model_repository" / MINILM / "model.toml").read_text()
    (repo / MINILM / "model.toml").write_text(toml + CACHE)
    write_classifier_model(repo, CLF, LABELS, parameters=TEXT_PARAMETERS + "\n" + CACHE, seed=1)
    write_classifier_model(repo, CE, ["relevance"], parameters=TEXT_PARAMETERS, seed=2)
    for seed, name in enumerate(DECODERS, start=3):
        write_decoder_model(repo, name, seed)

    spares = spares_of(folder)
    spares.mkdir()
    ranker2 = spares / f"{RANKER}-2"
    shutil.copytree(repo / RANKER, ranker2)
    toml_path = ranker2 / "model.toml"
    toml_path.write_text(toml_path.read_text().replace('version = "1"', 'version = "2"'))
    broken = spares / f"{CLF}-broken"
    shutil.copytree(repo / CLF, broken, ignore=shutil.ignore_patterns("hf"))
    (broken / "hf").symlink_to(repo / CLF / "hf")
    toml_path = broken / "model.toml"
    wrong = toml_path.read_text().replace('version = "1"', 'version = "2"')
    toml_path.write_text(wrong.replace('"threat"]', '"spam"]'))
    return folder


if __name__ == "__main__":
    build(Path(sys.argv[1]))
