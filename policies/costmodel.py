"""The cost model of DESIGN.md, in plain Python (no torch).

Expected tokens per iteration with per-position acceptance a_i:
    E[N](k) = 1 + Σ_{i ≤ k} a_1 · … · a_i          (constant α: (1 − α^{k+1}) / (1 − α))
Time per iteration: k · T_d + T_t(k + 1), where T_t(n) is the target's time to score n tokens.
Speedup over plain decoding, the draft's own cost included:
    S(k) = E[N](k) · T_t(1) / (k · T_d + T_t(k + 1)),   S(0) = 1.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

__all__ = ["expected_tokens", "speedup", "best_k", "interpolate_cost",
           "conditional_from_cumulative", "CostModelPolicy"]


def _rate(acceptance: Sequence[float | None], i: int) -> float:
    """Acceptance at position i (0-based); past the measured positions, the last one."""
    known = [a for a in acceptance if a is not None]
    if not known:
        return 0.0
    if i < len(acceptance) and acceptance[i] is not None:
        return float(acceptance[i])
    return float(known[-1])


def expected_tokens(acceptance: Sequence[float | None] | float, k: int) -> float:
    """E[N](k): tokens one iteration of lookahead k yields (accepted + the one more)."""
    if isinstance(acceptance, (int, float)):
        acceptance = [float(acceptance)]
    total, run = 1.0, 1.0
    for i in range(k):
        run *= _rate(acceptance, i)
        total += run
    return total


def conditional_from_cumulative(cum: Sequence[float | None]) -> list[float | None]:
    """vLLM-style per-position rates c_i = P(draft token i accepted) → the conditional
    a_i = P(accepted at i | accepted before i) = c_i / c_{i−1} that ``expected_tokens`` takes.
    Exact for counts gathered at a constant k, and for greedy traffic at any k."""
    out: list[float | None] = []
    prev = 1.0
    for c in cum:
        if c is None:
            out.append(None)
            continue
        out.append(min(1.0, c / prev) if prev > 0 else 0.0)
        prev = c
    return out


def interpolate_cost(curve: Mapping[int, float], *,
                     optimistic: bool = False) -> Callable[[int], float]:
    """T_t(n) from measured points: linear between them, flat below the first, and extended
    beyond the last along the slope of the last two (verification cost only grows).

    optimistic: the cheapest cost consistent with the points instead — the highest measured
    cost at any n' ≤ n (scoring more tokens never costs less), flat beyond the last point. A
    policy that decides by it tries each unmeasured n it might prefer, once, and learns its
    real cost; linear interpolation would hide a step (e.g. flat to 3 tokens, then doubling)
    it never measures. (Extrapolating linearly instead let one early rejection stop all
    drafting in fp32 on the real pair: optimism keeps the evidence coming.)
    """
    pts = sorted((int(n), float(t)) for n, t in curve.items() if t is not None and t > 0)
    if not pts:
        raise ValueError("no measured target costs")
    def cost(n: int) -> float:
        if optimistic and n >= pts[0][0]:
            return max(t for m, t in pts if m <= n)  # the cheapest cost consistent with pts
        return linear(n)

    def linear(n: int) -> float:
        if n <= pts[0][0]:
            return pts[0][1]
        for (n0, t0), (n1, t1) in zip(pts, pts[1:]):
            if n <= n1:
                return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
        if len(pts) == 1:
            return pts[-1][1]
        (n0, t0), (n1, t1) = pts[-2], pts[-1]
        return t1 + max(0.0, (t1 - t0) / (n1 - n0)) * (n - n1)

    return cost


def speedup(k: int, acceptance, t_draft: float,
            t_target: Mapping[int, float] | Callable[[int], float]) -> float:
    """S(k) against plain decoding (k = 0), counting the draft's cost."""
    cost = t_target if callable(t_target) else interpolate_cost(t_target)
    if k == 0:
        return 1.0
    return expected_tokens(acceptance, k) * cost(1) / (k * t_draft + cost(k + 1))


def best_k(acceptance, t_draft: float, t_target, k_max: int) -> tuple[int, float]:
    """argmax_k S(k) over 0 … k_max, and that S."""
    cost = t_target if callable(t_target) else interpolate_cost(t_target)
    return max(((k, speedup(k, acceptance, t_draft, cost)) for k in range(k_max + 1)),
               key=lambda ks: (ks[1], -ks[0]))


class CostModelPolicy:
    """argmax_k S(k) from the category's live acceptance posterior and measured costs.

    Exploration: while T_t(1) is unmeasured it runs k = 0 once (that is plain decoding, and
    measures the baseline); while the draft is unmeasured it runs ``initial_k``; an unmeasured
    T_t(n) is taken at its cheapest possible value (optimism), so any k that might be better
    gets run, and measured, once. Off is never forever: after ``reprobe_every``
    consecutive iterations at k = 0 it runs one iteration at ``probe_k`` to refresh the
    acceptance estimate (overhead ≤ probe_k · c / reprobe_every of plain decoding, c = T_d/T_t(1)),
    and discounting in ``LiveStats`` lets old evidence fade.
    """

    def __init__(self, *, initial_k: int = 3, reprobe_every: int = 64, probe_k: int = 1,
                 name: str = "costmodel"):
        self.initial_k, self.reprobe_every, self.probe_k = initial_k, reprobe_every, probe_k
        self.name = name
        self._off: dict[str, int] = {}  # category → consecutive k = 0 choices

    def choose(self, context) -> int:
        live = context.live
        if live is None:
            return min(self.initial_k, context.k_max)
        if 1 not in live.t_target:
            return 0
        if live.t_draft is None or len(live.t_target) < 2:
            return min(self.initial_k, context.k_max)
        k, _ = best_k(live.acceptance_curve(context.k_max), live.t_draft,
                      live.cost(optimistic=True), context.k_max)
        if k > 0:
            self._off[context.category] = 0
            return k
        off = self._off.get(context.category, 0) + 1
        if off >= self.reprobe_every:
            off = 0
            k = min(self.probe_k, context.k_max)
        self._off[context.category] = off
        return k

    def update(self, context, k: int, outcome) -> None:
        return None  # everything it needs is in context.live, fed by the loop
