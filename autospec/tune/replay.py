"""Replaying acceptance traces: what another k (or policy) would have seen, without models.

A greedy trace holds, per generated position, whether the draft's argmax continuing from the
target's own prefix matched the target's token. Because the output does not depend on k, the
accepted length of a block of k starting at position g is the run of 1s in trace[g : g+k]:
replay is exact. A sampled trace holds β per position (the acceptance probability); replay
gives expectations: E[accepted] = Σ_i Π_{j≤i} β_j.

Every other proposer replays by its own rule (``Proposer.replay`` of its class, in its own
module: ``autospec.engine.proposers``) over the trace it recorded for the request: prompt
lookup from its n-gram trace, suffix decoding from its suffix trace (what each would have
drafted at every generated position, and how much of it the output agreed with), any
registered proposer from its own. A request logged without a proposer's trace replays without
that proposer (its policy does not see it). Replay is exact for greedy traffic and an
estimate for sampled (a lookup's proposal counts as accepted where it equals what was
sampled; live it is accepted with probability p(x)).

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
from typing import Any, NamedTuple

from autospec.costs.price import interpolate_cost
from autospec.policies.base import early_stop_of, params_of
from autospec.traces import TRACE_GREEDY


def replay_block(kind: str, trace, g: int, k: int, **kwargs) -> tuple[int, int, bool]:
    """The draft model's replay rule (``autospec.engine.proposers.draft_model.replay_block``)."""
    from autospec.engine.proposers.draft_model import replay_block as rule

    return rule(kind, trace, g, k, **kwargs)

__all__ = ["replay_block", "replay_greedy", "expected_accepted", "Costs", "SimResult", "simulate",
           "batch_size_of", "plain_batch_seconds"]


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
    other batch sizes are read from a ``autospec.costs.table.CostTable`` holding the grid, the
    live controller's own table and interpolation (linear in B between measured batch
    sizes). ``table`` makes the one replay's policy prices by."""

    t_draft: float
    t_target: Mapping[int, float]
    target_grid: Mapping[int, Mapping[int, float]] = field(default_factory=dict)
    draft_grid: Mapping[int, float] = field(default_factory=dict)
    # seconds per token each lookup proposer proposes (its host time), by name
    t_lookup: Mapping[str, float] = field(default_factory=dict)
    has_draft: bool = True  # False: the pair has no draft model (lookups alone)
    # the execution paths the batch-1 fields and the grid were measured on (None: unknown,
    # taken as the same). Where they differ the grid is read alone, with its own batch 1 if
    # it has one: interpolating between batch 1 on one path and batch 4 on another would put
    # two paths in one S(k).
    path: str | None = None
    grid_path: str | None = None
    # the draft model's catch-up C(g) = a + b·g seconds to take in g tokens it has not seen
    # and propose its first (``costs.rules.catch_up_line``, fitted to logged catch-ups);
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
        # the fields only: the caches (a CostTable holds a lock) are rebuilt where unpickled
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

    @property
    def grid_key(self) -> str | None:
        """The path the grid (and every batched group's iterations) is kept under in a
        ``table``: its own where it was measured on another path than batch 1, else batch
        1's (``path``: the two are taken as one)."""
        return self.grid_path if self.other_paths else self.path

    def table(self, measure=None):
        """A cost table as replay's policy starts from (``live`` False: the grid is the
        truth, read as it is): the grid warmed under ``grid_key`` (with batch 1's fields as
        its B = 1 where both paths are one), every row cold — batch 1's costs are learned
        from what replay prices, as a new process learns them live."""
        from autospec.costs.table import CostTable

        target = {int(b): {int(n): float(s) for n, s in c.items()}
                  for b, c in self.target_grid.items()}
        draft = {int(b): float(s) for b, s in self.draft_grid.items()}
        if not self.other_paths:
            target[1] = {int(n): float(s) for n, s in self.t_target.items()}
            draft[1] = float(self.t_draft)
        table = CostTable(live=False) if measure is None else CostTable(measure=measure,
                                                                        live=False)
        table.warm_grid(self.grid_key, target, draft)
        return table

    @cached_property
    def _grid(self):
        return self.table()

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
            target = self._grid.target_cost(self.grid_key, batch, optimistic=False)
            if target is None:
                raise ValueError(f"no target cost at batch {batch}")
            draft = self._grid.draft_cost(self.grid_key, batch)
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
        if any(self.t_lookup.values()):
            out["t_lookup_s"] = {n: t for n, t in self.t_lookup.items() if t}
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
                   t_lookup={n: float(t) for n, t in _lookup_times(d).items()},
                   has_draft=bool(d.get("has_draft", True)),
                   catch_up=(None if d.get("catch_up_s") is None
                             else (float(d["catch_up_s"][0]), float(d["catch_up_s"][1]))))


