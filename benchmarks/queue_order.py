"""Queue order under mixed lengths: a simulation of one worker's queue, to decide whether a
length-aware take would pay for what it costs admission.

A discrete-event simulation (virtual clock, no model, no server: it runs the same on a busy
machine) of one worker serving closed-loop clients, each sending reranks of ``--docs``
documents of which ``--long-share`` are long (``--long-words``) and the rest short
(``--short-words``); a document costs its words x 1.3 tokens plus the query's and 3 special
tokens, at most ``--max-tokens``. A batch takes ``--batch-overhead-ms`` plus ``--token-ms`` per
token its forward calls compute, and ``--call-overhead-tokens`` more per call (the per-call cost
the text handlers measure at load). Batches hold at most ``--max-batch-size`` items and
``--max-batch-tokens`` of their cost (the handler's ``batch_cost``), as ``model.toml`` says.

Queue orders (``--orders``):

- ``arrival``: the server's (``app.serving.queue.RequestQueue``): requests whole in arrival
  order, each one's items sorted by cost, only the last request taken split;
- ``sorted:K``: every queued item by cost, shortest first, except that an item that has seen K
  batches formed since it arrived goes first (oldest first): Infinity's sorted queue with a
  bound on how long an item is passed over;
- ``window:K``: the oldest K batches' worth of items (K x max batch size) sorted by cost and cut
  into batches in that order, run before the next window is taken (a bounded lookahead).

Forward calls (``--calls``): ``one`` (each batch one call, padded to its longest item: the
cross-encoder's default, ``call_overhead_tokens = inf``) and ``groups`` (the batch cut into
length groups at the least padded tokens plus the call overhead:
``app.handlers.sentence_embedding.length_groups``).

Each row: documents/s, padded over real tokens, request latency p50/p99/max (ms), and the most
batches any item waited past its place in arrival order (what admission's backlog reasoning
would have to allow for).

    python -m benchmarks.queue_order                              # the rerank of issue 48, CPU figures
    python -m benchmarks.queue_order --clients 16 --seconds 600 --json out/queue-order.json
    python -m benchmarks.queue_order --token-ms 0.002 --call-overhead-tokens 1000 --batch-overhead-ms 1

The defaults are the CPU VM's ms-marco-MiniLM-L-6-v2 (0.31 ms a token: 15,694 ms for 51,000
tokens, docs/reliability.md; 27 tokens a call, docs/architecture.md) with the documented
cross-encoder ``model.toml`` (64 items, 16,384 tokens a batch) and 4 clients (c = 8 on 2 workers).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from app.handlers.sentence_embedding import length_groups
from app.serving.queue import most_within


@dataclass
class Item:
    """One document of a request: its cost in tokens and when its request arrived."""

    request: Request
    cost: int
    seq: int  # its place in arrival order, over all items
    formed_before: int = 0  # batches formed when it arrived
    passed: int = 0  # batches that took a newer item while it waited


@dataclass
class Request:
    """One rerank: its items, arrival time (s) and the items still not computed."""

    client: int
    arrival: float
    items: list[Item] = field(default_factory=list)
    pending: int = 0


@dataclass(frozen=True)
class CostModel:
    """What a batch takes: ``batch_overhead_s`` plus ``token_s`` per token its calls compute
    and ``call_overhead_tokens`` more per call; ``calls``: "one" or "groups"."""

    token_s: float
    call_overhead_tokens: float
    batch_overhead_s: float
    calls: str

    def batch(self, costs: np.ndarray) -> tuple[float, float]:
        """``(batch_cost, seconds)`` of a batch of items costing ``costs``: the padded tokens
        its calls compute (the handler's ``batch_cost``) and its time."""
        if self.calls == "one":
            padded, calls = float(costs.max()) * len(costs), 1
        else:
            groups = length_groups(costs, self.call_overhead_tokens)
            padded, calls = float(sum(int(costs[g].max()) * len(g) for g in groups)), len(groups)
        return padded, self.batch_overhead_s + self.token_s * (padded + self.call_overhead_tokens * calls)


@dataclass(frozen=True)
class Workload:
    """The requests' shape (module docstring)."""

    docs: int
    long_share: float
    short_words: tuple[int, int]
    long_words: tuple[int, int]
    query_tokens: int
    max_tokens: int

    def costs(self, rng: random.Random) -> list[int]:
        """Each document's tokens, sorted (the server sorts a request's items by cost)."""
        out = []
        for _ in range(self.docs):
            low, high = self.long_words if rng.random() < self.long_share else self.short_words
            out.append(min(self.max_tokens, int(rng.randint(low, high) * 1.3) + self.query_tokens + 3))
        return sorted(out)


Take = Callable[[list[Item], int], list[Item]]


def fill(candidates: Sequence[Item], model: CostModel, max_items: int, max_tokens: float) -> list[Item]:
    """The longest prefix of ``candidates`` within the batch's bounds (at least one item), found
    as the queue finds it (``app.serving.queue.most_within``)."""
    costs = np.array([i.cost for i in candidates[:max_items]], dtype=np.int64)
    n = most_within(lambda k: model.batch(costs[:k])[0], len(costs), max_tokens)
    return list(candidates[: max(1, n)])


def arrival_order(model: CostModel, max_items: int, max_tokens: float) -> Take:
    """The server's take: oldest first (requests whole, their items sorted)."""
    return lambda queue, formed: fill(queue, model, max_items, max_tokens)


def sorted_order(model: CostModel, max_items: int, max_tokens: float, bound: int) -> Take:
    """Shortest first; an item that has seen ``bound`` batches formed goes first."""

    def take(queue: list[Item], formed: int) -> list[Item]:
        overdue = [i for i in queue if formed - i.formed_before >= bound]
        rest = sorted((i for i in queue if formed - i.formed_before < bound), key=lambda i: (i.cost, i.seq))
        return fill(overdue + rest, model, max_items, max_tokens)

    return take


def window_order(model: CostModel, max_items: int, max_tokens: float, batches: int) -> Take:
    """The oldest ``batches`` x ``max_items`` items sorted by cost, run as the batches they cut
    into before the next window."""
    planned: list[list[Item]] = []

    def take(queue: list[Item], formed: int) -> list[Item]:
        live = {id(i) for i in queue}
        while planned and not all(id(i) in live for i in planned[0]):
            planned.pop(0)
        if not planned:
            window = sorted(queue[: batches * max_items], key=lambda i: (i.cost, i.seq))
            while window:
                batch = fill(window, model, max_items, max_tokens)
                planned.append(batch)
                window = window[len(batch) :]
        return planned.pop(0)

    return take


def simulate(
    take: Take, model: CostModel, workload: Workload, clients: int, seconds: float, seed: int
) -> dict[str, Any]:
    """Run ``clients`` closed-loop clients against one worker for ``seconds`` of virtual time;
    the first tenth is warm-up, not counted."""
    rng = random.Random(seed)
    seq = itertools.count()
    queue: list[Item] = []
    now, formed, real, padded = 0.0, 0, 0.0, 0.0
    latencies: list[float] = []
    docs_done = 0
    lateness = 0
    warm = seconds / 10
    arrivals: list[tuple[float, int]] = [(0.0, c) for c in range(clients)]
    heapq.heapify(arrivals)

    def arrive(at: float, client: int) -> None:
        request = Request(client, at)
        for cost in workload.costs(rng):
            request.items.append(Item(request, cost, next(seq), formed))
        request.pending = len(request.items)
        queue.extend(request.items)

    while now < seconds:
        while arrivals and arrivals[0][0] <= now:
            at, client = heapq.heappop(arrivals)
            arrive(at, client)
        if not queue:
            now = arrivals[0][0]
            continue
        batch = take(queue, formed)
        taken = {id(i) for i in batch}
        newest = max(i.seq for i in batch)
        queue[:] = [i for i in queue if id(i) not in taken]
        for item in queue:  # passed over: a newer item went in this batch
            if item.seq < newest:
                item.passed += 1
                lateness = max(lateness, item.passed)
        formed += 1
        costs = np.array([i.cost for i in batch])
        cost, took = model.batch(costs)
        now += took
        if now > warm:
            real, padded = real + float(costs.sum()), padded + cost
            docs_done += len(batch)
        for item in batch:
            request = item.request
            request.pending -= 1
            if request.pending == 0:
                if request.arrival >= warm:
                    latencies.append(now - request.arrival)
                heapq.heappush(arrivals, (now, request.client))
    span = seconds - warm
    lat = np.array(latencies) * 1000 if latencies else np.zeros(1)
    return {
        "docs_per_s": round(docs_done / span, 1),
        "padded_over_real": round(padded / real, 2) if real else None,
        "p50_ms": round(float(np.percentile(lat, 50)), 0),
        "p99_ms": round(float(np.percentile(lat, 99)), 0),
        "max_ms": round(float(lat.max()), 0),
        "most_batches_passed_over": lateness,
        "requests": len(latencies),
    }


def orders(names: Sequence[str], model: CostModel, max_items: int, max_tokens: float) -> dict[str, Take]:
    """The takes ``names`` asks for (module docstring)."""
    out: dict[str, Take] = {}
    for name in names:
        kind, _, bound = name.partition(":")
        if kind == "arrival":
            out[name] = arrival_order(model, max_items, max_tokens)
        elif kind == "sorted":
            out[name] = sorted_order(model, max_items, max_tokens, int(bound or 4))
        elif kind == "window":
            out[name] = window_order(model, max_items, max_tokens, int(bound or 4))
        else:
            raise SystemExit(f"unknown order {name!r}: arrival, sorted:K or window:K")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orders", default="arrival,sorted:4,window:2,window:4")
    parser.add_argument("--calls", default="one,groups", help="one, groups or both")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=300.0, help="virtual seconds per row")
    parser.add_argument("--docs", type=int, default=20)
    parser.add_argument("--long-share", type=float, default=0.1)
    parser.add_argument("--short-words", default="20,80")
    parser.add_argument("--long-words", default="200,400")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--token-ms", type=float, default=0.31)
    parser.add_argument("--call-overhead-tokens", type=float, default=27.0)
    parser.add_argument("--batch-overhead-ms", type=float, default=2.0)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-batch-tokens", type=float, default=16384)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    low_s, high_s = (int(v) for v in args.short_words.split(","))
    low_l, high_l = (int(v) for v in args.long_words.split(","))
    workload = Workload(args.docs, args.long_share, (low_s, high_s), (low_l, high_l), 10, args.max_tokens)
    rows = []
    print("| calls | order | docs/s | padded/real | p50 ms | p99 ms | max ms | batches passed over |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for calls in args.calls.split(","):
        model = CostModel(
            args.token_ms / 1000, args.call_overhead_tokens, args.batch_overhead_ms / 1000, calls
        )
        for name, take in orders(
            args.orders.split(","), model, args.max_batch_size, args.max_batch_tokens
        ).items():
            row = {"calls": calls, "order": name} | simulate(
                take, model, workload, args.clients, args.seconds, args.seed
            )
            rows.append(row)
            print(
                f"| {calls} | {name} | {row['docs_per_s']} | {row['padded_over_real']} | {row['p50_ms']:.0f} "
                f"| {row['p99_ms']:.0f} | {row['max_ms']:.0f} | {row['most_batches_passed_over']} |"
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"arguments": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
