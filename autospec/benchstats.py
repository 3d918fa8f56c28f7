"""Benchmark arithmetic: run records → rows (medians, paired speedups, acceptance) and the
cost model's oracle. Pure Python: no models, testable on hand-made records."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["RunRecord", "aggregate", "first_divergence", "oracle", "OVERALL"]

OVERALL = "overall"


@dataclass
class RunRecord:
    """One timed request. ``drafted``/``accepted``/``drafts`` are None where unknown."""

    category: str
    prompt_index: int
    repeat: int
    mode: str
    k: int | None
    new_tokens: int
    wall_s: float
    tokens: list[int] = field(default_factory=list, repr=False)  # the new tokens
    target_forwards: int | None = None  # verification forwards (iterations), prefill included
    drafts: int | None = None  # iterations that drafted (unknown for transformers' modes)
    drafted: int | None = None
    accepted: int | None = None
    t_target_1: float | None = None  # s, median target forward scoring 1 token
    t_target_k1: float | None = None  # s, scoring k+1 tokens
    t_draft: float | None = None  # s, mean draft forward
    k_schedule: list[int] = field(default_factory=list, repr=False)  # autospec: k per iteration
    accepted_per_position: list[int] = field(default_factory=list, repr=False)
    drafted_per_position: list[int] = field(default_factory=list, repr=False)
    divergence: dict | None = None  # first difference from plain (greedy), see run_bench


def _median(values, scale: float = 1.0) -> float | None:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(vals) * scale if vals else None


def aggregate(records: Sequence[RunRecord], *, greedy: bool) -> list[dict]:
    """Rows per (category, mode), then one ``overall`` row per mode.

    tokens_per_s: median over runs of new tokens / wall time. speedup: median over runs of the
    paired ratio plain time / mode time for the same prompt and repeat, each per new token so
    that it stays fair when (sampled) outputs differ in length. acceptance: pooled accepted /
    drafted. mean_accepted_length: 1 + accepted / drafting iterations (counts the bonus
    token; autospec only). tokens_per_forward: new tokens / target forwards, which also counts
    iterations that did not draft, and is known for transformers' modes too.
    """
    plain = {(r.prompt_index, r.repeat): r for r in records if r.mode == "plain"}
    cats = list(dict.fromkeys(r.category for r in records))
    modes = list(dict.fromkeys(r.mode for r in records))
    rows = []
    for cat in [*cats, OVERALL]:
        mine = [r for r in records if cat in (OVERALL, r.category)]
        best = oracle(mine) if cat != OVERALL else None
        for mode in modes:
            runs = [r for r in mine if r.mode == mode]
            if runs:
                row = _row(cat, runs, plain, greedy)
                row["oracle_k"], row["oracle_speedup"] = best or (None, None)
                rows.append(row)
    return rows


def oracle(records: Sequence[RunRecord], k_max: int = 16):
    """(k*, S(k*)): the cost model's best lookahead from what these runs measured — acceptance
    per draft position pooled over every autospec run, T_d and T_t(n) medians (T_t(1) from runs
    that decoded at k = 0). None when the costs needed are missing."""
    from autospec.policies.costmodel import best_k, conditional_from_cumulative

    acc, dr = Counter(), Counter()
    for r in records:
        for i, (a, d) in enumerate(zip(r.accepted_per_position, r.drafted_per_position)):
            acc[i] += a
            dr[i] += d
    curve = {}
    t1 = _median(r.t_target_1 for r in records)
    if t1:
        curve[1] = t1
    for k in {r.k for r in records if r.k}:
        tk = _median(r.t_target_k1 for r in records if r.k == k)
        if tk:
            curve[k + 1] = tk
    td = _median(r.t_draft for r in records)
    if not dr or 1 not in curve or len(curve) < 2 or not td:
        return None
    alphas = conditional_from_cumulative(
        [acc[i] / dr[i] if dr[i] else None for i in range(max(dr) + 1)])
    top = min(k_max, max(dr) + 1)
    return best_k(alphas, td, curve, top)


def _row(category: str, runs: list[RunRecord], plain: dict, greedy: bool) -> dict:
    ratios, same, divergences = [], [], []
    for r in runs:
        base = plain.get((r.prompt_index, r.repeat))
        if base is None:
            continue
        if r.wall_s > 0 and r.new_tokens > 0 and base.new_tokens > 0:
            ratios.append((base.wall_s / base.new_tokens) / (r.wall_s / r.new_tokens))
        same.append(r.tokens == base.tokens)
        if r.divergence is not None:
            divergences.append(r.divergence)
    drafted = sum(r.drafted for r in runs if r.drafted is not None)
    accepted = sum(r.accepted for r in runs if r.drafted is not None)
    with_drafts = [r for r in runs if r.drafts is not None]
    drafts = sum(r.drafts for r in with_drafts)
    with_fwd = [r for r in runs if r.target_forwards]
    row = {
        "category": category,
        "mode": runs[0].mode,
        "k": runs[0].k,
        "runs": len(runs),
        "new_tokens": _median(r.new_tokens for r in runs),
        "tokens_per_s": _median(r.new_tokens / r.wall_s for r in runs if r.wall_s > 0),
        "speedup": _median(ratios),
        "acceptance": accepted / drafted if drafted else None,
        "mean_accepted_length": (1 + sum(r.accepted for r in with_drafts) / drafts
                                 if drafts else None),
        "tokens_per_forward": (sum(r.new_tokens for r in with_fwd) /
                               sum(r.target_forwards for r in with_fwd) if with_fwd else None),
        "t_target_1_ms": _median((r.t_target_1 for r in runs), 1e3),
        "t_target_k1_ms": _median((r.t_target_k1 for r in runs), 1e3),
        "t_draft_ms": _median((r.t_draft for r in runs), 1e3),
        "identical": all(same) if greedy and same else None,
        "k_settled": _settled(runs),
        "divergences": divergences,
    }
    # the cost model's S(k) = E[N]·T_t(1) / (k·T_d + T_t(k+1)) from this row's own measurements
    k, t1, tk, td = row["k"], row["t_target_1_ms"], row["t_target_k1_ms"], row["t_draft_ms"]
    n = row["mean_accepted_length"]
    row["predicted_speedup"] = (n * t1 / (k * td + tk) if None not in (k, t1, tk, td, n)
                                and k * td + tk > 0 else None)
    return row


def _settled(runs: Sequence[RunRecord]) -> int | None:
    """The k a policy used most in its last repeat (what it settled on)."""
    last = max((r.repeat for r in runs), default=None)
    ks = Counter(k for r in runs if r.repeat == last for k in r.k_schedule)
    return ks.most_common(1)[0][0] if ks else None


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where a and b differ (or one ends); None if equal."""
    if list(a) == list(b):
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