def _lookup_times(d: Mapping[str, Any]) -> dict[str, float]:
    """Lookup seconds per token of a description (before the proposers were keyed by name it
    held prompt lookup's and suffix decoding's under keys of their own)."""
    out = dict(d.get("t_lookup_s") or {})
    for name, key in (("ngram", "t_ngram_s"), ("suffix", "t_suffix_s")):
        if key in d:
            out.setdefault(name, d[key])
    return out


@dataclass
class SimResult:
    """Totals of a replay. ``tokens``, ``drafted``, ``accepted`` sum over rows; ``iterations``
    and ``k_counts`` count batch iterations (one k for the whole batch); ``row_steps`` sums
    the rows running in each iteration (compaction: finished rows leave the batch)."""

    tokens: int = 0
    seconds: float = 0.0
    iterations: int = 0
    drafted: int = 0  # the model proposer's (the draft model's)
    accepted: int = 0
    # every proposer's [drafted, accepted], by name (the model's included)
    by_proposer: dict[str, list[int]] = field(default_factory=dict)
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

    def proposer(self, name: str):
        """One proposer's tokens drafted and accepted in the replay (``.proposed``,
        ``.accepted``)."""
        from autospec.engine.stats import ProposerCounts

        proposed, accepted = self.by_proposer.get(name, (0, 0))
        return ProposerCounts(proposed=proposed, accepted=accepted)

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
             category: str | Callable[[object], str] = "default", live=None, table=None,
             seed: int = 0, batched: bool = True, has_draft: bool | None = None,
             proposers: Mapping[str, type] | None = None) -> SimResult:
    """Replay ``traces`` (objects with ``trace_kind``, ``trace`` and ``traces`` by proposer
    name, e.g. the store's TraceRow, or (kind, bytes[, confidence]) tuples: the draft model's
    alone) under ``policy`` and the cost model, feeding it the outcomes it would have seen.
    A block the logged run also ran (the same proposer from the same position, at most as
    long) takes the logged outcome; any other block its proposer's replay rule: greedy
    traces replay exactly, sampled ones draw each acceptance from its recorded β with a
    seeded RNG. So the logged policy replays its own run exactly, sampled or greedy. Returns
    throughput and the plain-decoding baseline.

    Traces logged at batch size B > 1 (``batch_size``) replay in batches: the rows of one
    batched call together, as they ran (``batch_id``; its rows' categories may differ, each
    row then feeding its own category's statistics); rows logged without one per (B,
    category), in logged order, B traces at a time (a last, incomplete group is a smaller
    batch). Each iteration the policy chooses one k for the batch, every row replays its
    block from its own trace, rows leave when they reach their length, and the iteration costs
    k · T_d(B) + T_t(B, k + 1) at the B rows still running; the baseline is plain batched
    decoding of the same batches. A batch replays when its group is full (or at the end), so
    the policy sees requests in logged order as far as batching allows; traces at batch 1
    replay exactly as they always did. ``batched=False`` replays every trace alone at batch 1
    (costs without a batch grid).

    live: a dict category → LiveStats to feed (as the controller does); fresh ones by default.
    table: the pair's ``CostTable`` the policy prices by and replay feeds, as a controller
    keeps one for every category (default: ``costs.table``, batch 1 cold); batch-1 traces run
    on ``costs.path``, batched groups on ``costs.grid_key``. has_draft: False for a pair without a draft model (logged with lookups alone): the
    policy then sees the lookups only (default: ``costs.has_draft``). proposers: the
    proposers replay offers, by name (default: the registry's, ``autospec.engine.proposers``).
    """
    if has_draft is None:
        has_draft = costs.has_draft
    from autospec.engine.proposers import registered
    from autospec.policies.live import LiveStats

    classes = dict(registered() if proposers is None else proposers)
    if not has_draft:
        classes = {n: c for n, c in classes.items() if c.kind != "model"}
    rng = random.Random(seed)
    lives = {} if live is None else live
    # the pair's costs, once, as the controller keeps them; acceptance is per category
    table = costs.table() if table is None else table
    res = SimResult()
    pending: dict[tuple[int, str], list] = {}
    for row in traces:
        cat = category(row) if callable(category) else category
        stats = lives.get(cat)
        if stats is None:  # as the controller starts a category: from the pair's others
            stats = LiveStats(params=params_of(policy))
            stats.seed_from(list(lives.values()))
            lives[cat] = stats
        b = batch_size_of(row) if batched else 1
        if b == 1:
            _replay([_Row(row, classes, cat, stats)], policy, costs, table, k_max, rng, res)
            continue
        if not costs.batched:
            raise ValueError(f"a trace logged at batch {b} needs T_t(B, n) at batch > 1: "
                             "pass Costs(target_grid=...) or batched=False")
        # the rows of one batched call together, as they ran (its id); rows logged before
        # the store kept one: B at a time per (B, category)
        batch_id = getattr(row, "batch_id", None)
        key = ("call", batch_id) if batch_id else (b, cat)
        group = pending.setdefault(key, [])
        group.append(_Row(row, classes, cat, stats))
        if len(group) == b:
            _replay(pending.pop(key), policy, costs, table, k_max, rng, res)
    for group in pending.values():
        _replay(group, policy, costs, table, k_max, rng, res)
    return res


