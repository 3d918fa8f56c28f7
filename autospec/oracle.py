"""Perfect foresight: the least time any per-iteration choice could have taken on a request.

A request's traces say, at every generated position, what each proposer would have got there:
the model proposer's acceptance trace whether the draft model, continuing from the target's
own prefix, would have produced that position's token (greedy: 1 or 0); a lookup proposer's
trace what its draft held there and how many of its leading tokens agreed with the output.
With those, a dynamic programme over positions finds the least time of any schedule that
chooses at each iteration plain decoding, a model block of any k ≤ ``K_MAX``, or a lookup's
block — knowing every outcome (each block stopped exactly where acceptance ends), priced by
the measured forwards (``Prices``). A policy's time over that least time is how far it is from
perfect foresight (``autospec bench``'s "foresight" column; ``autospec report``).

Greedy traces only (a sampled trace holds acceptance probabilities, not outcomes). A position
the model proposer never saw (its trace's 255: a stretch lookups served that it never caught
up on, a request it never drafted) counts as accepted, so that the least time stays a lower
bound — looser there, never wrong. (Counted as a miss, it made a request the draft model
never ran on read above 100 % of perfect foresight.) Catch-ups are not charged; a lookup block
costs ``T_LOOKUP``.

A policy's share of perfect foresight (least ÷ the time it took) is two factors
(``scheduled_seconds``): its **choices** — least ÷ the schedule it ran, priced the same way —
and its **execution** — that priced schedule ÷ the time it took: what the run spent beyond its
forwards' median prices (the loop's host time, catch-ups, forwards slower than their median),
which a choice of k touches only through how many iterations and catch-ups it runs.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping

from autospec.traces import (
    NGRAM_NONE,
    SUFFIX_TRACE_WIDTH,
    UNOBSERVED,
    decode_suffix_value,
    decode_trace_value,
)

__all__ = ["K_MAX", "T_LOOKUP", "Prices", "leading", "least_seconds", "may_use", "scheduled_seconds"]

K_MAX = 16
T_LOOKUP = 0.0005  # seconds per lookup block, generous


class Prices:
    """T_t(n), the target's forward scoring n tokens (the median of the measured ones per n,
    linear between measured n), and T_d, the model proposer's forward."""

    def __init__(self, target_s_by_n: Mapping[int, float], t_draft: float):
        if 1 not in target_s_by_n:
            raise ValueError("no target forward of one token measured")
        self.t = dict(target_s_by_n)
        self.ns = sorted(self.t)
        self.t_draft = t_draft

    @classmethod
    def of(cls, requests: Iterable, *, min_count: int = 1) -> Prices | None:
        """From requests' ``target_s_by_n`` (n → seconds or a list of them) and ``draft_s`` /
        ``draft_forwards`` (``LoopStats`` or stored requests), pooled; None where no forward of
        one token was measured."""
        by_n: dict[int, list[float]] = {}
        draft_s = forwards = 0.0
        for r in requests:
            for n, seconds in (r.target_s_by_n or {}).items():
                by_n.setdefault(int(n), []).extend(
                    seconds if isinstance(seconds, (list, tuple)) else [seconds])
            draft_s += r.draft_s or 0.0
            forwards += r.draft_forwards or 0
        t = {n: statistics.median(v) for n, v in by_n.items() if len(v) >= min_count}
        if 1 not in t:
            return None
        return cls(t, draft_s / forwards if forwards else float("inf"))

    def __call__(self, n: int) -> float:
        if n in self.t:
            return self.t[n]
        lo = max((m for m in self.ns if m <= n), default=self.ns[0])
        hi = min((m for m in self.ns if m >= n), default=self.ns[-1])
        if lo == hi:
            return self.t[lo]
        return self.t[lo] + (self.t[hi] - self.t[lo]) * (n - lo) / (hi - lo)


def leading(trace, p: int, k: int) -> int:
    """Leading positions from ``p`` (at most k) where the model's prediction held, or was
    never observed (a lower bound's benefit of the doubt)."""
    a = 0
    while a < k and p + a < len(trace) and trace[p + a] in (1, UNOBSERVED):
        a += 1
    return a


