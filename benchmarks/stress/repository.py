"""The model repository a stress run, the memory-growth benchmark and the route fuzzer serve:
the demo models and two small BERT text models of a real architecture class, each API's model.

=================  ============================================  ===============================
model              what                                          APIs
=================  ============================================  ===============================
feed-ranker        the demo MLP (``scripts/export_ranking_model.py``, seed 0)  V2 JSON, V1, gRPC
all-MiniLM-L6-v2   the demo sentence embedder, response cache on   V2 binary, ``/v1/embeddings``
clf                a 3-label BERT classifier, windows, response cache on  ``/v1/classify``, gRPC
ce                 a BERT cross-encoder, windows                  ``/v1/rerank``
=================  ============================================  ===============================

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
MODELS = (RANKER, MINILM, CLF, CE)
LABELS = ["ok", "insult", "threat"]
#: Short windows, so that a post of a few hundred words takes several (the window stage).
TEXT_PARAMETERS = "max_seq_length = 64\nstride = 8\nmax_windows = 32"
CACHE = "\n[response_cache]\nenable = true\n"


def repository_of(folder: Path) -> Path:
    """The repository folder inside a built ``folder``."""
    return folder / "repo"


def spares_of(folder: Path) -> Path:
    """The spare model folders inside a built ``folder``."""
    return folder / "spares"


def tokenizer_file(folder: Path) -> Path:
    """The MiniLM tokenizer (``tokenizer.json``) whose vocabulary the text pools draw words from."""
    return repository_of(folder) / CLF / "hf" / "tokenizer.json"


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
