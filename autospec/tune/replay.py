"""Replaying acceptance traces: what another k (or policy) would have seen, without models.

A greedy trace holds, per generated position, whether the draft's argmax continuing from the
target's own prefix matched the target's token. Because the output does not depend on k, the
accepted length of a block of k starting at position g is the run of 1s in trace[g : g+k]:
replay is exact. A sampled trace holds β per position (the acceptance probability); replay
gives expectations: E[accepted] = Σ_i Π_{j≤i} β_j.

The n-gram proposer (prompt lookup) replays from the request's n-gram trace (``ngram_trace``,
see ``autospec.ngram.ngram_trace``): per generated position, the length of the match the
proposer had there and how many of its proposed tokens equal the output from there on. A
block of k it starts at position g accepts min(that count, k) — exact for greedy traffic, as
the draft's trace is; for sampled traffic it counts proposals equal to what was sampled (a
proposal x is accepted live with probability p(x), so this is an estimate). Where it had no
match the iteration is a plain step; the hybrid proposer takes the n-gram's block where the
match has ≥ min_match tokens, else the draft model's. Requests logged without an n-gram trace
replay the draft model only (their policy sees no n-gram proposer).

Suffix decoding replays from the request's suffix trace (``suffix_trace``, see
``autospec.suffix.suffix_trace``): per generated position, the match of the draft it had there
(from the category's memory as the request saw it), how many of its tokens equal the output,
and how many it held. A block of k it starts at position g holds min(k, that length) and
accepts min(agreement, block) — exact for greedy traffic where the live loop walked its drafts
for k_max = 16 (the trace's reach; another k_max may have drafted otherwise); the policy sees
the match (recorded up to 14 tokens, ``MATCH_REACH``: the cost model's longest bucket) and the
draft's length, as live. Its lookups cost ``Costs.t_suffix`` per proposed token. Requests
logged without a suffix trace offer no suffix proposer.

The draft model pays to resume: its first block takes in the prompt, and a block after k = 0
steps or n-gram blocks takes in what they emitted, in one catch-up forward. At batch 1 replay
tracks that gap as the live loop does, hands it to the policy (``Context.draft_gap``), and
charges C(gap) − T_d from the fit in ``Costs.catch_up`` (logged catch-ups): without it a
draft model resumed for free, and replay favoured policies that switch between proposers, or
speculate on long prompts, by what the live loop pays for them. At batch > 1 the batched loop
runs one catch-up forward over B × the widest row's gap (the others padded within it), and
replay charges C(B · gap) − T_d(B) as the policy prices it.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

from autospec.ngram import decode_trace_value
from autospec.policies.base import early_stop_of, params_of, stops_drafting
from autospec.policies.costmodel import interpolate_cost
from autospec.traces import (
    TRACE_CATCH_UP_MAX,
    TRACE_GREEDY,
    UNOBSERVED,
    decode_suffix_value,
    evidence,
)

__all__ = ["replay_block", "replay_greedy", "expected_accepted", "Costs", "SimResult", "simulate",
           "batch_size_of", "plain_batch_seconds"]


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
    """A timing model: seconds per proposed draft token and T_t(n) as measured points at
    batch 1 (``t_draft``, ``t_target``), and optionally the batch dimension: T_t(B, n) as
    ``target_grid`` (B → n → seconds of a forward scoring n tokens per row) and T_d(B) as
    ``draft_grid`` (B → seconds per proposed token). Batch 1 is always the batch-1 fields;
    other batch sizes interpolate through ``policies.batchcosts.BatchCosts``, the live
    controller's own interpolation (linear in B between measured batch sizes)."""

    t_draft: float
    t_target: Mapping[int, float]
    target_grid: Mapping[int, Mapping[int, float]] = field(default_factory=dict)
    draft_grid: Mapping[int, float] = field(default_factory=dict)
    t_ngram: float = 0.0  # seconds per token the n-gram proposer proposes (host lookup time)
    t_suffix: float = 0.0  # the same for suffix decoding
    has_draft: bool = True  # False: the pair has no draft model (n-gram proposer alone)
    # the execution paths the batch-1 fields and the grid were measured on (None: unknown,
    # taken as the same). Where they differ the grid is read alone, with its own batch 1 if
    # it has one: interpolating between batch 1 on one path and batch 4 on another would put
    # two paths in one S(k).
    path: str | None = None
    grid_path: str | None = None
    # the draft model's catch-up C(g) = a + b·g seconds to take in g tokens it has not seen
    # and propose its first (``policies.live.catch_up_line``, fitted to logged catch-ups);
    # None: not charged (nothing logged, or costs from before it was recorded)
    catch_up: tuple[float, float] | None = None

    def catch_up_seconds(self, tokens: int) -> float | None:
        """C(g): seconds of the draft model's forward over ``tokens`` tokens it has not seen,
        its first proposal included (never below T_d); None for the usual gap of one or two
        tokens after a draft block (that forward is a proposal, T_d), or without a fit."""
        if tokens <= 2 or self.catch_up is None:
            return None
        a, b = self.catch_up
        return max(a + b * tokens, self.t_draft)

    def __getstate__(self) -> dict[str, Any]:
        # the fields only: the caches (a BatchCosts holds a lock) are rebuilt where unpickled
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)

    @property
    def batched(self) -> bool:
        """Whether T_t(B, n) was measured at some batch size B > 1."""
        return any(int(b) > 1 and curve for b, curve in self.target_grid.items())

    @property
    def other_paths(self) -> bool:
        """Whether batch 1 and the grid were measured on different execution paths."""
        return (self.path is not None and self.grid_path is not None
                and self.path != self.grid_path)

    @cached_property
    def batch_costs(self):
        """A ``BatchCosts`` warmed with these costs (batch 1 from the batch-1 fields)."""
        from autospec.policies.batchcosts import BatchCosts

        target = {int(b): {int(n): float(s) for n, s in c.items()}
                  for b, c in self.target_grid.items()}
        draft = {int(b): float(s) for b, s in self.draft_grid.items()}
        if not self.other_paths:
            target[1] = {int(n): float(s) for n, s in self.t_target.items()}
            draft[1] = float(self.t_draft)
        bc = BatchCosts()
        bc.warm(target, draft)
        return bc

    @cached_property
    def _by_batch(self) -> dict[int, tuple[Callable[[int], float], float]]:
        return {}

    def at(self, batch: int = 1) -> tuple[Callable[[int], float], float]:
        """(T_t(B, ·) as a function of n, T_d(B)) at ``batch`` rows."""
        got = self._by_batch.get(batch)
        if got is not None:
            return got
        if batch <= 1:
            got = interpolate_cost(self.t_target), float(self.t_draft)
        else:
            target = self.batch_costs.target_cost(batch, optimistic=False)
            if target is None:
                raise ValueError(f"no target cost at batch {batch}")
            draft = self.batch_costs.draft_cost(batch)
            got = target, float(self.t_draft if draft is None else draft)
        self._by_batch[batch] = got
        return got

    def describe(self) -> dict[str, Any]:
        """JSON-ready: what a study pins and a tuning result reports."""
        out: dict[str, Any] = {"t_draft_s": self.t_draft,
                               "t_target_s_by_n": {int(n): t for n, t in self.t_target.items()}}
        if self.target_grid:
            out["t_target_s_by_bn"] = {int(b): {int(n): s for n, s in c.items()}
                                       for b, c in self.target_grid.items()}
            out["t_draft_s_by_b"] = {int(b): s for b, s in self.draft_grid.items()}
        if self.path is not None or self.grid_path is not None:
            out["path"], out["grid_path"] = self.path, self.grid_path
        if self.t_ngram:
            out["t_ngram_s"] = self.t_ngram
        if self.t_suffix:
            out["t_suffix_s"] = self.t_suffix
        if not self.has_draft:
            out["has_draft"] = False
        if self.catch_up is not None:
            out["catch_up_s"] = list(self.catch_up)
        return out

    @classmethod
    def from_description(cls, d: Mapping[str, Any]) -> Costs:
        """The inverse of ``describe`` (JSON keys come back as strings)."""
        return cls(t_draft=float(d["t_draft_s"]),
                   t_target={int(n): float(t) for n, t in d["t_target_s_by_n"].items()},
                   target_grid={int(b): {int(n): float(s) for n, s in c.items()}
                                for b, c in (d.get("t_target_s_by_bn") or {}).items()},
                   draft_grid={int(b): float(s)
                               for b, s in (d.get("t_draft_s_by_b") or {}).items()},
                   path=d.get("path"), grid_path=d.get("grid_path"),
                   t_ngram=float(d.get("t_ngram_s", 0.0)),
                   t_suffix=float(d.get("t_suffix_s", 0.0)),
                   has_draft=bool(d.get("has_draft", True)),
                   catch_up=(None if d.get("catch_up_s") is None
                             else (float(d["catch_up_s"][0]), float(d["catch_up_s"][1]))))


