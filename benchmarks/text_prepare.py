"""The text path's host work per item, outside the forward, in process: what a worker's threads
spend on each text of the demo MiniLM (all-MiniLM-L6-v2) between the request's arrays and the
model's input tensors, and back.

For a request of ``--items`` short feed texts (the feed's one query on every item, each text 8-14
words), times, on one thread with one torch thread, best of ``--repeats`` rounds of ``--rounds``
requests each:

- ``tokenizer``: the folder's Rust tokenizer alone (``encode_batch_fast`` of the distinct strings);
- ``item_costs``: the pricing of a request before it queues (the server calls it once a request);
- ``preprocess``: the batch's input tensors from what pricing made (``PREPARED`` where the handler
  returns it);
- ``postprocess``: the outputs back to numpy (the forward's outputs computed once, outside the
  timing);

each in µs per item of CPU time (``time.process_time``), and their sum (the path outside the
forward). It calls the handler as the serving core does, so the same script measures any version
of the handler: run it from another checkout (``PYTHONPATH=<checkout>``) for its figures.

Run: ``python -m benchmarks.text_prepare`` (CPU, about a minute). Figures: docs/text-models.md.
Speed figures need a quiet machine: the 2-core development VM shared with other work gives
figures several times too high.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.handlers.sentence_embedding import SentenceEmbeddingHandler
from app.models.repository import read_config

REPO = Path(__file__).resolve().parent.parent / "model_repository" / "all-MiniLM-L6-v2"
QUERY = "healthy cooking and outdoor sports"
WORDS = ("morning", "commute", "budget", "rice", "championship", "index", "funds", "species", "trail",
         "markets", "inflation", "stretches", "headphones", "dinners", "weeknights", "park")  # fmt: skip


def feed(items: int, rng: random.Random) -> dict[str, np.ndarray]:
    """One request: ``items`` short feed texts and the feed's query on each."""
    texts = [" ".join(rng.choices(WORDS, k=rng.randint(8, 14))).encode() for _ in range(items)]
    text = np.empty(items, dtype=object)
    text[:] = texts
    query = np.empty(items, dtype=object)
    query[:] = [QUERY.encode()] * items
    return {"text": text.reshape(-1, 1), "query": query.reshape(-1, 1)}


def cpu_us(run: Callable[[], Any], rounds: int, repeats: int) -> float:
    """The best of ``repeats`` CPU times of ``rounds`` calls of ``run``, µs per call."""
    best = float("inf")
    for _ in range(repeats):
        began = time.process_time()
        for _ in range(rounds):
            run()
        best = min(best, time.process_time() - began)
    return best / rounds * 1e6


def measure(items: int, rounds: int, repeats: int) -> dict[str, float]:
    """µs of CPU per item of each stage (module docstring)."""
    torch.set_num_threads(1)
    handler = SentenceEmbeddingHandler()
    handler.load(torch.device("cpu"), read_config(REPO))
    requests = [feed(items, random.Random(seed)) for seed in range(rounds)]
    turn = iter(range(10**9))

    def next_request() -> dict[str, np.ndarray]:
        return requests[next(turn) % rounds]

    priced = handler.item_costs(requests[0])
    prepared = getattr(priced, "prepared", None)
    batch = {**requests[0], "#prepared": prepared} if prepared is not None else requests[0]
    with torch.inference_mode():
        outputs = handler.predict(handler.preprocess(batch))
    strings = [t.decode() for t in requests[0]["text"].reshape(-1)] + [QUERY]
    tokenizer = getattr(handler, "tokenizer", None)
    encode = tokenizer.encode if tokenizer is not None else handler.model.tokenizer
    figures = {
        "tokenizer": cpu_us(lambda: encode(strings), rounds, repeats),
        "item_costs": cpu_us(lambda: handler.item_costs(next_request()), rounds, repeats),
        "preprocess": cpu_us(lambda: handler.preprocess(batch), rounds, repeats),
        "postprocess": cpu_us(lambda: handler.postprocess(outputs), rounds, repeats),
    }
    per_item = {name: us / items for name, us in figures.items()}
    stages = ("item_costs", "preprocess", "postprocess")
    per_item["outside the forward"] = sum(per_item[name] for name in stages)
    return per_item


def main(argv: list[str] | None = None) -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--items", type=int, default=8, help="texts per request")
    parser.add_argument("--rounds", type=int, default=200, help="requests per timing")
    parser.add_argument("--repeats", type=int, default=5, help="timings per stage (the best is kept)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    figures = measure(args.items, args.rounds, args.repeats)
    if args.json:
        print(json.dumps({name: round(us, 1) for name, us in figures.items()}))
        return
    for name, us in figures.items():
        print(f"{name:>20}: {us:7.1f} µs of CPU per item")


if __name__ == "__main__":
    main()
