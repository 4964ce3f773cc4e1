"""PyLate's own ColBERT, the reference of the multi-vector tests: builds a ``pylate.models.ColBERT``
from a local BERT folder, saves it, loads the saved folder again and writes what PyLate's
``encode`` and ``colbert_scores`` give on it.

PyLate 1.6 pins sentence-transformers 5.3, which the server's 6.x replaces (its loader hooks were
renamed), so this runs as a script in a process of its own with ``PYTHONPATH`` naming the folder
scripts/install fills with those two releases (:func:`tests.support.retrieval_models.pylate`);
everything else (torch, transformers, tokenizers) is the environment's. PyLate's ``utils``
package imports ``datasets`` for its knowledge-distillation training data alone: where that
library is not installed an empty module stands in for it (nothing here trains).

Usage: ``python pylate_reference.py SPEC.json OUT.npz`` (the spec's fields:
:func:`tests.support.retrieval_models.write_colbert_folder`).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import sys
import types
import warnings
from pathlib import Path
from typing import Any


def main(spec_file: str, out_file: str) -> None:
    """Build, save, reload, encode and score as the spec says; write the arrays to ``out_file``."""
    if importlib.util.find_spec("datasets") is None:
        stand_in = types.ModuleType("datasets")
        stand_in.__spec__ = importlib.machinery.ModuleSpec("datasets", None)
        sys.modules["datasets"] = stand_in
    warnings.filterwarnings("ignore")
    import numpy as np
    import sentence_transformers
    import torch
    from pylate import models, scores

    assert sentence_transformers.__version__.startswith("5."), sentence_transformers.__version__
    spec = json.loads(Path(spec_file).read_text(encoding="utf-8"))
    torch.manual_seed(spec["seed"])
    built = models.ColBERT(
        spec["bert"],
        device="cpu",
        embedding_size=spec["embedding_size"],
        query_length=spec["query_length"],
        document_length=spec["document_length"],
        local_files_only=True,
    )
    built.save(spec["out"])
    model = models.ColBERT(spec["out"], device="cpu", local_files_only=True)
    arrays: dict[str, Any] = {}
    queries = model.encode(spec["queries"], is_query=True) if spec["queries"] else []
    documents = model.encode(spec["documents"], is_query=False) if spec["documents"] else []
    for i, rows in enumerate(queries):
        arrays[f"q{i}"] = np.asarray(rows, dtype=np.float32)
    for j, rows in enumerate(documents):
        arrays[f"d{j}"] = np.asarray(rows, dtype=np.float32)
    table = np.zeros((len(queries), len(documents)), dtype=np.float32)
    for i, q in enumerate(queries):
        for j, d in enumerate(documents):
            table[i, j] = float(scores.colbert_scores([q], [d])[0, 0])
    arrays["scores"] = table
    np.savez(out_file, **arrays)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
