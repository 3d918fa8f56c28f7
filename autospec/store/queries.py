"""Reading the store: what ``autospec stats``, the policies and the simulator use.

Every function takes a session; the caller owns its lifecycle (``with store.session() as
s:``). Summaries read ``category_stats`` only, never scanning ``requests``.

Conventions (vLLM's): a *draft* is one drafting iteration; *drafted* the tokens proposed;
*accepted* those the target kept. Acceptance α = accepted / drafted; mean accepted length
= 1 + accepted / drafts, which counts the bonus (or recovered) token every iteration yields.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any, NamedTuple

from sqlalchemy import Text, cast, or_, select
from sqlalchemy.orm import Session

from autospec.costs import MIN_FORWARDS
from autospec.textfmt import named
from autospec.traces import capped

from .damage import (
    counters_problem,
    less,
    note,
    proposer_counters,
    request_note,
    request_problem,
    trace_problem,
    tuned_problem,
)
from .decisions import unpack as unpack_decisions
from .history import INGESTED
from .record import UNOBSERVED, trace_acceptance
from .tables import (
    Categorizer,
    CategoryPath,
    CategoryProposer,
    CategoryStat,
    Pair,
    PairCost,
    Probe,
    Request,
    RequestProposer,
    TunedParams,
)
from .write import category_key, pair_key

__all__ = [
    "PairRow", "CategorySummary", "RequestRow", "TraceRow", "ProbeRow", "DecisionsRow",
    "request_decisions", "latest_decisions", "category_decisions",
    "wilson_interval", "pairs", "category_summaries", "recent_requests", "traces",
    "latest_probe", "pair_id", "batch_costs", "live_batch_grid", "MIN_FORWARDS",
    "traffic_context", "serving_path", "paths", "TunedRow", "tuned_params", "tuned_fetcher",
    "CategorizerRow", "categorizers", "latest_categorizer", "FeatureRow", "feature_rows",
    "catch_ups", "lookup_seconds_per_token", "ProposerSums", "request_proposers",
    "category_lengths",
]

Z95 = 1.959963984540054


def wilson_interval(successes: int, trials: int, z: float = Z95) -> tuple[float, float] | None:
    """Wilson score interval for a binomial proportion (None without trials).

    Treats drafted tokens as independent trials; acceptances within a request are
    correlated, so read it as a lower bound on the real uncertainty."""
    if trials <= 0:
        return None
    if not 0 <= successes <= trials:
        raise ValueError(f"{successes} successes in {trials} trials: not a proportion")
    p = successes / trials
    denom = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def _ints(mapping: dict[str, Any] | None) -> dict[int, Any]:
    return {int(k): v for k, v in sorted((mapping or {}).items(), key=lambda kv: int(kv[0]))}


def _pairs(mapping: dict[str, Any] | None) -> dict[tuple[int, int], Any]:
    """``{"B,n": v}`` → ``{(B, n): v}``, sorted."""
    out = {}
    for key, v in (mapping or {}).items():
        b, n = key.split(",")
        out[int(b), int(n)] = v
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class PairRow:
    id: int
    target: str
    draft: str
    dtype: str
    hardware: str
    target_param_bytes: int
    draft_param_bytes: int
    created_at: datetime

    @classmethod
    def of(cls, p: Pair) -> PairRow:
        return cls(p.id, p.target, p.draft, p.dtype, p.hardware, p.target_param_bytes,
                   p.draft_param_bytes, p.created_at)


@dataclass(frozen=True)
class ProposerSums:
    """One proposer's counters, a request's (``request_proposers``, with its trace) or a
    category's sums (``category_proposers``), and what derives from them."""

    name: str
    kind: str  # "model" or "lookup"
    blocks: int = 0
    proposed: int = 0
    accepted: int = 0
    proposed_per_position: tuple[int, ...] = ()
    accepted_per_position: tuple[int, ...] = ()
    seconds: float = 0.0  # host seconds proposing
    trace: bytes | None = None  # a request's: what its replay rule reads
    confidence: bytes | None = None  # a request's model: top probability per position
    settings: dict[str, Any] | None = None

    @classmethod
    def of(cls, row, **counters) -> ProposerSums:
        """From a row of ``request_proposers`` or ``category_proposers`` (``counters``: the
        counters to take instead of the row's, where some were taken out)."""
        c = counters or proposer_counters(row)
        return cls(name=row.proposer, kind=row.kind, blocks=int(c["blocks"]),
                   proposed=int(c["proposed"]), accepted=int(c["accepted"]),
                   proposed_per_position=tuple(c["proposed_per_position"] or ()),
                   accepted_per_position=tuple(c["accepted_per_position"] or ()),
                   seconds=float(c["seconds"] or 0.0),
                   trace=_bytes(getattr(row, "trace", None)),
                   confidence=_bytes(getattr(row, "confidence", None)),
                   settings=getattr(row, "settings", None))

    @property
    def alpha(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def alpha_ci95(self) -> tuple[float, float] | None:
        return wilson_interval(self.accepted, self.proposed)

    @property
    def acceptance_by_position(self) -> tuple[float | None, ...]:
        return tuple(a / d if d else None
                     for a, d in zip(self.accepted_per_position, self.proposed_per_position))

    @property
    def mean_accepted_length(self) -> float | None:
        return 1 + self.accepted / self.blocks if self.blocks else None

    @property
    def seconds_per_token(self) -> float | None:
        """Host seconds per token it proposed (a lookup's T_propose; None: none proposed)."""
        return self.seconds / self.proposed if self.proposed else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: its counters, settings and the figures derived from them (its trace and
        confidences, bytes, are not)."""
        out = {f: getattr(self, f) for f in ("name", "kind", "blocks", "proposed", "accepted",
                                             "seconds", "settings")}
        out.update(proposed_per_position=list(self.proposed_per_position),
                   accepted_per_position=list(self.accepted_per_position),
                   **{f: getattr(self, f) for f in _DERIVED})
        out["acceptance_by_position"] = list(self.acceptance_by_position)
        return out


# the model proposer's counters ``CategorySummary.to_dict`` gives at its top level
_HEADLINE = ("drafts", "drafted", "accepted", "accepted_per_position", "drafted_per_position")
# what ``ProposerSums.to_dict`` adds to its counters
_DERIVED = ("alpha", "alpha_ci95", "acceptance_by_position", "mean_accepted_length",
            "seconds_per_token")


def _bytes(value) -> bytes | None:
    return None if value is None else bytes(value)


class _ModelFigures:
    """The model proposer's figures (the draft model's: the headline acceptance) read off
    ``proposers`` by the kinds the store keeps (zeros and None where there is none)."""

    @property
    def model(self) -> ProposerSums | None:
        return next((p for p in self.proposers.values() if p.kind == "model"), None)

    @property
    def drafts(self) -> int:
        return self.model.blocks if self.model else 0

    @property
    def drafted(self) -> int:
        return self.model.proposed if self.model else 0

    @property
    def accepted(self) -> int:
        return self.model.accepted if self.model else 0

    @property
    def accepted_per_position(self) -> tuple[int, ...]:
        return self.model.accepted_per_position if self.model else ()

    @property
    def drafted_per_position(self) -> tuple[int, ...]:
        return self.model.proposed_per_position if self.model else ()


@dataclass(frozen=True)
class CategorySummary(_ModelFigures):
    """Running sums of one (category, pair) and the figures derived from them."""

    category: str
    pair: PairRow
    requests: int
    prompt_tokens: int
    new_tokens: int
    iterations: int
    draft_s: float
    draft_forwards: int
    target_s_sum_by_n: dict[int, float]
    target_count_by_n: dict[int, int]
    k_counts: dict[int, int]  # k → iterations run with it
    wall_s: float
    prefill_s: float
    bandwidth_bytes: float  # Σ achieved bytes/s × target-forward seconds
    bandwidth_s: float  # Σ target-forward seconds of the requests that measured bandwidth
    bandwidth_peak_bytes_per_s: float | None
    nvml_mem_busy_sum: float
    nvml_mem_busy_n: int
    nvml_sm_util_sum: float
    nvml_sm_util_n: int
    first_seen: datetime
    last_seen: datetime
    # the execution path the timing fields (draft_s, draft_forwards, target_*_by_n and what
    # derives from them) come from: one path only (``category_summaries``); None: unknown,
    # the requests logged before paths were stored
    path: str | None = None
    # every proposer's sums, by name (``category_proposers``): the model's (the draft
    # model's, the headline figures below) and each lookup's
    proposers: dict[str, ProposerSums] = field(default_factory=dict)
    # derived
    alpha: float | None = field(init=False)
    alpha_ci95: tuple[float, float] | None = field(init=False)
    acceptance_by_position: tuple[float | None, ...] = field(init=False)
    mean_accepted_length: float | None = field(init=False)
    t_draft_s: float | None = field(init=False)  # T_d: seconds per draft forward
    t_target_s_by_n: dict[int, float] = field(init=False)  # T_t(n): mean forward seconds
    tokens_per_s: float | None = field(init=False)
    bandwidth_bytes_per_s: float | None = field(init=False)  # achieved, time-weighted
    bandwidth_utilisation: float | None = field(init=False)  # achieved / peak
    nvml_mem_busy_pct: float | None = field(init=False)  # mean over requests
    nvml_sm_util_pct: float | None = field(init=False)

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        model = self.model
        put("alpha", model.alpha if model else None)
        put("alpha_ci95", model.alpha_ci95 if model else None)
        put("acceptance_by_position", model.acceptance_by_position if model else ())
        put("mean_accepted_length", model.mean_accepted_length if model else None)
        put("t_draft_s", self.draft_s / self.draft_forwards if self.draft_forwards else None)
        put("t_target_s_by_n", {n: s / self.target_count_by_n[n]
                                for n, s in self.target_s_sum_by_n.items()
                                if self.target_count_by_n.get(n)})
        put("tokens_per_s", self.new_tokens / self.wall_s if self.wall_s > 0 else None)
        bw = self.bandwidth_bytes / self.bandwidth_s if self.bandwidth_s > 0 else None
        put("bandwidth_bytes_per_s", bw)
        peak = self.bandwidth_peak_bytes_per_s
        put("bandwidth_utilisation", bw / peak if bw is not None and peak else None)
        put("nvml_mem_busy_pct", self.nvml_mem_busy_sum / self.nvml_mem_busy_n
            if self.nvml_mem_busy_n else None)
        put("nvml_sm_util_pct", self.nvml_sm_util_sum / self.nvml_sm_util_n
            if self.nvml_sm_util_n else None)

    @property
    def by_proposer(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        """(accepted, proposed) per position of every proposer, by name (what a policy's
        statistics warm from: ``LiveStats.warm_start``)."""
        return {n: (p.accepted_per_position, p.proposed_per_position)
                for n, p in self.proposers.items()}

    @property
    def pair_id(self) -> int:
        return self.pair.id

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (datetimes as ISO strings)."""
        out = asdict(self)
        for name in ("first_seen", "last_seen"):
            out[name] = getattr(self, name).isoformat()
        out["pair"]["created_at"] = self.pair.created_at.isoformat()
        out["proposers"] = {name: p.to_dict() for name, p in self.proposers.items()}
        for name in _HEADLINE:  # the model proposer's, as its figures beside them
            value = getattr(self, name)
            out[name] = list(value) if isinstance(value, tuple) else value
        return out


