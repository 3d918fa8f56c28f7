"""What an iteration taught: counters, the policy's statistics, the pair's costs, the policy.

Torch-free, and the one place this happens: the live engine calls ``account`` with what it
measured, trace replay (``autospec.tune.replay``) with what it replayed and priced, so the
two cannot drift. Per row it counts the block in the row's ``LoopStats``; it feeds each
row's category statistics and its request's own (``LiveStats``), the batch's forward timings
to the pair's ``BatchCosts``, and finally ``policy.update`` with the iteration's
``Outcome``.

Timings feed the category statistics only at batch 1 (a batch's forward is not a point of
the batch-1 cost curve); at every batch size they feed ``BatchCosts``. The prefill (the
first target forward, over the prompt) is never a cost point: its target time is NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from autospec.engine.stats import PROPOSER_CODES, LoopStats
from autospec.policies.base import Outcome

__all__ = ["RowStep", "StepTimes", "account"]

NAN = float("nan")


@dataclass(slots=True)
class RowStep:
    """One row's part of an iteration (the engine fills it after the sync, its proposers
    add what they learned; replay fills it from the traces)."""

    proposer: str | None  # who proposed its block ("draft", "ngram", "suffix"); None: none
    proposed: int  # the block's length
    accepted: int
    emitted: int = 0  # tokens it emitted: accepted + 1, fewer where it stopped
    lookup: bool = False  # whether prompt lookup serves this row (its match is a fact then)
    match: int = 0  # prompt lookup's match length at the iteration's start (0: none)
    # where prompt lookup had a match but did not propose: how many of the tokens it would
    # have proposed equal the ones emitted (its shadow block); None: no shadow
    shadow: int | None = None
    # suffix decoding's match at the iteration's start (0: none, or no suffix proposer) and,
    # where it had a draft but did not propose, (leading tokens equal to the ones emitted,
    # tokens compared: at most its draft's length)
    suffix_match: int = 0
    suffix_shadow: tuple[int, int] | None = None
    # positions decoded without the draft model that its catch-up predicted when it resumed
    unproposed: tuple[float, ...] = ()
    # the draft model's block before, accepted whole: (its length, what the draft's catch-up
    # predicted at the position after it; ``LiveStats.observe_beyond``)
    beyond: tuple[int, float] | None = None
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
    draft_s: float = 0.0  # the draft model's proposing forwards (after its catch-up)
    draft_tokens: int = 0  # proposals those forwards made (T_d = draft_s / draft_tokens)
    catch_up: tuple[int, float] | None = None  # the draft's catch-up: (tokens, seconds)
    lookup_s: float = 0.0  # host time of the lookups


def account(policy, ctx, width: int, rows: Sequence[RowStep], times: StepTimes, *,
            lives: Sequence, requests: Sequence, stats: Sequence[LoopStats] | None = None,
            costs=None) -> Outcome:
    """Count, feed and tell: see the module docstring. ``width``: the block width the target
    scored (k); ``lives``/``requests``: each row's category and request ``LiveStats`` (None
    entries are skipped); ``stats``: each row's ``LoopStats`` (None: not kept). Returns the
    ``Outcome`` the policy was given."""
    B = len(rows)
    drafted, looked_up = False, None  # looked_up: the lookup proposer that served rows
    for r in rows:
        if r.proposer == "draft":
            drafted = True
        elif r.proposer is not None:
            looked_up = r.proposer
    per_token = times.draft_s / times.draft_tokens if times.draft_tokens else None
    if width == 0:
        proposing_s = 0.0
    elif drafted:
        proposing_s = per_token * width if per_token is not None else NAN
    else:
        proposing_s = times.lookup_s
    timed = times.batch == 1 and not times.prefill
    target_s = times.target_s if timed else NAN
    if stats is not None:
        for row, st in zip(rows, stats):
            _count(st, row, width, times, per_token)
    if times.catch_up is not None:  # the pair's fit takes it once, each category its time
        fed: set[int] = set()
        for live in {id(x): x for x in (*lives, *requests) if x is not None}.values():
            pair = id(getattr(live, "costs", live))
            if pair in fed:
                live.observe_catch_up(*times.catch_up, fit=False)
            else:
                live.observe_catch_up(*times.catch_up)
                fed.add(pair)
    for row, live, request in zip(rows, lives, requests):
        if live is not None and row.unproposed:
            live.observe_unproposed(row.unproposed)
        if live is not None and row.beyond is not None:
            live.observe_beyond(*row.beyond)
        for x in (live, request):
            if x is None:
                continue
            if row.lookup:
                x.observe_match(row.match > 0)
            if row.proposer == "ngram":
                x.observe_ngram(row.proposed, row.accepted, proposing_s if timed else NAN,
                                target_s, match=row.match)
            elif row.proposer == "suffix":
                x.observe_ngram(row.proposed, row.accepted, proposing_s if timed else NAN,
                                target_s, match=row.suffix_match, proposer="suffix")
            elif row.proposer == "draft" or width == 0:
                x.observe(row.proposed, row.accepted, proposing_s if timed else NAN, target_s)
            if row.shadow is not None and row.proposer != "ngram" and row.match > 0:
                x.observe_ngram_shadow(row.match, row.shadow, row.emitted)
            if row.suffix_shadow is not None and row.proposer != "suffix":
                agree, held = row.suffix_shadow
                x.observe_ngram_shadow(row.suffix_match, agree, min(held, row.emitted),
                                       proposer="suffix")
    if costs is not None and not times.prefill:
        costs.observe(B, width + 1, times.target_s, per_token)
    if B == 1:
        accepted, per_row, unproposed = rows[0].accepted, (), rows[0].unproposed
    else:
        per_row = tuple(r.accepted for r in rows)
        accepted, unproposed = sum(per_row) // B, tuple(v for r in rows for v in r.unproposed)
    outcome = Outcome(
        drafted=width, accepted=accepted, draft_time_s=proposing_s,
        target_time_s=NAN if times.prefill else times.target_s, unproposed=unproposed,
        beyond=tuple(r.beyond for r in rows if r.beyond is not None),
        accepted_rows=per_row, batch_size=B, proposer=looked_up or "draft")
    policy.update(ctx, width, outcome)
    return outcome


def _count(st: LoopStats, row: RowStep, width: int, times: StepTimes,
           per_token: float | None) -> None:
    """The row's counters and the iteration's timings, as the row's ``LoopStats`` keeps
    them (batch-1 curves only from batch-1 forwards, batch points only from batched calls)."""
    st.iterations += 1
    st.k_schedule.append(row.proposed)
    st.accepted_schedule.append(row.accepted)
    st.proposer_schedule.append(PROPOSER_CODES.get(row.proposer or "draft", 0))
    if row.proposer is not None and row.proposed > 0:
        st.count_block(row.proposer, row.proposed, row.accepted)
    if row.proposer == "ngram":
        st.ngram_s += times.lookup_s / times.batch
    elif row.proposer == "suffix":
        st.suffix_s += times.lookup_s / times.batch
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