def _lookup_at(trace: bytes, n: int, p: int) -> int:
    """Tokens a lookup's draft at generated position ``p`` would have had accepted: its
    agreeing tokens, at most its draft's length (0: no draft there)."""
    if len(trace) == SUFFIX_TRACE_WIDTH * n:  # suffix decoding's encoding: draft length kept
        got = decode_suffix_value(trace, p)
        return min(got[1], got[2]) if got else 0
    if p < len(trace) and trace[p] != NGRAM_NONE:  # prompt lookup's: one byte a position
        return decode_trace_value(trace[p])[1]
    return 0


def least_seconds(n: int, traces: Mapping[str, bytes], allowed: Iterable[str], prices: Prices,
                  *, model: str | None, hybrid: bool = False) -> float:
    """The least seconds to emit generated positions 1 … n − 1 (position 0 is the prefill's)
    choosing among plain decoding and the ``allowed`` proposers' blocks, knowing every outcome.
    ``model``: the call's model proposer (``LoopStats.model``; None: none), whose trace is an
    acceptance trace (any k); every other allowed name with a trace is a lookup. hybrid: a lookup's block may be continued by the model."""
    allowed = [a for a in allowed if a in traces]
    draft = traces.get(model) if model in allowed else None
    lookups = [traces[a] for a in allowed if a != model]
    best = [float("inf")] * (n + 1)
    best[min(1, n)] = 0.0
    td = prices.t_draft
    for p in range(1, n):
        here = best[p]

        def go(q: int, seconds: float, here: float = here) -> None:
            q = min(q, n)
            best[q] = min(best[q], here + seconds)

        go(p + 1, prices(1))
        if draft is not None:
            run = leading(draft, p, K_MAX)  # a block of k accepts min(k, run)
            for k in range(1, K_MAX + 1):
                go(p + min(k, run) + 1, k * td + prices(k + 1))
        for trace in lookups:
            m = min(_lookup_at(trace, n, p), K_MAX)
            if m:
                go(p + m + 1, T_LOOKUP + prices(m + 1))
                if hybrid and draft is not None:
                    run = leading(draft, p + m, K_MAX - m)
                    for j in range(1, K_MAX + 1 - m):
                        go(p + m + min(j, run) + 1, T_LOOKUP + j * td + prices(m + j + 1))
    return best[n]


def scheduled_seconds(target_s_by_n: Mapping, draft_forwards: int, lookup_blocks: int,
                      prices: Prices) -> float:
    """The schedule a request ran, priced as ``least_seconds`` prices perfect foresight's: each
    of its target forwards after the prefill (``target_s_by_n``: n → that width's timings, a
    list or one) at T_t(n), each model forward at T_d, each lookup block at ``T_LOOKUP``;
    catch-ups charged on neither side. least ÷ this is how near its choices came."""
    seconds = sum((len(v) if isinstance(v, (list, tuple)) else 1) * prices(int(n))
                  for n, v in target_s_by_n.items())
    if draft_forwards:
        seconds += draft_forwards * prices.t_draft
    return seconds + lookup_blocks * T_LOOKUP


def may_use(mode: str, proposers: Iterable[str], model: str | None) -> set[str]:
    """The proposers a bench mode or a stored policy may choose among, of those the call had
    (``proposers``: every one it opened, a trace or not): ``plain`` none; a fixed k
    (``autospec:K``, ``fixed:K``, an int) the model; ``NAME:K`` for a lookup NAME that lookup;
    any other policy every one. Foresight over them needs each one's trace: where one left
    none (suffix decoding records its trace only for a store), there is no foresight."""
    have = set(proposers)
    head = mode.split(":")[0]
    if head == "plain":
        return set()
    if head in ("autospec", "fixed") or mode.isdigit():
        return {model} & have if model else set()
    if head in have and head != model:
        return {head}
    return have
