"""What a text model's forward calls cost, measured at load: length groups and ``batch_cost``.

A forward call of U strings padded to T tokens takes, in units of one short token's time,

    ``cost(U, T) = overhead + U * T * (1 + T / knee)``

``overhead`` (``call_overhead_tokens``) is what a call costs beyond its tokens (Python, kernel
launches); ``knee`` (``attention_knee_tokens``) is the length at which a token's attention,
whose work grows with the length, costs as much as the rest of its work (a token at 256 costs
more than one at 16; ``inf``: the cost is linear). :func:`calibrate` fits both to calls timed at
load at a few shapes up to ``max_seq_length``; ``model.toml`` may fix either.

The model serves three uses: the length groups a batch runs in (:meth:`CostModel.groups`: the
cut of the sorted lengths that costs least, one forward call per group, each padded to its own
longest), ``batch_cost`` (:meth:`CostModel.batch`: what those calls cost, proportional to their
time across lengths, so that admission and ``max_batch_tokens`` price a batch of long windows
right from the first one), and the padded tokens a batch computes (:meth:`CostModel.padded`).

Source: the split mirrors ``SentenceTransformer.encode()`` sorting its input by length and
text-embeddings-inference's token budget; the cost is the standard transformer FLOP count
(a linear term per token plus attention's term per token times the length: Kaplan et al. 2020,
"Scaling Laws for Neural Language Models", table 1).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

__all__ = ["CostModel", "calibrate", "calibration_shapes", "length_groups", "padded_tokens"]

log = logging.getLogger(__name__)

#: The timings per shape: the best of this many rounds after a warm-up round (a round of
#: all-MiniLM-L6-v2 at 256 tokens: about 0.25 s of one core of the 2-core VM).
ROUNDS = 3
#: Measurements at most: one that fits no call overhead at all (a negative intercept, clipped to
#: 0: its larger calls were slowed by other work, such as a sibling worker calibrating on the same
#: cores) is taken again. Zero is never a forward call's real overhead (its Python and launches),
#: and it is the costly error: every distinct length would run as a call of its own.
ATTEMPTS = 3
#: The overhead assumed when every attempt fitted none (tokens; the 2-core VM measured 23-43 for
#: MiniLM-sized encoders); the log says so and names ``call_overhead_tokens`` to fix it.
FALLBACK_OVERHEAD_TOKENS = 32.0
#: A knee below this is noise on a loaded machine: by the FLOP count a token's attention
#: equals its other work at about 6 x the hidden size (2,300 tokens for MiniLM, 4,600 for BERT-base).
MIN_KNEE_TOKENS = 64.0


@dataclass(frozen=True)
class CostModel:
    """``cost(U, T) = overhead + U * T * (1 + T / knee)`` (module docstring), in tokens.

    Attributes:
        overhead: a call's cost beyond its tokens (``inf``: a batch is always one call).
        knee: the length at which attention doubles a token's cost (``inf``: linear).
    """

    overhead: float = math.inf
    knee: float = math.inf
    #: The last cuts made, by the lengths' bytes (:meth:`groups`).
    _recent: dict[bytes, tuple[npt.NDArray[np.int64], ...]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def per_token(self, tokens: npt.ArrayLike) -> npt.NDArray[np.float64]:
        """The cost of one token in a call padded to ``tokens``: ``1 + tokens / knee``."""
        values = np.asarray(tokens, dtype=np.float64)
        return 1.0 + values / self.knee if math.isfinite(self.knee) else np.ones_like(values)

    def groups(self, lengths: npt.ArrayLike) -> list[npt.NDArray[np.int64]]:
        """The length groups of strings of ``lengths`` tokens (``[U]``, U >= 1): indices into
        ``lengths``, shortest group first, each in ascending length, together a permutation of
        ``range(U)``; the cut minimises the sum of :meth:`call` over the groups.

        The best cut of sorted lengths into contiguous groups is a shortest path over the U + 1
        cut points (``best[j] = min_i best[i] + overhead + (j - i) * w(sorted[j - 1])``),
        O(U^2): in plain Python floats up to ``_PLAIN_UP_TO`` strings (a batch's few dozen: a
        numpy call per cut point costs more than the arithmetic), in numpy beyond; both give
        the same cut (the same float64 arithmetic, the first minimum).

        A batch asks for the cut of the same lengths up to three times (its cost when it forms,
        its padded tokens when it is done, its forward's preprocess on the inference thread):
        the last :data:`RECENT_CUTS` cuts are kept by the lengths' bytes and returned again
        (read-only index arrays, a new list each time).
        """
        values = np.asarray(lengths, dtype=np.float64).reshape(-1)
        if values.size <= 1 or not math.isfinite(self.overhead):
            return [np.argsort(values, kind="stable").astype(np.int64)]
        key = values.tobytes()
        recent = self._recent.get(key)
        if recent is not None:
            return list(recent)
        cut = self._cut(values)
        if len(self._recent) >= RECENT_CUTS:  # a batch's three asks are close together
            self._recent.clear()
        self._recent[key] = cut
        return list(cut)

    def _cut(self, values: npt.NDArray[np.float64]) -> tuple[npt.NDArray[np.int64], ...]:
        order = np.argsort(values, kind="stable")
        ordered = values[order]
        weighted = ordered * self.per_token(ordered)
        n = ordered.size
        plain = n <= _PLAIN_UP_TO
        cut = _cuts_plain(weighted.tolist(), self.overhead) if plain else _cuts(weighted, self.overhead)
        bounds = [n]
        while bounds[-1] > 0:
            bounds.append(int(cut[bounds[-1]]))
        bounds.reverse()
        groups = tuple(order[a:b].astype(np.int64) for a, b in itertools.pairwise(bounds))
        for group in groups:
            group.setflags(write=False)
        return groups

    def call(self, rows: int, tokens: int) -> float:
        """One call's tokens' cost, ``rows * tokens * (1 + tokens / knee)`` (its overhead aside)."""
        return float(rows * tokens * self.per_token(tokens))

    def _real(self, lengths: npt.ArrayLike) -> npt.NDArray[np.int64]:
        values = np.asarray(lengths, dtype=np.int64).reshape(-1)
        return values[values > 0]  # 0: a string priced already (``item_costs``) computes nothing

    def batch(self, lengths: npt.ArrayLike) -> int:
        """What the length groups of ``lengths`` cost (:meth:`groups`): each call's tokens'
        cost, plus the overhead of every call after the first (the service rate's intercept,
        ``app.serving.admission``, holds one call's); items of 0 tokens count nothing."""
        values = self._real(lengths)
        if values.size == 0:
            return 0
        groups = self.groups(values)
        total = sum(self.call(len(g), int(values[g].max())) for g in groups)
        return round(total + (len(groups) - 1) * self.overhead) if len(groups) > 1 else round(total)

    def padded(self, lengths: npt.ArrayLike) -> int:
        """The tokens the length groups of ``lengths`` compute, padding included."""
        values = self._real(lengths)
        if values.size == 0:
            return 0
        return sum(int(values[g].max()) * len(g) for g in self.groups(values))


#: The cuts :meth:`CostModel.groups` keeps (a few batches' worth: one batch forms while the one
#: before it runs and the one before that is finished).
RECENT_CUTS = 16

#: Up to this many strings :meth:`CostModel.groups` cuts in plain Python (CPU VM: 8 strings 4 µs
#: against 33 in numpy, 32 strings 37 against 129, 64 136 against 274; even at 128).
_PLAIN_UP_TO = 128


def _cuts_plain(weighted: list[float], overhead: float) -> list[int]:
    """``cut[j]``: where the last group of the best cut of the first ``j`` strings begins
    (:meth:`CostModel.groups`), ``weighted`` the sorted strings' per-token weights."""
    n = len(weighted)
    best = [0.0] * (n + 1)
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        w = weighted[j - 1]
        low, at = best[0] + overhead + j * w, 0
        for i in range(1, j):
            c = best[i] + overhead + (j - i) * w
            if c < low:
                low, at = c, i
        best[j], cut[j] = low, at
    return cut


def _cuts(weighted: npt.NDArray[np.float64], overhead: float) -> list[int]:
    """:func:`_cuts_plain` in numpy, one vector operation per cut point."""
    n = weighted.size
    best = np.zeros(n + 1)
    cut = [0] * (n + 1)
    starts = np.arange(n)
    for j in range(1, n + 1):
        costs = best[:j] + overhead + (j - starts[:j]) * weighted[j - 1]
        i = int(np.argmin(costs))
        best[j], cut[j] = costs[i], i
    return cut


def length_groups(lengths: npt.ArrayLike, overhead_tokens: float) -> list[npt.NDArray[np.int64]]:
    """:meth:`CostModel.groups` with a linear cost (``knee`` = inf)."""
    return CostModel(overhead_tokens).groups(lengths)


def padded_tokens(lengths: npt.ArrayLike, overhead_tokens: float) -> int:
    """:meth:`CostModel.padded` with a linear cost (``knee`` = inf)."""
    return CostModel(overhead_tokens).padded(lengths)


def calibration_shapes(max_length: int) -> list[tuple[int, int]]:
    """The (strings, tokens) calls timed at load: one short string (the overhead), and as many
    tokens twice over, in strings of 64 tokens and in one string of ``max_length`` (the
    per-token cost and the knee: the linear layers see the same rows, attention not). Where
    ``max_length`` <= 64 the knee cannot show: 1 x 16 and 8 x ``max_length``."""
    if max_length <= 64:
        return [(1, min(16, max_length)), (8, max_length)]
    return [(1, 16), (max(1, max_length // 64), 64), (1, max_length)]


def fit(shapes: Sequence[tuple[int, int]], seconds: Sequence[float]) -> CostModel:
    """The cost model of calls of ``shapes`` that took ``seconds``: least squares of
    ``t = a + b * U * T + c * U * T^2`` (``c`` only with three shapes or more); overhead
    ``a / b``, knee ``b / c``. Tokens that explain under 0.1 % of the largest call's time (a GPU
    at these sizes) give ``overhead = inf`` (one call per batch) and a linear cost."""
    n = np.array([u * t for u, t in shapes], dtype=np.float64)
    lengths = np.array([t for _, t in shapes], dtype=np.float64)
    times = np.asarray(seconds, dtype=np.float64)
    columns = [np.ones_like(n), n] + ([n * lengths] if len(shapes) >= 3 else [])
    solution = np.linalg.lstsq(np.stack(columns, axis=1), times, rcond=None)[0]
    a, b = float(solution[0]), float(solution[1])
    c = float(solution[2]) if len(solution) > 2 else 0.0
    if c < 0:  # no measurable attention term: the linear fit alone
        a, b = (float(v) for v in np.linalg.lstsq(np.stack(columns[:2], axis=1), times, rcond=None)[0])
        c = 0.0
    if b * float(n.max()) <= 1e-3 * float(times.max()):  # the tokens explain nothing: a flat call
        return CostModel()
    knee = b / c if c > 0 else math.inf
    if knee > 1000 * float(lengths.max()):  # under 0.1 % at the longest length: no knee to speak of
        knee = math.inf
    return CostModel(max(0.0, a / b), max(knee, MIN_KNEE_TOKENS))


def calibrate(
    run: Callable[[int, int], None], max_length: int, clock: Callable[[], float] = time.perf_counter
) -> CostModel:
    """Time ``run(strings, tokens)`` (one forward call of that shape, waited for) at
    :func:`calibration_shapes`, best of :data:`ROUNDS` each after one warm-up round, the shapes
    taken in turn (so that a machine slowing down or speeding up weighs on all alike), and
    :func:`fit` them; measured again, up to :data:`ATTEMPTS` times, while the fit finds no call
    overhead (then :data:`FALLBACK_OVERHEAD_TOKENS`, with a WARNING). ``clock``: seconds."""
    shapes = calibration_shapes(max_length)
    model = CostModel()
    for _ in range(ATTEMPTS):
        best = [math.inf] * len(shapes)
        for round_ in range(ROUNDS + 1):
            for i, (strings, tokens) in enumerate(shapes):
                began = clock()
                run(strings, tokens)
                if round_:  # the first round warms up
                    best[i] = min(best[i], clock() - began)
        model = fit(shapes, best)
        if model.overhead > 0:
            return model
    log.warning(
        "the forward's cost measured at load fits no call overhead in %d attempts (other work on "
        "these cores?): %.0f tokens assumed; set call_overhead_tokens in model.toml to fix it",
        ATTEMPTS, FALLBACK_OVERHEAD_TOKENS,
    )  # fmt: skip
    return CostModel(FALLBACK_OVERHEAD_TOKENS, model.knee)