@dataclass
class SimResult:
    """Totals of a replay. ``tokens``, ``drafted``, ``accepted`` sum over rows; ``iterations``
    and ``k_counts`` count batch iterations (one k for the whole batch); ``row_steps`` sums
    the rows running in each iteration (compaction: finished rows leave the batch)."""

    tokens: int = 0
    seconds: float = 0.0
    iterations: int = 0
    drafted: int = 0
    accepted: int = 0
    ngram_drafted: int = 0  # the n-gram proposer's share of drafted / accepted
    ngram_accepted: int = 0
    suffix_drafted: int = 0  # suffix decoding's share
    suffix_accepted: int = 0
    k_counts: Counter = field(default_factory=Counter)
    unobserved_hits: int = 0  # blocks that ran into an unobserved position (counted rejected)
    # the same batches decoded plainly: one token per running row per step, Σ_t T_t(B_t, 1)
    plain_seconds: float = 0.0
    row_steps: int = 0
    k_counts_by_batch: dict[int, Counter] = field(default_factory=dict)  # rows running → k
    # the draft model's catch-ups beyond their first proposal (in ``seconds``)
    catch_up_seconds: float = 0.0
    # each replayed request's counters, in replay order, as the engine keeps them live
    requests: list = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")

    @property
    def speedup(self) -> float:
        return self.plain_seconds / self.seconds if self.seconds else float("nan")

    def k_by_batch(self) -> dict[int, int]:
        """The k run most often at each number of running rows."""
        return {b: c.most_common(1)[0][0] for b, c in sorted(self.k_counts_by_batch.items())}

    def _count(self, batch: int, k: int) -> None:
        self.iterations += 1
        self.k_counts[k] += 1
        self.k_counts_by_batch.setdefault(batch, Counter())[k] += 1