def pairs(session: Session) -> list[PairRow]:
    return [PairRow.of(p) for p in session.scalars(select(Pair).order_by(Pair.id))]


_SERVED = object()  # category_summaries' default path: the one that served most requests


def _paths_served(session: Session, category: str | None, pair_id: int | None
                  ) -> dict[tuple[str, int], dict[str, CategoryPath]]:
    """(category_key, pair_id) → path → its ``category_paths`` row."""
    stmt = select(CategoryPath)
    if category is not None:
        stmt = stmt.where(CategoryPath.category_key == category_key(category))
    if pair_id is not None:
        stmt = stmt.where(CategoryPath.pair_id == pair_id)
    out: dict[tuple[str, int], dict[str, CategoryPath]] = {}
    for c in session.scalars(stmt):
        out.setdefault((c.category_key, c.pair_id), {})[c.path] = c
    return out


def path_costs(session: Session, pair_id: int | None = None
               ) -> dict[tuple[int, str], PairCost]:
    """(pair_id, path) → its ``pair_costs`` row: batch 1's timing sums, every category's
    requests pooled (the pair's costs, once)."""
    stmt = select(PairCost)
    if pair_id is not None:
        stmt = stmt.where(PairCost.pair_id == pair_id)
    return {(c.pair_id, c.path): c for c in session.scalars(stmt)}


