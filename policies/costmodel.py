"""The cost model (docs/policy.md), in plain Python (no torch).

Expected tokens per iteration with per-position acceptance a_i:
    E[N](k) = 1 + Σ_{i ≤ k} a_1 · … · a_i          (constant α: (1 − α^{k+1}) / (1 − α))
Time per iteration: k · T_d + T_t(k + 1), where T_t(n) is the target's time to score n tokens.
Speedup over plain decoding, the draft's own cost included:
    S(k) = E[N](k) · T_t(1) / (k · T_d + T_t(k + 1)),   S(0) = 1.

At batch B (one k for every row; T_t(B, n) scores n tokens in each of B rows, T_d(B) is one
draft step for B rows), against plain batched decoding at the same B:
    S_B(k) = Σ_i E[N_i](k) · T_t(B, 1) / (B · (k · T_d(B) + T_t(B, k + 1))).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import statistics
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence

from . import explain
from .base import K_LIMIT, Choice, batch_bucket
from .params import DEFAULTS, Parameters

_FIELDS = frozenset(f.name for f in dataclasses.fields(Parameters))

__all__ = ["expected_tokens", "speedup", "best_k", "batch_best_k", "interpolate_cost",
           "catch_up_per_token", "valued_speedup", "block_saving", "induced_catch_up",
           "request_ngram_curve", "batch_finish_k", "conditional_from_cumulative",
           "acceptance_cap", "CostModelPolicy"]


def _last_known(acceptance: Sequence[float | None]) -> float:
    """The rate past the measured positions (and at an unmeasured one): the last measured
    one; 0 where none is."""
    for a in reversed(acceptance):
        if a is not None:
            return float(a)
    return 0.0


def expected_tokens(acceptance: Sequence[float | None] | float, k: int) -> float:
    """E[N](k): tokens one iteration of lookahead k yields (accepted + the one more)."""
    if isinstance(acceptance, (int, float)):
        acceptance = [float(acceptance)]
    last = _last_known(acceptance)
    total, run, size = 1.0, 1.0, len(acceptance)
    for i in range(k):
        a = acceptance[i] if i < size else None
        run *= last if a is None else float(a)
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


def acceptance_cap(acceptance, k_max: int, marginal: float = DEFAULTS.marginal) -> int:
    """The largest k ≤ ``k_max`` (at least 1) whose last token is accepted with probability
    a_1 · … · a_k ≥ ``marginal``. With acceptance α a block's expected tokens saturate at
    1 / (1 − α): past this k, a position adds less than ``marginal`` tokens for a draft step
    and a longer verification each, so only a cost curve that is (nearly) free to extend can
    make it pay — which is what timings taken at different loads can fake. At α = 0.13 the
    cap is 1, at 0.5 it is 3, at 0.8 it is 10."""
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


def settle_sample(first: list[float], old: float | None, new: float, settle: int,
                  ema: float) -> float:
    """A live cost point after one more sample: the median of its first ``settle`` samples
    (``first`` collects them, kept by the caller), then an exponential moving average. A
    process's first forwards at a size run slow (fresh allocations), and one of them taken
    alone as the point would misprice every decision until the average had walked it back."""
    if len(first) < settle:
        first.append(new)
        return statistics.median(first)
    return (1 - ema) * old + ema * new


def interpolate_cost(curve: Mapping[int, float], *, optimistic: bool = False,
                     noise: float = DEFAULTS.cost_noise) -> Callable[[int], float]:
    """T_t(n) from measured points: linear between them, flat below the first, and extended
    beyond the last along the slope of the last two (verification cost only grows).

    optimistic: the cheapest cost the points make plausible instead, so that a policy
    deciding by it tries an unmeasured n it might prefer, once, and learns its real cost
    (linear interpolation hides a step it never measures, e.g. flat to 3 tokens, then
    doubling; extrapolating the slope of two close, noisy points can stop all drafting).
    Scoring more tokens never costs less, so at least the highest
    cost measured at any n' <= n. A cost curve is flat while memory-bound, then grows,
    and its slope only steepens (tile steps aside), so a rise the points show is real:

    - between two measured points, at least the neighbouring segments extended into the
      gap (a segment's slope holds at least until the next point), never above the chord;
    - beyond the last point, its cost plus the average slope from the first point (the
      least a curve whose slope only steepens can grow by);

    each less ``noise`` x the first point's cost, so a rise within a live timing's
    noise reads as none: a flat curve (memory-bound, a GPU's and most CPUs' batch-1 regime)
    keeps the plain optimism, flat beyond the last point; on a compute-bound curve a flat
    extension would read T_t(16) = T_t(4) and send a cold policy to try the longest blocks,
    each at the cost of many plain steps, where it should switch off.
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


def speedup(k: int, acceptance, t_draft: float,
            t_target: Mapping[int, float] | Callable[[int], float],
            per_token: float = 0.0) -> float:
    """S(k) against plain decoding (k = 0), counting the draft's cost, as ``best_k`` reads
    it: E[N] · T_t(1) / (k · T_d + T_t(k + 1) + E[N] · per_token)."""
    cost = t_target if callable(t_target) else interpolate_cost(t_target)
    if k == 0:
        return 1.0
    tokens = expected_tokens(acceptance, k)
    return tokens * cost(1) / (k * t_draft + cost(k + 1) + tokens * per_token)


def best_k(acceptance, t_draft: float, t_target, k_max: int,
           per_token: float = 0.0) -> tuple[int, float]:
    """argmax_k S(k) over 0 … k_max, and that S (the smallest k among ties). One pass: E[N]
    grows by one product per k, so this is O(k_max) — it runs every iteration.

    per_token: seconds more per token drafting yields, beyond the iteration's own cost (a
    catch-up paid once and shared over the tokens the draft will serve): S(k) =
    E[N] · T_t(1) / (k · T_d + T_t(k + 1) + E[N] · per_token)."""
    cost = t_target if callable(t_target) else interpolate_cost(t_target)
    if isinstance(acceptance, (int, float)):
        acceptance = [float(acceptance)]
    last = _last_known(acceptance)
    t1 = cost(1)
    best, best_s = 0, 1.0
    run, tokens = 1.0, 1.0
    for k in range(1, k_max + 1):
        a = acceptance[k - 1] if k - 1 < len(acceptance) else None
        run *= last if a is None else float(a)
        tokens += run
        s = tokens * t1 / (k * t_draft + cost(k + 1) + tokens * per_token)
        if s > best_s:
            best, best_s = k, s
    return best, best_s


def valued_speedup(acceptance, k: int, t_draft: float, cost, per_token: float,
                   value: float) -> float:
    """A block of k against one plain step when the tokens past its first are worth
    ``value`` seconds each — the rate the rest of the request will run at — rather than
    T_t(1): (T_t(1) + (E[N] − 1) · value) / (k · T_d + T_t(k + 1) + E[N] · per_token). A
    block's first token saves a plain step; the others only save what covering them
    otherwise would cost. The switch point is S's (``best_k``) wherever this block's own
    proposer sets the rate (value = its cost per token); where a cheaper one does (prompt
    lookup on copy-heavy traffic), dear blocks lose. The cost model picks each proposer's k by S (the k that
    serves tokens at the best rate) and decides by this whether the block beats a plain step
    and which proposer's does: valuing tokens below T_t(1) in the argmax too shortened every
    n-gram block on copy-heavy traffic, where the n-gram itself sets the rate."""
    cost = cost if callable(cost) else interpolate_cost(cost)
    tokens = expected_tokens(acceptance, k)
    return ((cost(1) + (tokens - 1) * value)
            / (k * t_draft + cost(k + 1) + tokens * per_token))


def block_saving(acceptance, k: int, t_draft: float, cost, per_token: float,
                 value: float) -> float:
    """Seconds a block of k saves against producing its tokens at ``value`` seconds each
    and paying a plain step for the first: T_t(1) + (E[N] − 1) · value − (k · T_d +
    T_t(k + 1) + E[N] · per_token). ``valued_speedup`` is the ratio of the same two terms;
    both say whether a block beats a plain step, but only this difference ranks two
    blocks: with the rest of the request running at ``value`` seconds per token, the one
    that saves more seconds ends it sooner (the renewal-reward rule: argmax E[N] · v − C).
    The ratio ranks a cheap block above a dear one that saves as much or more: a
    prompt-lookup block from a 1-token chance match can out-rank the draft model's block by
    the ratio while saving no more seconds."""
    cost = cost if callable(cost) else interpolate_cost(cost)
    tokens = expected_tokens(acceptance, k)
    return (cost(1) + (tokens - 1) * value) - (k * t_draft + cost(k + 1) + tokens * per_token)


def induced_catch_up(live, gap: int, tokens: float) -> float:
    """Seconds an n-gram block emitting ``tokens`` adds to the draft model's next step, where
    a draft block was the alternative: the draft must then take those tokens in before it
    proposes, C(gap + tokens) against what that step would have cost (one proposal, T_d,
    after a draft block; C(gap) when it was behind already). 0 while no catch-up was
    measured. Uncharged, lookup blocks on chance matches look free while each makes the
    draft's next step a catch-up dearer than a proposal."""
    if live is None:
        return 0.0
    after = live.catch_up_cost(max(1, round(gap + tokens)))
    if after is None:
        return 0.0
    before = (live.t_draft or 0.0) if gap <= 2 else (live.catch_up_cost(gap) or 0.0)
    return max(0.0, after - before)


def _priced(curve, k: int, t_propose: float, cost, per_token: float, value: float | None,
            s: float) -> tuple[float, float]:
    """(S, seconds saved) of a proposer's block of k at batch 1: S valued at the request's
    rate where there is one (else best_k's ``s`` stands), and ``block_saving`` at that rate
    (else T_t(1))."""
    v = cost(1) if value is None else value
    if value is not None:
        s = valued_speedup(curve, k, t_propose, cost, per_token, value)
    return s, block_saving(curve, k, t_propose, cost, per_token, v)


def request_ngram_curve(curve: Sequence[float], context, match: int = 0, *,
                        proposer: str = "ngram",
                        prior_blocks: float = DEFAULTS.request_prior_blocks) -> list[float]:
    """The n-gram proposer's acceptance curve for this request: the category's (``curve``,
    for a match of ``match`` tokens; 0: any), per position pulled toward this request's own
    blocks and shadow so far from a match that long (``context.request``), which count
    against ``prior_blocks`` blocks of the category's. A request of a copy-heavy
    category that has nothing to copy (its matches fail at once) stops proposing long n-gram
    blocks after a few; one that copies well proposes longer ones than its category's
    average. Only the same match length's blocks pull: a request's failed chance hits say
    nothing about its copy runs (pooled, they shortened its blocks inside quotations).
    ``proposer``: the lookup proposer ("ngram" or "suffix"), by the same rule."""
    req = getattr(context, "request", None)
    if req is None:
        return list(curve)
    accepted, reached = req.ngram_counts(match, proposer=proposer)
    if reached[0] <= 0:
        return list(curve)
    w = prior_blocks
    return [(c * w + accepted[i]) / (w + reached[i]) if i < len(reached) else c
            for i, c in enumerate(curve)]


LOOKUP_PROPOSERS = ("ngram", "suffix")  # the proposers whose blocks are host lookups


def lookup_now(context, proposer: str, row: int | None = None) -> tuple[int, int]:
    """(match length, tokens its block may hold) of a lookup proposer now: prompt lookup's
    block is as long as the policy asks; suffix decoding's at most what its draft holds
    (``context.suffix_length``). ``row``: that row's, at batch > 1."""
    if proposer == "suffix":
        if row is None:
            return getattr(context, "suffix_match", 0), getattr(context, "suffix_length", 0)
        matches = getattr(context, "suffix_matches", ()) or ()
        sizes = getattr(context, "suffix_lengths", ()) or ()
        return ((matches[row], sizes[row]) if row < len(matches) and row < len(sizes)
                else (0, 0))
    if row is None:
        return getattr(context, "ngram_match", 0), K_LIMIT
    matches = getattr(context, "ngram_matches", ()) or ()
    return (matches[row] if row < len(matches) else 0), K_LIMIT


def held(curve: Sequence[float], size: int) -> list[float]:
    """``curve`` for a block that holds at most ``size`` tokens: nothing is accepted past
    them (a longer k would score more tokens for no more kept)."""
    return list(curve[:size]) + [0.0] * max(0, len(curve) - size)


def catch_up_per_token(live, gap: int, served: float, *, rows: int = 1,
                       t_draft: float | None = None) -> float:
    """What resuming the draft model costs per token it will then serve: the catch-up over
    the ``gap`` tokens it has not seen, less the one proposal it replaces (T_d), shared over
    ``served`` tokens. Zero for the usual gap of one or two tokens after a draft block, and
    while no catch-up has been measured (optimism: the first one measures it).

    At batch (``rows`` > 1, ``gap`` the widest row's): the catch-up forward is one block of
    rows × gap slots (rows with less to take in are padded within it), priced by the fit at
    that many tokens, less one draft step of the batch (``t_draft``, T_d(B))."""
    if gap <= 2 or live is None:
        return 0.0
    cost = live.catch_up_cost(gap * max(1, rows))
    if cost is None:
        return 0.0
    step = live.t_draft if t_draft is None else t_draft
    return max(0.0, cost - (step or 0.0)) / max(1.0, served)


def batch_best_k(curves: Sequence, t_draft: float, cost, k_max: int,
                 per_token: float = 0.0) -> tuple[int, float]:
    """argmax_k S_B(k) over 0 … k_max for a batch whose row i accepts along ``curves[i]`` (a
    per-position list or a constant α), and that S against plain batched decoding at the same
    B = len(curves) (the smallest k among ties; S_B(0) = 1). ``cost``: T_t(B, ·) as a mapping
    n → seconds or a function. Rows that share a curve object are computed once.

    per_token: seconds more per token of the batch that drafting yields (the draft model's
    catch-up shared over the tokens it will serve, as ``best_k``'s): S_B(k) =
    Σ E[N_i] · T_t(B, 1) / (B · (k · T_d(B) + T_t(B, k + 1) + Σ E[N_i] · per_token))."""
    cost = cost if callable(cost) else interpolate_cost(cost)
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


def _row_expected(curves: Sequence, k_max: int):
    """For k = 1 … k_max: each row's E[N](k), the row accepting along its curve (a
    per-position list, None past what is known meaning the last known rate, or a constant α).
    Rows that share a curve object are computed once: one running product per curve."""
    groups: dict[int, list] = {}  # id → [rates, rate past them, a_1 · … · a_k, E[N](k)]
    for c in curves:
        if id(c) not in groups:
            rates = [float(c)] if isinstance(c, (int, float)) else list(c)
            groups[id(c)] = [rates, _last_known(rates), 1.0, 1.0]
    of_row = [groups[id(c)] for c in curves]
    for k in range(1, k_max + 1):
        for g in groups.values():
            a = g[0][k - 1] if k - 1 < len(g[0]) else None
            g[2] *= g[1] if a is None else float(a)
            g[3] += g[2]
        yield [g[3] for g in of_row]


def batch_finish_k(curves: Sequence, remaining: Sequence[int],
                   step_cost: Callable[[int, int], float], k_max: int,
                   once: float = 0.0) -> tuple[int, float]:
    """argmax_k over 0 … k_max of how much sooner a batch's last row finishes at k than by
    plain batched decoding, and that ratio S (the smallest k among ties; S(0) = 1).

    Row i accepts along ``curves[i]`` (as ``batch_best_k``'s) and has ``remaining[i]`` tokens
    left, so at k it needs remaining[i] / E[N_i](k) more iterations (at least one). Rows
    leave the batch as they finish, so the time is Σ over phases of (iterations in the
    phase) × ``step_cost(b, k)`` with b the rows still running (``step_cost(b, 0)``:
    T_t(b, 1)), plus ``once`` (seconds paid once at k > 0: the draft's catch-up).

    A generate call returns when its last row does: its tokens are fixed, so its tokens per
    second are those of the slowest row's finish. Σ E[N_i] per iteration (``batch_best_k``)
    counts a fast row's tokens as gained even after that row is done while a slow one still
    runs, so on a mixed batch it picks the long blocks the fast rows like and leaves the slow
    row to run on alone at them. For rows of one curve and one remaining length this equals
    ``batch_best_k`` (with once = per_token × Σ remaining)."""
    rows = len(curves)
    if rows == 0:
        return 0, 1.0
    left = [max(1.0, float(r)) for r in remaining]
    if len(left) != rows:
        raise ValueError(f"{rows} curves but {len(left)} remaining counts")

    def finish(k: int, expected) -> float:
        need = sorted(max(1.0, r / e) for r, e in zip(left, expected))
        total, done = 0.0, 0.0
        for j, n in enumerate(need):
            if n > done:
                total += (n - done) * step_cost(rows - j, k)
                done = n
        return total

    plain = finish(0, [1.0] * rows)
    best, best_s = 0, 1.0
    for k, expected in enumerate(_row_expected(curves, k_max), start=1):
        s = plain / (finish(k, expected) + once)
        if s > best_s:
            best, best_s = k, s
    return best, best_s


class CostModelPolicy:
    """argmax_k S(k) from the category's live acceptance posterior and measured costs.

    Exploration: while T_t(1) is unmeasured it runs k = 0 once (that is plain decoding, and
    measures the baseline); while the draft is unmeasured it runs ``initial_k``, and so it does
    where it would switch off a category the draft model has drafted fewer than ``cold_start``
    blocks on (ever, the stored history's included) unless perfect acceptance could not pay;
    an unmeasured T_t(n) is taken at its cheapest possible value (optimism), so any k that
    might be better gets run, and measured, once. Off is never forever: after
    ``reprobe_every`` consecutive iterations without the draft model (k = 0 or n-gram blocks)
    it runs, at the next would-be k = 0, one iteration at ``probe_k`` to refresh the
    acceptance estimate, and discounting in ``LiveStats`` lets old evidence fade. A probe
    costing more than ``reprobe_steps`` plain steps (its block and the draft model's
    catch-up over what it has not seen) waits proportionally longer, so re-probing costs at
    most reprobe_steps / reprobe_every of plain decoding (``_reprobe_after``).

    Every number it decides by is a field of ``params`` (``policies.params.Parameters``:
    each documented there, the defaults the untuned ``"auto"``, the ones ``autospec tune``
    searches marked); keyword arguments override single fields
    (``CostModelPolicy(z=0.5)`` is ``CostModelPolicy(DEFAULTS.but(z=0.5))``).
    - ``proposers``: which proposers it may choose among those the request has: "both"
      (every one: the draft model, and each lookup proposer — prompt lookup, suffix
      decoding — where it has a match now), one of "draft", "ngram", "suffix", or several
      joined by "+" ("draft+suffix"). Each lookup is weighed with its own acceptance
      statistics (per match length) and host time, against the draft model and each other
      by the seconds its block saves.

    At batch > 1 (``context.rows`` and ``context.costs`` given) it chooses one k for the batch:
    the k that finishes the batch's rows soonest against plain batched decoding
    (``batch_finish_k``, each row's tokens left from ``context.remaining_rows``), from each
    row's category statistics and the controller's ``BatchCosts`` at B and at the smaller
    sizes rows leave it at, k = 0 unless some k beats plain by ``min_gain``; the n-gram
    proposer's blocks, which hold for one iteration, by ``batch_best_k``. The same
    exploration, per batch size: T_t(B, 1) unknown → k = 0 (measures plain decoding at B);
    T_d(B) or the rest of T_t(B, ·) unknown → ``initial_k``; off counters are kept per (set
    of categories, batch-size bucket), apart from batch 1's.
    """

    def __init__(self, params: Parameters | None = None, *, name: str = "costmodel",
                 proposers: str = "both", **overrides):
        names = proposers.split("+") if isinstance(proposers, str) else []
        if proposers != "both" and (not names or any(n not in ("draft", "ngram", "suffix")
                                                     for n in names)):
            raise ValueError(f"proposers must be 'both' (every one the request has), a "
                             f"proposer ('draft', 'ngram', 'suffix') or several joined by "
                             f"'+' ('draft+suffix'), got {proposers!r}")
        self.params = (DEFAULTS if params is None else params).but(**overrides)
        self.name = name
        self.proposers = proposers
        self._off: dict[str, int] = {}  # category → consecutive k = 0 choices
        self._off_batch: dict[tuple, int] = {}  # (categories, batch bucket) → the same
        self._moves: dict[str, int] = {}  # category → the LiveStats.level_moves seen last
        self._own: dict[str, object] = {}  # category → own LiveStats (with ``discount``)
        # per LiveStats: (top, counts_version, acceptance curve, version, cost function), each
        # rebuilt only when what it derives from changed or another curve length is asked for
        self._derived: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._derived_ngram: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._derived_lock = threading.Lock()

    def __getattr__(self, name: str):
        """A parameter read off the policy (``policy.z``) is ``policy.params.z``."""
        params = self.__dict__.get("params")
        if params is not None and name in _FIELDS:
            return getattr(params, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __getstate__(self) -> dict:
        # the derived cache and its lock are rebuilt where copied or unpickled
        return {k: v for k, v in self.__dict__.items()
                if k not in ("_derived", "_derived_ngram", "_derived_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._derived = weakref.WeakKeyDictionary()
        self._derived_ngram = weakref.WeakKeyDictionary()
        self._derived_lock = threading.Lock()

    def derived(self, live, top: int) -> tuple[list[float], Callable[[int], float] | None]:
        """(acceptance curve over ``top`` positions, T_t cost function) from ``live``: the
        curve the same object until the draft model's counts change (``counts_version``), the
        cost function until anything does (``version``). Callers only read them."""
        counts, version = live.counts_version, live.version  # read first: built from at least these
        with self._derived_lock:
            hit = self._derived.get(live)
        if hit is not None and hit[0] == top and hit[3] == version:
            return hit[2], hit[4]
        curve = (hit[2] if hit is not None and hit[0] == top and hit[1] == counts
                 else live.acceptance_curve(top, z=self.params.z))
        cost = live.cost(optimistic=self.params.optimistic)
        with self._derived_lock:
            self._derived[live] = (top, counts, curve, version, cost)
        return curve, cost

    def derived_ngram(self, live, top: int, match: int = 0,
                      proposer: str = "ngram") -> list[float]:
        """A lookup proposer's acceptance curve from ``live`` ("ngram" or "suffix") for a
        match of ``match`` tokens (0: any), rebuilt only when the lookups' counts change
        (``live.lookup_version``)."""
        version = live.lookup_version
        key = (proposer, match, top)
        with self._derived_lock:  # (version, {key: curve}): one version at a time
            entry = self._derived_ngram.get(live)
        if entry is not None and entry[0] == version and key in entry[1]:
            return entry[1][key]
        curve = live.ngram_acceptance_curve(top, z=self.params.z, match=match, proposer=proposer)
        with self._derived_lock:
            entry = self._derived_ngram.get(live)
            if entry is None or entry[0] != version:
                entry = self._derived_ngram[live] = (version, {})
            entry[1][key] = curve
        return curve

    def _stats(self, context):
        """The statistics to decide by: the controller's, or (with ``discount``) the
        controller's with our own discounted draft-model acceptance in place of its own."""
        live = context.live
        if self.params.discount is None or live is None:
            return live
        own = self._own.get(context.category)
        if own is None:
            own = self._own[context.category] = live.copy(discount=self.params.discount)
        # only the acceptance is ours: the n-gram's counts, catch-ups, costs and the rate
        # are fed to the controller's statistics alone (a copy of those would freeze them at
        # the first decision: a replayed cold category would never learn that lookup pays)
        return live.copy(acceptance_from=own)

    def choose(self, context) -> int:
        top = context.k_max if self.params.k_cap is None else min(self.params.k_cap, context.k_max)
        asked = getattr(context, "why", None)
        why = None if asked is None else {"candidates": []}
        if _batched(context):
            k, rule = self._choose_batch(context, top, why)
        else:
            k, rule = self._choose_one(context, top, why)
        if asked is not None:
            asked.append(explain.record(k, rule, why["candidates"],
                                        batch=getattr(context, "batch_size", 1),
                                        t_plain=why.get("t_plain"), value=why.get("value"),
                                        min_gain=self.params.min_gain,
                                        busy=why.get("busy", False)))
        return k

    def _choose_one(self, context, top: int, why: dict | None) -> tuple[int, str]:
        """(k, the rule that decided it: ``policies.explain.RULES``) at batch 1; ``why``
        (where asked) collects every candidate priced."""
        live = self._stats(context)
        proposers = self._allowed(context)
        drafts = "draft" in proposers
        lookup = next((p for p in proposers if p in LOOKUP_PROPOSERS), "ngram")
        initial = min(self.params.initial_k, top)
        if live is None:
            return (initial if drafts else Choice(initial, lookup)), "no-stats"
        if not live.settled(1):  # plain steps measure the baseline first
            return 0, "baseline"
        best = (0, 1.0, "draft", 0.0)  # (k, S, proposer, seconds saved: block_saving)
        value = self._token_value(live, context, proposers)
        busy = live.busy() if hasattr(live, "busy") else False
        if why is not None:
            why.update(value=value, busy=busy, t_plain=live.t_target.get(1))
            why["candidates"].append(explain.plain(live.t_target.get(1), live.cost_origin()))
        if drafts:
            if live.t_draft is None or len(live.t_target) < 2:
                return initial, "explore"
            predicted = getattr(context, "predicted_alpha", None)
            curve, cost = self.derived(live, top)
            source = "live" if live.observed > 0 else "prior"
            if predicted is not None and live.observed < self.params.cold_start:
                curve, source = [float(predicted)] * top, "forecast"
            per_token = self._catch_up(live, context, proposers)
            # a busy machine's costs are not decided by: k within what acceptance justifies
            cap = min(top, acceptance_cap(curve, top, self.params.marginal)) if busy else top
            k, s = best_k(curve, live.t_draft, cost, cap, per_token=per_token)
            saved = 0.0
            if k:
                s, saved = _priced(curve, k, live.t_draft, cost, per_token, value, s)
            best = (k, s, "draft", saved)
            if why is not None:
                why["candidates"].append(self._candidate(
                    "draft", k, s, saved, curve, live.t_draft, cost, per_token, value, cap,
                    source, live.cost_origin()))
        for name in proposers:  # each lookup with a match now: what would it pay?
            match, size = lookup_now(context, name) if name in LOOKUP_PROPOSERS else (0, 0)
            if match <= 0 or size <= 0:
                continue
            cost = self.derived(live, top)[1]
            curve = held(request_ngram_curve(self.derived_ngram(live, top, match, name),
                                             context, match, proposer=name,
                                             prior_blocks=self.params.request_prior_blocks),
                         size)
            t_lookup = (live.t_suffix if name == "suffix" else live.t_ngram) or 0.0
            cap = min(top, acceptance_cap(curve, top, self.params.marginal)) if busy else top
            k, s = 0, 1.0
            if name == "suffix" and self.params.suffix_whole:  # its own length rule
                k = min(size, cap)
                s = speedup(k, curve, t_lookup, cost)
                k = k if s > 1 else 0
            if not k:  # else (or where its whole draft does not pay) the k of best S
                k, s = best_k(curve, t_lookup, cost, cap)
            induced, saved = 0.0, 0.0
            if k:
                s, saved = _priced(curve, k, t_lookup, cost, 0.0, value, s)
                paying = best[0] > 0 and best[1] >= 1 + self.params.min_gain
                if paying and best[2] == "draft":  # it pays the draft's catch-up
                    induced = induced_catch_up(live, getattr(context, "draft_gap", 0),
                                               expected_tokens(curve, k))
                    saved -= induced
                # the proposers are ranked by the seconds their block saves, not by S
                if saved > best[3] or not paying:
                    best = (k, s, name, saved)
            if why is not None:
                why["candidates"].append(self._candidate(
                    name, k, s, saved, curve, t_lookup, cost, 0.0, value, cap,
                    f"live, match {match}", live.cost_origin(), induced=induced))
        k, s, proposer, _ = best
        if k > 0 and s >= 1 + self.params.min_gain:
            # a lookup's block measures nothing of the draft model: its re-probe stays due
            self._off[context.category] = (0 if proposer == "draft" or not drafts
                                           else self._off.get(context.category, 0) + 1)
            return (k if proposer == "draft" else Choice(k, proposer)), "best"
        trial = self._untried(live, context, top) if drafts else 0
        if trial:
            self._off[context.category] = 0
            return trial, "trial"
        off = self._off.get(context.category, 0) + 1
        k, rule = 0, "off"
        # the level moved since the last decision (a burst began or ended): the costs that
        # switched the draft model off were measured at another load, so re-probe now
        moves = getattr(live, "level_moves", 0)
        moved = moves != self._moves.get(context.category, 0)
        self._moves[context.category] = moves
        if moved or off >= self._reprobe_after(live, context, live.t_target.get(1),
                                               live.t_draft, self.derived(live, top)[1], top):
            off, rule = 0, "reprobe"
            k = min(self.params.probe_k, top)
            if not drafts:
                k = Choice(k, lookup)
        self._off[context.category] = off
        return k, rule

    @staticmethod
    def _candidate(proposer: str, k: int, s: float, saved: float, curve, t_propose: float,
                   cost, per_token: float, value, cap: int, source: str, origin: str, *,
                   induced: float = 0.0) -> dict:
        """One proposer's block as the decision record shows it. Where no k paid (k = 0) the
        block of its best S is shown instead, priced the same way, so the record says by how
        much it missed."""
        if not k:
            k = max(range(1, max(1, cap) + 1),
                    key=lambda j: speedup(j, curve, t_propose, cost, per_token))
            s, saved = _priced(curve, k, t_propose, cost, per_token, value,
                               speedup(k, curve, t_propose, cost, per_token))
        return explain.candidate(proposer, k, tokens=expected_tokens(curve, k),
                                 block_s=k * t_propose + cost(k + 1), extra_s=per_token,
                                 speedup=s, saved_s=saved, induced_s=induced,
                                 acceptance=curve[:k], acceptance_from=source,
                                 t_propose=t_propose, t_verify=cost(k + 1), costs_from=origin)

    def _untried(self, live, context, top: int) -> int:
        """The k to try the draft model at on this category instead of switching it off, or
        0: while fewer than ``cold_start`` of its blocks were ever counted here (the stored
        history's included) and the request has no acceptance forecast, the draft is tried
        if some k would pay at perfect acceptance, at ``initial_k`` or that k if smaller. A
        cold store's prior (α = 0.5) against a probed T_d can price the draft out before it
        ran once; the n-gram proposer, free to try, would then take every step it could, and
        k = 0 the rest, on categories where the draft model pays. Where verification is
        compute-bound only a short block can pay even then, so the trial runs at that k.
        Where perfect acceptance would gain less than ``trial_gain`` the trial has nothing
        to find that pays for it: near S = 1 the choice would flip with every timing."""
        if live.draft_blocks >= self.params.cold_start or getattr(context, "predicted_alpha",
                                                           None) is not None:
            return 0
        k, s = best_k([1.0] * top, live.t_draft, self.derived(live, top)[1], top)
        gain = max(self.params.min_gain, self.params.trial_gain)
        return min(self.params.initial_k, k) if k > 0 and s >= 1 + gain else 0

    def _token_value(self, live, context, proposers) -> float | None:
        """With both proposers, a token beyond a block's first is worth the rate the request
        runs at (seconds per token, realized), when that beats plain decoding: on copy-heavy
        traffic prompt lookup covers most tokens almost free, and a draft-model block that
        beats a plain step by S can still lose to the lookup the next step would do. The
        request's own rate
        so far, pulled toward the category's by ``request_prior_tokens`` tokens of it: one prompt
        of a copy-heavy category can have nothing to copy. None (T_t(1)) with one proposer,
        or before the category's rate is known."""
        if len(proposers) < 2 or self.proposers != "both":
            return None
        rate = live.seconds_per_token()
        t1 = live.t_target.get(1)
        if rate is None or t1 is None:
            return None
        req = getattr(context, "request", None)
        seconds, tokens = req.spent if req is not None else (0.0, 0.0)
        w = self.params.request_prior_tokens
        rate = (rate * w + seconds) / (w + tokens)
        return min(rate, t1)

    def _catch_up(self, live, context, proposers) -> float:
        """The draft model's catch-up, per token it is expected to serve in the rest of this
        request: all of it where it drafts alone; with the n-gram proposer beside it, the
        share of the category's decision points without an n-gram match (measured on the
        traffic, whatever was chosen: pricing by the draft's own recent share would keep a
        draft that was priced out, out). On copy-heavy prompts its first use costs a forward
        over the whole prompt, which a few unmatched steps cannot pay back."""
        gap = getattr(context, "draft_gap", 0)
        if gap <= 2:
            return 0.0
        remaining = max(1, getattr(context, "remaining", 1))
        share = _draft_share(live, context, self.params) if "ngram" in proposers else 1.0
        return catch_up_per_token(live, gap, remaining * share)

    def _batch_catch_up(self, context, rows: list, t_draft: float, proposers) -> float:
        """The draft model's catch-up at batch, per token of the batch it is expected to serve:
        one forward over B × the widest row's gap (``context.draft_gap``), priced by the
        catch-up fit of the rows' statistics (the controller's, fed by every catch-up; the
        pair's cost), shared over the rows' tokens left, times each row's share the draft
        serves beside the n-gram proposer (as at batch 1, by category). Unpriced, a batch's
        first draft block took in every row's prompt for free, and so did every block after
        a stretch of k = 0."""
        gap = getattr(context, "draft_gap", 0)
        if gap <= 2:
            return 0.0
        fit = next((live for live in context.rows
                    if live is not None and live.catch_up_cost(gap) is not None), None)
        if fit is None:
            return 0.0
        batch = len(context.rows)
        share = 1.0
        if "ngram" in proposers:
            once: dict[int, float] = {}  # rows of one category share their statistics
            for live in rows:
                if id(live) not in once:
                    once[id(live)] = (_draft_share(live, context, self.params)
                                      if live is not None else 1.0)
            share = sum(once[id(live)] for live in rows) / len(rows)
        served = sum(_rows_left(context)) * share
        return catch_up_per_token(fit, gap, served, rows=batch, t_draft=t_draft)

    def _allowed(self, context) -> tuple[str, ...]:
        """The proposers this request has (``context.proposers``) that ``proposers`` allows;
        a request without any of them keeps what it has."""
        have = tuple(getattr(context, "proposers", ("draft",)))
        if self.proposers == "both" or len(have) == 1:
            return have
        allowed = self.proposers.split("+")
        return tuple(p for p in have if p in allowed) or have

    def _row_stats(self, context) -> list:
        """Each row's statistics to decide by (our own per category, with ``discount``)."""
        rows = list(context.rows)
        if self.params.discount is None:
            return rows
        cats = _row_categories(context)
        out = []
        for cat, live in zip(cats, rows):
            own = self._own.get(cat)
            if own is None and live is not None:
                own = self._own[cat] = live.copy(discount=self.params.discount)
            out.append(None if live is None else live.copy(acceptance_from=own))
        return out

    def _choose_batch(self, context, top: int, why: dict | None) -> tuple[int, str]:
        """(k, rule) for the batch; ``why`` (where asked) collects the candidates, each with
        the batch's tokens per iteration and S against plain batched decoding (the finish
        time's, for the draft model)."""
        batch, costs = context.batch_size, context.costs
        points = costs.target_points(batch) if hasattr(costs, "target_points") else None
        cost = costs.target_cost(batch, optimistic=self.params.optimistic)
        if (cost is None or (points is not None and 1 not in points)
                or not getattr(costs, "baseline_live", lambda b: True)(batch)):
            return 0, "baseline"  # plain batched decoding at this B: measures the baseline
        if why is not None:
            why["t_plain"] = cost(1)
            why["candidates"].append(explain.plain(cost(1), "batch"))
        proposers = self._allowed(context)
        lookup = (0, 1.0, "ngram")  # the best lookup's (k, S_B(k), proposer)
        for name in proposers:
            if name in LOOKUP_PROPOSERS:
                k, s = self._batch_lookup(context, cost, top, name, why)
                if s > lookup[1]:
                    lookup = (k, s, name)
        if "draft" not in proposers:
            return self._batch_decision(context, batch, lookup[0], lookup[1], top, lookup[2])
        t_draft = costs.draft_cost(batch)
        if t_draft is None or (points is not None and len(points) < 2):
            return min(self.params.initial_k, top), "explore"
        stats = self._row_stats(context)
        # each row's acceptance forecast (the categoriser's), where the engine gave them
        forecasts = tuple(getattr(context, "predicted_alphas", ()) or ())
        if len(forecasts) != len(stats):
            forecasts = (getattr(context, "predicted_alpha", None),) * len(stats)
        curves, by_stats = [], {}
        for live, predicted in zip(stats, forecasts):
            key = (id(live), predicted)
            curve = by_stats.get(key)
            if curve is None:
                if live is None:
                    curve = [self.params.unknown_alpha if predicted is None
                             else float(predicted)] * top
                elif predicted is not None and live.observed < self.params.cold_start:
                    curve = [float(predicted)] * top
                else:
                    curve = self.derived(live, top)[0]
                by_stats[key] = curve
            curves.append(curve)
        per_token = self._batch_catch_up(context, self._row_stats(context), t_draft, proposers)
        left = _rows_left(context)
        k, s = batch_finish_k(curves, left, _step_costs(costs, batch, cost, t_draft,
                                                      self.params.optimistic),
                              top, once=per_token * sum(left))
        if why is not None and k:
            why["candidates"].append(_batch_candidate("draft", k, s, curves, t_draft, cost,
                                                      per_token, "live", "batch"))
        if lookup[1] > s:
            return self._batch_decision(context, batch, lookup[0], lookup[1], top, lookup[2])
        return self._batch_decision(context, batch, k, s, top, "draft")

    def _batch_lookup(self, context, cost, top: int, proposer: str,
                      why: dict | None = None) -> tuple[int, float]:
        """(k, S_B(k)) of a lookup proposer ("ngram", "suffix") for this batch: rows with a
        match now draft by their category's acceptance of it (a suffix draft no longer than
        it holds), rows without one propose nothing (E[N] = 1 but still scored at k + 1),
        lookups cost what they measured (≈ nothing)."""
        rows = self._row_stats(context)
        now = [lookup_now(context, proposer, b) for b in range(len(rows))]
        if not any(m and n for m, n in now):
            return 0, 1.0
        curves, t_lookup = [], 0.0
        for live, (matched, size) in zip(rows, now):
            if live is None or not matched or not size:
                curves.append([0.0] * top)
                continue
            curves.append(held(self.derived_ngram(live, top, matched, proposer), size))
            t = live.t_suffix if proposer == "suffix" else live.t_ngram
            t_lookup = max(t_lookup, t or 0.0)
        k, s = batch_best_k(curves, t_lookup, cost, top)
        if why is not None and k:
            why["candidates"].append(_batch_candidate(proposer, k, s, curves, t_lookup, cost,
                                                      0.0, "live", "batch"))
        return k, s

    def _batch_decision(self, context, batch: int, k: int, s: float, top: int,
                        proposer: str) -> tuple[int, str]:
        """(k as the proposer's Choice, "best") when it pays by min_gain, else plain batched
        decoding ("off") with a re-probe ("reprobe") every ``reprobe_every`` off iterations
        per (categories, bucket)."""
        key = (tuple(sorted(set(_row_categories(context)))), batch_bucket(batch))
        if k > 0 and s >= 1 + self.params.min_gain:
            self._off_batch[key] = 0
            return (k if proposer == "draft" else Choice(k, proposer)), "best"
        off = self._off_batch.get(key, 0) + 1
        k, rule = 0, "off"
        costs = context.costs
        cost = costs.target_cost(batch)
        fit = next((live for live in context.rows if live is not None
                    and live.catch_up_cost(1) is not None), None)
        if off >= self._reprobe_after(fit, context, cost(1), costs.draft_cost(batch), cost,
                                      top, rows=batch):
            off, rule = 0, "reprobe"
            k = min(self.params.probe_k, top)
            if proposer != "draft" and "draft" not in getattr(context, "proposers", ("draft",)):
                k = Choice(k, proposer)
        self._off_batch[key] = off
        return k, rule

    def _reprobe_after(self, live, context, t_plain, t_draft, cost, top: int, *,
                       rows: int = 1) -> int:
        """Off iterations before a re-probe: ``reprobe_every``, stretched where the probe
        costs more than ``reprobe_steps`` plain steps — its k = ``probe_k`` block over a
        plain step, plus the draft model's catch-up over every token it has not seen
        (``catch_up_per_token``'s price, the whole of it) — so that re-probing costs at
        most reprobe_steps plain steps per ``reprobe_every`` off. Where the draft's forward
        over the context is dear (compute-bound verification: many plain steps), a re-probe
        at the plain cadence would cost far more than the c / ``reprobe_every`` the cadence
        was chosen by."""
        if not t_plain or t_draft is None or cost is None:
            return self.params.reprobe_every
        k = min(self.params.probe_k, top)
        block = k * t_draft + max(0.0, cost(k + 1) - t_plain)
        gap = getattr(context, "draft_gap", 0)
        extra = catch_up_per_token(live, gap, 1.0, rows=rows, t_draft=t_draft)
        steps = (block + extra) / t_plain
        return max(self.params.reprobe_every,
                   math.ceil(self.params.reprobe_every * steps / self.params.reprobe_steps - 1e-9))

    def update(self, context, k: int, outcome) -> None:
        # the controller's statistics are fed by the loop; our own (with ``discount``) here
        if self.params.discount is not None and _batched(context):
            accepted = getattr(outcome, "accepted_rows", ()) or ()
            for cat, a in zip(_row_categories(context), accepted):
                own = self._own.get(cat)
                if own is not None:  # acceptance only: batch timings are not batch 1's
                    own.observe(k, a, float("nan"), float("nan"))
            return
        own = self._own.get(context.category) if self.params.discount is not None else None
        if own is not None:
            own.observe_unproposed(outcome.unproposed)
            if getattr(outcome, "proposer", "draft") == "draft":  # the draft model's alone
                own.observe(k, outcome.accepted, outcome.draft_time_s, outcome.target_time_s)


def _batch_candidate(proposer: str, k: int, s: float, curves, t_propose: float, cost,
                     per_token: float, source: str, origin: str) -> dict:
    """A batch's block of k as the decision record shows it: the rows' tokens per iteration
    (Σ E[N_i]), one iteration's seconds at B, and S against plain batched decoding."""
    tokens = sum(expected_tokens(c, k) for c in curves)
    return explain.candidate(proposer, k, tokens=tokens, block_s=k * t_propose + cost(k + 1),
                             extra_s=per_token, speedup=s, acceptance=curves[0][:k] if curves
                             else (), acceptance_from=source, t_propose=t_propose,
                             t_verify=cost(k + 1), costs_from=origin)


def _draft_share(live, context, params: Parameters = DEFAULTS) -> float:
    """The share of the rest of a request the draft model serves beside the n-gram proposer:
    where the n-gram has no match, or has one that fails at once — this request's points and
    n-gram acceptance (``context.request``, batch 1), pulled toward the category's."""
    req = getattr(context, "request", None)
    unmatched, matched = req.match_points if req is not None else (0.0, 0.0)
    w = params.request_prior_points
    share = ((live.unmatched_share() * w + unmatched) / (w + unmatched + matched))
    first = request_ngram_curve(live.ngram_acceptance_curve(1), context,
                                prior_blocks=params.request_prior_blocks)[0]
    return share + (1 - share) * (1 - first)


def _rows_left(context) -> tuple[int, ...]:
    """Each running row's tokens left (``context.remaining_rows``; where not given, every row
    has ``context.remaining``)."""
    rows = len(context.rows)
    left = tuple(getattr(context, "remaining_rows", ()) or ())
    return left if len(left) == rows else (max(1, getattr(context, "remaining", 1)),) * rows


def _step_costs(costs, batch: int, cost, t_draft: float,
                optimistic: bool) -> Callable[[int, int], float]:
    """step(b, k): one iteration with b rows at k, k · T_d(b) + T_t(b, k + 1) (k = 0:
    T_t(b, 1)). Read from ``costs`` at ``batch`` and at the powers of two below it, linear in
    b between them (as ``BatchCosts`` interpolates between its grid's batch sizes): a
    decision reads log2(B) + 1 batch sizes, not every size rows leave the batch at. A size
    ``costs`` has nothing for is priced at ``batch``'s (a row leaving then saves nothing)."""
    anchors = sorted({batch, *(1 << i for i in range(batch.bit_length()) if 1 << i < batch)})
    anchored = set(anchors)
    per_b: dict[int, tuple] = {batch: (cost, t_draft)}
    memo: dict[tuple[int, int], float] = {}

    def at(b: int, k: int) -> float:
        got = per_b.get(b)
        if got is None:
            tc, td = costs.target_cost(b, optimistic=optimistic), costs.draft_cost(b)
            got = per_b[b] = (tc or cost, td if td is not None else t_draft)
        return got[0](k + 1) + k * got[1] if k else got[0](1)

    def step(b: int, k: int) -> float:
        key = (b, k)
        value = memo.get(key)
        if value is None:
            if b in anchored:
                value = at(b, k)
            else:
                i = bisect.bisect_left(anchors, b)
                b0, b1 = anchors[i - 1], anchors[i]
                v0, v1 = step(b0, k), step(b1, k)
                value = v0 + (v1 - v0) * (b - b0) / (b1 - b0)
            memo[key] = value
        return value

    return step


def _batched(context) -> bool:
    """A batch the batch cost model can decide for: rows and the costs at batch sizes."""
    return (getattr(context, "batch_size", 1) > 1 and bool(getattr(context, "rows", ()))
            and getattr(context, "costs", None) is not None)


def _row_categories(context) -> tuple[str, ...]:
    """Each row's category (the context's one category where they were not given)."""
    cats = tuple(getattr(context, "categories", ()) or ())
    rows = len(context.rows)
    return cats if len(cats) == rows else (context.category,) * rows