def batch_size_of(row) -> int:
    """The batch a logged request ran in (1 for tuples and rows logged before batching)."""
    return max(1, int(getattr(row, "batch_size", 1) or 1))


def plain_batch_seconds(lengths: Sequence[int], costs: Costs) -> float:
    """Plain batched decoding of rows of these lengths, finished rows leaving the batch:
    Σ over steps t of T_t(B_t, 1), B_t the rows still running at step t."""
    total, step = 0.0, 0
    for running, length in zip(range(len(lengths), 0, -1), sorted(lengths)):
        if length > step:
            total += (length - step) * costs.at(running)[0](1)
            step = length
    return total


def simulate(traces: Iterable, policy, costs: Costs, *, k_max: int = 16,
             category: str | Callable[[object], str] = "default", live=None,
             seed: int = 0, batched: bool = True, has_draft: bool | None = None) -> SimResult:
    """Replay ``traces`` (objects with ``trace_kind`` and ``trace``, e.g. the store's TraceRow,
    or (kind, bytes) tuples) under ``policy`` and the cost model, feeding it the outcomes it
    would have seen. Greedy traces replay exactly; sampled ones draw each acceptance from its
    recorded β with a seeded RNG. Returns throughput and the plain-decoding baseline.

    Traces logged at batch size B > 1 (``batch_size``) replay in batches: per (B, category),
    in logged order, B traces at a time (a last, incomplete group is a smaller batch). Each
    iteration the policy chooses one k for the batch, every row replays its block from its own
    trace, rows leave when they reach their length, and the iteration costs
    k · T_d(B) + T_t(B, k + 1) at the B rows still running; the baseline is plain batched
    decoding of the same batches. A batch replays when its group is full (or at the end), so
    the policy sees requests in logged order as far as batching allows; traces at batch 1
    replay exactly as they always did. ``batched=False`` replays every trace alone at batch 1
    (costs without a batch grid).

    live: a dict category → LiveStats to feed (as the controller does); fresh ones by default,
    every new one referencing one ``PairCosts`` (the given ones', where some are given).
    has_draft: False for a pair without a draft model (logged with the n-gram proposer alone):
    the policy then sees the n-gram proposer only (default: ``costs.has_draft``).
    """
    if has_draft is None:
        has_draft = costs.has_draft
    from autospec.policies.live import LiveStats, PairCosts

    rng = random.Random(seed)
    lives = {} if live is None else live
    # the pair's costs, once, as the controller keeps them: every category's statistics
    # reference one (the given statistics' where there are some), acceptance is per category
    pair = next((st.costs for st in lives.values()), None)
    res = SimResult()
    pending: dict[tuple[int, str], list] = {}
    for row in traces:
        cat = category(row) if callable(category) else category
        stats = lives.get(cat)
        if stats is None:
            if pair is None:
                pair = PairCosts(params=params_of(policy))
            stats = lives[cat] = LiveStats(params=params_of(policy), costs=pair)
        b = batch_size_of(row) if batched else 1
        if b == 1:
            _replay([_Row(row, has_draft)], policy, costs, cat, stats, k_max, rng, res)
            continue
        if not costs.batched:
            raise ValueError(f"a trace logged at batch {b} needs T_t(B, n) at batch > 1: "
                             "pass Costs(target_grid=...) or batched=False")
        group = pending.setdefault((b, cat), [])
        group.append(_Row(row, has_draft))
        if len(group) == b:
            _replay(pending.pop((b, cat)), policy, costs, cat, stats, k_max, rng, res)
    for (_b, cat), group in pending.items():
        _replay(group, policy, costs, cat, lives[cat], k_max, rng, res)
    return res


