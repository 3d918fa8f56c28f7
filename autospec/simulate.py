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

from autospec.policies.base import early_stop_of, stops_drafting
from autospec.policies.costmodel import interpolate_cost
from autospec.store.records import TRACE_CATCH_UP_MAX, TRACE_GREEDY, UNOBSERVED

__all__ = ["replay_block", "replay_greedy", "expected_accepted", "Costs", "SimResult", "simulate"]


def replay_block(kind: str, trace, g: int, k: int, *, confidence=None,
                 early_stop: float | None = None,
                 rng: random.Random | None = None) -> tuple[int, int, bool]:
    """One block of k drafted from generated position g, replayed: (drafted, accepted,
    whether it ran into an unobserved position, counted as a rejection there).

    Greedy traces replay exactly. Sampled ones draw each acceptance from its recorded β with
    ``rng``. With ``early_stop`` and the request's ``confidence`` bytes, drafting stops where
    the live loop's rule (``policies.base.stops_drafting``) would: token i's confidence is
    recorded when tokens 0…i−1 were accepted (the draft ran on the target's prefix). Past the
    first rejection the live draft runs off that prefix, where nothing was recorded: replay
    assumes it drafts on, which can only overcount draft cost, never the accepted count."""
    m, rejected, unobserved = 0, False, False
    for i in range(k):
        c = UNOBSERVED
        if not rejected:
            v = trace[g + i]
            if v == UNOBSERVED:
                unobserved = rejected = True
            elif v == 1 if kind == TRACE_GREEDY else _draw(rng) < v / 254:
                m += 1
            else:
                rejected = True
            if confidence is not None:
                c = confidence[g + i]
        if early_stop is not None and i + 1 < k and stops_drafting(c, early_stop):
            return i + 1, m, unobserved
    return k, m, unobserved


def _draw(rng: random.Random | None) -> float:
    if rng is None:
        raise ValueError("replaying a sampled trace draws acceptances: pass rng")
    return rng.random()


def replay_greedy(trace: bytes | Sequence[int], k: int | Callable[[int], int],
                  max_new_tokens: int | None = None, *, confidence=None,
                  early_stop: float | None = None, drafted: list[int] | None = None
                  ) -> list[int]:
    """Accepted count per iteration when blocks of k (or k(g) at generated position g) run
    over this request, with optional early stopping on the recorded ``confidence``. Stops at
    the first block whose outcome is unknown (it reaches an unobserved position before its
    first rejection). ``drafted``: a list to receive the drafted count per iteration."""
    choose = k if callable(k) else (lambda g, _k=k: _k)
    total = len(trace) if max_new_tokens is None else min(max_new_tokens, len(trace))
    accepted: list[int] = []
    g = 0
    while g < total:
        kk = max(0, min(int(choose(g)), total - g - 1))
        d, m, unknown = replay_block(TRACE_GREEDY, trace, g, kk, confidence=confidence,
                                     early_stop=early_stop)
        if unknown:
            break  # the block's outcome is unknown past here
        accepted.append(m)
        if drafted is not None:
            drafted.append(d)
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
        if isinstance(row, tuple) and not hasattr(row, "trace"):  # (kind, bytes[, conf])
            kind, trace, conf = (*row, None)[:3]
        else:
            kind, trace, conf = row.trace_kind, row.trace, getattr(row, "confidence", None)
        cat = category(row) if callable(category) else category
        stop = early_stop_of(policy, cat)
        stats = lives.setdefault(cat, LiveStats())
        total, g = len(trace), 0
        covered, prev_k = 0, None  # first position the draft has not predicted; last k
        while g < total:
            ctx = Context(category=cat, k_max=k_max, generated=g, remaining=total - g,
                          live=stats)
            k = max(0, min(int(policy.choose(ctx)), k_max, total - g - 1))
            unproposed: tuple = ()
            if k > 0 and prev_k == 0:  # drafting resumes: the catch-up predicts the gap
                unproposed = tuple(
                    (v if kind == TRACE_GREEDY else v / 254)
                    for v in trace[max(covered, g - TRACE_CATCH_UP_MAX) : g] if v != UNOBSERVED)
            k, m, unknown = replay_block(kind, trace, g, k, confidence=conf,
                                         early_stop=stop, rng=rng)
            res.unobserved_hits += unknown
            if k > 0:
                covered = g + min(m + 1, k)
            prev_k = k
            d_s, t_s = k * costs.t_draft, cost(k + 1)
            stats.observe_unproposed(unproposed)
            stats.observe(k, m, d_s, t_s)
            policy.update(ctx, k, Outcome(drafted=k, accepted=m, draft_time_s=d_s,
                                          target_time_s=t_s, unproposed=unproposed))
            res.iterations += 1
            res.drafted += k
            res.accepted += m
            res.k_counts[k] += 1
            res.tokens += m + 1
            res.seconds += d_s + t_s
            res.plain_seconds += (m + 1) * t1
            g += m + 1
    return res
