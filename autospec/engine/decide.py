"""What the policy sees and what its answer means for each row: the first step of an iteration.

Torch-free, and shared by the live engine and trace replay (``autospec.tune.replay``), so
that both build the same ``Context`` and turn the same ``choose`` answer into the same
blocks. ``decide`` calls the policy once, checks its answer, clamps k to what the request
can keep, and assigns each row its proposer, by name, from what the call's proposers showed
(``autospec.engine.proposers``: nothing here names one):

- the model proposer (a plain int k) drafts k tokens for every row it serves (its forwards
  run over the whole batch);
- a lookup proposer (``Choice(k, name, min_match)``) serves the rows whose match has at least
  ``min_match`` tokens; with ``fallback`` ("hybrid": prompt lookup, the call's first lookup)
  the model serves the others; a row proposes at most what it can still keep;
- a row nobody proposes for decodes plainly within the iteration (a block of 0).

A row's block never runs past the tokens it may still generate. The block width the target
scores is k when the model runs, else the longest lookup block; 0 is a plain step. Without a
model proposer (``wrap(target)`` with no draft model), the model's block is the call's first
lookup's.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, fields
from typing import Any, NamedTuple

from autospec.policies import explain
from autospec.policies.base import HYBRID, Choice, Context, proposer_of

__all__ = ["RowView", "Decision", "make_context", "decide", "check_choice"]

_NONE: Mapping[str, int] = {}


class RowView(NamedTuple):
    """One running row, as the policy may see it (a tuple: built every iteration)."""

    category: str
    live: Any  # the category's LiveStats (None: no statistics)
    request: Any  # this request's own LiveStats
    generated: int
    left: int  # tokens the row may still generate, this iteration's included
    matches: Mapping[str, int] = _NONE  # each lookup's match length now (0: none)
    sizes: Mapping[str, int] = _NONE  # the tokens each lookup's draft holds now
    gap: int = 0  # tokens the model proposer has not taken in yet
    forecast: float | None = None  # the categoriser's acceptance forecast for the request


class Decision(NamedTuple):
    """The policy's k and proposer after the clamps, and per row who proposes how much."""

    k: int
    proposer: str | None  # as chosen, resolved to a name (None: a plain step)
    rows: tuple[str | None, ...]  # per row: the proposer serving it, or None (plain)
    lengths: tuple[int, ...]  # per row: its block's length (0: plain)
    served: dict[str, list[int]]  # proposer → the rows it serves (empty: a plain step)
    # where the model proposer's block stops before k (``policies.stopping.StopRule``)
    stop: Any = None

    def runs(self, proposer: str | None) -> bool:
        """Whether ``proposer`` serves rows this iteration."""
        return proposer in self.served

    @property
    def width(self) -> int:
        """Tokens per row the target scores beyond the one it always scores."""
        return max(self.lengths, default=0)


def make_context(rows: Sequence[RowView], *, k_max: int, proposers: tuple[str, ...],
                 model: str | None, whole: tuple[str, ...] = (), costs=None,
                 why: list | None = None, matches: Mapping[str, tuple[int, ...]] | None = None,
                 sizes: Mapping[str, tuple[int, ...]] | None = None) -> Context:
    """The ``Context`` of one iteration. Batch 1 is a batch of one: the per-row fields hold
    every running row, and the scalar ones the batch's (the first row's category, the most
    tokens left, the widest model gap); at one row they are that row's. ``matches`` /
    ``sizes``: each lookup's per row, where the caller has them so (else read off the rows'
    ``RowView.matches`` / ``sizes``)."""
    r0 = rows[0]
    if matches is None or sizes is None:
        lookups = [p for p in proposers if p != model]
        matches = {p: tuple(r.matches.get(p, 0) for r in rows) for p in lookups}
        sizes = {p: tuple(r.sizes.get(p, 0) for r in rows) for p in lookups}
    common = {"category": r0.category, "k_max": k_max, "live": r0.live, "costs": costs,
              "proposers": proposers, "model": model, "matches": matches, "sizes": sizes,
              "whole": whole, "request": r0.request, "why": why}
    if len(rows) == 1:  # a row's fields as one-tuples, built directly (every iteration)
        return _context({**common, "remaining_rows": (r0.left,), "categories": (r0.category,),
                         "generated_rows": (r0.generated,),
                         "rows": (r0.live,), "requests": (r0.request,),
                         "predicted_alphas": (r0.forecast,), "generated": r0.generated,
                         "remaining": r0.left, "gap": r0.gap if model else 0,
                         "predicted_alpha": r0.forecast})
    lefts, gens, cats, lives, reqs, forecasts = (tuple(c) for c in zip(
        *((r.left, r.generated, r.category, r.live, r.request, r.forecast) for r in rows)))
    common.update(remaining_rows=lefts, generated_rows=gens, categories=cats, rows=lives,
                  requests=reqs, predicted_alphas=forecasts)
    return _context({**common, "batch_size": len(rows),
                     "generated": min(r.generated for r in rows),
                     "remaining": max(r.left for r in rows),
                     "gap": max(r.gap for r in rows) if model else 0,
                     "predicted_alpha": None})