def category_lengths(session: Session, category: str, pair_id: int,
                     limit: int) -> list[tuple[int, bool]]:
    """(new tokens, stopped at its cap?) of the category's latest ``limit`` requests on the
    pair, oldest first: how long its requests run (``LiveStats.observe_length``). A request
    that ended by neither an EOS nor a stopping criterion counts as stopped at its cap."""
    stmt = (select(Request.new_tokens, Request.stop_reason)
            .where(Request.category_key == category_key(category), Request.pair_id == pair_id)
            .order_by(Request.created_at.desc(), Request.id.desc()).limit(limit))
    rows = session.execute(stmt).all()
    return [(int(n), capped(reason)) for n, reason in reversed(rows)]


def category_summaries(session: Session, category: str | None = None,
                       pair_id: int | None = None, *, path=_SERVED) -> list[CategorySummary]:
    """One summary per (category, pair), most requests first.

    Counters and acceptance cover every request. The timing fields (T_t(n), T_d and their
    sums) are the pair's on ONE execution path, ``summary.path`` (``pair_costs``: every
    category's batch-1 requests on it pooled; costs are the pair's, not the category's):
    ``path`` if given (zero where the category has no requests on it); by default the path
    that served most of the category's requests (ties: the latest); where no request of the
    category has a known path (all logged before paths were stored), the category's own sums
    of those requests with ``path`` None (unknown)."""
    stmt = select(CategoryStat, Pair).join(Pair, Pair.id == CategoryStat.pair_id)
    if category is not None:
        stmt = stmt.where(CategoryStat.category_key == category_key(category))
    if pair_id is not None:
        stmt = stmt.where(CategoryStat.pair_id == pair_id)
    by_path = _paths_served(session, category, pair_id)
    pooled = path_costs(session, pair_id)
    out = []
    sums = _category_proposers(session, category, pair_id)
    for st, p in session.execute(stmt):
        known = by_path.get((st.category_key, st.pair_id), {})
        chosen = path
        if chosen is _SERVED:
            chosen = max(known, key=lambda q: (known[q].requests, known[q].last_seen),
                         default=None)
        if chosen is None and not known:
            timing = dict(draft_s=st.draft_s, draft_forwards=st.draft_forwards,
                          target_s_sum_by_n=_ints(st.target_s_sum_by_n),
                          target_count_by_n=_ints(st.target_count_by_n))
        elif chosen in known and (st.pair_id, chosen) in pooled:
            c = pooled[(st.pair_id, chosen)]
            timing = dict(draft_s=c.draft_s, draft_forwards=c.draft_forwards,
                          target_s_sum_by_n=_ints(c.target_s_sum_by_n),
                          target_count_by_n=_ints(c.target_count_by_n))
        else:  # a path this category never ran on (or unknown beside known ones): no costs
            timing = dict(draft_s=0.0, draft_forwards=0, target_s_sum_by_n={},
                          target_count_by_n={})
        rows = sums.get((st.category_key, st.pair_id), [])
        totals = {name: getattr(st, name) for name in _TOTALS}
        counters = {row.proposer: proposer_counters(row) for row in rows}
        damaged = {n: problem for n, c in counters.items()
                   if (problem := counters_problem(c, n)) is not None}
        if damaged:  # a damaged row in the store: left out, and said so
            kept = _less_damaged(session, st, totals, counters, damaged)
            if kept is None:
                continue  # its only requests were damaged: nothing to show
            totals, counters = kept
        proposers = {row.proposer: ProposerSums.of(row, **counters[row.proposer])
                     for row in rows if row.proposer in counters}
        out.append(CategorySummary(
            category=st.category, pair=PairRow.of(p), **totals, **timing,
            k_counts=_ints(st.k_counts),
            wall_s=st.wall_s, prefill_s=st.prefill_s, bandwidth_bytes=st.bandwidth_bytes,
            bandwidth_s=st.bandwidth_s, bandwidth_peak_bytes_per_s=st.bandwidth_peak_bytes_per_s,
            nvml_mem_busy_sum=st.nvml_mem_busy_sum, nvml_mem_busy_n=st.nvml_mem_busy_n,
            nvml_sm_util_sum=st.nvml_sm_util_sum, nvml_sm_util_n=st.nvml_sm_util_n,
            first_seen=st.first_seen, last_seen=st.last_seen, path=chosen,
            proposers=proposers))
    out.sort(key=lambda s: (-s.requests, s.category, s.pair.id))
    return out


def _category_proposers(session: Session, category: str | None, pair_id: int | None
                        ) -> dict[tuple[str, int], list[CategoryProposer]]:
    """The ``category_proposers`` rows by (category_key, pair_id), sorted by name."""
    stmt = select(CategoryProposer).order_by(CategoryProposer.proposer)
    if category is not None:
        stmt = stmt.where(CategoryProposer.category_key == category_key(category))
    if pair_id is not None:
        stmt = stmt.where(CategoryProposer.pair_id == pair_id)
    out: dict[tuple[str, int], list[CategoryProposer]] = {}
    for row in session.scalars(stmt):
        out.setdefault((row.category_key, row.pair_id), []).append(row)
    return out


# a category's totals of its requests (``category_stats``) that a damaged request is taken
# out of, beside its proposers' counters
_TOTALS = ("requests", "prompt_tokens", "new_tokens", "iterations")


def _less_damaged(session: Session, st: CategoryStat, totals: dict[str, Any],
                  counters: dict[str, dict[str, Any]], damaged: dict[str, str]
                  ) -> tuple[dict[str, Any], dict[str, dict[str, Any]]] | None:
    """A category whose proposers' sums are damaged (``damaged``: name → problem) read as
    well as it can be: each request with a proposer row that breaks the rule is left out
    whole — its totals and every one of its proposers' counters taken out (each such request
    noted). A proposer's sums still damaged after that are left out and noted. Returns the
    (totals, counters) left, or None where no request is left (nothing to show). Runs only
    on a damaged category (it reads the category's requests)."""
    stmt = (select(RequestProposer, Request.policy,
                   *(getattr(Request, name) for name in _TOTALS[1:]))
            .join(Request, Request.id == RequestProposer.request_id)
            .where(Request.category_key == st.category_key, Request.pair_id == st.pair_id)
            .order_by(Request.id, RequestProposer.proposer))
    left_totals, left = dict(totals), {n: dict(c) for n, c in counters.items()}
    bad: list[tuple[int, str, str]] = []

    def take_out(rid: int, mine: list) -> None:
        why = next((p for p in (request_problem(r) for r, *_ in mine) if p is not None), None)
        if why is None:
            return
        _, policy, *values = mine[0]
        bad.append((rid, policy, why))
        for name, value in zip(_TOTALS, (1, *values)):
            left_totals[name] = (left_totals[name] or 0) - (value or 0)
        for r, *_ in mine:
            if r.proposer in left:
                left[r.proposer] = less(left[r.proposer], proposer_counters(r))

    try:
        rid, mine = None, []
        for row in session.execute(stmt.execution_options(yield_per=1000)):
            if row[0].request_id != rid and mine:
                take_out(rid, mine)
                mine = []
            rid = row[0].request_id
            mine.append(tuple(row))
        if mine:
            take_out(rid, mine)
    except (TypeError, ValueError):  # a row too damaged to take out: no request is
        left_totals, left, bad = dict(totals), {n: dict(c) for n, c in counters.items()}, []
    where = f"category {named(st.category)} on pair {st.pair_id}"
    for name, problem in damaged.items():
        if counters_problem(left[name]) is not None or not bad:
            rows = (f" (its damaged request rows: {', '.join(str(b[0]) for b in bad[:5])})"
                    if bad else "")
            note(f"{where}: its statistics of {named(name, 64)} hold {problem}{rows}; "
                 "left out")
            del left[name]
    for rid, policy, why in bad:
        note(request_note(rid, st.category, st.pair_id, policy, why))
    return (left_totals, left) if left_totals["requests"] > 0 else None


