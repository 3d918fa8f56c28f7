"""Where a draft-model block stops: at the first token past which one more does not pay.

The draft's probability of the token it proposes (its confidence, quantized as the traces
store it: ``round(254 · p)``) is evidence of whether the target will accept it. A
category's draft-model statistics keep, per confidence bin, how often a token proposed on
the target's prefix was accepted (``calibrated``); a block's tokens 1 … i are all accepted
with probability q_i = a(c_1) · … · a(c_i). Drafting token m > i costs one draft step and
widens verification by one position, x_m = T_d + T_t(m + 1) − T_t(m), and adds a token with
probability q_i · a_{i+1} · … · a_m (a_m: the category's acceptance at that position, before
the draft has proposed it), worth ρ seconds (the priced block's own seconds per token:
drafting on pays while it is cheaper per token than the block). Going on to token j pays
where q_i · ρ · Σ_{m=i+1..j} a_{i+1} · … · a_m exceeds Σ_{m=i+1..j} x_m, so drafting stops
after token i where no j makes it pay:

    q_i < bar_i = min_j  Σ x_m / (ρ · Σ a_{i+1} · … · a_m)

(``StopRule``). The rule reads the draft's own distribution only, never the target's, so
output stays exactly the target's (docs/exactness.md); live and replay apply the same
``StopRule.stops``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from autospec.traces import CONFIDENCE_BINS as BINS
from autospec.traces import CONFIDENCE_SCALE, UNOBSERVED, evidence

from .params import CONSTANTS

__all__ = ["BINS", "bin_of", "calibrated", "confident", "StopRule", "stop_rule"]


def bin_of(confidence: int) -> int:
    """The bin of a stored confidence byte (0 … 254)."""
    return min(BINS - 1, confidence * BINS // CONFIDENCE_SCALE)


def confident(values: Sequence[int], confidences: Sequence[int], greedy: bool
              ) -> list[tuple[int, float]]:
    """(confidence byte, acceptance) of each token of a block on the target's prefix where
    both were observed: ``values`` its trace bytes, ``confidences`` the draft's."""
    return [(int(c), evidence(v, greedy)) for v, c in zip(values, confidences)
            if v != UNOBSERVED and c != UNOBSERVED]


def calibrated(hits: Sequence[float], seen: Sequence[float],
               prior: float = CONSTANTS.calibration_prior) -> tuple[float, ...]:
    """Acceptance per confidence bin from counts per bin (``hits`` of ``seen``), each pulled
    toward its bin's centre by ``prior`` observations (a draft as often right as it is
    confident) and kept non-decreasing in confidence (a more confident draft is never read as
    less often right: pooled adjacent violators)."""
    raw = [((b + 0.5) / BINS * prior + h) / (prior + n)
           for b, (h, n) in enumerate(zip(hits, seen))]
    weights = [prior + n for n in seen]
    blocks: list[list[float]] = []  # [value, weight, bins]
    for v, w in zip(raw, weights):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, c2 = blocks.pop()
            v1, w1, c1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    out: list[float] = []
    for v, _w, c in blocks:
        out += [v] * int(c)
    return tuple(out)


class StopRule(NamedTuple):
    """Per confidence bin, the acceptance of a token proposed there (``accept``); per
    position i (0-based: after the draft proposed token i + 1), the probability of the block
    so far being accepted below which drafting stops (``bars``; none past them). The last
    bar may be ≥ 1: the block ends there whatever the draft's confidence (``longest``)."""

    accept: tuple[float, ...]
    bars: tuple[float, ...]
    # the category's acceptance at each position (0-based) before the draft proposed it:
    # a token whose confidence was not read counts at it
    expect: tuple[float, ...] = ()
    # what each bar is made of: the seconds token i + 2 costs (for every i < k − 1, past the
    # last bar too), and a token's worth
    extra: tuple[float, ...] = ()
    worth: float = 0.0

    def step(self, i: int, q: float, confidence: int) -> float:
        """q after token i + 1 (0-based i) proposed with ``confidence`` (a byte; unobserved:
        at the category's acceptance there)."""
        if confidence == UNOBSERVED:
            return q * (self.expect[min(i, len(self.expect) - 1)] if self.expect else 1.0)
        return q * self.accept[bin_of(confidence)]

    def stops(self, i: int, q: float) -> bool:
        """Whether drafting stops after token i + 1 (0-based i) with the block so far
        accepted with probability q."""
        return i < len(self.bars) and q < self.bars[i]

    def unread(self, k: int) -> int:
        """The tokens a block of ``k`` under this rule drafts where no confidence is read:
        each token at the category's acceptance there (a simulation without a draft)."""
        q = 1.0
        for i in range(k - 1):
            q = self.step(i, q, UNOBSERVED)
            if self.stops(i, q):
                return i + 1
        return k

    @property
    def longest(self) -> int:
        """The most tokens a block under this rule drafts."""
        return len(self.bars) + (0 if self.bars and self.bars[-1] >= 1 else 1)

    def describe(self) -> dict:
        """The rule as its decision record keeps it (docs/policy.md, "The record's format")."""
        return {"accept": list(self.accept), "bars": list(self.bars), "expect": list(self.expect),
                "extra_s": list(self.extra), "worth_s": self.worth}


def stop_rule(accept: Sequence[float], curve: Sequence[float], t_draft: float,
              cost: Callable[[int], float], rate: float, k: int) -> StopRule:
    """The rule for a block of at most ``k`` draft tokens: bar_i for i = 0 … k − 2 from the
    draft's step ``t_draft``, the verification cost T_t(n) (``cost``), the worth of a token
    (``rate``, seconds) and the category's acceptance per position (``curve``; past it, its
    last value) — up to the first bar no confidence can pass (≥ 1)."""
    n = max(0, k - 1)
    expect = [float(curve[i] if i < len(curve) else (curve[-1] if curve else 0.0))
              for i in range(max(1, k))]
    extras = [float(t_draft + max(0.0, cost(i + 3) - cost(i + 2))) for i in range(n)]
    nexts = expect[1:]
    bars = []
    for i in range(n):  # the cheapest way on: tokens i + 2 … j + 2 at their seconds per token
        spent, tokens, run, bar = 0.0, 0.0, 1.0, float("inf")
        for j in range(i, n):
            spent += extras[j]
            run *= nexts[j]
            tokens += run
            if tokens > 0:
                bar = min(bar, spent / (rate * tokens))
        bars.append(bar)
        if bar >= 1:  # no confidence can make the tokens past here pay: the block ends
            break
    return StopRule(tuple(float(a) for a in accept), tuple(bars), tuple(expect),
                    tuple(extras), float(rate))
