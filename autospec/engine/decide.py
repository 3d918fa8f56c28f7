"""What the policy sees and what its answer means for each row: the first step of an iteration.

Torch-free, and shared by the live engine and trace replay (``autospec.tune.replay``), so
that both build the same ``Context`` and turn the same ``choose`` answer into the same
blocks. ``decide`` calls the policy once, checks its answer, clamps k to what the request
can keep, and assigns each row its proposer:

- "draft": the draft model drafts k tokens for every row it serves (its forwards run over the
  whole batch);
- "ngram": prompt lookup, for rows whose match is long enough ("ngram" needs any match,
  "hybrid" at least ``min_match`` tokens); a row proposes at most what it can still keep;
- "suffix": suffix decoding (the category's earlier outputs too), for rows with a match;
- a row nobody proposes for decodes plainly within the iteration (a block of 0).

A row's block never runs past the tokens it may still generate.

The block width the target scores is k when the draft model runs, else the longest
lookup block; 0 is a plain step.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any, NamedTuple

from autospec.policies import explain
from autospec.policies.base import Choice, Context, proposer_of

__all__ = ["RowView", "Decision", "make_context", "decide", "check_choice", "LOOKUPS"]

# the proposers that look their blocks up in host memory, each with a match per row: prompt
# lookup ("ngram") and suffix decoding ("suffix"); the draft model is the other kind
LOOKUPS = ("ngram", "suffix")


class RowView(NamedTuple):
    """One running row, as the policy may see it (a tuple: built every iteration)."""

    category: str
    live: Any  # the category's LiveStats (None: no statistics)
    request: Any  # this request's own LiveStats
    generated: int
    left: int  # tokens the row may still generate, this iteration's included
    match: int = 0  # prompt lookup's match length now (0: none, or no lookup)
    gap: int = 0  # tokens the draft model has not taken in yet
    forecast: float | None = None  # the categoriser's acceptance forecast for the request
    suffix: int = 0  # suffix decoding's match now (0: none, or no suffix proposer)
    suffix_length: int = 0  # the tokens its draft holds


class Decision(NamedTuple):
    """The policy's k and proposer after the clamps, and per row who proposes how much."""

    k: int
    proposer: str  # as chosen: "draft", "ngram", "hybrid" or "suffix"
    rows: tuple[str | None, ...]  # per row: "draft", "ngram", "suffix" or None (plain)
    lengths: tuple[int, ...]  # per row: its block's length (0: plain)
    served: dict[str, list[int]]  # proposer → the rows it serves (empty: a plain step)

    @property
    def draft_runs(self) -> bool:
        return "draft" in self.rows

    @property
    def width(self) -> int:
        """Tokens per row the target scores beyond the one it always scores."""
        return max(self.lengths, default=0)


def make_context(rows: Sequence[RowView], *, k_max: int, proposers: tuple[str, ...],
                 has_draft: bool, costs=None, why: list | None = None) -> Context:
    """The ``Context`` of one iteration. Batch 1 is a batch of one: the per-row fields hold
    every running row, and the scalar ones the batch's (the first row's category, the most
    tokens left, the longest match, the widest draft gap); at one row they are that row's."""
    r0 = rows[0]
    if len(rows) == 1:
        return _context({
            "category": r0.category, "k_max": k_max, "generated": r0.generated,
            "remaining": r0.left, "live": r0.live, "remaining_rows": (r0.left,),
            "categories": (r0.category,), "rows": (r0.live,), "costs": costs,
            "proposers": proposers, "ngram_match": r0.match, "ngram_matches": (r0.match,),
            "draft_gap": r0.gap if has_draft else 0, "request": r0.request,
            "predicted_alpha": r0.forecast, "requests": (r0.request,),
            "predicted_alphas": (r0.forecast,), "suffix_match": r0.suffix,
            "suffix_matches": (r0.suffix,), "suffix_length": r0.suffix_length,
            "suffix_lengths": (r0.suffix_length,), "why": why})
    return _context({
        "category": r0.category, "k_max": k_max, "batch_size": len(rows),
        "generated": min(r.generated for r in rows), "remaining": max(r.left for r in rows),
        "live": r0.live, "remaining_rows": tuple(r.left for r in rows),
        "categories": tuple(r.category for r in rows), "rows": tuple(r.live for r in rows),
        "costs": costs, "proposers": proposers, "ngram_match": max(r.match for r in rows),
        "ngram_matches": tuple(r.match for r in rows),
        "draft_gap": max(r.gap for r in rows) if has_draft else 0, "request": r0.request,
        "predicted_alpha": None, "requests": tuple(r.request for r in rows),
        "predicted_alphas": tuple(r.forecast for r in rows),
        "suffix_match": max(r.suffix for r in rows),
        "suffix_matches": tuple(r.suffix for r in rows),
        "suffix_length": max(r.suffix_length for r in rows),
        "suffix_lengths": tuple(r.suffix_length for r in rows), "why": why})