@dataclass(frozen=True)
class RequestRow(_ModelFigures):
    """One stored request, as the runtime recorded it (times as aware UTC datetimes), with its
    proposers' rows by name (``proposers``; the model's figures read off them)."""

    id: int
    created_at: datetime
    category: str
    pair_id: int
    policy: str
    greedy: bool
    prompt_tokens: int
    new_tokens: int
    iterations: int
    k_schedule: bytes
    accepted_schedule: bytes
    trace_kind: str
    wall_s: float
    prefill_s: float
    draft_s: float
    draft_forwards: int
    target_s_by_n: dict[int, list[float]]
    bandwidth_bytes_per_s: float | None
    bandwidth_peak_bytes_per_s: float | None
    nvml_mem_busy_pct: float | None
    nvml_sm_util_pct: float | None
    prompt_text: str | None
    output_text: str | None
    stop_reason: str
    category_source: str = "given"
    features: bytes | None = None
    predicted_alpha: float | None = None
    batch_size: int = 1  # rows of the batch the request started in
    # forwards at batch B > 1: (B, n) → [seconds]; B → [seconds per proposed token]
    target_s_by_bn: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    draft_s_by_b: dict[int, list[float]] = field(default_factory=dict)
    path: str | None = None  # the execution path (None: unknown, logged before 0005)
    # the model's catch-up forwards (0007; None: not recorded): (tokens, seconds)
    draft_catch_ups: list[tuple[int, float]] | None = None
    # its proposers' rows, by name (0011), and who drafted each iteration (a name; None: a
    # plain step; the list None where the store has no schedule)
    proposers: dict[str, ProposerSums] = field(default_factory=dict)
    proposer_schedule: list[str | None] | None = None
    batch_id: str | None = None  # the batched call it ran in (None: batch 1)

    @property
    def trace(self) -> bytes:
        """The model proposer's acceptance trace (unobserved throughout without one)."""
        model = self.model
        if model is not None and model.trace is not None:
            return model.trace
        return bytes([UNOBSERVED]) * self.new_tokens

    @property
    def confidence(self) -> bytes | None:
        return self.model.confidence if self.model else None

    @classmethod
    def of(cls, r: Request, proposers: dict[str, ProposerSums]) -> RequestRow:
        names = {f for f in cls.__dataclass_fields__ if f not in ("proposers",
                                                                   "proposer_schedule")}
        values = {name: getattr(r, name) for name in names}
        values["target_s_by_n"] = _ints(r.target_s_by_n)
        values["batch_size"] = r.batch_size or 1
        values["target_s_by_bn"] = _pairs(r.target_s_by_bn)
        values["draft_s_by_b"] = _ints(r.draft_s_by_b)
        if r.draft_catch_ups is not None:
            values["draft_catch_ups"] = [(int(g), float(c)) for g, c in r.draft_catch_ups]
        for name in ("k_schedule", "accepted_schedule", "features"):
            if values[name] is not None:
                values[name] = bytes(values[name])
        return cls(**values, proposers=proposers,
                   proposer_schedule=schedule_names(r.proposer_schedule, proposers))


def schedule_names(stored: bytes | None, proposers) -> list[str | None] | None:
    """A stored ``proposer_schedule`` (per iteration the 1-based index of the drafting
    proposer among the request's, sorted by name; 0: nobody) as names (None: a plain step).
    None where nothing was stored: every iteration the model's, or plain."""
    if stored is None:
        return None
    names = sorted(proposers)
    return [names[b - 1] if 0 < b <= len(names) else None for b in bytes(stored)]


def request_proposers(session: Session, ids) -> dict[int, dict[str, ProposerSums]]:
    """The ``request_proposers`` rows of these requests: request id → name → its row."""
    out: dict[int, dict[str, ProposerSums]] = {}
    ids = list(ids)
    for at in range(0, len(ids), 500):
        stmt = (select(RequestProposer).where(RequestProposer.request_id.in_(ids[at:at + 500]))
                .order_by(RequestProposer.request_id, RequestProposer.proposer))
        for row in session.scalars(stmt):
            out.setdefault(row.request_id, {})[row.proposer] = ProposerSums.of(row)
    return out


@dataclass(frozen=True)
class DecisionsRow:
    """One stored request's decision records (``autospec.policies.explain``, each with its
    "iteration"), with what it ran (``k_schedule``: per iteration, its block's k)."""

    id: int
    created_at: datetime
    category: str
    pair_id: int
    policy: str
    batch_size: int
    iterations: int
    new_tokens: int
    k_schedule: bytes
    proposer_schedule: bytes | None
    decisions: list[dict[str, Any]] | None  # None: none kept (nobody asked, or before 0009)


_DECISION_COLUMNS = (Request.id, Request.created_at, Request.category, Request.pair_id,
                     Request.policy, Request.batch_size, Request.iterations, Request.new_tokens,
                     Request.k_schedule, Request.proposer_schedule, Request.decisions)


def _decisions_row(r) -> DecisionsRow:
    return DecisionsRow(
        id=r.id, created_at=r.created_at, category=r.category, pair_id=r.pair_id,
        policy=r.policy, batch_size=r.batch_size or 1, iterations=r.iterations,
        new_tokens=r.new_tokens, k_schedule=bytes(r.k_schedule),
        proposer_schedule=None if r.proposer_schedule is None else bytes(r.proposer_schedule),
        decisions=unpack_decisions(None if r.decisions is None else bytes(r.decisions)))


