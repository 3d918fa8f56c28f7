"""The cost model (docs/policy.md, "One quantity: the time to finish"), in plain Python; the
arithmetic it prices by is ``autospec.costs.price``.

A candidate block b (plain decoding, the draft model's block of k, a lookup's block of k) is
expected to emit E[N_b] tokens and to cost C_b = k · T_propose + T_t(k + 1) + E[N_b] · x_b
seconds (x_b: the draft model's catch-up per token it serves). With the rest of the request
running at ρ seconds per token, b finishes it sooner than a plain step by

    saved_b = T_t(1) + (E[N_b] − 1) · ρ − C_b        (plain decoding: 0)

Each proposer's k minimises C_b / E[N_b] (ρ at its own rate: the ratio S(k) = E[N] · T_t(1) /
C); ``best_offer`` takes, among the blocks that pay (S at ρ ≥ 1 + min_gain), the one that saves
the most. Exploration is one rule, ``CostModelPolicy._explore``: what is not measured yet
(T_d, or the draft model's acceptance on a category with too few blocks) is priced at its bound,
and that block competes in the same decision.

At batch B one k serves every row and the same holds in batch tokens worth ρ = T_t(B, 1) / B
each (with several proposers, the paying draft block's ρ / S), counted by the time the call's
last row takes (rows leave as they finish): the draft model's block at k runs on to the end, its
S the rows' finish ratio (``finish_speedups``, its catch-up paid once), k the best; a lookup's
block is one step, worth 1 + what it saves the plain steps after it / ρ (``finish_tokens``), k
the one that saves the most. Where every row gains alike that is Σ E[N_i] − B + 1.
"""

from __future__ import annotations

import bisect
import functools
import threading
import weakref
from collections import namedtuple
from collections.abc import Callable, Sequence

from autospec.costs.price import (
    Offer,
    acceptance_cap,
    batch_best_k,
    best_k,
    best_offer,
    catch_up_per_token,
    expected_tokens,
    finish_speedups,
    finish_tokens,
    induced_catch_up,
    rows_offer,
    saved,
    valued,
)

from . import explain
from .base import K_LIMIT, Choice
from .params import CONSTANTS, DEFAULTS, Parameters
from .stopping import stop_rule

__all__ = ["request_curve", "CostModelPolicy"]


def request_curve(curve: Sequence[float], req, proposer: str, match: int = 0, *,
                  prior_blocks: float = DEFAULTS.request_prior_blocks) -> list[float]:
    """A lookup proposer's acceptance curve for one request: the category's (``curve``, for a
    match of ``match`` tokens; 0: any), per position pulled toward the request's own blocks and
    shadow from a match that long (``req``, its LiveStats; None: the category's alone), which
    count against ``prior_blocks`` blocks of the category's. Only the same match length's
    blocks pull."""
    if req is None:
        return list(curve)
    accepted, reached = req.counts(proposer, match)
    if reached[0] <= 0:
        return list(curve)
    w = prior_blocks
    return [(c * w + accepted[i]) / (w + reached[i]) if i < len(reached) else c
            for i, c in enumerate(curve)]


def lookup_now(context, proposer: str, row: int = 0) -> tuple[int, int]:
    """(match length, tokens its draft holds) of a lookup proposer for ``row`` now."""
    matches = context.matches.get(proposer) or ()
    sizes = context.sizes.get(proposer) or (K_LIMIT,) * len(matches)  # unsaid: as asked
    return (matches[row], sizes[row]) if row < min(len(matches), len(sizes)) else (0, 0)


def held(curve: Sequence[float], size: int) -> list[float]:
    """``curve`` for a block of at most ``size`` tokens: nothing is accepted past them."""
    return list(curve[:size]) + [0.0] * max(0, len(curve) - size)


# what a decision prices by (``_prices``): rows' statistics, T_t(1), T_t(n), T_d, both measured?,
# T_d and a second T_t known?, T_d only carried over a level move?, ρ (None: T_t(1)), busy?,
# the costs' origin, the first row's statistics, the step costs,
# the costs (the ``CostRow`` of the iteration's path and batch size)
_Prices = namedtuple("_Prices",
                     "rows t1 cost t_draft measured carried rate busy origin live steps costs")