# every field of Context with its default (each is a plain value: no default factories)
_CONTEXT_DEFAULTS = {f.name: f.default for f in fields(Context)}


def _context(values: dict) -> Context:
    """``Context(**values)``, the same frozen object with every field set, built by filling
    its ``__dict__`` instead of the frozen ``__init__``'s one guarded ``setattr`` per field
    (one is built every iteration); ``values`` are field names only."""
    ctx = object.__new__(Context)
    state = ctx.__dict__
    state.update(_CONTEXT_DEFAULTS)
    state.update(values)
    return ctx


def check_choice(policy, choice, k_max: int) -> int:
    """k from what ``policy.choose`` returned: an int (or a ``Choice``) ≥ 0. More than
    ``k_max`` is clamped to it (as to the tokens a request can keep); anything else is a
    bug in the policy, reported with its name and what it returned."""
    if type(choice) is int or type(choice) is Choice:  # the usual answers, checked fast
        if choice >= 0:
            return choice if choice <= k_max else k_max
    name = getattr(policy, "name", type(policy).__name__)
    if isinstance(choice, bool) or not isinstance(choice, numbers.Integral):
        raise TypeError(f"policy {name!r} returned {choice!r} ({type(choice).__name__}) from "
                        f"choose(): it must return an int k in 0..{k_max} (0: plain "
                        "decoding), or an autospec.policies.Choice")
    if choice < 0:
        raise ValueError(f"policy {name!r} returned k = {int(choice)} from choose(): k must "
                         f"be in 0..{k_max} (0: plain decoding)")
    return min(int(choice), k_max)


def decide(policy, ctx: Context, *, longest: int, has_draft: bool,
           target_context: int | None = None, draft_context: int | None = None,
           lookups: Mapping[str, Sequence[int]] | None = None) -> Decision:
    """Ask ``policy`` for this iteration and resolve its answer per row.

    longest: the most tokens any row holds (prompt + generated), for the context limits;
    lookups: per lookup proposer, each row's match length now ("ngram", "suffix")."""
    choice = policy.choose(ctx)
    k = check_choice(policy, choice, ctx.k_max)
    proposer, min_match = proposer_of(choice)
    if not has_draft and proposer not in LOOKUPS:
        proposer = "ngram"
    # every iteration emits at least one token: never draft past what can be kept
    k = min(k, ctx.remaining - 1)
    if target_context is not None:
        k = min(k, target_context - longest)
    if draft_context is not None and proposer not in LOOKUPS:
        k = min(k, draft_context - longest + 1)
    k = max(k, 0)
    left = ctx.remaining_rows or (ctx.remaining,)
    source = "suffix" if proposer == "suffix" else "ngram"  # the lookup it asks
    matches = (lookups or {}).get(source) or (0,) * len(left)
    rows: list[str | None] = []
    lengths: list[int] = []
    served: dict[str, list[int]] = {}
    looks = k > 0 and proposer != "draft"  # a row with a match takes the lookup's block
    least = min_match if proposer == "hybrid" else 1  # the match it needs
    other = "draft" if proposer not in LOOKUPS and has_draft else None  # a row without
    for b, (row_left, match) in enumerate(zip(left, matches)):
        size = min(k, row_left - 1)  # a row never proposes past what it can keep
        who = (source if looks and match >= least else other) if size > 0 else None
        rows.append(who)
        lengths.append(size if who else 0)
        if who:
            served.setdefault(who, []).append(b)
    if ctx.why is not None:  # asked why (a kept iteration): what the engine made of it
        _annotate(ctx, policy, choice, k, proposer)
    return Decision(k=k, proposer=proposer, rows=tuple(rows), lengths=tuple(lengths),
                    served=served)


def _annotate(ctx: Context, policy, choice, k: int, proposer: str) -> None:
    """The iteration's decision record (``policies.explain``) in ``ctx.why``: the policy's,
    or, where it appended none, the engine's own (rule "policy": its answer); then what the
    clamps made of it (``k_run``, ``proposer_run``) and the policy's name."""
    why = ctx.why
    if not why:
        k_asked = check_choice(policy, choice, ctx.k_max)
        why.append(explain.record(Choice(k_asked, *proposer_of(choice)) if k_asked else 0,
                                  "policy", batch=ctx.batch_size))
    rec = why[-1]
    rec.setdefault("policy", getattr(policy, "name", type(policy).__name__))
    rec["k_run"], rec["proposer_run"] = int(k), proposer if k else "plain"
