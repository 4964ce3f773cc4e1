"""The text models' cost model (app.handlers.text_cost): the fit recovers a forward's overhead and
attention knee from timed calls; the length groups minimise the modelled time; ``batch_cost`` of
long windows is priced by their time, not by their tokens alone; the calibration's shapes and
its order of timings. Timings are synthetic: speed lives in benchmarks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from app.handlers.text_cost import (
    ATTEMPTS,
    FALLBACK_OVERHEAD_TOKENS,
    ROUNDS,
    CostModel,
    calibrate,
    calibration_shapes,
    fit,
    length_groups,
    padded_tokens,
)


def _seconds(
    strings: int, tokens: int, overhead: float = 40.0, knee: float = 512.0, per: float = 1e-4
) -> float:
    """A forward whose time is overhead + U * T * (1 + T / knee) tokens of ``per`` seconds."""
    return per * (overhead + strings * tokens * (1 + tokens / knee))


@pytest.mark.parametrize("max_length", [128, 256, 512])
def test_the_fit_recovers_the_overhead_and_the_knee(max_length: int) -> None:
    shapes = calibration_shapes(max_length)
    model = fit(shapes, [_seconds(u, t) for u, t in shapes])
    assert model.overhead == pytest.approx(40.0, rel=1e-6) and model.knee == pytest.approx(512.0, rel=1e-6)


def test_a_linear_forward_fits_no_knee_and_a_flat_one_one_call() -> None:
    shapes = calibration_shapes(256)
    linear = fit(shapes, [_seconds(u, t, knee=math.inf) for u, t in shapes])
    assert linear.knee == math.inf and linear.overhead == pytest.approx(40.0, rel=1e-6)
    flat = fit(shapes, [0.002] * len(shapes))  # a GPU at these sizes: the call, not its tokens
    assert flat == CostModel(math.inf, math.inf)
    assert calibration_shapes(64) == [(1, 16), (8, 64)] and calibration_shapes(256) == [
        (1, 16),
        (4, 64),
        (1, 256),
    ]


class FakeForward:
    """A forward timed on a fake clock: each call advances it by :func:`_seconds` of its shape,
    its calls of more than 16 tokens ``slowed`` times slower in the first ``disturbed``
    calibration attempts."""

    def __init__(self, disturbed: int = 0, slowed: float = 3.0) -> None:
        self.now, self.disturbed, self.slowed = 0.0, disturbed, slowed
        self.calls: list[tuple[int, int]] = []
        self.per_attempt = len(calibration_shapes(256)) * (ROUNDS + 1)

    def clock(self) -> float:
        return self.now

    def __call__(self, strings: int, tokens: int) -> None:
        attempt = len(self.calls) // self.per_attempt
        self.calls.append((strings, tokens))
        factor = self.slowed if attempt < self.disturbed and tokens > 16 else 1.0
        self.now += _seconds(strings, tokens) * factor


def test_calibration_times_each_shape_in_turn_and_keeps_the_best() -> None:
    forward = FakeForward()
    model = calibrate(forward, 256, clock=forward.clock)
    assert forward.calls == calibration_shapes(256) * (ROUNDS + 1)  # one warm-up round, then ROUNDS
    assert model.overhead == pytest.approx(40.0, rel=1e-6) and model.knee == pytest.approx(512.0, rel=1e-6)


def test_a_calibration_disturbed_into_no_overhead_is_measured_again() -> None:
    # The larger calls slowed threefold (a sibling worker calibrating on the same cores): the fit's
    # intercept goes negative and would cut every distinct length into a call of its own.
    slowed = [_seconds(u, t) * (3.0 if t > 16 else 1.0) for u, t in calibration_shapes(256)]
    assert fit(calibration_shapes(256), slowed).overhead == 0.0
    forward = FakeForward(disturbed=1)
    model = calibrate(forward, 256, clock=forward.clock)
    assert len(forward.calls) == 2 * forward.per_attempt
    assert model.overhead == pytest.approx(40.0, rel=1e-6)


def test_a_calibration_that_never_finds_an_overhead_assumes_one_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    forward = FakeForward(disturbed=ATTEMPTS)
    model = calibrate(forward, 256, clock=forward.clock)
    assert len(forward.calls) == ATTEMPTS * forward.per_attempt
    assert model.overhead == FALLBACK_OVERHEAD_TOKENS
    assert "set call_overhead_tokens in model.toml" in caplog.text


def test_long_windows_cost_their_time_and_short_texts_their_tokens() -> None:
    model = CostModel(40.0, 512.0)
    short = np.full(64, 16)
    long = np.full(64, 256)
    assert model.batch(short) == round(64 * 16 * (1 + 16 / 512))
    assert model.batch(long) == round(64 * 256 * 1.5)
    # time ratio of the two batches, as the forward above would take them
    assert model.batch(long) / model.batch(short) == pytest.approx(
        (_seconds(64, 256) - 40e-4) / (_seconds(64, 16) - 40e-4), rel=1e-3
    )
    assert model.padded(long) == 64 * 256 and model.batch(np.array([0, 0])) == 0


def test_groups_cut_where_the_modelled_time_is_least() -> None:
    lengths = [180, 12, 200, 9, 15, 170]
    linear = CostModel(40.0)
    assert [g.tolist() for g in linear.groups(lengths)] == [[3, 1, 4], [5, 0, 2]]
    assert linear.batch(lengths) == 3 * 15 + 3 * 200 + 40  # two calls: one overhead beyond the first
    assert [g.tolist() for g in length_groups(lengths, 40)] == [[3, 1, 4], [5, 0, 2]]
    assert padded_tokens(lengths, 40) == 3 * 15 + 3 * 200
    # with a knee a long string is dearer: cutting it off the mid-length ones pays earlier
    mixed = [100, 100, 100, 110]
    assert len(CostModel(40.0).groups(mixed)) == 1
    assert [g.tolist() for g in CostModel(40.0, 64.0).groups(mixed)] == [[0, 1, 2], [3]]
    rng = np.random.default_rng(0)
    values = rng.integers(3, 257, size=64)
    for model in (CostModel(5.0, 300.0), CostModel(40.0, 1000.0), CostModel(500.0)):
        groups = model.groups(values)
        assert sorted(np.concatenate(groups).tolist()) == list(range(64))
        one = model.call(64, int(values.max()))
        assert model.batch(values) <= round(one)  # never dearer than one call padded to the longest


def test_a_batchs_repeated_asks_for_its_groups_are_answered_from_the_last_cuts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import app.handlers.text_cost as text_cost

    cuts = 0
    real = text_cost._cuts_plain

    def counted(weighted: list[float], overhead: float) -> list[int]:
        nonlocal cuts
        cuts += 1
        return real(weighted, overhead)

    monkeypatch.setattr(text_cost, "_cuts_plain", counted)
    cost = CostModel(40.0)
    lengths = np.array([180, 12, 200, 9, 15, 170])
    first = cost.groups(lengths)
    assert cost.batch(lengths) == 3 * 15 + 3 * 200 + 40 and cost.padded(lengths) == 3 * 15 + 3 * 200
    assert [g.tolist() for g in cost.groups(lengths.tolist())] == [g.tolist() for g in first]
    assert cuts == 1  # the cost, the padded tokens and the forward's groups: one cut
    with pytest.raises(ValueError):
        first[0][0] = 5  # shared between callers: read-only
    first.pop()  # each caller gets its own list
    assert len(cost.groups(lengths)) == 2
    for n in range(text_cost.RECENT_CUTS + 1):  # other batches: the memo stays bounded
        cost.groups(lengths + n + 1)
    assert len(cost._recent) <= text_cost.RECENT_CUTS
    assert CostModel(40.0) == cost  # the memo is no part of the model


def test_the_plain_and_the_numpy_cut_agree_to_the_bit() -> None:
    # groups() cuts a batch's few dozen strings in plain Python and longer lists in numpy: the
    # same float64 arithmetic in the same order, the first minimum on ties.
    from app.handlers.text_cost import _cuts, _cuts_plain

    rng = np.random.default_rng(7)
    for overhead, knee in ((0.0, math.inf), (29.2, 2032.0), (400.0, math.inf), (10.0, 500.0)):
        cost = CostModel(overhead, knee)
        for _ in range(100):
            lengths = np.sort(rng.integers(1, 600 if rng.random() < 0.5 else 20, int(rng.integers(2, 80))))
            weighted = lengths * cost.per_token(lengths)
            assert _cuts_plain(weighted.tolist(), overhead) == _cuts(weighted.astype(np.float64), overhead)