class _Decision:
    """One decision's pricing (``CostModelPolicy._choose``): the proposers' blocks at the
    iteration's prices ``pr``, each also written into the record (``why``) where asked."""

    def __init__(self, policy, context, pr: _Prices, top: int, why: dict | None, proposers):
        self.policy, self.p, self.context, self.pr, self.top, self.why = (
            policy, policy.params, context, pr, top, why)
        self.proposers, self.model = proposers, context.model
        self.drafts = self.model is not None and self.model in proposers
        self.n = len(pr.rows)
        self.per_row = None if self.n == 1 else pr.t1 / self.n  # ρ of plain decoding
        self.rate = pr.rate
        self.left = _expected_left(context, pr.rows)
        self._steps: dict = {}
        if why is not None:
            why.update(busy=pr.busy, t_plain=pr.t1)
            why["candidates"].append(explain.plain(pr.t1, pr.origin, self.n))

    def cap(self, curve) -> int:
        """The widest k a block is priced at: at B > 1 k + 1 ≤ ``CONSTANTS.width_reach`` ×
        the widest n the batch grid has at B (beyond, T_t(B, n) would be extrapolated over B
        times the tokens measured), each block run there widening it; on a busy machine,
        whose costs are not decided by, within what acceptance justifies."""
        pr, top = self.pr, self.top
        if self.n > 1:
            top = max(1, min(top, int(CONSTANTS.width_reach * pr.costs.widest()) - 1))
        return min(top, acceptance_cap(curve, top, pr.costs.measure.marginal)) if pr.busy else top

    def record(self, name, curves, b, cap, t_propose, per_token, source, offers=()):
        """The proposer's block ``b`` (None: no k paid) into the record, which then shows its
        block of best S within ``cap`` (among ``offers`` where given), so it says by how much
        it missed. At B > 1 the draft's catch-up (``per_token``) is in its tokens already (the
        finish ratio pays it once): the record's ``extra_s`` is 0 there."""
        if self.why is None:
            return
        pr, t1, cost = self.pr, self.pr.t1, self.pr.cost
        shown = b or max(offers or (rows_offer(name, curves, j, t_propose, cost, per_token)
                                    for j in range(1, max(1, cap) + 1)),
                         key=lambda c: valued(c, t1, self.per_row))
        self.why["candidates"].append(explain.candidate(
            name, shown.k, tokens=shown.tokens + (self.n - 1),
            extra_s=per_token if self.n == 1 else 0.0,
            block_s=shown.k * t_propose + cost(shown.k + 1),
            speedup=valued(shown, t1, self.rate), saved_s=saved(shown, t1, self.rate),
            induced_s=shown.induced, acceptance=curves[0][:shown.k], acceptance_from=source,
            t_propose=t_propose, t_verify=cost(shown.k + 1), costs_from=pr.origin))

    def steps(self, t_draft: float | None = None) -> Callable[[int, int], float]:
        """step(b, k): one iteration of b rows at k with the draft's step at ``t_draft``
        (None: as measured; ``_step_costs``), built once per ``t_draft``."""
        t_draft = self.pr.t_draft if t_draft is None else t_draft
        got = self._steps.get(t_draft)
        if got is None:
            got = self._steps[t_draft] = self.pr.steps(t_draft or 0.0)
        return got

    def lookup_block(self, name: str, curves, t_lookup: float, k: int) -> Offer:
        """A lookup's block of k over the rows; at B > 1 in the batch tokens the rows' finish
        counts (``finish_tokens``): a token of a row that leaves before the batch's last is
        worth what that row costs a step, not the step's share."""
        b = rows_offer(name, curves, k, t_lookup, self.pr.cost)
        if self.n == 1:
            return b
        expected = [expected_tokens(c, k) for c in curves]
        return b._replace(tokens=finish_tokens(expected, self.left, self.steps(), self.per_row))

    def model_offers(self, curves, t_draft: float, cap: int, per_token: float) -> list[Offer]:
        """The draft model's blocks of k = 1 … ``cap`` over the rows; at B > 1 each in the
        batch tokens that make its S the rows' finish ratio at that k (``finish_speedups``,
        its catch-up paid once in full)."""
        pr = self.pr
        if self.n == 1:
            return [rows_offer(self.model, curves, k, t_draft, pr.cost, per_token)
                    for k in range(1, cap + 1)]
        speedups = finish_speedups(curves, self.left, self.steps(t_draft), cap,
                                   once=per_token * sum(self.left))
        out = []
        for k, s in enumerate(speedups, start=1):
            b = rows_offer(self.model, curves, k, t_draft, pr.cost)
            out.append(b._replace(tokens=1 + (s * b.seconds - pr.t1) / self.per_row))
        return out

    def draft(self) -> tuple[Offer | None, list[float]]:
        """The draft model's block (None: no k pays) and its first row's curve; with several
        proposers at B > 1 a paying one sets the rate the rest of the batch runs at."""
        pr, context = self.pr, self.context
        curves, source = self.policy._draft_curves(context, pr.rows, self.top)
        per_token = self.policy._catch_up(context, pr.rows, pr.t_draft, self.proposers)
        cap = self.cap(curves[0])
        offers = self.model_offers(curves, pr.t_draft, cap, per_token) if self.n > 1 else ()
        if offers:  # the k that finishes the rows soonest
            best = max(offers, key=lambda c: (valued(c, pr.t1, self.per_row), -c.k))
            b = best if valued(best, pr.t1, self.per_row) > 1 else None
        else:
            k = best_k(curves[0], pr.t_draft, pr.cost, cap, per_token=per_token)[0]
            b = rows_offer(self.model, curves, k, pr.t_draft, pr.cost, per_token) if k else None
        s = valued(b, pr.t1, self.per_row) if b and self.n > 1 else 0.0
        if (s >= 1 + self.p.min_gain and len(self.proposers) > 1
                and self.policy.proposers == "both"):
            self.rate /= s  # with several proposers, the rest of a batch runs at the draft's S_B
        self.record(self.model, curves, b, cap, pr.t_draft, per_token, source, offers)
        return b, curves[0]

    def lookups(self, draft_pays: bool) -> list[Offer | None]:
        """Each lookup's block where a row has a match: its whole draft (``suffix_whole``)
        where that pays, else its k of best S (at B > 1: the k that saves the most); beside a
        paying draft block it pays the draft's catch-up it causes."""
        pr, context, p, n, top = self.pr, self.context, self.p, self.n, self.top
        requests = _per_row(context, "requests", context.request)
        out = []
        for name in (x for x in self.proposers if x != self.model):
            now = [lookup_now(context, name, i) for i in range(n)]
            if not any(match > 0 and size > 0 for match, size in now):
                continue
            curves, t_lookup = [], 0.0
            for live, req, (match, size) in zip(pr.rows, requests, now):
                if live is None or match <= 0 or size <= 0:  # proposes nothing: E[N] = 1
                    curves.append([0.0] * top)
                    continue
                curves.append(held(request_curve(
                    self.policy.derived(live, name, top, match), req, name, match,
                    prior_blocks=p.request_prior_blocks), size))
                t_lookup = pr.costs.lookup_cost(name) or 0.0
            cap, k = self.cap(curves[0]), 0
            block = functools.partial(self.lookup_block, name, curves, t_lookup)
            offers = [block(j) for j in range(1, cap + 1)] if n > 1 else ()
            if name in context.whole and p.suffix_whole:  # its own rule: its whole draft
                k = min(max(size for _, size in now), cap)
                whole = offers[k - 1] if offers else block(k)
                if valued(whole, pr.t1, self.per_row) <= 1:
                    k = 0  # its whole draft does not pay: the k of best S instead
            if not k and offers:  # B > 1: the k that brings the rows' end closest
                best = max(offers, key=lambda c: (saved(c, pr.t1, self.per_row), -c.k))
                k = best.k if valued(best, pr.t1, self.per_row) > 1 else 0
            elif not k:
                k = batch_best_k(curves, t_lookup, pr.cost, cap)[0]
            induced = (induced_catch_up(pr.costs, getattr(context, "gap", 0),
                                        expected_tokens(curves[0], k))
                       if k and draft_pays and n == 1 else 0.0)
            source = f"live, match {now[0][0]}" if n == 1 else "live"
            b = (offers[k - 1] if offers else block(k))._replace(induced=induced) if k else None
            self.record(name, curves, b, cap, t_lookup, 0.0, source, offers)
            out.append(b)
        return out