def request_decisions(session: Session, request_id: int) -> DecisionsRow | None:
    """Request ``request_id``'s decision records; None: no such request."""
    row = session.execute(select(*_DECISION_COLUMNS).where(Request.id == request_id)).first()
    return None if row is None else _decisions_row(row)


def latest_decisions(session: Session, category: str | None = None) -> DecisionsRow | None:
    """The latest request (of ``category``) with decision records kept; None: none has."""
    stmt = (select(*_DECISION_COLUMNS).where(Request.decisions.is_not(None))
            .order_by(Request.id.desc()).limit(1))
    if category is not None:
        stmt = stmt.where(Request.category_key == category_key(category))
    row = session.execute(stmt).first()
    return None if row is None else _decisions_row(row)


def category_decisions(session: Session, category: str, pair_id: int,
                       limit: int = 200) -> list[DecisionsRow]:
    """The latest ``limit`` requests of (category, pair) with decision records, newest first."""
    stmt = (select(*_DECISION_COLUMNS)
            .where(Request.category_key == category_key(category), Request.pair_id == pair_id,
                   Request.decisions.is_not(None))
            .order_by(Request.created_at.desc(), Request.id.desc()).limit(limit))
    return [_decisions_row(r) for r in session.execute(stmt)]


def recent_requests(session: Session, category: str | None = None,
                    pair_id: int | None = None, limit: int = 20) -> list[RequestRow]:
    """The latest ``limit`` requests, newest first."""
    stmt = select(Request).order_by(Request.id.desc()).limit(limit)
    if category is not None:
        stmt = stmt.where(Request.category_key == category_key(category))
    if pair_id is not None:
        stmt = stmt.where(Request.pair_id == pair_id)
    rows = list(session.scalars(stmt))
    props = request_proposers(session, [r.id for r in rows])
    return [RequestRow.of(r, props.get(r.id, {})) for r in rows]


class TraceRow(NamedTuple):
    """What the simulator replays: each proposer's trace by name (``Proposer.replay`` reads
    its own: ``autospec.engine.proposers``), its extras (the model's confidences, a lookup's
    settings), and the schedule actually run."""

    trace_kind: str
    traces: dict[str, bytes]
    k_schedule: bytes
    accepted_schedule: bytes
    id: int = 0
    created_at: datetime | None = None
    category: str = ""
    batch_size: int = 1  # rows of the batch the request started in
    proposer_schedule: list[str | None] | None = None  # who drafted each iteration
    prompt_tokens: int = 0  # the model's first catch-up takes these in (replay)
    new_tokens: int = 0  # generated positions (0: the length of its model's trace)
    extras: dict[str, dict] = {}
    kinds: dict[str, str] = {}  # each proposer's kind ("model", "lookup")
    batch_id: str | None = None  # the batched call it ran in (None: batch 1)
    max_new_tokens: int | None = None  # the tokens it could have generated (None: not known)

    @property
    def model(self) -> str | None:
        """Its model proposer's name, if it had one."""
        return next((n for n, k in self.kinds.items() if k == "model"), None)

    @property
    def trace(self) -> bytes:
        """The model proposer's acceptance trace (unobserved throughout without one)."""
        got = self.traces.get(self.model) if self.model else None
        return got if got is not None else bytes([UNOBSERVED]) * self.new_tokens

    @property
    def confidence(self) -> bytes | None:
        return (self.extras.get(self.model) or {}).get("confidence") if self.model else None


def _when(t: datetime | float) -> datetime:
    return t if isinstance(t, datetime) else datetime.fromtimestamp(t, timezone.utc)


def traces(session: Session, category: str | None = None, pair_id: int | None = None,
           since: datetime | float | None = None, limit: int | None = None,
           until: datetime | float | None = None, newest: bool = False,
           id_range: tuple[int, int] | None = None) -> Iterator[TraceRow]:
    """Stored traces, oldest first, streamed (keep the session open while iterating).
    ``since`` (inclusive) / ``until`` (exclusive): aware datetimes or Unix times.
    ``newest=True`` with ``limit``: the latest ``limit`` traces (still yielded oldest first).
    ``id_range``: request ids first … last, inclusive (a window pinned exactly).
    The records ``autospec ingest`` wrote (an engine's counters, no trace) are not requests
    to replay: left out. A request whose proposer's trace cannot be its own (not a whole,
    non-zero number of bytes per generated position: ``damage.trace_problem``; an older
    release's or a hand-written row) is left out and noted."""
    stmt = select(Request.trace_kind, Request.k_schedule, Request.accepted_schedule,
                  Request.id, Request.created_at, Request.category, Request.batch_size,
                  Request.proposer_schedule, Request.prompt_tokens, Request.new_tokens,
                  Request.batch_id, Request.pair_id, Request.policy, Request.max_new_tokens)
    stmt = stmt.where(or_(Request.stop_reason.is_(None), Request.stop_reason != INGESTED))
    if category is not None:
        stmt = stmt.where(Request.category_key == category_key(category))
    if pair_id is not None:
        stmt = stmt.where(Request.pair_id == pair_id)
    if since is not None:
        stmt = stmt.where(Request.created_at >= _when(since))
    if until is not None:
        stmt = stmt.where(Request.created_at < _when(until))
    if id_range is not None:
        stmt = stmt.where(Request.id >= id_range[0], Request.id <= id_range[1])
    if newest and limit is not None:
        ids = [i for (i,) in session.execute(
            stmt.with_only_columns(Request.id).order_by(Request.id.desc()).limit(limit))]
        if not ids:
            return
        stmt = stmt.where(Request.id >= min(ids))
    elif limit is not None:
        stmt = stmt.limit(limit)
    stmt = stmt.order_by(Request.id)
    chunk: list = []
    for row in session.execute(stmt.execution_options(yield_per=500)):
        chunk.append(row)
        if len(chunk) == 500:
            yield from _trace_rows(session, chunk)
            chunk = []
    yield from _trace_rows(session, chunk)