class _Logged(NamedTuple):
    """A (kind, bytes[, confidence]) tuple as a logged request: the model proposer's trace."""

    trace_kind: str
    trace: bytes
    traces: dict
    extras: dict
    prompt_tokens: int = 0


def _as_record(row, model: str | None):
    if isinstance(row, tuple) and not hasattr(row, "trace"):  # (kind, bytes[, conf])
        kind, trace, conf = (*row, None)[:3]
        if model is None:
            return _Logged(kind, trace, {}, {})
        return _Logged(kind, trace, {model: trace},
                       {model: {"confidence": conf}} if conf is not None else {})
    return row


class _Row:
    """One request being replayed: where it stands, each of its proposers' replay, its
    category and that category's statistics (``live``), and what the logged run did at each
    position an iteration of it started from (``logged``: position → (proposer, k,
    accepted))."""

    __slots__ = ("kind", "length", "limit", "props", "g", "request", "stats", "cat", "live",
                 "logged")

    def __init__(self, row, classes: Mapping[str, type], cat: str = "default", live=None):
        from autospec.engine.stats import LoopStats
        from autospec.policies import LiveStats

        model = next((n for n, c in classes.items() if c.kind == "model"), None)
        record = _as_record(row, model)
        # generated positions: the record's count, else its model trace's length
        self.kind = record.trace_kind
        self.length = getattr(record, "new_tokens", 0) or len(record.trace)
        # the tokens it could have generated: what the live policy saw as its room (an EOS or
        # a criterion ended it at ``length``); unknown: its length
        self.limit = max(getattr(record, "max_new_tokens", None) or 0, self.length)
        # each proposer's replay, the model's first (those the request carries a trace of)
        self.props = {n: rr for n, c in sorted(classes.items(), key=lambda i: i[1].kind != "model")
                      if (rr := c.replay(record)) is not None}
        self.g = 0  # generated so far
        # the request's own, as the engine keeps it (its counts and rate; no costs)
        self.request = LiveStats(discount=1.0)
        self.stats = LoopStats(model=model if model in self.props else None)
        self.cat, self.live = cat, live
        self.logged = _logged_blocks(record, self.stats.model)

    def outcome(self, who: str, k: int, m: int, unknown: bool) -> tuple[int, bool]:
        """(accepted, unknown) of a block of k by ``who`` from here: the logged run's where it
        ran a block of at least k by ``who`` from this position (the first k positions'
        acceptances are the same events: exact for sampled traces too), else the rule's."""
        logged = self.logged.get(self.g)
        if logged is not None and logged[0] == who and k <= logged[1]:
            return min(logged[2], k), False
        return m, unknown

    def stopped(self, who: str, k: int, m: int, size: int) -> int:
        """Where a block a stop rule ended after its first rejection (m < k) stopped: the
        confidences the live draft met past that rejection were never recorded, so where the
        logged run drafted from here and was rejected at the same token, its length stands in
        (exact when the rule is the logged run's own); else ``k``, as replayed."""
        logged = self.logged.get(self.g)
        if m < k and logged is not None and logged[0] == who and logged[2] == m < logged[1]:
            return min(logged[1], size)
        return k

    @property
    def remaining(self) -> int:
        return self.length - self.g

    @property
    def room(self) -> int:
        """Tokens it may still generate as the live run knew it (to its limit)."""
        return self.limit - self.g