class CostModelPolicy:
    """``auto``: the block that finishes the work in front of it soonest (the module's one
    objective, docs/policy.md), from the category's acceptance (its ``LiveStats``) and the
    pair's measured costs (``Context.costs``: the row of the controller's ``CostTable`` at
    the iteration's path and batch size), decided by one function at every batch size
    (``_choose``) with one exploration rule (``_explore``).

    ``params``: every number it decides by (``policies.params.Parameters``); keyword
    arguments override single fields (``CostModelPolicy(min_gain=0.05)``). ``proposers``: "both"
    (every one the request has), one of "draft", "ngram", "suffix", or several joined by "+".
    """

    def __init__(self, params: Parameters | None = None, *, name: str = "costmodel",
                 proposers: str = "both", **overrides):
        names = proposers.split("+") if isinstance(proposers, str) else []
        if proposers != "both" and (not names or any(not n.isidentifier() for n in names)):
            raise ValueError(f"proposers must be 'both' (every one the request has), a "
                             f"proposer's name ('draft', 'ngram', 'suffix', …) or several "
                             f"joined by '+' ('draft+suffix'), got {proposers!r}")
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"proposers {proposers!r} names {', '.join(repeated)} more than "
                             "once: name each proposer once")
        self.params = (DEFAULTS if params is None else params).but(**overrides)
        self.name = name
        self.proposers = proposers
        # per LiveStats (and CostRow): the curves (costs) derived, with the version they are of
        self._derived: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._derived_lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_derived", "_derived_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._derived = weakref.WeakKeyDictionary()
        self._derived_lock = threading.Lock()

    def _memo(self, live, key, version: int, build: Callable):
        """``build()`` for (``live``, ``key``), kept until ``version`` changes."""
        with self._derived_lock:
            hit = self._derived.setdefault(live, {}).get(key)
        if hit is not None and hit[0] == version:
            return hit[1]
        value = build()
        with self._derived_lock:
            self._derived.setdefault(live, {})[key] = (version, value)
        return value

    def derived(self, live, proposer: str | None, top: int, match: int = 0) -> list[float]:
        """A proposer's acceptance curve over ``top`` positions from ``live`` (a lookup's for
        a match of ``match`` tokens; 0: any), rebuilt when its counts change. Callers only
        read it."""
        return self._memo(live, (proposer, match, top), live.proposer_version(proposer),
                          lambda: live.curve(proposer, top, match=match))

    def derived_cost(self, costs) -> Callable[[int], float] | None:
        """T_t(B, ·) as a function from ``costs`` (a ``CostRow``), rebuilt when its path's
        costs changed (``version``)."""
        return self._memo(costs, "cost", costs.version,
                          lambda: costs.cost(optimistic=self.params.optimistic))

    @staticmethod
    def _row_stats(context) -> list:
        """Each row's statistics to decide by (batch 1: ``context.live``)."""
        return list(context.rows) if _batched(context) else [context.live]

    def choose(self, context) -> int:
        top = context.k_max if self.params.k_cap is None else min(self.params.k_cap, context.k_max)
        asked = getattr(context, "why", None)
        why = None if asked is None else {"candidates": []}
        k, rule = self._choose(context, top, why)
        if asked is not None:
            asked.append(explain.record(k, rule, why["candidates"],
                                        batch=getattr(context, "batch_size", 1),
                                        t_plain=why.get("t_plain"), value=why.get("value"),
                                        min_gain=self.params.min_gain,
                                        busy=why.get("busy", False), model=context.model,
                                        stop=why.get("stop")))
        return k

    def _prices(self, context, top: int, proposers) -> _Prices | tuple[int, str]:
        """What the decision prices by (``_Prices``), or (k, rule) where nothing can be priced
        yet: a block at ``initial_k`` without statistics at batch 1 ("no-stats"), plain steps
        until T_t(B, 1) can be decided by ("baseline": ``CostRow.ready``). Every cost is read
        from ``context.costs``, at batch 1 and at B > 1 alike."""
        p, costs, batched = self.params, context.costs, _batched(context)
        rows = self._row_stats(context)
        if not batched and rows[0] is None:
            k = min(p.initial_k, top)
            model = context.model if context.model in proposers else None
            lookup = next((n for n in proposers if n != model), None)
            if model is None and lookup is None:
                return 0, "no-stats"
            return (k if model is not None else Choice(k, lookup)), "no-stats"
        if costs is None or not costs.ready():
            return 0, "baseline"  # plain steps at this path and batch size measure it
        cost, t_draft = self.derived_cost(costs), costs.draft_cost()
        if batched:
            batch = context.batch_size
            rate = cost(1) / len(rows)
            steps = lambda t_d: _step_costs(costs, batch, cost, t_d, p.optimistic)  # noqa: E731
            live = next((r for r in rows if r is not None), None)
        else:
            live, steps = rows[0], None
            rate = self._rate(live, costs, context, proposers)
        return _Prices(rows, cost(1), cost, t_draft, costs.known(), costs.carried(), rate,
                       costs.busy(), costs.cost_origin(), live, steps, costs)

    def _choose(self, context, top: int, why: dict | None) -> tuple[int, str]:
        """(k, the rule that decided it: ``policies.explain.RULES``); ``why`` (where asked)
        collects every candidate priced. Batch 1 is a batch of one row: a block is priced in
        batch tokens (Σ E[N_i] − B + 1: what it yields beyond a plain step's B, plus that
        step's one), each proposer's k is its best (the draft model's: the k that finishes
        the rows soonest), and ``best_offer`` takes the block that saves the most."""
        proposers = self._allowed(context)
        pr = self._prices(context, top, proposers)
        if not isinstance(pr, _Prices):
            return pr
        d = _Decision(self, context, pr, top, why, proposers)
        draft, curve = d.draft() if d.drafts and pr.measured else (None, None)
        pays = draft is not None and valued(draft, pr.t1, d.rate) >= 1 + self.params.min_gain
        blocks = [b for b in (draft, *d.lookups(pays)) if b is not None]
        best = best_offer(blocks, pr.t1, d.rate, self.params.min_gain)
        rule = "best" if best is not None else "off"
        if why is not None:
            why["value"] = d.rate
        if d.drafts and (best is None or best.proposer != d.model):
            got = self._explore(d, top)
            if got is not None and (best is None or saved(got[0], pr.t1, d.rate)
                                    > saved(best, pr.t1, d.rate)):
                b, curves, source, per_token = got
                d.record(b.proposer, curves, b, b.k, _explored_t_draft(pr), per_token, source)
                best, rule = b, "explore"
        if best is None:
            return 0, rule
        if best.proposer != d.model:
            return Choice(best.k, best.proposer), rule
        if rule != "best" or d.n > 1 or not self.params.stop_rule:
            return best.k, rule
        # its block runs on while one more token costs less than the block's own seconds per
        # token (where C / E[N] is least), stopping by the draft's confidence
        stop = stop_rule(pr.live.calibration(d.model), curve, pr.t_draft, pr.cost,
                         best.seconds / best.tokens, best.k if pr.busy else top)
        if why is not None:
            why["stop"] = {"priced_k": best.k, **stop.describe()}
        return Choice(stop.longest, d.model, stop=stop), rule

    def _explore(self, d: _Decision, top: int) -> tuple[Offer, list, str, float] | None:
        """The one exploration rule: what is not measured yet is priced at its bound — T_d
        unmeasured (or only carried over a level move since it was timed) as free, and the
        draft model's acceptance on a row whose category has fewer than ``cold_start`` of its
        blocks counted (seeded and stored ones included) and no forecast for it, as perfect;
        what is measured (the acceptance otherwise, the catch-up it causes) at what
        was measured. The draft model's block so priced, at ``initial_k`` (one token where only
        a carried T_d is to be re-timed), where it pays: running it measures what was
        missing. (block, its curves, where they came from, its catch-up per token); None
        where nothing is missing or it cannot pay."""
        pr, context, p, model = d.pr, d.context, self.params, d.model
        forecasts = _per_row(context, "predicted_alphas", context.predicted_alpha)
        thin = [live is not None and live.observed(model) < p.cold_start and forecast is None
                for live, forecast in zip(pr.rows, forecasts)]  # per row: its category's
        if pr.measured and not any(thin) and not pr.carried:
            return None
        k = min(p.initial_k, top) if any(thin) or not pr.measured else 1  # else: re-time T_d
        curves, source = self._draft_curves(context, pr.rows, k)
        if any(thin):
            curves = [[1.0] * k if t else c for t, c in zip(thin, curves)]
            source = "perfect"
        t_draft = _explored_t_draft(pr)
        per_token = self._catch_up(context, pr.rows, t_draft, d.proposers)
        b = d.model_offers(curves, t_draft, k, per_token)[-1]
        if valued(b, pr.t1, pr.rate) < 1 + p.min_gain:
            return None
        return b, curves, source, per_token

    def _draft_curves(self, context, rows, top: int) -> tuple[list, str]:
        """(each row's draft-model acceptance curve, where the first came from): the
        categoriser's forecast while the row's category has fewer than ``cold_start``
        blocks, else the statistics' posterior; with no statistics the forecast or
        the prior's mean. Rows of one category and forecast share one curve."""
        forecasts = _per_row(context, "predicted_alphas", context.predicted_alpha)
        model = context.model
        memo: dict[tuple, tuple[list[float], str]] = {}
        out = []
        for live, predicted in zip(rows, forecasts):
            key = (id(live), predicted)
            if key not in memo:
                if live is None:
                    memo[key] = ([CONSTANTS.prior_mean if predicted is None
                                  else float(predicted)] * top, "prior")
                elif predicted is not None and live.observed(model) < self.params.cold_start:
                    memo[key] = [float(predicted)] * top, "forecast"
                else:
                    memo[key] = (self.derived(live, model, top),
                                 "live" if live.observed(model) > 0 else "prior")
            out.append(memo[key])
        return [c for c, _ in out], out[0][1]

    def _rate(self, live, costs, context, proposers) -> float | None:
        """ρ, what a token past a block's first is worth (seconds): with several proposers,
        the rate the request runs at (its own, pulled toward its category's by
        ``request_prior_tokens`` tokens), never above T_t(1); None (T_t(1)) with one
        proposer, or before the category's rate is known."""
        if len(proposers) < 2 or self.proposers != "both":
            return None
        rate = live.seconds_per_token()
        t1 = costs.t_target.get(1)
        if rate is None or t1 is None:
            return None
        req = getattr(context, "request", None)
        seconds, tokens = req.spent if req is not None else (0.0, 0.0)
        w = self.params.request_prior_tokens
        return min((rate * w + seconds) / (w + tokens), t1)

    def _catch_up(self, context, rows: Sequence, t_draft: float | None, proposers) -> float:
        """The draft model's catch-up per token it is expected to serve: one forward over the
        ``rows`` × the widest row's gap (``context.gap``) by the path's catch-up fit
        (``context.costs``), less one draft step (``t_draft``), shared over the rows' tokens
        left, each row's times its share beside prompt lookup (``_draft_share``; all of them
        alone)."""
        gap, fit = getattr(context, "gap", 0), context.costs
        if gap <= 2 or fit is None or fit.catch_up_cost(gap) is None:
            return 0.0
        share = 1.0
        lookups = [n for n in proposers if n != context.model]
        if lookups:  # one share per statistics (rows of one category share them)
            once = {i: 1.0 if live is None else _draft_share(live, context, lookups, self.params)
                    for i, live in {id(live): live for live in rows}.items()}
            share = sum(once[id(live)] for live in rows) / len(rows)
        return catch_up_per_token(fit, gap, sum(_expected_left(context, rows)) * share,
                                  rows=len(rows), t_draft=t_draft)

    def _allowed(self, context) -> tuple[str, ...]:
        """The proposers this request has (``context.proposers``) that ``proposers`` allows;
        a request without any of them keeps what it has."""
        have = tuple(getattr(context, "proposers", ("draft",)))
        if self.proposers == "both" or len(have) == 1:
            return have
        allowed = self.proposers.split("+")
        return tuple(p for p in have if p in allowed) or have

    def update(self, context, k: int, outcome) -> None:
        """Nothing: the controller's statistics and cost table are fed by the loop."""


