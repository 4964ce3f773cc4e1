"""The two-paragraph check of long texts in windows, with the demo MiniLM (all-MiniLM-L6-v2, 256
tokens): a text of a paragraph on one topic followed by a paragraph on another, each about 250
tokens, embedded truncated (the first 256 tokens) and in windows (the token-weighted mean of
its windows' embeddings, renormalised). Prints the cosine of each to each paragraph's own
embedding, and the rerank position of a long document whose relevant part lies past token 256.

Run: ``python -m benchmarks.windows_check`` (CPU, about 10 s). Figures: docs/text-models.md.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from app.handlers.sentence_embedding import SentenceEmbeddingHandler
from app.models.repository import read_config
from app.serving.context import RequestContext
from app.serving.windows import WindowStage

REPO = Path(__file__).resolve().parent.parent / "model_repository" / "all-MiniLM-L6-v2"

COOKING = (
    "To make a good risotto, toast the rice in butter before adding warm stock one ladle at a time. "
    "Stir often so the starch thickens the sauce, and season with salt, pepper and parmesan at the end. "
    "Fresh herbs, mushrooms or saffron change the dish completely. "
)
ASTRONOMY = (
    "The telescope revealed a distant galaxy whose light left its stars billions of years ago. "
    "Astronomers measure the redshift of the spectrum to estimate how fast it recedes from the Milky Way. "
    "Dark matter shapes the rotation of its spiral arms. "
)


def paragraph(sentences: str, tokens: int, count: Callable[[str], int]) -> str:
    """``sentences`` repeated until the paragraph has about ``tokens`` tokens (``count``: a
    text's tokens, special tokens aside)."""
    text = sentences
    while count(text + sentences) <= tokens:
        text += sentences
    return text.strip()


def embed(
    handler: SentenceEmbeddingHandler, texts: list[str], queries: list[str] | None = None
) -> dict[str, Any]:
    """``texts`` through the window stage and the handler, as the data plane runs them."""
    inputs = {"text": np.array([t.encode() for t in texts], dtype=object).reshape(-1, 1)}
    if queries is not None:
        inputs["query"] = np.array([q.encode() for q in queries], dtype=object).reshape(-1, 1)
    runner, config = SimpleNamespace(handler=handler), SimpleNamespace(name="check")
    model: Any = SimpleNamespace(runner=runner, config=config)
    stage = WindowStage()
    items, plan = asyncio.run(stage.expand(model, RequestContext("check", 0.0), inputs))
    assert items is not None
    with torch.inference_mode():
        out = handler.postprocess(handler.predict(handler.preprocess(items)))
    return stage.assemble(plan, out)


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args(argv)
    config = read_config(REPO)
    handler = SentenceEmbeddingHandler()
    handler.load(torch.device("cpu"), config)

    def count(text: str) -> int:
        return handler.tokenizer.count([text])[0]

    first, second = paragraph(COOKING, 250, count), paragraph(ASTRONOMY, 250, count)
    text = first + " " + second
    windowed = embed(handler, [text, first, second])
    policy = handler.policy
    handler.policy = type(policy)("truncate", policy.max_length, policy.stride)
    truncated = embed(handler, [text])["embedding"][0]
    handler.policy = policy
    w, p1, p2 = windowed["embedding"]
    print(f"text: {count(text) + 2} tokens, {int(windowed['windows'][0, 0])} windows")
    print(f"cosine to paragraph 1 (cooking):   truncated {truncated @ p1:.3f}  windowed {w @ p1:.3f}")
    print(f"cosine to paragraph 2 (astronomy): truncated {truncated @ p2:.3f}  windowed {w @ p2:.3f}")
    query = "how do astronomers measure the redshift of a galaxy"
    documents = [
        text,
        "Physicists measure the speed of light with lasers and mirrors.",
        "Geologists date rocks by measuring the decay of radioactive isotopes.",
        "The train leaves the station at nine.",
    ]
    ranked = embed(handler, documents, [query] * len(documents))["score"][:, 0]
    handler.policy = type(policy)("truncate", policy.max_length, policy.stride)
    cut = embed(handler, documents, [query] * len(documents))["score"][:, 0]
    print(f"rerank {query!r}: document 0 the long text (relevant past token 256), 1-3 short, off topic")
    for name, scores in (("windowed (MaxP)", ranked), ("truncated", cut)):
        shown = ", ".join(f"{s:.3f}" for s in scores)
        print(f"  {name:>16}: scores [{shown}]  order {np.argsort(-scores).tolist()}")


if __name__ == "__main__":
    main()