def _trace_rows(session: Session, rows: list) -> Iterator[TraceRow]:
    """``TraceRow``s of these request rows, their proposers' rows read in one query."""
    props = request_proposers(session, [r.id for r in rows])
    for (kind, ks, acc, rid, created, cat, batch, sched, prompt, new, batch_id, pid,
         policy, limit) in rows:
        mine = props.get(rid, {})
        problem = next((f"its {name} trace {why}" for name, p in mine.items()
                        if p.trace is not None and new
                        and (why := trace_problem(len(p.trace), new)) is not None), None)
        if problem is not None:  # a damaged row: left out, and said so
            note(request_note(rid, cat, pid, policy, problem))
            continue
        extras = {n: {**(p.settings or {}),
                      **({"confidence": p.confidence} if p.confidence is not None else {})}
                  for n, p in mine.items()}
        yield TraceRow(kind, {n: p.trace for n, p in mine.items() if p.trace is not None},
                       bytes(ks), bytes(acc), rid, created, cat, batch or 1,
                       schedule_names(sched, mine), prompt or 0, new or 0, extras,
                       {n: p.kind for n, p in mine.items()}, batch_id, limit)


@dataclass(frozen=True)
class ProbeRow:
    id: int
    pair_id: int
    created_at: datetime
    payload: dict[str, Any]
    grid: dict[int, dict[int, float]] = field(default_factory=dict)  # T_t(B, n), seconds
    draft_grid: dict[int, float] = field(default_factory=dict)  # T_d(B), seconds per token
    path: str | None = None  # the execution path it timed (None: before 0005, bare forwards)

    @classmethod
    def of(cls, p: Probe) -> ProbeRow:
        grid = {b: {int(n): float(t) for n, t in sorted(row.items(), key=lambda x: int(x[0]))}
                for b, row in _ints(p.grid).items()}
        return cls(p.id, p.pair_id, p.created_at, p.payload, grid,
                   {b: float(t) for b, t in _ints(p.draft_grid).items()}, p.path)


_ANY = object()  # latest_probe's default: a probe of any path, unknown included


def _probes(session: Session, pair_id: int, path=_ANY):
    stmt = select(Probe).where(Probe.pair_id == pair_id)
    if path is not _ANY:
        stmt = stmt.where(Probe.path.is_(None) if path is None else Probe.path == path)
    return stmt.order_by(Probe.created_at.desc(), Probe.id.desc())


def latest_probe(session: Session, pair_id: int, path=_ANY) -> ProbeRow | None:
    """The pair's latest probe; with ``path``, the latest that timed that execution path
    (None: the probes of unknown path, stored before 0005)."""
    p = session.scalars(_probes(session, pair_id, path).limit(1)).first()
    return None if p is None else ProbeRow.of(p)


def pair_id(session: Session, pair) -> int | None:
    """The id of ``pair``'s row (a PairInfo), or None if nothing was logged for it."""
    return session.scalar(select(Pair.id).where(Pair.key == pair_key(pair)))


def paths(session: Session, pair_id: int, category: str | None = None) -> dict[str, int]:
    """Execution path → batch-1 requests with costs on it, for the pair (one category's, or
    all), most first. Requests of unknown path are not counted."""
    stmt = select(CategoryPath.path, CategoryPath.requests).where(
        CategoryPath.pair_id == pair_id)
    if category is not None:
        stmt = stmt.where(CategoryPath.category_key == category_key(category))
    out: dict[str, int] = {}
    for path, n in session.execute(stmt):
        out[path] = out.get(path, 0) + int(n or 0)
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def serving_path(session: Session, pair_id: int, category: str | None = None) -> str | None:
    """The execution path the pair's traffic ran on: the one with the most batch-1 requests
    of the category (else of the pair), else the latest probe's; None if none is known."""
    for cat in ([category, None] if category is not None else [None]):
        known = paths(session, pair_id, cat)
        if known:
            return next(iter(known))
    return session.scalar(select(Probe.path).where(Probe.pair_id == pair_id,
                                                   Probe.path.is_not(None))
                          .order_by(Probe.created_at.desc(), Probe.id.desc()).limit(1))


def catch_ups(session: Session, pair_id: int, *, path: str | None = None, recent: int = 500,
              min_forwards: int = MIN_FORWARDS
              ) -> tuple[list[tuple[int, float]], float | None]:
    """The draft model's catch-up forwards the pair's latest ``recent`` batch-1 requests on
    ``path`` logged ((tokens, seconds), oldest first), and T_d per proposed token over the
    same requests (None below ``min_forwards`` proposals): a catch-up's cost is the pair's and
    the hardware's, whatever the category. Replay reads the fit relative to that T_d, so that
    it stands beside T_d from another source (a probe) at the same ratio."""
    stmt = (select(Request.draft_catch_ups, Request.draft_s, Request.draft_forwards)
            .where(Request.pair_id == pair_id, Request.batch_size == 1,
                   Request.draft_catch_ups.is_not(None))
            .order_by(Request.id.desc()).limit(recent))
    if path is not None:
        stmt = stmt.where(Request.path == path)
    points: list[tuple[int, float]] = []
    draft_s, forwards = 0.0, 0
    for ups, d_s, d_n in reversed(session.execute(stmt).all()):
        points += [(int(g), float(c)) for g, c in ups or ()]
        draft_s += d_s or 0.0
        forwards += d_n or 0
    return points, (draft_s / forwards if forwards >= min_forwards else None)


def lookup_seconds_per_token(session: Session, pair_id: int, category: str | None = None
                             ) -> dict[str, float]:
    """Each lookup proposer's host seconds per token it proposed, by name, over every request
    of the pair (of ``category``, where given) that had it (``category_proposers``): what
    replay prices its lookups at. A proposer that never proposed a token is left out."""
    stmt = (select(CategoryProposer.proposer, CategoryProposer.seconds,
                   CategoryProposer.proposed)
            .where(CategoryProposer.pair_id == pair_id, CategoryProposer.kind == "lookup"))
    if category is not None:
        stmt = stmt.where(CategoryProposer.category_key == category_key(category))
    seconds: dict[str, float] = {}
    proposed: dict[str, int] = {}
    for name, s_, n in session.execute(stmt):
        seconds[name] = seconds.get(name, 0.0) + float(s_ or 0.0)
        proposed[name] = proposed.get(name, 0) + int(n or 0)
    return {n: seconds[n] / proposed[n] for n in seconds if proposed[n] > 0}


def catch_up_source(session: Session, pair_id: int, *, path: str | None = None,
                    recent: int = 500, min_forwards: int = MIN_FORWARDS
                    ) -> tuple[list[tuple[int, float]], float | None, str]:
    """(points, T_d they stand beside, source) of the draft model's catch-up cost: what the
    pair's requests logged (``catch_ups``; source "logged"), else what the latest probe of
    that path timed at batch 1 with its T_d (source "probe"), else ([], None, "none"). A
    store that holds only a probe prices the first catch-up instead of taking it for free."""
    points, t_draft = catch_ups(session, pair_id, path=path, recent=recent,
                                min_forwards=min_forwards)
    if points:
        return points, t_draft, "logged"
    probe = latest_probe(session, pair_id) if path is None else latest_probe(session, pair_id,
                                                                             path)
    raw = (probe.payload or {}).get("draft_catch_up") if probe is not None else None
    try:
        points = [(int(g), float(c)) for g, c in raw or ()
                  if int(g) > 0 and 0 < float(c) < float("inf")]
    except (TypeError, ValueError):
        points = []  # a payload from elsewhere: not priced from it
    if not points:
        return [], None, "none"
    d = probe.payload.get("draft_s")
    return points, (float(d) if isinstance(d, (int, float)) and d > 0 else None), "probe"