def _draft_share(live, context, lookups: Sequence[str], params: Parameters = DEFAULTS) -> float:
    """The share of the rest of a request the model proposer serves beside the ``lookups``:
    where none has a match (the category's share of decision points without one), or one
    that fails at once (this request's, pulled toward the category's), each lookup taken
    alone."""
    req = getattr(context, "request", None)
    share = 1.0
    for name in lookups:
        alone = live.unmatched_share(name)
        first = request_curve(live.curve(name, 1), req, name,
                              prior_blocks=params.request_prior_blocks)[0]
        share *= alone + (1 - alone) * (1 - first)
    return share


def _step_costs(costs, batch: int, cost, t_draft: float,
                optimistic: bool) -> Callable[[int, int], float]:
    """step(b, k): one iteration of b rows at k, k · T_d(b) + T_t(b, k + 1) (k = 0: T_t(b, 1)),
    read at ``batch`` and the powers of two below it (on the path's grid: ``costs.across``),
    linear in b between them; a size the grid has nothing for is priced at ``batch``'s."""
    anchors = sorted({batch, *(1 << i for i in range(batch.bit_length()) if 1 << i < batch)})
    anchored = set(anchors)
    per_b: dict[int, tuple] = {batch: (cost, t_draft)}
    memo: dict[tuple[int, int], float] = {}

    def at(b: int, k: int) -> float:
        got = per_b.get(b)
        if got is None:
            tc, td = costs.across(b, optimistic=optimistic)
            got = per_b[b] = (tc or cost, td if td is not None else t_draft)
        return got[0](k + 1) + k * got[1] if k else got[0](1)

    def step(b: int, k: int) -> float:
        key = (b, k)
        value = memo.get(key)
        if value is None:
            if b in anchored:
                value = at(b, k)
            else:
                i = bisect.bisect_left(anchors, b)
                b0, b1 = anchors[i - 1], anchors[i]
                v0, v1 = step(b0, k), step(b1, k)
                value = v0 + (v1 - v0) * (b - b0) / (b1 - b0)
            memo[key] = value
        return value

    return step


