"""What an iteration taught: counters, the policy's statistics, the pair's costs, the policy.

Torch-free, and the one place this happens: the live engine calls ``account`` with what it
measured, trace replay (``autospec.tune.replay``) with what it replayed and priced, so the
two cannot drift. Per row it counts the block in the row's ``LoopStats``; it feeds each
row's category statistics and its request's own (``LiveStats``) — the block under its
proposer's name, every other proposer's shadow and evidence under theirs — then the
iteration's timings, once, to the row of the pair's cost table at the iteration's execution
path and batch size (``costs``, a ``CostRow``: the one-row tail of a batched call goes to its
own path's batch-1 row), and finally ``policy.update`` with the iteration's ``Outcome``. No
proposer is named here: each one's share is keyed by its name.

A category's rate takes an iteration's time only at batch 1 (a batch's forward is not one
request's time). The prefill (the first target forward, over the prompt) is never a cost
point: its target time is NaN (the cost row's clock ticks alone).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from autospec.engine.stats import LoopStats
from autospec.policies.base import Outcome

__all__ = ["RowStep", "StepTimes", "account"]

NAN = float("nan")


@dataclass(slots=True)
class RowStep:
    """One row's part of an iteration (the engine fills it after the sync, every proposer
    adds what it learned; replay fills it from the traces)."""

    proposer: str | None  # who proposed its block; None: nobody (a plain step)
    proposed: int  # the block's length
    accepted: int
    emitted: int = 0  # tokens it emitted: accepted + 1, fewer where it stopped
    # each lookup proposer's match length at the iteration's start (0: none), by name
    matches: dict[str, int] = field(default_factory=dict)
    # a lookup that had a draft but did not propose: (its leading tokens equal to the ones
    # emitted, tokens compared), by name
    shadows: dict[str, tuple[int, int]] = field(default_factory=dict)
    # evidence of a proposer's own acceptance at a depth, by name: (depth, value: greedy 0/1,
    # sampled the acceptance probability) — the model's catch-up predicting positions it had
    # not drafted (depth 0) or the one after a block it had accepted whole (its length)
    evidence: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    # the model proposer's block on the target's prefix, by name: (its confidence byte, the
    # token's acceptance — greedy 0/1, sampled its probability) per token
    confident: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    gen: int = 0  # the engine: generated tokens before this iteration
    new: list[int] | None = None  # the engine: the accepted tokens and the next one


@dataclass(slots=True)
class StepTimes:
    """An iteration's costs, shared by every row of the batch."""

    batch: int  # rows in the iteration
    call_batch: int  # rows of the generate call (the batch it started as)
    target_s: float  # the target forward (NaN: the prefill, or not measured)
    target_cached: int = 0  # tokens the target's cache held before it (batch 1)
    prefill: bool = False
    # the call's model proposer (None: the call has none), whether or not it drafted here (a
    # block whose one proposal came with its catch-up has no proposing forwards of its own)
    model: str | None = None
    draft_s: float = 0.0  # its proposing forwards (after its catch-up)
    draft_tokens: int = 0  # proposals those forwards made (T_d = draft_s / draft_tokens)
    catch_up: tuple[int, float] | None = None  # its catch-up: (tokens, seconds)
    # host seconds each lookup proposer spent, by name
    lookup_s: Mapping[str, float] = field(default_factory=dict)


