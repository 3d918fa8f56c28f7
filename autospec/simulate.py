"""Replaying acceptance traces: what another k (or policy) would have seen, without models.

A greedy trace holds, per generated position, whether the draft's argmax continuing from the
target's own prefix matched the target's token. Because the output does not depend on k, the
accepted length of a block of k starting at position g is the run of 1s in trace[g : g+k]:
replay is exact. A sampled trace holds β per position (the acceptance probability); replay
gives expectations: E[accepted] = Σ_i Π_{j≤i} β_j.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from autospec.policies.costmodel import interpolate_cost
from autospec.store.records import UNOBSERVED

__all__ = ["replay_greedy", "expected_accepted", "Costs", "SimResult", "simulate"]


def replay_greedy(trace: bytes | Sequence[int], k: int | Callable[[int], int],
                  max_new_tokens: int | None = None) -> list[int]:
    """Accepted count per iteration when blocks of k (or k(g) at generated position g) run
    over this request. Stops at the first block that reaches an unobserved position."""
    choose = k if callable(k) else (lambda g, _k=k: _k)
    total = len(trace) if max_new_tokens is None else min(max_new_tokens, len(trace))
    accepted: list[int] = []
    g = 0
    while g < total:
        kk = max(0, min(int(choose(g)), total - g - 1))
        m = 0
        while m < kk and trace[g + m] == 1:
            m += 1
        if m < kk and trace[g + m] == UNOBSERVED:
            break  # the block's outcome is unknown past here
        accepted.append(m)
        g += m + 1
    return accepted


def expected_accepted(betas: Sequence[float], k: int) -> float:
    """E[accepted] for a block of k with per-position acceptance probabilities betas."""
    total, run = 0.0, 1.0
    for b in betas[:k]:
        run *= b
        total += run
    return total


# -- running a policy over traces -------------------------------------------------------------

@dataclass(frozen=True)
class Costs:
    """A timing model: seconds per proposed draft token, and T_t(n) as measured points."""

    t_draft: float
    t_target: Mapping[int, float]



@dataclass
class SimResult:
    tokens: int = 0
    seconds: float = 0.0
    iterations: int = 0
    drafted: int = 0
    accepted: int = 0
    k_counts: Counter = field(default_factory=Counter)
    unobserved_hits: int = 0  # blocks that ran into an unobserved position (counted rejected)
    plain_seconds: float = 0.0  # the same tokens decoded one at a time

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")

    @property
    def speedup(self) -> float:
        return self.plain_seconds / self.seconds if self.seconds else float("nan")


def simulate(traces: Iterable, policy, costs: Costs, *, k_max: int = 16,
             category: str | Callable[[object], str] = "default", live=None,
             seed: int = 0) -> SimResult:
    """Replay ``traces`` (objects with ``trace_kind`` and ``trace``, e.g. the store's TraceRow,
    or (kind, bytes) tuples) under ``policy`` and the cost model, feeding it the outcomes it
    would have seen. Greedy traces replay exactly; sampled ones draw each acceptance from its
    recorded β with a seeded RNG. Returns throughput and the plain-decoding baseline.

    live: a dict category → LiveStats to feed (as the controller does); fresh ones by default.
    """
    from autospec.policies import Context, LiveStats, Outcome

    rng = random.Random(seed)
    cost = interpolate_cost(costs.t_target)
    t1 = cost(1)
    lives = {} if live is None else live
    res = SimResult()
    for row in traces:
        kind, trace = (row if isinstance(row, tuple) else (row.trace_kind, row.trace))[:2]
        cat = category(row) if callable(category) else category
        stats = lives.setdefault(cat, LiveStats())
        total, g = len(trace), 0
        while g < total:
            ctx = Context(category=cat, k_max=k_max, generated=g, remaining=total - g,
                          live=stats)
            k = max(0, min(int(policy.choose(ctx)), k_max, total - g - 1))
            m = 0
            while m < k:
                v = trace[g + m]
                if v == UNOBSERVED:
                    res.unobserved_hits += 1
                    break
                ok = v == 1 if kind == "greedy" else rng.random() < v / 254
                if not ok:
                    break
                m += 1
            d_s, t_s = k * costs.t_draft, cost(k + 1)
            stats.observe(k, m, d_s, t_s)
            policy.update(ctx, k, Outcome(drafted=k, accepted=m, draft_time_s=d_s,
                                          target_time_s=t_s))
            res.iterations += 1
            res.drafted += k
            res.accepted += m
            res.k_counts[k] += 1
            res.tokens += m + 1
            res.seconds += d_s + t_s
            res.plain_seconds += (m + 1) * t1
            g += m + 1
    return res