def _explored_t_draft(pr: _Prices) -> float:
    """T_d as exploration prices it: free where unmeasured or only carried over a level move."""
    return 0.0 if not pr.measured or pr.carried else (pr.t_draft or 0.0)


def _batched(context) -> bool:
    """A batch the batch cost model decides for: more than one row, and costs for it."""
    return (getattr(context, "batch_size", 1) > 1 and bool(getattr(context, "rows", ()))
            and getattr(context, "costs", None) is not None)


def _expected_left(context, rows: Sequence) -> tuple[float, ...]:
    """Each row's tokens expected left: at most its ``remaining_rows``, fewer where its
    category's ended requests say it will stop sooner (``LiveStats.expected_left``; a row
    without statistics: all it may)."""
    left = _per_row(context, "remaining_rows", max(1, context.remaining))
    done = _per_row(context, "generated_rows", context.generated)
    return tuple(float(n) if live is None else live.expected_left(g, n)
                 for live, g, n in zip(rows, done, left))


def _per_row(context, name: str, default) -> tuple:
    """``context.<name>``, one entry per running row (``context.rows``; batch 1: one), where
    it has them, else ``default`` for every row (a context that gave the batch's alone)."""
    rows = max(1, len(context.rows)) if _batched(context) else 1
    got = tuple(getattr(context, name, ()) or ())
    return got if len(got) == rows else (default,) * rows