BATCH_PATH = "eager"  # the batched loop (batch > 1) runs eager forwards only


def batch_costs(session: Session, pair_id: int, *, min_forwards: int = MIN_FORWARDS,
                recent: int = 2000, path: str = BATCH_PATH,
                ) -> tuple[dict[int, dict[int, float]], dict[int, float], str]:
    """(T_t(B, n): B → n → seconds, T_d(B): B → seconds per proposed token, source) for a
    pair on one execution path (default the batched loop's, eager), from ONE source, as
    ``autospec.costs.stored.batch_one`` takes batch 1's:

    - ``"probe"``: the grid of the latest probe of that path that measured some batch B > 1
      (its batch 1 is the probe's T_t(n) curve and T_d);
    - ``"live"``: else medians of the forwards the pair's last ``recent`` requests at batch
      > 1 on that path timed, per (B, n) — and per B for the draft — each point kept only if
      it rests on at least ``min_forwards`` forwards; batch 1's points from the same
      requests' batch-1 forwards (compaction tails: ``(1, n)`` keys, else ``target_s_by_n``),
      same rule;
    - else the latest probe's batch 1 alone (``"probe"``), or ``({}, {}, "none")``.

    Probes and requests of unknown path (stored before 0005) are not read."""
    latest = None
    for p in session.scalars(_probes(session, pair_id, path)):
        row = ProbeRow.of(p)
        latest = latest or row
        if any(b > 1 for b in row.grid):
            return _with_batch_one(row)
    target, draft = live_batch_grid(session, pair_id, min_forwards=min_forwards,
                                    recent=recent, path=path)
    if any(b > 1 for b in target):
        return target, draft, "live"
    if latest is not None:
        target, draft, _ = _with_batch_one(latest)
        if target:
            return target, draft, "probe"
    return {}, {}, "none"


def _with_batch_one(row: ProbeRow) -> tuple[dict[int, dict[int, float]], dict[int, float], str]:
    """A probe's grid with batch 1 filled from its T_t(n) curve and T_d where the grid
    lacks it (probes stored before the batch dimension)."""
    target = {b: dict(ns) for b, ns in row.grid.items()}
    draft = dict(row.draft_grid)
    curve = {int(n): float(t) for n, t in row.payload.get("target_s_by_n", {}).items()}
    if 1 not in target and curve:
        target[1] = dict(sorted(curve.items()))
    if 1 not in draft and row.payload.get("draft_s"):
        draft[1] = float(row.payload["draft_s"])
    return dict(sorted(target.items())), dict(sorted(draft.items())), "probe"


def traffic_context(session: Session, pair_id: int, *, recent: int = 500) -> int | None:
    """The median context a forward of the pair's traffic sees: over its last ``recent``
    requests (any batch size, any path), the prompt plus half the new tokens — a request's
    cache grows from its prompt to prompt + new tokens, and a step's cost at batch > 1 grows
    with it (attention). None without requests. ``autospec probe`` times its grid at this
    length, so that the grid's level is the traffic's, not that of an arbitrary context."""
    stmt = (select(Request.prompt_tokens, Request.new_tokens)
            .where(Request.pair_id == pair_id).order_by(Request.id.desc()).limit(recent))
    lengths = [p + n / 2 for p, n in session.execute(stmt)]
    return max(1, round(statistics.median(lengths))) if lengths else None


def live_batch_grid(session: Session, pair_id: int, *, min_forwards: int = MIN_FORWARDS,
                    recent: int = 2000, path: str = BATCH_PATH
                    ) -> tuple[dict[int, dict[int, float]], dict[int, float]]:
    """The ``"live"`` source of ``batch_costs`` alone, whether or not a probe exists: medians
    of the forwards the pair's last ``recent`` batched requests on ``path`` timed, per
    (B, n), and per B for the draft, each resting on ≥ ``min_forwards`` forwards."""
    stmt = (select(Request.target_s_by_bn, Request.draft_s_by_b, Request.target_s_by_n)
            .where(Request.pair_id == pair_id, Request.batch_size > 1, Request.path == path)
            .order_by(Request.id.desc()).limit(recent))
    target_points: dict[tuple[int, int], list[float]] = {}
    draft_points: dict[int, list[float]] = {}
    for by_bn, by_b, by_n in session.execute(stmt):
        points = _pairs(by_bn)
        if not any(b == 1 for b, _ in points):  # batch 1 listed under (1, n) or by n alone
            points.update({(1, n): ts for n, ts in _ints(by_n).items()})
        for key, ts in points.items():
            target_points.setdefault(key, []).extend(ts)
        for b, ts in _ints(by_b).items():
            draft_points.setdefault(b, []).extend(ts)
    target: dict[int, dict[int, float]] = {}
    for (b, n), ts in sorted(target_points.items()):
        if len(ts) >= min_forwards:
            target.setdefault(b, {})[n] = statistics.median(ts)
    draft = {b: statistics.median(ts) for b, ts in sorted(draft_points.items())
             if len(ts) >= min_forwards}
    return target, draft


@dataclass(frozen=True)
class TunedRow:
    id: int
    created_at: datetime
    category: str
    pair_id: int
    family: str
    params: dict[str, Any]
    tokens_per_s: float
    baseline_tokens_per_s: float | None
    provenance: dict[str, Any]
    # why the row cannot be applied (``damage.tuned_problem``; None: it can). ``tuned_params``
    # returns sound rows only; ``tuned_fetcher`` hands damaged ones on as well, so that the
    # live policy logs each one once and reads past it
    problem: str | None = None

    @property
    def note(self) -> str:
        """What a reader says when it leaves this (damaged) row out."""
        return (f"tuned parameters #{self.id} (category {named(self.category)} on pair "
                f"{self.pair_id}, family {named(self.family, 30)}): {self.problem}; left out")