def _logged_blocks(record, model: str | None) -> dict[int, tuple[str | None, int, int]]:
    """Position → (proposer, k, accepted) of each block the logged run started there (none
    where the record has no schedule, e.g. a bare trace)."""
    ks = bytes(getattr(record, "k_schedule", b"") or b"")
    acc = bytes(getattr(record, "accepted_schedule", b"") or b"")
    who = getattr(record, "proposer_schedule", None)
    out, g = {}, 0
    for i, (k, m) in enumerate(zip(ks, acc)):
        if k:
            out[g] = (who[i] if who is not None and i < len(who) else model, k, m)
        g += m + 1
    return out


def _replay(rows: list[_Row], policy, costs: Costs, table, k_max: int, rng,
            res: SimResult) -> None:
    """Requests that ran together (one, at batch 1), replayed as the engine ran them: the
    same ``Context``, the same ``decide``, the same ``account`` as ``autospec.engine.step``,
    with each row's block replayed by its proposer's rule and the iteration priced by the
    cost model: k · T_d(B) + T_t(B, k + 1) at the B rows still running, plus lookup time and
    the model's catch-up beyond its first proposal (C(B · gap) − T_d(B), where the widest
    row's gap exceeds 2 tokens). The baseline is plain decoding of the same rows. The
    policy prices by ``table``'s row at the group's path and the rows running, which the
    accounting feeds as the live loop's."""
    from autospec.engine.accounting import RowStep, StepTimes, account
    from autospec.engine.decide import RowView, decide, make_context
    from autospec.engine.proposers import registered

    stop = early_stop_of(policy, rows[0].cat)  # as the live call: its first row's category
    group = len(rows)
    path = costs.grid_key if group > 1 else costs.path
    for r in rows:
        r.stats.batch_size = group
    res.plain_seconds += plain_batch_seconds([r.length for r in rows], costs)
    classes = registered()
    while True:
        running = [r for r in rows if r.remaining > 0]
        if not running:  # the call's end: its rows' lengths, as the controller feeds them
            for r in rows:
                if r.live is not None:
                    r.live.observe_length(r.length, r.length >= r.limit)
            res.requests.extend(r.stats for r in rows)
            return
        b = len(running)
        cost, t_draft = costs.at(b)
        names = tuple(running[0].props)
        model = running[0].stats.model
        whole = tuple(n for n in names if n != model and getattr(classes.get(n), "whole_draft",
                                                                  False))
        shown = [{n: rr.now(r.g) for n, rr in r.props.items() if n != model} for r in running]
        views = [RowView(category=r.cat, live=r.live, request=r.request, generated=r.g,
                         left=r.room, matches={n: v[0] for n, v in now.items()},
                         sizes={n: v[1] for n, v in now.items()},
                         gap=r.props[model].gap if model else 0)
                 for r, now in zip(running, shown)]
        view = table.at(path, b)
        ctx = make_context(views, k_max=k_max, proposers=names, model=model, whole=whole,
                           costs=view)
        d = decide(policy, ctx, longest=0)
        gap = max(r.props[model].gap for r in running) if model else 0
        steps = []
        for r, who, size in zip(running, d.rows, d.lengths):
            found = r.props[model].catch_up(r.g) if d.runs(model) else []
            k, m, unknown = (r.props[who].block(r.g, size, rng=rng,
                                                **({"stop": stop, "rule": d.stop}
                                                   if who == model else {}))
                             if who is not None else (0, 0, False))
            if k:
                m, unknown = r.outcome(who, k, m, unknown)
                if who == model and d.stop is not None:
                    k = r.stopped(who, k, m, size)
            steps.append((who if k else None, k, m, unknown, found))
        width = max(k for _who, k, *_ in steps)
        # the model drafts the policy's k for the batch (fewer only where early stopping
        # stopped every row)
        drafted_width = d.k if stop is None and d.stop is None else max(
            (k for who, k, *_ in steps if who == model), default=0)
        spent: dict[str, float] = {}
        for who, k, *_ in steps:
            if who is not None and who != model:
                spent[who] = spent.get(who, 0.0) + costs.t_lookup.get(who, 0.0) * k
        drafted = width if d.runs(model) else 0
        catch_up = None
        if d.runs(model) and gap > 2 and costs.catch_up is not None:
            catch_up = (b * gap, max(costs.catch_up_seconds(b * gap), t_draft))
            res.seconds += catch_up[1] - t_draft
            res.catch_up_seconds += catch_up[1] - t_draft
        times = StepTimes(batch=b, call_batch=group, target_s=cost(width + 1),
                          model=model, draft_s=drafted * t_draft,
                          draft_tokens=drafted, catch_up=catch_up, lookup_s=spent)
        row_steps = []
        for r, now, (who, k, m, _u, found) in zip(running, shown, steps):
            # it emits its accepted tokens and the next, up to where the request ended
            emitted = min(m + 1, r.remaining)
            step = RowStep(proposer=who, proposed=k, accepted=m, emitted=emitted,
                           matches={n: v[0] for n, v in now.items()})
            for n, rr in r.props.items():
                if n != who and n != model and (sh := rr.shadow(r.g, emitted)) is not None:
                    step.shadows[n] = sh
            if found:
                step.evidence[model] = found
            if who == model and k:
                pairs = r.props[model].confident(r.g, min(m + 1, k))
                if pairs:
                    step.confident[model] = pairs
            row_steps.append(step)
            for rr in r.props.values():
                rr.after(r.g, who, k, m, drafted_width if who == model else width)
        account(policy, ctx, width, row_steps, times, lives=[r.live for r in running],
                requests=[r.request for r in running], stats=[r.stats for r in running],
                costs=view)
        for r, (who, k, m, unknown, _f) in zip(running, steps):
            res.tokens += min(m + 1, r.remaining)
            r.g += m + 1
            res.unobserved_hits += unknown
            if who is None or who == model:  # the model's and plain steps'
                res.drafted += k
                res.accepted += m
            if who is not None:
                mine = res.by_proposer.setdefault(who, [0, 0])
                mine[0] += k
                mine[1] += m
        res._count(b, width)
        res.row_steps += b
        res.seconds += times.draft_s + sum(spent.values()) + times.target_s
