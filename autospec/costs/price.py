"""The objective's arithmetic (docs/policy.md, "One quantity: the time to finish"): what a block
of k tokens is expected to yield and to cost, and which k pays, from acceptance curves and
measured costs. Pure functions: the policy (``policies.costmodel``) decides by them, and the
cost table, the report, the export, the tuner and the vLLM proposer price by the same ones.

A block b yields E[N_b] = 1 + Σ_{i ≤ k} a_1 · … · a_i tokens and costs
C_b = k · T_propose + T_t(k + 1) + E[N_b] · x_b seconds (x_b: the draft model's catch-up per
token it serves); at batch B, Σ E[N_i] − B + 1 batch tokens beyond a plain step's B — the
draft's block that runs to the rows' end is priced by when the last row finishes
(``finish_speedups``: each row ``expected_max(B)`` spreads of its block count late).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from statistics import NormalDist
from typing import NamedTuple

from autospec.costs.measure import MEASURE

__all__ = ["expected_tokens", "conditional_from_cumulative", "acceptance_cap",
           "interpolate_cost", "speedup", "best_k", "Offer", "offer", "rows_offer", "valued",
           "saved", "best_offer", "induced_catch_up", "catch_up_per_token", "batch_best_k",
           "batch_finish_k", "expected_max", "finish_speedups", "finish_seconds",
           "finish_tokens"]


def _last_known(acceptance: Sequence[float | None]) -> float:
    """The rate past the measured positions (and at an unmeasured one): the last measured
    one; 0 where none is."""
    for a in reversed(acceptance):
        if a is not None:
            return float(a)
    return 0.0


def expected_tokens(acceptance: Sequence[float | None] | float, k: int) -> float:
    """E[N](k) = 1 + Σ_{i ≤ k} a_1 · … · a_i: tokens one iteration of lookahead k yields."""
    rates = [float(acceptance)] if isinstance(acceptance, (int, float)) else acceptance
    last, total, run = _last_known(rates), 1.0, 1.0
    for i in range(k):
        run *= last if i >= len(rates) or rates[i] is None else float(rates[i])
        total += run
    return total


def conditional_from_cumulative(cum: Sequence[float | None]) -> list[float | None]:
    """vLLM-style per-position rates c_i = P(draft token i accepted) → the conditional
    a_i = c_i / c_{i−1} that ``expected_tokens`` takes (exact at a constant k, and for greedy
    traffic at any k)."""
    out: list[float | None] = []
    prev = 1.0
    for c in cum:
        if c is None:
            out.append(None)
            continue
        out.append(min(1.0, c / prev) if prev > 0 else 0.0)
        prev = c
    return out


def acceptance_cap(acceptance, k_max: int, marginal: float = MEASURE.marginal) -> int:
    """The largest k ≤ ``k_max`` (at least 1) whose last token is accepted with probability
    a_1 · … · a_k ≥ ``marginal``: past it a position adds under ``marginal`` tokens, so only
    a nearly free verification curve (which timings at different loads can fake) pays for it.
    At α = 0.13 the cap is 1, at 0.5 it is 3, at 0.8 it is 10."""
    if isinstance(acceptance, (int, float)):
        acceptance = [float(acceptance)]
    last = _last_known(acceptance)
    run, cap = 1.0, 1
    for k in range(1, k_max + 1):
        a = acceptance[k - 1] if k - 1 < len(acceptance) else None
        run *= last if a is None else float(a)
        if run < marginal:
            break
        cap = k
    return max(1, min(cap, k_max))


def interpolate_cost(curve: Mapping[int, float], *, optimistic: bool = False,
                     noise: float = MEASURE.cost_noise) -> Callable[[int], float]:
    """T_t(n) from measured points: linear between them, flat below the first, extended
    beyond the last along the slope of the last two.

    optimistic: the cheapest cost the points make plausible instead (docs/policy.md,
    "Optimism about unmeasured costs"), so a policy tries an unmeasured n it might prefer
    once: never below the highest cost measured at any n' ≤ n (a measured point too: where a
    smaller n cost more, as a one-token forward can on a CPU, it reads at that ceiling);
    between two points, at least the neighbouring segments continued into the gap, those
    continuations capped at the chord; beyond the last point, its cost plus the average slope
    from the first — each less ``noise`` × the first point's cost, so a rise within timing
    noise reads as none.
    """
    pts = sorted((int(n), float(t)) for n, t in curve.items() if t is not None and t > 0)
    if not pts:
        raise ValueError("no measured target costs")
    ns = [n for n, _ in pts]
    ts = [t for _, t in pts]
    ceiling = list(itertools.accumulate(ts, max))  # max cost at n' ≤ n_i
    slack = noise * ts[0]
    rise = (max(0.0, ceiling[-1] - ts[0] - slack) / (ns[-1] - ns[0]) if len(pts) > 1 else 0.0)

    def slope(i: int) -> float:  # of the segment from point i to point i + 1
        return max(0.0, (ts[i + 1] - ts[i]) / (ns[i + 1] - ns[i]))

    memo: dict[int, float] = {}  # a decision reads each n several times

    def cost(n: int) -> float:
        value = memo.get(n)
        if value is None:
            value = memo[n] = shaped(n)
        return value

    def shaped(n: int) -> float:
        if not optimistic or n < ns[0]:
            return linear(n)
        i = bisect.bisect_right(ns, n) - 1
        if i == len(pts) - 1:  # at or beyond the last point
            return ceiling[i] + rise * (n - ns[i])
        if n == ns[i]:
            return ceiling[i]
        bound = ceiling[i]
        if i >= 1:  # the segment ending at point i, continued
            bound = max(bound, ts[i] + slope(i - 1) * (n - ns[i]) - slack)
        if i + 2 < len(pts):  # the segment starting at point i + 1, continued backwards
            bound = max(bound, ts[i + 1] - slope(i + 1) * (ns[i + 1] - n) - slack)
        return max(ceiling[i], min(bound, linear(n)))

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


def _as_cost(t_target) -> Callable[[int], float]:
    return t_target if callable(t_target) else interpolate_cost(t_target)


def speedup(k: int, acceptance, t_draft: float,
            t_target: Mapping[int, float] | Callable[[int], float],
            per_token: float = 0.0) -> float:
    """S(k) = E[N] · T_t(1) / (k · T_d + T_t(k + 1) + E[N] · per_token); S(0) = 1."""
    cost = _as_cost(t_target)
    return valued(offer("model", acceptance, k, t_draft, cost, per_token), cost(1)) if k else 1.0


def best_k(acceptance, t_draft: float, t_target, k_max: int,
           per_token: float = 0.0) -> tuple[int, float]:
    """argmax_k S(k) over 0 … k_max and that S (the smallest k among ties): ``batch_best_k``
    of one row. per_token: seconds more per token the block yields (a catch-up shared over the
    tokens the draft will serve)."""
    return batch_best_k([acceptance], t_draft, t_target, k_max, per_token)


class Offer(NamedTuple):
    """A candidate block: E[N] ``tokens`` for ``seconds`` = k · T_propose + T_t(k + 1) +
    E[N] · per_token; ``induced``: seconds it adds to another proposer's next step (a lookup
    block's share of the draft model's catch-up)."""

    proposer: str
    k: int
    tokens: float
    seconds: float
    induced: float = 0.0


def offer(proposer: str, acceptance, k: int, t_propose: float, cost: Callable[[int], float],
          per_token: float = 0.0) -> Offer:
    """The block of k a proposer with per-position ``acceptance`` drafts."""
    return rows_offer(proposer, [acceptance], k, t_propose, cost, per_token)


def rows_offer(proposer: str, curves: Sequence, k: int, t_propose: float,
               cost: Callable[[int], float], per_token: float = 0.0) -> Offer:
    """The block of k for rows accepting along ``curves`` (one per row), in batch tokens:
    Σ E[N_i] − B + 1 (what it yields beyond a plain step's B, plus that step's one; E[N] at
    one row) for k · T_p + T_t(k + 1) + Σ E[N_i] · per_token."""
    tokens = sum(expected_tokens(c, k) for c in curves)
    return Offer(proposer, k, tokens - (len(curves) - 1),
                 k * t_propose + cost(k + 1) + tokens * per_token)


def valued(b: Offer, t_plain: float, rate: float | None = None) -> float:
    """S of ``b`` against one plain step when the tokens past its first are worth ``rate``
    seconds each (None: T_t(1), the ratio S(k)): (T_t(1) + (E[N] − 1) · ρ) / C."""
    if rate is None:
        return b.tokens * t_plain / b.seconds
    return (t_plain + (b.tokens - 1) * rate) / b.seconds


def saved(b: Offer, t_plain: float, rate: float | None = None) -> float:
    """Seconds ``b`` saves against plain steps with the rest running at ``rate``:
    T_t(1) + (E[N] − 1) · ρ − C − induced."""
    rate = t_plain if rate is None else rate
    return t_plain + (b.tokens - 1) * rate - b.seconds - b.induced


def best_offer(blocks: Sequence[Offer], t_plain: float, rate: float | None,
           min_gain: float) -> Offer | None:
    """The one decision: among the blocks that pay (``valued`` ≥ 1 + ``min_gain``), the one
    that saves the most seconds (the first among ties); None: a plain step."""
    best, most = None, -math.inf
    for b in blocks:
        if b.k <= 0 or valued(b, t_plain, rate) < 1 + min_gain:
            continue
        s = saved(b, t_plain, rate)
        if s > most:
            best, most = b, s
    return best


def induced_catch_up(costs, gap: int, tokens: float) -> float:
    """Seconds a lookup block emitting ``tokens`` adds to the draft model's next step where a
    draft block was the alternative: C(gap + tokens) against that step's own cost (T_d after
    a draft block; C(gap) when it was behind already), by ``costs`` (the pair's at this path
    and batch size, a ``CostRow``). 0 while no catch-up was measured."""
    if costs is None:
        return 0.0
    after = costs.catch_up_cost(max(1, round(gap + tokens)))
    if after is None:
        return 0.0
    before = (costs.draft_cost() or 0.0) if gap <= 2 else (costs.catch_up_cost(gap) or 0.0)
    return max(0.0, after - before)


def catch_up_per_token(costs, gap: int, served: float, *, rows: int = 1,
                       t_draft: float | None = None) -> float:
    """The draft model's catch-up over the ``gap`` tokens it has not seen, less the one
    proposal it replaces (T_d), per token of the ``served`` it will then serve, by ``costs``
    (a ``CostRow``); 0 for the usual gap of one or two tokens and while no catch-up was
    measured. At batch (``rows`` > 1, ``gap`` the widest row's) one forward of rows × gap
    slots, less one draft step of the batch (``t_draft``, T_d(B))."""
    if gap <= 2 or costs is None:
        return 0.0
    cost = costs.catch_up_cost(gap * max(1, rows))
    if cost is None:
        return 0.0
    step = costs.draft_cost() if t_draft is None else t_draft
    return max(0.0, cost - (step or 0.0)) / max(1.0, served)


def batch_best_k(curves: Sequence, t_draft: float, cost, k_max: int,
                 per_token: float = 0.0) -> tuple[int, float]:
    """argmax_k S_B(k) over 0 … k_max for a batch whose row i accepts along ``curves[i]``,
    and that S against plain batched decoding at B = len(curves) (the smallest k among ties):
    S_B(k) = Σ E[N_i] · T_t(B, 1) / (B · (k · T_d(B) + T_t(B, k + 1) + Σ E[N_i] · per_token))."""
    cost = _as_cost(cost)
    rows = len(curves)
    if rows == 0:
        return 0, 1.0
    t1 = cost(1)
    best, best_s = 0, 1.0
    for k, expected in enumerate(_row_expected(curves, k_max), start=1):
        tokens = sum(expected)
        s = tokens * t1 / (rows * (k * t_draft + cost(k + 1) + tokens * per_token))
        if s > best_s:
            best, best_s = k, s
    return best, best_s


def _row_expected(curves: Sequence, k_max: int, *, moments: bool = False):
    """For k = 1 … k_max: each row's E[N](k) along its curve (a per-position list or a
    constant α) — with ``moments``, (E[N](k), Var[N](k)) — rows that share a curve object
    computed once. Var from the survival P(N ≥ j): E[N²] = Σ_j (2j − 1) · P(N ≥ j)."""
    # id → [rates, rate past them, a_1 · … · a_k, E[N](k), E[N²](k)]
    groups: dict[int, list] = {}
    for c in curves:
        if id(c) not in groups:
            rates = [float(c)] if isinstance(c, (int, float)) else list(c)
            groups[id(c)] = [rates, _last_known(rates), 1.0, 1.0, 1.0]
    of_row = [groups[id(c)] for c in curves]
    for k in range(1, k_max + 1):
        for g in groups.values():
            a = g[0][k - 1] if k - 1 < len(g[0]) else None
            g[2] *= g[1] if a is None else float(a)
            g[3] += g[2]
            g[4] += (2 * k + 1) * g[2]
        yield ([(g[3], max(0.0, g[4] - g[3] ** 2)) for g in of_row] if moments
               else [g[3] for g in of_row])


def expected_max(n: int) -> float:
    """E[max of n independent standard normals] (Blom's approximation; 0 at n = 1)."""
    return 0.0 if n <= 1 else NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def finish_speedups(curves: Sequence, remaining: Sequence[int],
                    step_cost: Callable[[int, int], float], k_max: int,
                    once: float = 0.0) -> list[float]:
    """For k = 1 … k_max, how much sooner a batch's last row finishes at k than by plain
    batched decoding (S_fin(k); ``batch_finish_k`` takes the best).

    Row i needs ``remaining[i]`` / E[N_i](k) more iterations (at least one) on average,
    with spread √(r · Var[N_i] / E[N_i]³) (how many blocks reach r tokens), and a call waits
    for its last row: each row is read ``expected_max(B)`` spreads late, where the last of
    B alike rows is expected (plain steps do not spread: every one emits one token; at one
    row this is E[N]'s S). Rows leave as they finish, so the time is Σ over phases of
    iterations × ``step_cost(b, k)`` with b the rows still running (k = 0: T_t(b, 1);
    ``finish_seconds``), plus ``once`` (paid once at k > 0: the draft's catch-up)."""
    rows = len(curves)
    left = [max(1.0, float(r)) for r in remaining]
    if len(left) != rows:
        raise ValueError(f"{rows} curves but {len(left)} remaining counts")
    if rows == 0:
        return [1.0] * k_max

    late = expected_max(rows)

    def finish(k: int, moments) -> float:  # a row's iterations: r / μ, sd √(r σ² / μ³)
        return finish_seconds([max(1.0, r / e + late * math.sqrt(r * v / e ** 3))
                               for r, (e, v) in zip(left, moments)], step_cost, k)

    plain = finish(0, [(1.0, 0.0)] * rows)
    return [plain / (finish(k, moments) + once)
            for k, moments in enumerate(_row_expected(curves, k_max, moments=True), start=1)]


def batch_finish_k(curves: Sequence, remaining: Sequence[int],
                   step_cost: Callable[[int, int], float], k_max: int,
                   once: float = 0.0) -> tuple[int, float]:
    """argmax_k over 0 … k_max of ``finish_speedups`` (the smallest k among ties; S(0) = 1)
    and that S."""
    best, best_s = 0, 1.0
    for k, s in enumerate(finish_speedups(curves, remaining, step_cost, k_max, once), start=1):
        if s > best_s:
            best, best_s = k, s
    return best, best_s


def finish_seconds(need: Sequence[float], step_cost: Callable[[int, int], float],
                   k: int = 0) -> float:
    """Seconds until the last of a batch's rows is done, row i after ``need[i]`` more
    iterations at k, rows leaving as they finish: Σ over phases of iterations ×
    ``step_cost(b, k)``, b the rows still running."""
    total, done, rows = 0.0, 0.0, len(need)
    for j, n in enumerate(sorted(need)):
        if n > done:
            total += (n - done) * step_cost(rows - j, k)
            done = n
    return total


def finish_tokens(expected: Sequence[float], remaining: Sequence[int],
                  step_cost: Callable[[int, int], float], rate: float) -> float:
    """One block's batch tokens as the rows' finish counts them: 1 + the seconds by which it
    brings the end of the rows' plain decoding after it closer than a plain step would
    (rows emitting ``expected[i]`` tokens now, with ``remaining[i]`` left), in tokens worth
    ``rate`` seconds. A token of a row that finishes before the batch's last is worth what
    its row costs a step (the step's cost with it less without it), not the step's share:
    at one row this is E[N]."""
    after_plain = finish_seconds([max(0.0, r - 1.0) for r in remaining], step_cost)
    after = finish_seconds([max(0.0, r - e) for r, e in zip(remaining, expected)], step_cost)
    return 1.0 + (after_plain - after) / rate