# the JSON columns are read as text and parsed row by row: one row that does not parse must
# not fail the query for every other row
_TUNED_COLUMNS = (TunedParams.id, TunedParams.created_at, TunedParams.category,
                  TunedParams.pair_id, TunedParams.family,
                  cast(TunedParams.params, Text).label("params"), TunedParams.tokens_per_s,
                  TunedParams.baseline_tokens_per_s,
                  cast(TunedParams.provenance, Text).label("provenance"))
_NOT_JSON = object()


def _parsed(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return _NOT_JSON


def _tuned_row(r) -> TunedRow:
    params, provenance = _parsed(r.params), _parsed(r.provenance)
    problem = ("its parameters are not valid JSON" if params is _NOT_JSON
               else tuned_problem(r.family, params, r.tokens_per_s))
    base = r.baseline_tokens_per_s
    return TunedRow(
        r.id, r.created_at, r.category, r.pair_id, r.family,
        dict(params) if problem is None else {}, r.tokens_per_s,
        base if isinstance(base, (int, float)) and math.isfinite(base) else None,
        provenance if isinstance(provenance, dict) else {}, problem)


def _tuned_rows(session: Session, category: str | None, pair_id: int | None,
                after_id: int) -> list[TunedRow]:
    """Every tuned row (newer than ``after_id``), newest first, damaged ones included."""
    stmt = (select(*_TUNED_COLUMNS).where(TunedParams.id > after_id)
            .order_by(TunedParams.id.desc()))
    if category is not None:
        stmt = stmt.where(TunedParams.category_key == category_key(category))
    if pair_id is not None:
        stmt = stmt.where(TunedParams.pair_id == pair_id)
    return [_tuned_row(r) for r in session.execute(stmt)]


def _latest(rows: list[TunedRow]) -> list[TunedRow]:
    """The first (newest) row per (category, pair)."""
    seen: set[tuple[str, int]] = set()
    out = []
    for r in rows:
        if (r.category, r.pair_id) not in seen:
            seen.add((r.category, r.pair_id))
            out.append(r)
    return out


def tuned_params(session: Session, category: str | None = None, pair_id: int | None = None,
                 *, latest_only: bool = True, after_id: int = 0) -> list[TunedRow]:
    """Tuning results, newest first; ``latest_only``: the one in force per (category, pair).
    ``after_id``: only rows newer than that id (cheap polling for the live "tuned" policy).
    A row that cannot be applied (``TunedRow.problem``: parameters that are not a JSON object
    a policy can be built from) is left out and noted (``damage.note``): the newest sound
    row of a (category, pair) is the one in force."""
    rows = []
    for r in _tuned_rows(session, category, pair_id, after_id):
        if r.problem is not None:
            note(r.note)
        else:
            rows.append(r)
    return _latest(rows) if latest_only else rows


def tuned_fetcher(store, pair):
    """``fetch(after_id)`` for ``policies.TunedPolicy.attach``: the tuned rows of ``pair`` (a
    PairInfo) in ``store`` newer than ``after_id``, newest first — the newest sound row per
    category, and every damaged row (``TunedRow.problem``), which the policy logs once and
    reads past; none while nothing was logged for the pair (its id is looked up until it
    exists)."""
    pid: int | None = None

    def fetch(after_id: int) -> list[TunedRow]:
        nonlocal pid
        with store.session() as s:
            if pid is None:
                pid = pair_id(s, pair)
                if pid is None:
                    return []  # nothing logged for this pair yet, so nothing tuned
            rows = _tuned_rows(s, None, pid, after_id)
        damaged = [r for r in rows if r.problem is not None]
        return sorted(_latest([r for r in rows if r.problem is None]) + damaged,
                      key=lambda r: -r.id)

    return fetch


@dataclass(frozen=True)
class CategorizerRow:
    id: int
    created_at: datetime
    name: str
    version: int
    kind: str
    payload: bytes
    meta: dict[str, Any]

    @classmethod
    def of(cls, c: Categorizer) -> CategorizerRow:
        return cls(c.id, c.created_at, c.name, c.version, c.kind, bytes(c.payload),
                   dict(c.meta))


def categorizers(session: Session, name: str | None = None) -> list[CategorizerRow]:
    """Every stored categoriser version (newest first), optionally of one name."""
    stmt = select(Categorizer).order_by(Categorizer.id.desc())
    if name is not None:
        stmt = stmt.where(Categorizer.name == name)
    return [CategorizerRow.of(c) for c in session.scalars(stmt)]


def latest_categorizer(session: Session, name: str = "default",
                       version: int | None = None) -> CategorizerRow | None:
    stmt = select(Categorizer).where(Categorizer.name == name)
    if version is not None:
        stmt = stmt.where(Categorizer.version == version)
    c = session.scalars(stmt.order_by(Categorizer.version.desc()).limit(1)).first()
    return None if c is None else CategorizerRow.of(c)


class FeatureRow(NamedTuple):
    """A request's prompt features with what it saw: its category (and how it was set) and
    its acceptance (from the trace, independent of the k that ran; None if unobserved)."""

    id: int
    created_at: datetime
    category: str
    category_source: str
    pair_id: int
    features: bytes
    acceptance: float | None


def feature_rows(session: Session, *, pair_id: int | None = None,
                 sources: tuple[str, ...] | None = ("given",),
                 since: datetime | float | None = None, until: datetime | float | None = None,
                 limit: int | None = None) -> Iterator[FeatureRow]:
    """Requests that stored features, oldest first (streamed). ``sources``: which category
    provenance to include (default: only categories the caller gave, i.e. real labels)."""
    model = (select(RequestProposer.request_id, RequestProposer.trace)
             .where(RequestProposer.kind == "model").subquery())
    stmt = (select(Request.id, Request.created_at, Request.category, Request.category_source,
                   Request.pair_id, Request.features, Request.trace_kind, model.c.trace)
            .outerjoin(model, model.c.request_id == Request.id)
            .where(Request.features.is_not(None)).order_by(Request.id))
    if pair_id is not None:
        stmt = stmt.where(Request.pair_id == pair_id)
    if sources is not None:
        stmt = stmt.where(Request.category_source.in_(sources))
    if since is not None:
        stmt = stmt.where(Request.created_at >= _when(since))
    if until is not None:
        stmt = stmt.where(Request.created_at < _when(until))
    if limit is not None:
        stmt = stmt.limit(limit)
    for rid, created, cat, src, pid, feats, kind, trace in session.execute(
            stmt.execution_options(yield_per=1000)):
        yield FeatureRow(rid, created, cat, src, pid, bytes(feats),
                         None if trace is None else trace_acceptance(kind, bytes(trace)))