# every field of Context with its default (a factory's made once: nothing mutates them)
_CONTEXT_DEFAULTS = {f.name: f.default if f.default is not MISSING else f.default_factory()
                     for f in fields(Context)}


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
            return int(choice) if choice <= k_max else k_max
    name = getattr(policy, "name", type(policy).__name__)
    if isinstance(choice, bool) or not isinstance(choice, numbers.Integral):
        raise TypeError(f"policy {name!r} returned {choice!r} ({type(choice).__name__}) from "
                        f"choose(): it must return an int k in 0..{k_max} (0: plain "
                        "decoding), or an autospec.policies.Choice")
    if choice < 0:
        raise ValueError(f"policy {name!r} returned k = {int(choice)} from choose(): k must "
                         f"be in 0..{k_max} (0: plain decoding)")
    return min(int(choice), k_max)


def decide(policy, ctx: Context, *, longest: int, target_context: int | None = None,
           draft_context: int | None = None) -> Decision:
    """Ask ``policy`` for this iteration and resolve its answer per row.

    longest: the most tokens any row holds (prompt + generated), for the context limits;
    draft_context: the model proposer's context length."""
    choice = policy.choose(ctx)
    k = check_choice(policy, choice, ctx.k_max)
    name, min_match, fallback = proposer_of(choice)
    model = ctx.model if ctx.model in ctx.proposers else None
    lookups = [p for p in ctx.proposers if p != model]
    if name == HYBRID:  # prompt lookup (the first lookup), else the model
        name, fallback = (lookups[0] if lookups else model), True
    if name is None or (name == model and model is not None) or (
            model is None and name == ctx.model):  # the model's block, with or without one
        name = model if model is not None else (lookups[0] if lookups else None)
    lookup = name != model  # a lookup this request lacks has no match: a plain step
    other = model if (not lookup or fallback) else None  # who serves a row without a match
    # every iteration emits at least one token: never draft past what can be kept
    k = min(k, ctx.remaining - 1)
    if target_context is not None:
        k = min(k, target_context - longest)
    if draft_context is not None and other is not None:
        k = min(k, draft_context - longest + 1)
    k = max(k, 0)
    left = ctx.remaining_rows or (ctx.remaining,)
    matches = ctx.matches.get(name) or (0,) * len(left) if lookup else (0,) * len(left)
    rows: list[str | None] = []
    lengths: list[int] = []
    served: dict[str, list[int]] = {}
    for b, (row_left, match) in enumerate(zip(left, matches)):
        size = min(k, row_left - 1)  # a row never proposes past what it can keep
        who = (name if lookup and match >= min_match else other) if size > 0 else None
        rows.append(who)
        lengths.append(size if who else 0)
        if who:
            served.setdefault(who, []).append(b)
    if ctx.why is not None:  # asked why (a kept iteration): what the engine made of it
        _annotate(ctx, policy, choice, k, name)
    stop = getattr(choice, "stop", None) if model is not None and not lookup else None
    return Decision(k=k, proposer=name if k else None, rows=tuple(rows),
                    lengths=tuple(lengths), served=served, stop=stop)


def _annotate(ctx: Context, policy, choice, k: int, proposer: str | None) -> None:
    """The iteration's decision record (``policies.explain``) in ``ctx.why``: the policy's,
    or, where it appended none, the engine's own (rule "policy": its answer); then what the
    clamps made of it (``k_run``, ``proposer_run``) and the policy's name."""
    why = ctx.why
    if not why:
        k_asked = check_choice(policy, choice, ctx.k_max)
        asked, min_match, fallback = proposer_of(choice)
        why.append(explain.record(
            Choice(k_asked, asked or proposer or "plain", min_match, fallback) if k_asked
            else 0, "policy", batch=ctx.batch_size))
    rec = why[-1]
    rec.setdefault("policy", getattr(policy, "name", type(policy).__name__))
    rec["k_run"], rec["proposer_run"] = int(k), (proposer or "plain") if k else "plain"