class _Row:
    """One request being replayed: its trace and where it stands."""

    __slots__ = ("kind", "trace", "conf", "ngram", "suffix", "has_draft", "g", "covered",
                 "prev_k", "gap", "request", "stats", "whole")

    def __init__(self, row, has_draft: bool = True):
        self.ngram = self.suffix = None
        self.has_draft = has_draft
        if isinstance(row, tuple) and not hasattr(row, "trace"):  # (kind, bytes[, conf])
            self.kind, self.trace, self.conf = (*row, None)[:3]
        else:
            self.kind, self.trace = row.trace_kind, row.trace
            self.conf = getattr(row, "confidence", None)
            self.ngram = getattr(row, "ngram_trace", None) or None
            self.suffix = getattr(row, "suffix_trace", None) or None
        self.g = 0  # generated so far
        self.covered = 0  # first position the draft has not predicted
        self.prev_k: int | None = None
        # its last draft block, accepted whole: (length, the position after it), which the
        # next catch-up predicts (the live loop's ``RowStep.beyond``)
        self.whole: tuple[int, int] | None = None
        # tokens the draft model has not taken in (the live loop's ``draft_gap``): the prompt
        # before its first block (0 where the trace does not say how long it was)
        self.gap = int(getattr(row, "prompt_tokens", 0) or 0)
        from autospec.engine.stats import LoopStats
        from autospec.policies import LiveStats

        # the request's own, as the engine keeps it (its counts and rate; no costs)
        self.request = LiveStats(discount=1.0, feed_costs=False)
        self.stats = LoopStats()

    @property
    def remaining(self) -> int:
        return len(self.trace) - self.g

    @property
    def proposers(self) -> tuple[str, ...]:
        """The proposers the live loop had, in its order, as far as the traces tell: the
        draft model (where the pair has one), prompt lookup, and suffix decoding where the
        request carries its trace."""
        if not self.has_draft:
            names: tuple[str, ...] = ("ngram",)
        else:
            names = ("draft", "ngram") if self.ngram is not None else ("draft",)
        return names + ("suffix",) if self.suffix is not None else names

    def ngram_match(self) -> tuple[int, int]:
        """(match length, tokens of its block that equal the output) at the current position;
        (0, 0) without a match (or without an n-gram trace)."""
        if self.ngram is None or self.g >= len(self.ngram):
            return 0, 0
        return decode_trace_value(self.ngram[self.g]) or (0, 0)

    def ngram_step(self, k: int) -> tuple[int, int]:
        """Replay one n-gram block of (at most) k: (proposed, accepted); (0, 0) without a
        match (a plain step). The draft model did not see these positions: its next block
        starts with a catch-up over them, as after k = 0."""
        matched, agree = self.ngram_match()
        k = k if matched else 0
        m = min(agree, k)
        self.prev_k = 0
        self.g += m + 1
        self.gap += m + 1
        return k, m

    def suffix_now(self) -> tuple[int, int, int]:
        """(match length, tokens of its draft that equal the output, tokens the draft holds)
        of suffix decoding at the current position; (0, 0, 0) without a draft (or without a
        suffix trace)."""
        if self.suffix is None or self.g >= len(self.trace):
            return 0, 0, 0
        return decode_suffix_value(self.suffix, self.g) or (0, 0, 0)

    def suffix_step(self, k: int) -> tuple[int, int]:
        """Replay one suffix block of (at most) k: (proposed, accepted) — it holds no more
        than its draft; (0, 0) without one (a plain step). The draft model did not see these
        positions, as after an n-gram block."""
        matched, agree, size = self.suffix_now()
        k = min(k, size) if matched else 0
        m = min(agree, k)
        self.prev_k = 0
        self.g += m + 1
        self.gap += m + 1
        return k, m

    def catch_up(self) -> tuple[float, ...]:
        """The draft model runs this iteration: its first forward takes in what it has not
        seen (the engine feeds every row's), predicting those positions from the target's
        prefix. Where it had not drafted them (k = 0, prompt lookup) they are what it learns
        (``unproposed``); where its last block was accepted whole, the position after it is
        what a longer block would have met (``beyond``); either way they are covered and its
        gap is closed. Returns (unproposed, beyond)."""
        unproposed: tuple = ()
        start = max(self.covered, self.g - TRACE_CATCH_UP_MAX)
        greedy = self.kind == TRACE_GREEDY
        if self.prev_k == 0:
            unproposed = tuple(evidence(v, greedy)
                               for v in self.trace[start : self.g] if v != UNOBSERVED)
        beyond = None
        if self.whole is not None and start <= self.whole[1] < self.g:
            v = self.trace[self.whole[1]]
            if v != UNOBSERVED:
                beyond = (self.whole[0], evidence(v, greedy))
        self.whole = None
        self.covered = max(self.covered, self.g)
        self.gap = 0
        return unproposed, beyond

    def step(self, k: int, stop: float | None, rng) -> tuple[int, int, bool]:
        """Replay one block of (at most) k: (drafted, accepted, unknown). After a draft
        block the caller sets the gap (``kept``), which depends on the batch's block."""
        k, m, unknown = replay_block(self.kind, self.trace, self.g, k, confidence=self.conf,
                                     early_stop=stop, rng=rng)
        if k > 0:
            self.covered = self.g + min(m + 1, k)
        else:
            self.gap += m + 1
        self.prev_k = k
        self.g += m + 1
        return k, m, unknown

    def kept(self, m: int, width: int) -> None:
        """The draft model drafted ``width`` tokens for the batch and took in all but its
        last; it keeps those this row accepted: the target's token is new to it, and its
        last proposal if it accepted every one it was fed. A block of ``width`` accepted
        whole leaves the position after it for the next catch-up (``whole``)."""
        self.gap = m + 1 - min(m, width - 1)
        if m == width:
            self.whole = (width, self.g - 1)