def account(policy, ctx, width: int, rows: Sequence[RowStep], times: StepTimes, *,
            lives: Sequence, requests: Sequence, stats: Sequence[LoopStats] | None = None,
            costs=None) -> Outcome:
    """Count, feed and tell: see the module docstring. ``width``: the block width the target
    scored (k); ``lives``/``requests``: each row's category and request ``LiveStats`` (None
    entries are skipped); ``stats``: each row's ``LoopStats`` (None: not kept). Returns the
    ``Outcome`` the policy was given."""
    B = len(rows)
    model = times.model
    served = {r.proposer for r in rows if r.proposer is not None}
    looked_up = next((n for n in served if n != model), None)  # a lookup that served rows
    per_token = times.draft_s / times.draft_tokens if times.draft_tokens else None
    lookup_total = sum(times.lookup_s.values())
    if width == 0:
        proposing_s = 0.0
    elif model in served:
        proposing_s = per_token * width if per_token is not None else NAN
    else:
        proposing_s = lookup_total
    timed = times.batch == 1 and not times.prefill
    target_s = times.target_s if timed else NAN
    if stats is not None:
        for row, st in zip(rows, stats):
            _count(st, row, width, times, per_token)
    if times.catch_up is not None:  # each category's and request's time (the fit: below)
        for live in {id(x): x for x in (*lives, *requests) if x is not None}.values():
            live.observe_catch_up(*times.catch_up)
    evidence = []
    for row, live, request in zip(rows, lives, requests):
        for name, found in row.evidence.items():
            evidence += [(name, d, v) for d, v in found]
            if live is not None:
                for depth, value in found:
                    live.observe_evidence(name, depth, value)
        if live is not None:
            for name, pairs in row.confident.items():
                live.observe_confidence(name, pairs)
        for x in (live, request):
            if x is None:
                continue
            for name, match in row.matches.items():
                x.observe_match(match > 0, proposer=name)
            who = row.proposer
            spent = proposing_s if timed else NAN
            if who is not None and who != model:
                x.observe_lookup(who, row.proposed, row.accepted,
                                 times.lookup_s.get(who, 0.0) if timed else NAN, target_s,
                                 match=row.matches.get(who, 0))
            elif who is not None or width == 0:  # the model's block, or a plain step
                x.observe(row.proposed, row.accepted, spent, target_s, proposer=model)
            for name, (agree, seen) in row.shadows.items():
                if name != who:
                    x.observe_shadow(name, row.matches.get(name, 0), agree,
                                     min(seen, row.emitted))
    if costs is not None:
        _feed(costs, width, rows, times, served, per_token)
    if B == 1:
        accepted, per_row = rows[0].accepted, ()
    else:
        per_row = tuple(r.accepted for r in rows)
        accepted = sum(per_row) // B
    outcome = Outcome(
        drafted=width, accepted=accepted, draft_time_s=proposing_s,
        target_time_s=NAN if times.prefill else times.target_s, evidence=tuple(evidence),
        accepted_rows=per_row, batch_size=B, proposer=looked_up or model)
    policy.update(ctx, width, outcome)
    return outcome


def _feed(costs, width: int, rows: Sequence[RowStep], times: StepTimes, served: set,
          per_token: float | None) -> None:
    """The iteration's timings into its cost row, once: the target's forward over width + 1
    tokens per row, the model proposer's seconds for its block where it served rows, each
    serving lookup's host seconds per token of its longest block, the model's catch-up."""
    model = times.model
    if times.prefill:
        costs.observe(width, NAN)
    else:
        lookups = None
        if served and (len(served) > 1 or model not in served):  # a lookup served rows
            longest: dict[str, int] = {}
            for r in rows:
                if r.proposer in served and r.proposer != model:
                    longest[r.proposer] = max(longest.get(r.proposer, 0), r.proposed)
            lookups = {name: times.lookup_s.get(name, 0.0) / k
                       for name, k in longest.items() if k > 0}
        costs.observe(width, times.target_s,
                      per_token * width if model in served and per_token is not None else NAN,
                      lookups)
    if times.catch_up is not None:
        costs.observe_catch_up(*times.catch_up)


def _count(st: LoopStats, row: RowStep, width: int, times: StepTimes,
           per_token: float | None) -> None:
    """The row's counters and the iteration's timings, as the row's ``LoopStats`` keeps
    them (batch-1 curves only from batch-1 forwards, batch points only from batched calls)."""
    st.iterations += 1
    st.k_schedule.append(row.proposed)
    st.accepted_schedule.append(row.accepted)
    st.proposer_schedule.append(row.proposer if row.proposed > 0 else None)
    if row.proposer is not None and row.proposed > 0:
        st.count_block(row.proposer, row.proposed, row.accepted)
        spent = times.lookup_s.get(row.proposer)
        if spent:
            st.counts[row.proposer].seconds += spent / times.batch
    t = times.target_s
    if times.prefill:
        st.prefill_s = t
    elif not math.isnan(t):
        if times.call_batch > 1:
            st.target_s_by_bn.setdefault((times.batch, width + 1), []).append(t)
        if times.batch == 1:
            st.target_s_by_n.setdefault(width + 1, []).append(t)
            if times.call_batch == 1:
                st.target_forwards.append((times.target_cached, t))
    if per_token is not None:
        if times.call_batch > 1:
            st.draft_s_by_b.setdefault(times.batch, []).append(per_token)
        st.draft_s += times.draft_s
        st.draft_forwards += times.draft_tokens
    if times.catch_up is not None and times.call_batch == 1:
        st.draft_prefill_s += times.catch_up[1]
        st.draft_catch_ups.append(times.catch_up)
