"""The queue-order simulation (``benchmarks.queue_order``): the server's order never passes an
item over, the length-aware orders do, every order serves its closed-loop clients, and one
padded call per batch pads more than length groups."""

from __future__ import annotations

import pytest

from benchmarks.queue_order import CostModel, Workload, orders, simulate

WORKLOAD = Workload(docs=20, long_share=0.1, short_words=(20, 80), long_words=(200, 400), query_tokens=10,
                    max_tokens=512)  # fmt: skip


@pytest.mark.parametrize("calls", ["one", "groups"])
def test_only_the_length_aware_orders_pass_items_over(calls: str) -> None:
    model = CostModel(token_s=0.00031, call_overhead_tokens=27, batch_overhead_s=0.002, calls=calls)
    rows = {
        name: simulate(take, model, WORKLOAD, clients=8, seconds=60, seed=1)
        for name, take in orders(["arrival", "window:2", "sorted:3"], model, 64, 16384).items()
    }
    assert rows["arrival"]["most_batches_passed_over"] == 0
    assert (
        rows["window:2"]["most_batches_passed_over"] >= 1
        and rows["sorted:3"]["most_batches_passed_over"] >= 1
    )
    assert all(row["requests"] > 0 and row["docs_per_s"] > 0 for row in rows.values())
    # one call per batch pads every item to the longest: more padding than length groups
    assert (rows["arrival"]["padded_over_real"] > 2) == (calls == "one")