def _replay(rows: list[_Row], policy, costs: Costs, cat: str, stats, k_max: int, rng,
            res: SimResult) -> None:
    """Requests that ran together (one, at batch 1), replayed as the engine ran them: the
    same ``Context``, the same ``decide``, the same ``account`` as ``autospec.engine.step``,
    with each row's block replayed from its traces and the iteration priced by the cost
    model: k · T_d(B) + T_t(B, k + 1) at the B rows still running, plus lookup time and the
    draft model's catch-up beyond its first proposal (C(B · gap) − T_d(B), where the widest
    row's gap exceeds 2 tokens). The baseline is plain decoding of the same rows."""
    from autospec.engine.accounting import RowStep, StepTimes, account
    from autospec.engine.decide import RowView, decide, make_context

    stop = early_stop_of(policy, cat)
    group = len(rows)
    grid = costs.batch_costs if group > 1 else None
    res.plain_seconds += plain_batch_seconds([len(r.trace) for r in rows], costs)
    while True:
        running = [r for r in rows if r.remaining > 0]
        if not running:
            res.requests.extend(r.stats for r in rows)
            return
        b = len(running)
        cost, t_draft = costs.at(b)
        has_draft = running[0].has_draft
        shadows = [r.ngram_match() for r in running]  # (match length, agreement) per row
        # suffix decoding's (match length, agreement, draft length) per row
        suffixes = [r.suffix_now() for r in running]
        views = [RowView(category=cat, live=stats, request=r.request, generated=r.g,
                         left=r.remaining, match=match, gap=r.gap, suffix=sfx[0],
                         suffix_length=sfx[2])
                 for r, (match, _agree), sfx in zip(running, shadows, suffixes)]
        proposers = running[0].proposers
        ctx = make_context(views, k_max=k_max, proposers=proposers, has_draft=has_draft,
                           costs=grid)
        lookup = "ngram" in proposers
        lookups = {"ngram": [m for m, _ in shadows]} if lookup else {}
        if "suffix" in proposers:
            lookups["suffix"] = [sfx[0] for sfx in suffixes]
        d = decide(policy, ctx, longest=0, has_draft=has_draft, lookups=lookups or None)
        gap = max(r.gap for r in running) if has_draft else 0
        steps = []
        for r, who, size in zip(running, d.rows, d.lengths):
            seen = r.catch_up() if d.draft_runs else ((), None)
            if who == "ngram":
                k, m = r.ngram_step(size)
                steps.append((who if k else None, k, m, False, seen))
            elif who == "suffix":
                k, m = r.suffix_step(size)
                steps.append((who if k else None, k, m, False, seen))
            else:
                k, m, unknown = r.step(size if who == "draft" else 0, stop, rng)
                steps.append((who if k else None, k, m, unknown, seen))
        width = max(k for _who, k, *_ in steps)
        # the draft model drafts the policy's k for the batch (fewer only where early
        # stopping stopped every row)
        drafted_width = d.k if stop is None else max(
            (k for who, k, *_ in steps if who == "draft"), default=0)
        for r, (who, _k, m, *_rest) in zip(running, steps):
            if who == "draft":
                r.kept(m, drafted_width)
        lookup_s = (costs.t_ngram * sum(k for who, k, *_ in steps if who == "ngram")
                    + costs.t_suffix * sum(k for who, k, *_ in steps if who == "suffix"))
        drafted = width if d.draft_runs else 0
        catch_up = None
        if d.draft_runs and gap > 2 and costs.catch_up is not None:
            catch_up = (b * gap, max(costs.catch_up_seconds(b * gap), t_draft))
            res.seconds += catch_up[1] - t_draft
            res.catch_up_seconds += catch_up[1] - t_draft
        times = StepTimes(batch=b, call_batch=group, target_s=cost(width + 1),
                          draft_s=drafted * t_draft, draft_tokens=drafted, catch_up=catch_up,
                          lookup_s=lookup_s)
        row_steps = [RowStep(proposer=who, proposed=k, accepted=m, emitted=m + 1,
                             lookup=r.ngram is not None, match=match, shadow=agree,
                             unproposed=seen[0], beyond=seen[1], suffix_match=sfx[0],
                             suffix_shadow=_suffix_shadow(sfx, who, m + 1))
                     for r, (who, k, m, _u, seen), (match, agree), sfx
                     in zip(running, steps, shadows, suffixes)]
        account(policy, ctx, width, row_steps, times, lives=[stats] * b,
                requests=[r.request for r in running], stats=[r.stats for r in running])
        for (who, k, m, unknown, _u) in steps:
            res.unobserved_hits += unknown
            res.tokens += m + 1
            if who == "ngram":
                res.ngram_drafted += k
                res.ngram_accepted += m
            elif who == "suffix":
                res.suffix_drafted += k
                res.suffix_accepted += m
            else:
                res.drafted += k
                res.accepted += m
        res._count(b, width)
        res.row_steps += b
        res.seconds += times.draft_s + lookup_s + times.target_s


def _suffix_shadow(now: tuple[int, int, int], who: str | None,
                   emitted: int) -> tuple[int, int] | None:
    """What the live suffix proposer reports where it had a draft and another proposer (or
    nobody) drafted: (its leading tokens equal to the ``emitted`` ones, the tokens compared —
    its draft's length or the emitted count, the shorter); None where it drafted, or had no
    draft."""
    matched, agree, size = now
    if not matched or who == "suffix":
        return None
    return min(agree, emitted), min(size, emitted)
