"""``autospec report``: per workload, the three questions of DESIGN.md, answered from the store.

A *workload* is one (category, pair) — a pair row already names the hardware. For each:

1. how well the draft matches the target here: acceptance α with a Wilson interval, per draft
   position, and over time;
2. whether verification is memory-bound here: T_t(n) from the requests (completed by the
   pair's latest probe), T_t(k+1)/T_t(1), achieved bandwidth against the device's peak;
3. the speedup *including* the draft's cost against plain decoding: MEASURED where the store
   holds plain requests of the same workload (every iteration at k = 0) beside speculative
   ones — Σ tokens / Σ wall seconds of each, the token-weighted mean rate — and ESTIMATED from
   the cost model otherwise, S(k) = E[N]·T_t(1) / (k·T_d + T_t(k+1)); always labelled which.

plus the policy in force (the latest requests' policies and k, the latest ``autospec tune``
result with its provenance and its simulated gain over the untuned default), a verdict in
plain words, and the batch dimension (``Batch``): from the pair's cost grid T_t(B, n), T_d(B)
(``queries.batch_costs``: the probe's grid, else live medians), the largest batch size at
which verification is still memory-bound, the k the cost model picks at each batch size for
this workload's acceptance (every row of the batch this workload) with its predicted speedup
over plain batched decoding, the batch size from which it switches speculation off, the k a
tuned table uses, and the requests' logged batch sizes. ``build_report`` returns numbers; ``render_text`` / ``render_html`` /
``render_json`` present them. It reads only the store (no torch), aggregating in SQL
(``autospec.store.history``), so it runs beside a serving process on any store size.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import sys
from dataclasses import dataclass, field, fields, is_dataclass
from datetime import datetime, timezone
from html import escape
from pathlib import Path
from typing import Any

from autospec.policies.batchcosts import BatchCosts
from autospec.policies.costmodel import (
    batch_best_k,
    best_k,
    conditional_from_cumulative,
    interpolate_cost,
    speedup,
)
from autospec.svgplot import PALETTE, Marker, Series, bar_chart, line_chart, placeholder
from autospec.textfmt import fmt, human_bytes, table

__all__ = [
    "Report", "Workload", "Traffic", "Acceptance", "Verification", "PolicyInForce", "Tuning",
    "Speedup", "Verdict", "Batch", "BatchPoint", "batch_view", "build_report", "cost_inputs", "render_text", "render_html",
    "render_json", "add_parser", "run",
]

log = logging.getLogger(__name__)

K_MAX = 8  # the oracle curve S(k) spans k = 0 … max(K_MAX, largest k seen)
MIN_DRAFTED = 100  # fewer drafted tokens: "not enough traffic yet"
MIN_MEASURED = 5  # requests of each mode before a measured speedup decides the verdict
PAYS, LOSES = 1.05, 0.95  # a speedup above PAYS pays; below LOSES loses; between: break-even
# T_t(n)/T_t(1) up to which scoring n tokens counts as free (autospec.probe's threshold;
# not imported from there because autospec.probe imports torch)
MEMORY_BOUND_RATIO = 1.25
RECENT = 200  # the latest requests that say which policy (and k) is in force
BATCH_K_REF = 3  # the k at which "memory-bound at batch B" is judged: T_t(B, 4) / T_t(B, 1)
BATCH_FIXED_KS = (1, 2, 3, 4)  # fixed k whose predicted speedup is shown per batch size
PROBE_BATCH_HINT = "autospec probe --batch 1,2,4,8,16,32"


# -- the numbers ------------------------------------------------------------------------------

@dataclass
class Traffic:
    requests: int
    new_tokens: int
    prompt_tokens: int
    iterations: int
    first_seen: datetime
    last_seen: datetime
    tokens_per_s: float | None  # Σ new tokens / Σ wall seconds, every request


@dataclass
class Acceptance:
    drafted: int
    accepted: int
    alpha: float | None
    alpha_ci95: tuple[float, float] | None  # Wilson
    by_position: list[float | None]  # P(draft token i accepted), i = 1, 2, …
    drafted_by_position: list[int]
    conditional: list[float | None]  # P(accepted at i | accepted before i): the cost model's
    mean_accepted_length: float | None  # tokens per drafting iteration, bonus included


@dataclass
class Verification:
    """Is scoring k+1 tokens about as cheap as scoring one (memory-bound) here?"""

    t_target_s_by_n: dict[int, float]  # the cost model's curve: one source (cost_inputs)
    source_by_n: dict[int, str]  # "probe" or "requests"
    t_draft_s: float | None
    draft_ratio: float | None  # c = T_d / T_t(1)
    k: int | None  # the k the ratio is taken at (in force, else the most used k > 0)
    cost_ratio: float | None  # T_t(k+1) / T_t(1) (interpolated where unmeasured)
    memory_bound_up_to: int | None  # largest measured n with T_t(n)/T_t(1) ≤ 1.25
    memory_bound: bool | None  # at k + 1
    bandwidth_bytes_per_s: float | None  # achieved by the requests' target forwards
    bandwidth_peak_bytes_per_s: float | None
    bandwidth_utilisation: float | None
    nvml_mem_busy_pct: float | None
    nvml_sm_util_pct: float | None
    probe: dict[str, Any] | None  # the pair's latest probe: id, time, bandwidth, its verdict
    live_by_n: dict[int, tuple[float, int]] = field(default_factory=dict)  # requests: (mean s,
    # forwards) per n, shown beside the curve whatever it was taken from


@dataclass
class Tuning:
    """The latest ``autospec tune`` row of the workload: in force for the "tuned" policy."""

    id: int
    created_at: datetime
    family: str
    params: dict[str, Any]
    tokens_per_s: float  # simulated, tuning window
    baseline_tokens_per_s: float | None  # the untuned default, same window
    gain: float | None  # tokens_per_s / baseline
    holdout_tokens_per_s: float | None  # provenance["holdout"], on traces not tuned on
    holdout_baseline_tokens_per_s: float | None
    holdout_gain: float | None
    holdout_traces: int | None
    provenance: dict[str, Any]


@dataclass
class PolicyInForce:
    recent_requests: int  # how many of the latest requests the figures below cover
    recent_since: datetime | None
    policies: dict[str, int]  # policy name → requests, among the recent ones
    recent_k_counts: dict[int, int]  # k → iterations, among the recent requests
    k_in_force: int | None  # the k the recent requests ran most
    k_counts: dict[int, int]  # k → iterations, all time (CategorySummary.k_counts)
    tuned: Tuning | None


@dataclass
class Rate:
    requests: int
    new_tokens: int
    wall_s: float
    tokens_per_s: float | None


@dataclass
class Speedup:
    """Against plain decoding, the draft's cost included. ``value``/``source`` is the one the
    verdict uses: "measured" where both modes have ≥ MIN_MEASURED requests, else
    "estimated" (cost model at ``k``), else None."""

    plain: Rate | None
    speculative: Rate | None
    measured: float | None  # speculative tokens/s ÷ plain tokens/s
    k: int | None  # the k the estimate is for (in force; else the most used k > 0)
    estimated: float | None  # S(k)
    oracle_k: int | None  # argmax S
    oracle: float | None
    curve: dict[int, float]  # S(k), k = 0 … K
    flat_oracle: float | None  # max S if verification cost nothing extra (T_t(n) = T_t(1))
    source: str | None
    value: float | None


@dataclass
class Verdict:
    kind: str  # pays | break_even | low_acceptance | compute_bound | not_enough | no_drafts
    #          | switched_off_but_would_pay | unknown
    text: str
    switched_off: bool = False


@dataclass
class BatchPoint:
    """One batch size of the cost grid, for one workload (every row of the batch from it)."""

    batch: int
    t_target_1_s: float  # T_t(B, 1): one plain batched decoding step
    cost_ratio: float | None  # T_t(B, BATCH_K_REF + 1) / T_t(B, 1)
    t_draft_s: float | None  # T_d(B), per proposed token (interpolated in B where unmeasured)
    k: int | None  # the cost model's k (batch_best_k); None without acceptance or T_d(B)
    speedup: float | None  # its predicted speedup over plain batched decoding at B
    speedup_by_k: dict[int, float]  # the same at each fixed k of BATCH_FIXED_KS
    tuned_k: int | None  # the k the tuned table (if any) runs at B


@dataclass
class Batch:
    """The batch dimension of a workload: the cost grid read through the cost model."""

    source: str  # where the grid came from ("probe #3", "live", "none")
    points: list[BatchPoint]  # ascending batch sizes of the grid
    memory_bound_up_to: int | None  # largest grid B up to which (every B' ≤ B) T_t(B, 4) /
    #                                 T_t(B, 1) ≤ MEMORY_BOUND_RATIO; None: not even the first
    crossover: int | None  # smallest grid B from which on the cost model's k is 0; None: k > 0
    #                        at the largest B (or k unknown)
    tuned: str | None  # the tuned table in force for this workload, as stored
    requests_by_batch: dict[int, int]  # logged requests per batch size
    note: str | None  # why something is missing, and what to run


@dataclass
class Workload:
    category: str
    pair: dict[str, Any]  # id, target, draft, dtype, hardware
    traffic: Traffic
    acceptance: Acceptance
    verification: Verification
    policy: PolicyInForce
    speedup: Speedup
    history_bucket_s: int
    history: list[dict[str, Any]]  # {start, requests, new_tokens, drafted, accepted, alpha}
    verdict: Verdict
    batch: Batch | None = None


@dataclass
class Report:
    store: str
    generated_at: datetime
    filters: dict[str, Any]
    workloads: list[Workload] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: datetimes as ISO strings, int keys as strings."""
        return _jsonable(self)


def _jsonable(x: Any) -> Any:
    if is_dataclass(x) and not isinstance(x, type):
        return {f.name: _jsonable(getattr(x, f.name)) for f in fields(x)}
    if isinstance(x, datetime):
        return x.isoformat()
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


# -- building ---------------------------------------------------------------------------------

def _live(v: Verification, n: int) -> str:
    t, count = v.live_by_n.get(n, (None, 0))
    return "-" if t is None else f"{_ms(t)} ({count})"


MIN_FORWARDS = 16  # a live T_t(n) or T_d point counts only with this many forwards behind it


def cost_inputs(summary, probe_payload: dict | None
                ) -> tuple[dict[int, float], dict[int, str], float | None]:
    """The cost model's inputs for one workload, from ONE source so that their ratios hold:
    the pair's latest probe (medians of interleaved timings) if there is one, else the
    requests' mean T_t(n) and T_d where each rests on ≥ MIN_FORWARDS forwards. Mixing a quiet
    probe with a busy server's means would invent steps in the curve (the rule
    ``autospec.store.queries.measured_costs`` applies for tuning; ``autospec stats`` too)."""
    pl = probe_payload or {}
    probe_curve = {int(n): float(t) for n, t in (pl.get("target_s_by_n") or {}).items()
                   if t is not None and float(t) > 0}
    if probe_curve:
        curve = dict(sorted(probe_curve.items()))
        return curve, dict.fromkeys(curve, "probe"), pl.get("draft_s") or None
    curve = {n: t for n, t in sorted(summary.t_target_s_by_n.items())
             if t and t > 0 and summary.target_count_by_n.get(n, 0) >= MIN_FORWARDS}
    t_draft = summary.t_draft_s if summary.draft_forwards >= MIN_FORWARDS else None
    return curve, dict.fromkeys(curve, "requests"), t_draft


def _mode(counts: dict[int, int], positive: bool = False) -> int | None:
    ks = {k: c for k, c in counts.items() if c and (k > 0 or not positive)}
    return max(ks, key=lambda k: (ks[k], k)) if ks else None


def _rate(r) -> Rate | None:
    return None if r is None else Rate(r.requests, r.new_tokens, r.wall_s, r.tokens_per_s)


def _tuning(row) -> Tuning | None:
    if row is None:
        return None
    prov = dict(row.provenance or {})
    hold = prov.get("holdout") if isinstance(prov.get("holdout"), dict) else {}

    def num(v: Any) -> float | None:
        return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    h_t, h_b = num(hold.get("tuned_tokens_per_s")), num(hold.get("baseline_tokens_per_s"))
    traces = hold.get("traces")
    return Tuning(row.id, row.created_at, row.family, dict(row.params), row.tokens_per_s,
                  row.baseline_tokens_per_s, ratio(row.tokens_per_s, row.baseline_tokens_per_s),
                  h_t, h_b, ratio(h_t, h_b), int(traces) if isinstance(traces, int) else None,
                  prov)


def _verification(sm, probe, curve, source, t_draft, k) -> Verification:
    t1 = curve.get(1)
    cost = interpolate_cost(curve) if curve else None
    ratio = cost(k + 1) / t1 if t1 and cost and k is not None else None
    upto = (max((n for n, t in curve.items() if t / t1 <= MEMORY_BOUND_RATIO), default=1)
            if t1 else None)
    p = None
    if probe is not None:
        pl = probe.payload or {}
        p = {"id": probe.id, "created_at": probe.created_at,
             "achieved_bytes_per_s": pl.get("achieved_bytes_per_s"),
             "peak_bytes_per_s": pl.get("peak_bytes_per_s"),
             "utilisation": pl.get("utilisation"), "dtype": pl.get("dtype"),
             "context": pl.get("context"), "verdict": pl.get("verdict")}
    return Verification(
        curve, source, t_draft, t_draft / t1 if t_draft and t1 else None, k, ratio, upto,
        None if ratio is None else ratio <= MEMORY_BOUND_RATIO, sm.bandwidth_bytes_per_s,
        sm.bandwidth_peak_bytes_per_s, sm.bandwidth_utilisation, sm.nvml_mem_busy_pct,
        sm.nvml_sm_util_pct, p,
        {n: (t, sm.target_count_by_n.get(n, 0)) for n, t in sm.t_target_s_by_n.items()})


def _speedup(alphas, curve, t_draft, k, k_max, modes) -> Speedup:
    plain = _rate(modes.plain if modes else None)
    spec = _rate(modes.speculative if modes else None)
    measured = None
    if plain and spec and plain.tokens_per_s and spec.tokens_per_s:
        measured = spec.tokens_per_s / plain.tokens_per_s
    est = okb = ob = flat = None
    s_curve: dict[int, float] = {}
    known = any(a is not None for a in alphas)
    if 1 in curve and t_draft and known:
        cost = interpolate_cost(curve)
        s_curve = {j: speedup(j, alphas, t_draft, cost) for j in range(k_max + 1)}
        okb, ob = best_k(alphas, t_draft, cost, k_max)
        flat = best_k(alphas, t_draft, {1: curve[1]}, k_max)[1]
        if k is not None:
            est = s_curve.get(k, speedup(k, alphas, t_draft, cost))
    enough = (measured is not None and plain.requests >= MIN_MEASURED
              and spec.requests >= MIN_MEASURED)
    source, value = (("measured", measured) if enough else
                     ("estimated", est) if est is not None else
                     ("measured", measured) if measured is not None else (None, None))
    return Speedup(plain, spec, measured, k, est, okb, ob, s_curve, flat, source, value)


def _tuned_table(tuned: Tuning | None):
    """The tuned policy's k by batch size, where it has one: a ``TablePolicy`` from a stored
    table spec (``"table:1-2:4,…"``) or ``{batch: k}`` choices, a fixed k as a one-range table;
    None for the adaptive families (their k is chosen live)."""
    from autospec.policies.table import TablePolicy

    if tuned is None:
        return None
    params = tuned.params
    for v in params.values():
        if isinstance(v, str) and v.strip().lower().startswith("table:"):
            with contextlib.suppress(ValueError):
                return TablePolicy.parse(v)
    if tuned.family == "table":
        for v in params.values():
            if isinstance(v, dict) and v:
                with contextlib.suppress(ValueError, TypeError):
                    return TablePolicy.from_choices({int(b): int(k) for b, k in v.items()})
    if tuned.family == "fixed" and isinstance(params.get("k"), int):
        return TablePolicy({(1, None): params["k"]})
    return None


def at_live_level(target: dict[int, dict[int, float]], draft: dict[int, float], source: str,
                  live_target: dict[int, dict[int, float]], live_draft: dict[int, float]
                  ) -> tuple[dict[int, dict[int, float]], dict[int, float], str]:
    """A probe's grid read as the live cost model reads it: the probe gives the shape, the
    loop's own forwards (the store's live medians) the level — live points replace the probe's
    at their (B, n), the rest is scaled by live/probe at the nearest batch size measured
    (``BatchCosts``). On the default pair the probe (context 200, every row) put T_t(16, 1)
    at 401 ms where the loop measured ~290 ms, and the report said k = 1 pays at B = 16
    (1.24×) where it ran at 0.73–0.88×. Other sources, and a probe without live points,
    come back as they are."""
    live_t = {b: ns for b, ns in live_target.items() if b > 1}  # batch 1 stays the probe's:
    live_d = {b: t for b, t in live_draft.items() if b > 1}  # its curve is batch-1 requests'
    if source != "probe" or not (live_t or live_d):
        return target, draft, source
    costs = BatchCosts(settle=1)
    costs.warm(target, draft)
    for b, ns in live_t.items():
        for n, t in ns.items():
            costs.observe(b, n, t)
    for b, t in live_d.items():
        costs.observe(b, 0, float("nan"), t)
    sizes = sorted({b for b in target if b > 1} | set(live_t))
    out_t = {**({1: dict(target[1])} if 1 in target else {}),
             **{b: dict(sorted(costs.target_points(b).items())) for b in sizes}}
    out_d = {**({1: draft[1]} if 1 in draft else {}),
             **{b: d for b in sizes if (d := costs.draft_cost(b)) is not None}}
    measured = ", ".join(map(str, sorted(set(live_t) | set(live_d))))
    return out_t, out_d, f"probe at the live level (live/probe per n, batch sizes {measured})"


def batch_grid(session, pair_id: int):
    """The pair's cost grid as the report and ``autospec stats`` show it:
    ``queries.batch_costs`` read ``at_live_level`` of the store's live medians."""
    from autospec.store import queries

    return at_live_level(*queries.batch_costs(session, pair_id),
                         *queries.live_batch_grid(session, pair_id, min_forwards=MIN_FORWARDS))


def batch_view(alphas: list[float | None], target: dict[int, dict[int, float]],
               draft: dict[int, float], source: str, *, k_max: int = K_MAX,
               tuned: Tuning | None = None, requests_by_batch: dict[int, int] | None = None
               ) -> Batch:
    """The batch dimension of one workload from the pair's cost grid (``queries.batch_costs``):
    at each grid batch size B, the cost model's k for a batch whose every row has this
    workload's acceptance ``alphas`` (``batch_best_k``: Σ E[N_i](k) / (k·T_d(B) + T_t(B, k+1))
    against B / T_t(B, 1)), its predicted speedup, the speedup at fixed k, and where
    verification stops being memory-bound and speculation is switched off."""
    counts = dict(sorted((requests_by_batch or {}).items()))
    table_ = _tuned_table(tuned)
    tuned_spec = table_.name if table_ is not None else None
    grid = {int(b): {int(n): float(t) for n, t in ns.items() if t and t > 0}
            for b, ns in target.items()}
    grid = {b: ns for b, ns in sorted(grid.items()) if ns.get(1)}
    if not any(b > 1 for b in grid):
        what = ("no batch cost grid for this pair" if not grid else
                "the cost grid has batch 1 only")
        return Batch(source, [], None, None, tuned_spec, counts,
                     f"{what}: run `{PROBE_BATCH_HINT}` to measure T_t(B, n) and T_d(B)")
    known = any(a is not None for a in alphas)
    across = BatchCosts()  # T_d at a batch size the grid lacks: the live policy's rule
    across.warm(grid, draft)
    points = []
    for b, ns in grid.items():
        cost = interpolate_cost(ns)
        t1 = cost(1)
        t_d = across.draft_cost(b)
        k = s = None
        by_k: dict[int, float] = {}
        if known and t_d is not None:
            k, s = batch_best_k([alphas] * b, t_d, cost, k_max)
            by_k = {j: speedup(j, alphas, t_d, cost) for j in BATCH_FIXED_KS}
        points.append(BatchPoint(b, t1, cost(BATCH_K_REF + 1) / t1, t_d, k, s, by_k,
                                 None if table_ is None else table_.k_for(b)))
    upto = None
    for p in points:
        if p.cost_ratio is None or p.cost_ratio > MEMORY_BOUND_RATIO:
            break
        upto = p.batch
    crossover = None
    if points[-1].k == 0:
        crossover = points[-1].batch
        for p in reversed(points[:-1]):
            if p.k != 0:
                break
            crossover = p.batch
    note = None
    if not known:
        note = "no acceptance measured for this workload yet: k per batch size unknown"
    elif all(p.t_draft_s is None for p in points):
        note = f"no draft timing T_d(B) in the grid: run `{PROBE_BATCH_HINT}`"
    elif source == "live":
        note = (f"costs from live traffic (medians of ≥ {MIN_FORWARDS} forwards per point); "
                f"`{PROBE_BATCH_HINT}` measures the full grid")
    return Batch(source, points, upto, crossover, tuned_spec, counts, note)


def _pct(a: float) -> str:
    return f"{a * 100:.0f} %"


def _verdict(acc: Acceptance, ver: Verification, pol: PolicyInForce, sp: Speedup) -> Verdict:
    off = pol.k_in_force == 0
    if acc.drafted == 0:
        return Verdict("no_drafts", "plain decoding only so far: no drafted tokens to judge "
                       "the draft by" + (" (the policy keeps k = 0)" if off else ""), off)
    if acc.drafted < MIN_DRAFTED:
        return Verdict("not_enough", f"not enough traffic yet ({acc.drafted} drafted "
                       f"token{'s' if acc.drafted != 1 else ''})", off)
    why_loses = None
    if sp.flat_oracle is not None and sp.flat_oracle >= PAYS and (ver.cost_ratio or 0) > \
            MEMORY_BOUND_RATIO:
        why_loses = ("compute_bound", f"verification is compute-bound here: "
                     f"T_t({ver.k + 1}) = {ver.cost_ratio:.1f} × T_t(1)")
    elif acc.alpha is not None:
        why_loses = ("low_acceptance", f"the draft matches only {_pct(acc.alpha)}")
    if off:
        if sp.oracle is not None and sp.oracle >= PAYS:
            return Verdict("switched_off_but_would_pay", f"switched off, though the cost model "
                           f"expects {sp.oracle:.2f}× at k = {sp.oracle_k}", True)
        kind, text = why_loses or ("unknown", "no acceptance measured")
        return Verdict(kind, f"switched off: {text}", True)
    if sp.value is None:
        return Verdict("unknown", f"α = {fmt(acc.alpha, '.2f')}, but no cost measurements "
                       "to judge the speedup by: run `autospec probe` for this pair")
    at = f" at k = {sp.k}" if sp.k is not None else ""
    figure = f"{sp.value:.2f}×{at} ({sp.source})"
    if sp.value >= PAYS:
        return Verdict("pays", f"speculation pays here: {figure}")
    if sp.value > LOSES:
        return Verdict("break_even", f"break-even here: {figure}")
    kind, text = why_loses or ("unknown", "speculation loses here")
    return Verdict(kind, f"{text}; speculation loses: {figure}")


def build_report(source, *, category: str | None = None, pair_id: int | None = None,
                 recent: int = RECENT, max_buckets: int = 48, store_url: str | None = None
                 ) -> Report:
    """The report's numbers, from a ``Store`` or an open ``Session`` (read-only)."""
    from sqlalchemy.orm import Session

    if isinstance(source, Session):
        cm = contextlib.nullcontext(source)
        url = store_url or str(source.get_bind().url.render_as_string(hide_password=True))
    else:
        cm, url = source.session(), store_url or source.url
    with cm as s:
        return _build(s, url, category, pair_id, recent, max_buckets)


def _build(s, url, category, pair_id, recent, max_buckets) -> Report:
    from autospec.store import history, queries
    from autospec.store.rows import category_key

    report = Report(url, datetime.now(timezone.utc),
                    {"category": category, "pair_id": pair_id})
    summaries = queries.category_summaries(s, category=category, pair_id=pair_id)
    if not summaries:
        return report
    modes = history.plain_vs_speculative(s, category=category, pair_id=pair_id, by_path=True)
    tuned = {(t.category, t.pair_id): t
             for t in queries.tuned_params(s, category=category, pair_id=pair_id)}
    by_batch = requests_by_batch(s, category=category, pair_id=pair_id)
    probes: dict[tuple[int, str | None], Any] = {}
    grids: dict[int, Any] = {}
    for sm in summaries:
        pid = sm.pair.id
        if (pid, sm.path) not in probes:  # the probe of the path the summary's costs are on
            probes[pid, sm.path] = queries.latest_probe(s, pid, sm.path)
        if pid not in grids:
            grids[pid] = batch_grid(s, pid)
        probe = probes[pid, sm.path]
        curve, src, t_draft = cost_inputs(sm, probe.payload if probe else None)
        recent_act = history.recent_activity(s, sm.category, pid, limit=recent)
        k_in_force = recent_act.k_mode
        # the k the ratio and the estimate are taken at: in force, else the most used k > 0
        k_ref = (k_in_force if k_in_force else
                 _mode(recent_act.k_counts, positive=True) or _mode(sm.k_counts, positive=True))
        k_max = max([K_MAX, *sm.k_counts])
        alphas = conditional_from_cumulative(list(sm.acceptance_by_position))
        acc = Acceptance(sm.drafted, sm.accepted, sm.alpha, sm.alpha_ci95,
                         list(sm.acceptance_by_position), list(sm.drafted_per_position),
                         alphas, sm.mean_accepted_length)
        sp = _speedup(alphas, curve, t_draft, k_ref, k_max,
                      modes.get((category_key(sm.category), pid, sm.path)))
        if k_ref is None and sp.oracle_k:  # nothing ever drafted: judge at the oracle's k
            k_ref = sp.oracle_k
        # the cost ratio needs some k even before anything was drafted: k = 4 then
        ver = _verification(sm, probe, curve, src, t_draft, k_ref or 4)
        pol = PolicyInForce(recent_act.requests, recent_act.since, recent_act.policies,
                            recent_act.k_counts, k_in_force, dict(sm.k_counts),
                            _tuning(tuned.get((sm.category, pid))))
        bucket_s = history.bucket_seconds(sm.first_seen, sm.last_seen, max_buckets)
        hist = [{"start": b.start, "requests": b.requests, "new_tokens": b.new_tokens,
                 "drafted": b.drafted, "accepted": b.accepted, "alpha": b.alpha}
                for b in history.alpha_over_time(s, sm.category, pid, bucket_s)]
        traffic = Traffic(sm.requests, sm.new_tokens, sm.prompt_tokens, sm.iterations,
                          sm.first_seen, sm.last_seen, sm.tokens_per_s)
        pair = {name: getattr(sm.pair, name)
                for name in ("id", "target", "draft", "dtype", "hardware")}
        g_target, g_draft, g_source = grids[pid]
        batch = batch_view(alphas, g_target, g_draft, g_source, k_max=k_max, tuned=pol.tuned,
                           requests_by_batch=by_batch.get((category_key(sm.category), pid)))
        report.workloads.append(Workload(sm.category, pair, traffic, acc, ver, pol, sp,
                                         bucket_s, hist, _verdict(acc, ver, pol, sp), batch))
    return report


def requests_by_batch(s, *, category: str | None = None, pair_id: int | None = None
                      ) -> dict[tuple[str, int], dict[int, int]]:
    """Logged requests per batch size: (category_key, pair_id) → {batch size: requests}.
    One grouped query (the requests index leads with category_key, pair_id)."""
    from sqlalchemy import func, select

    from autospec.store.models import Request
    from autospec.store.rows import category_key

    stmt = select(Request.category_key, Request.pair_id, Request.batch_size,
                  func.count()).group_by(Request.category_key, Request.pair_id,
                                         Request.batch_size)
    if category is not None:
        stmt = stmt.where(Request.category_key == category_key(category))
    if pair_id is not None:
        stmt = stmt.where(Request.pair_id == pair_id)
    out: dict[tuple[str, int], dict[int, int]] = {}
    for key, pid, b, n in s.execute(stmt):
        cell = out.setdefault((key, pid), {})
        cell[int(b or 1)] = cell.get(int(b or 1), 0) + int(n)
    return out


# -- text ---------------------------------------------------------------------------------------

def _short(name: str, n: int = 36) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1][:n]


def _label(w: Workload, n: int = 60) -> str:
    cat = w.category if len(w.category) <= n else w.category[: n - 1] + "…"
    cat = cat.replace("\n", " ").replace("\t", " ")
    p = w.pair
    return (f"{cat}  ·  {_short(p['target'])} <- {_short(p['draft'])}  "
            f"({p['dtype']}, {p['hardware']})")


def _ms(s: float | None) -> str:
    return fmt(None if s is None else s * 1e3, ".1f")


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}×"


def _bucket_name(sec: int) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if sec % size == 0:
            return f"{sec // size} {unit}"
    return f"{sec} s"


def _when(t: datetime | None) -> str:
    return "-" if t is None else t.strftime("%Y-%m-%d %H:%M")


def _speed_line(sp: Speedup) -> list[str]:
    out = []
    if sp.plain or sp.speculative:
        def side(r: Rate | None) -> str:
            if r is None:
                return "none"
            return f"{fmt(r.tokens_per_s, '.1f')} tok/s over {r.requests} requests"
        out.append(f"measured: {_x(sp.measured)}  (speculative {side(sp.speculative)}; "
                   f"plain {side(sp.plain)})")
    else:
        out.append("measured: - (no requests of this workload in the store)")
    if sp.estimated is not None or sp.oracle is not None:
        out.append(f"estimated: S({sp.k}) = {_x(sp.estimated)};  oracle S({sp.oracle_k}) = "
                   f"{_x(sp.oracle)};  with free verification {_x(sp.flat_oracle)}")
    else:
        out.append("estimated: - (needs T_t(1), T_d and acceptance: run `autospec probe`)")
    out.append(f"used for the verdict: {sp.source or '-'} {_x(sp.value)}")
    return out


def _batch_headline(b: Batch) -> str:
    """Where verification stops being memory-bound and where the cost model stops drafting."""
    if not b.points:
        return b.note or "no batch cost grid"
    pts = b.points
    ratio = f"T_t(B, {BATCH_K_REF + 1}) / T_t(B, 1) ≤ {MEMORY_BOUND_RATIO}"
    if b.memory_bound_up_to is None:
        mem = f"verification is not memory-bound even at B = {pts[0].batch} ({ratio} fails)"
    elif b.memory_bound_up_to == pts[-1].batch:
        mem = (f"verification memory-bound up to the largest probed B = {b.memory_bound_up_to}"
               f" ({ratio})")
    else:
        mem = f"verification memory-bound up to B = {b.memory_bound_up_to} ({ratio})"
    if all(p.k is None for p in pts):
        off = "the cost model's k per batch size is unknown"
    elif b.crossover is None:
        off = f"the cost model speculates at every probed batch size (up to B = {pts[-1].batch})"
    elif b.crossover == pts[0].batch:
        off = f"the cost model keeps speculation off at every probed batch size (from B = " \
              f"{b.crossover})"
    else:
        off = f"the cost model switches speculation off from B = {b.crossover}"
    return f"{mem}; {off}"


def _batch_text(b: Batch) -> list[str]:
    out = []
    if b.points:
        out.append(f"costs: {b.source}" + (f"; tuned table: {b.tuned}" if b.tuned else
                                           "; tuned table: none"))
        header = ["B", "T_t(B,1) ms", f"T_t(B,{BATCH_K_REF + 1})/T_t(B,1)", "T_d(B) ms",
                  "k (cost model)", "predicted S", *(f"S(k={j})" for j in BATCH_FIXED_KS),
                  "tuned k", "requests"]
        out.append(table(header, [
            [str(p.batch), _ms(p.t_target_1_s), fmt(p.cost_ratio, ".2f"), _ms(p.t_draft_s),
             "-" if p.k is None else str(p.k), _x(p.speedup),
             *(_x(p.speedup_by_k.get(j)) for j in BATCH_FIXED_KS),
             "-" if p.tuned_k is None else str(p.tuned_k),
             str(b.requests_by_batch.get(p.batch, 0))] for p in b.points]))
    if b.note and b.points:
        out.append(b.note)
    if b.requests_by_batch:
        out.append("requests by batch size: " + ", ".join(
            f"B = {k}: {n}" for k, n in b.requests_by_batch.items()))
    return out


def render_text(report: Report) -> str:
    lines = [f"autospec report — store {report.store}, "
             f"generated {report.generated_at.strftime('%Y-%m-%d %H:%M:%S UTC')}"]
    flt = ", ".join(f"{k} = {v!r}" for k, v in report.filters.items() if v is not None)
    if flt:
        lines.append(f"filters: {flt}")
    if not report.workloads:
        lines.append("\nno traffic logged yet: no requests in the store"
                     + (" match these filters" if flt else ""))
        return "\n".join(lines) + "\n"
    rows = [[_label(w, 30), w.verdict.text, str(w.traffic.requests),
             str(w.traffic.new_tokens), fmt(w.acceptance.alpha, ".3f"),
             "-" if w.policy.k_in_force is None else str(w.policy.k_in_force),
             _x(w.speedup.value) + (f" {w.speedup.source[:4]}." if w.speedup.source else "")]
            for w in report.workloads]
    lines += ["", table(["workload", "verdict", "requests", "tokens", "alpha", "k", "speedup"],
                        rows, left=2)]
    for w in report.workloads:
        lines += ["", "=" * 78, _label(w, 200), "=" * 78, f"verdict: {w.verdict.text}"]
        t, a, v, p, sp = w.traffic, w.acceptance, w.verification, w.policy, w.speedup
        lines.append(f"traffic: {t.requests} requests, {t.new_tokens} new tokens, "
                     f"{t.iterations} iterations, {_when(t.first_seen)} .. {_when(t.last_seen)}"
                     f" UTC; overall {fmt(t.tokens_per_s, '.1f')} tok/s")
        ci = a.alpha_ci95
        lines.append(f"\n1. acceptance: alpha = {fmt(a.alpha, '.3f')}"
                     + (f" [{ci[0]:.3f}, {ci[1]:.3f}] (95 %, Wilson)" if ci else "")
                     + f" over {a.drafted} drafted tokens; mean accepted length "
                     f"{fmt(a.mean_accepted_length, '.2f')} (bonus included)")
        if a.by_position:
            lines.append(table(["position", "drafted", "accepted rate", "conditional"],
                               [[str(i + 1), str(d), fmt(r, ".3f"), fmt(c, ".3f")]
                                for i, (d, r, c) in enumerate(zip(
                                    a.drafted_by_position, a.by_position, a.conditional))]))
        if w.history:
            lines.append(f"alpha over time ({_bucket_name(w.history_bucket_s)} buckets, UTC):")
            lines.append(table(["from", "requests", "drafted", "alpha"],
                               [[_when(b["start"]), str(b["requests"]), str(b["drafted"]),
                                 fmt(b["alpha"], ".3f")] for b in w.history]))
        lines.append("\n2. verification: "
                     + ("memory-bound" if v.memory_bound else
                        "compute-bound" if v.memory_bound is False else "unknown")
                     + (f" at k = {v.k}: T_t({v.k + 1}) / T_t(1) = {v.cost_ratio:.2f}"
                        if v.cost_ratio is not None else " (T_t(1) not measured)")
                     + (f"; within {MEMORY_BOUND_RATIO}× of one token up to n = "
                        f"{v.memory_bound_up_to}" if v.memory_bound_up_to else ""))
        lines.append(f"T_d = {_ms(v.t_draft_s)} ms, c = T_d / T_t(1) = "
                     f"{fmt(v.draft_ratio, '.2f')}; bandwidth "
                     f"{human_bytes(v.bandwidth_bytes_per_s, per_s=True)} of "
                     f"{human_bytes(v.bandwidth_peak_bytes_per_s, per_s=True)} peak"
                     + (f" ({v.bandwidth_utilisation:.0%})" if v.bandwidth_utilisation else "")
                     + (f"; NVML memory busy {v.nvml_mem_busy_pct:.0f} %"
                        if v.nvml_mem_busy_pct is not None else ""))
        if v.t_target_s_by_n:
            t1 = v.t_target_s_by_n.get(1)
            lines.append(table(["n scored", "T_t(n) ms", "vs n=1", "from",
                                "requests' mean ms (forwards)"],
                               [[str(n), _ms(s), fmt(s / t1 if t1 else None, ".2f"),
                                 v.source_by_n[n], _live(v, n)]
                                for n, s in v.t_target_s_by_n.items()]))
        if v.probe:
            pr = v.probe
            lines.append(f"latest probe ({_when(pr['created_at'])}): "
                         f"{human_bytes(pr['achieved_bytes_per_s'], per_s=True)} of "
                         f"{human_bytes(pr['peak_bytes_per_s'], per_s=True)} peak; "
                         f"{pr['verdict'] or ''}")
        lines.append("\npolicy in force: "
                     + (", ".join(f"{name} ({n})" for name, n in p.policies.items()) or "-")
                     + f" over the latest {p.recent_requests} batch-1 requests"
                     + (f" (since {_when(p.recent_since)})" if p.recent_since else "")
                     + f"; k in force {'-' if p.k_in_force is None else p.k_in_force}")
        if p.k_counts:
            total = sum(p.k_counts.values()) or 1
            rt = sum(p.recent_k_counts.values()) or 1
            lines.append(table(["k", "iterations", "share", "recent share"],
                               [[str(k), str(c), f"{c / total:.1%}",
                                 f"{p.recent_k_counts.get(k, 0) / rt:.1%}"]
                                for k, c in sorted(p.k_counts.items())]))
        if p.tuned:
            tu = p.tuned
            lines.append(f"tuned: {tu.family} {json.dumps(tu.params, sort_keys=True)} "
                         f"(tune #{tu.id}, {_when(tu.created_at)}): simulated "
                         f"{tu.tokens_per_s:.1f} tok/s vs {fmt(tu.baseline_tokens_per_s, '.1f')}"
                         f" untuned ({_x(tu.gain)})"
                         + (f"; held out ({tu.holdout_traces} traces): "
                            f"{fmt(tu.holdout_tokens_per_s, '.1f')} vs "
                            f"{fmt(tu.holdout_baseline_tokens_per_s, '.1f')} "
                            f"({_x(tu.holdout_gain)})" if tu.holdout_tokens_per_s else ""))
            prov = {k: tu.provenance[k] for k in ("study", "trial", "trials", "window",
                                                   "hardware") if k in tu.provenance}
            if prov:
                lines.append(f"provenance: {json.dumps(prov, sort_keys=True, default=str)}")
        else:
            lines.append("tuned: none (no `autospec tune` result for this workload)")
        lines.append("\n3. speedup vs plain decoding at batch 1, the draft's cost included:")
        lines += ["   " + s for s in _speed_line(sp)]
        if sp.curve:
            lines.append(table(["k", *map(str, sp.curve)],
                               [["S(k)", *(f"{s:.2f}" for s in sp.curve.values())]]))
        if w.batch is not None:
            lines.append("\n4. batch: " + _batch_headline(w.batch))
            lines += _batch_text(w.batch)
    lines += ["", "alpha = accepted / drafted; measured speedup = speculative ÷ plain tokens/s "
              "(Σ tokens / Σ wall s) of the same workload; estimated S(k) = "
              "E[N]·T_t(1) / (k·T_d + T_t(k+1)) from α by position and T_t(n) (requests, "
              "completed by `autospec probe`). At batch B: predicted speedup over plain "
              "batched decoding = E[N](k)·T_t(B,1) / (k·T_d(B) + T_t(B,k+1)), every row of "
              "the batch this workload (`autospec probe --batch` measures T_t(B, n), T_d(B))."]
    return "\n".join(lines) + "\n"


def render_json(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=2, ensure_ascii=False, default=str) + "\n"


# -- html ---------------------------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1180px}
h1{font-size:22px}h2{font-size:18px;margin-top:36px;border-bottom:1px solid #ccc}
h3{font-size:15px;margin:18px 0 4px}
table{border-collapse:collapse;margin:8px 0;font-size:13px}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}
td:first-child,th:first-child{text-align:left}
.verdict{font-size:16px;font-weight:bold;padding:6px 10px;border-radius:4px;display:inline-block}
.pays{background:#e3f4e1}.loses{background:#fbe4e1}.neutral{background:#eeeeee}
.plots{display:flex;flex-wrap:wrap;gap:10px}.small{color:#666;font-size:12px}
code{background:#f4f4f4;padding:0 3px}
"""


def _h(x: object) -> str:
    return escape(str(x), quote=True)


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["<table><tr>", *(f"<th>{_h(c)}</th>" for c in header), "</tr>"]
    for r in rows:
        out += ["<tr>", *(f"<td>{_h(c)}</td>" for c in r), "</tr>"]
    out.append("</table>")
    return "".join(out)


def _plots(w: Workload) -> list[str]:
    a, sp, v = w.acceptance, w.speedup, w.verification
    plots = [bar_chart([str(i + 1) for i in range(len(a.by_position))], a.by_position,
                       title="acceptance by draft position", x_label="position",
                       y_label="accepted rate", y_max=1.0, empty="nothing drafted yet")]
    if sp.curve:
        series = [Series("oracle S(k) (cost model)", sorted(sp.curve.items()), PALETTE[0])]
        markers = []
        k = w.policy.k_in_force if w.policy.k_in_force is not None else sp.k
        if k is not None and k in sp.curve:
            markers.append(Marker(k, sp.curve[k], f"k in force = {k}", PALETTE[1]))
        if sp.measured is not None and k is not None:
            markers.append(Marker(k, sp.measured, f"measured {sp.measured:.2f}×", PALETTE[2]))
        plots.append(line_chart(series, title="speedup vs k (draft cost included)",
                                x_label="k", y_label="speedup ×", markers=markers,
                                hlines=[(1.0, "plain")]))
    elif sp.measured is not None:
        k = w.policy.k_in_force or 0
        plots.append(line_chart([], title="speedup vs k (draft cost included)", x_label="k",
                                y_label="speedup ×", x_ticks=[(k, str(k))],
                                markers=[Marker(k, sp.measured, f"measured {sp.measured:.2f}×",
                                                PALETTE[2])], hlines=[(1.0, "plain")]))
    else:
        plots.append(placeholder("speedup vs k", "no costs measured: run `autospec probe`"))
    hist = [(b["start"].timestamp(), b["alpha"]) for b in w.history]
    if any(y is not None for _, y in hist):
        x0, x1 = hist[0][0], hist[-1][0]
        ticks = [(x0, _when(w.history[0]["start"]))]
        if x1 > x0:
            ticks.append((x1, _when(w.history[-1]["start"])))
        plots.append(line_chart(
            [Series(f"α per {_bucket_name(w.history_bucket_s)}", hist, PALETTE[0],
                    dots=len(hist) <= 60)],
            title="acceptance α over time (UTC)", y_label="α", x_ticks=ticks, y_max=1.0,
            width=420))
    else:
        plots.append(placeholder("acceptance α over time", "nothing drafted yet"))
    t1 = v.t_target_s_by_n.get(1)
    if t1:
        pts = [(n, t / t1) for n, t in v.t_target_s_by_n.items()]
        plots.append(line_chart(
            [Series("T_t(n) / T_t(1)", pts, PALETTE[3])], title="cost of scoring n tokens",
            x_label="n scored", y_label="× one token",
            hlines=[(1.0, ""), (MEMORY_BOUND_RATIO, "memory-bound below")]))
    else:
        plots.append(placeholder("cost of scoring n tokens", "T_t(1) not measured"))
    return plots


def _verdict_class(v: Verdict) -> str:
    if v.kind == "pays":
        return "pays"
    if v.kind in ("low_acceptance", "compute_bound"):
        return "loses"
    return "neutral"


def _batch_plots(b: Batch) -> list[str]:
    """Predicted speedup over plain batched decoding by batch size (log2 axis): at the cost
    model's k (labelled with it), and at each fixed k, thinner; the crossover marked. Then
    the requests' logged batch sizes."""
    plots = []
    if b.points:
        xs = [math.log2(p.batch) for p in b.points]
        ticks = [(x, str(p.batch)) for x, p in zip(xs, b.points)]
        series = [Series(f"fixed k = {j}", [(x, p.speedup_by_k.get(j))
                                            for x, p in zip(xs, b.points)],
                         PALETTE[(i + 1) % len(PALETTE)], dashed=True, dots=False, stroke=1.0)
                  for i, j in enumerate(BATCH_FIXED_KS)]
        series.append(Series("cost model's k", [(x, p.speedup) for x, p in zip(xs, b.points)],
                             "#111111", stroke=2.6,
                             labels=[f"k={p.k}" if p.k is not None else ""
                                     for p in b.points]))
        series.insert(0, Series("plain batched", [(xs[0], 1.0), (xs[-1], 1.0)], "#888888",
                                dashed=True, dots=False, stroke=1.0))
        vlines = []
        if b.memory_bound_up_to is not None and b.memory_bound_up_to != b.crossover:
            vlines.append((math.log2(b.memory_bound_up_to),
                           f"memory-bound to B = {b.memory_bound_up_to}"))
        if b.crossover is not None:
            vlines.append((math.log2(b.crossover), f"off from B = {b.crossover}"))
        top = max([1.0, *(y for s in series for _, y in s.points if y is not None)])
        plots.append(line_chart(series, title="predicted speedup vs plain batched decoding",
                                x_label="batch size B (log2 axis)", y_label="speedup ×",
                                x_ticks=ticks, vlines=vlines, y_max=math.ceil(top / 0.75 * 1.05)
                                * 0.75, y_fmt=".3g", width=600, height=300, legend_width=120,
                                x_pad=0.3, empty="no acceptance or T_d(B) measured"))
    if b.points or any(k > 1 for k in b.requests_by_batch):
        sizes = sorted(set(b.requests_by_batch) | {p.batch for p in b.points})
        counts = [b.requests_by_batch.get(x, 0) for x in sizes]
        plots.append(bar_chart([str(x) for x in sizes], counts,
                               title="requests by batch size (logged)", x_label="batch size",
                               y_label="requests", value_fmt=".0f", y_fmt=".0f",
                               y_max=4 * _round_step(max(counts) / 4),
                               empty="no requests logged"))
    return plots


def _round_step(v: float) -> float:
    """The smallest 1, 2 or 5 × 10^e (e ≥ 0) ≥ v: integer gridlines for counts."""
    step = 1
    while True:
        for m in (1, 2, 5):
            if m * step >= v:
                return m * step
        step *= 10


def _batch_html(b: Batch) -> list[str]:
    out = [f"<h3>Batch</h3><p><b>{_h(_batch_headline(b))}</b>"
           + (f" (costs: {_h(b.source)})" if b.points else "") + ".</p>"]
    if b.points:
        out.append(_html_table(
            ["B", "T_t(B,1) ms", f"T_t(B,{BATCH_K_REF + 1}) / T_t(B,1)", "T_d(B) ms",
             "k (cost model)", "predicted speedup", *(f"k = {j}" for j in BATCH_FIXED_KS),
             "tuned k", "requests"],
            [[str(p.batch), _ms(p.t_target_1_s), fmt(p.cost_ratio, ".2f"), _ms(p.t_draft_s),
              "-" if p.k is None else str(p.k), _x(p.speedup),
              *(_x(p.speedup_by_k.get(j)) for j in BATCH_FIXED_KS),
              "-" if p.tuned_k is None else str(p.tuned_k),
              str(b.requests_by_batch.get(p.batch, 0))] for p in b.points]))
        out.append("<p class=\"small\">Tuned table: "
                   + (f"<code>{_h(b.tuned)}</code>" if b.tuned else "none") + ".</p>")
        if b.note:
            out.append(f"<p class=\"small\">{_h(b.note)}</p>")
    plots = _batch_plots(b)
    if plots:
        out += ["<div class=\"plots\">", *plots, "</div>"]
    return out


def render_html(report: Report) -> str:
    """One self-contained HTML page: inline CSS and SVG, no scripts, nothing fetched."""
    out = ["<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">",
           "<title>autospec report</title><style>", _CSS, "</style></head><body>",
           "<h1>autospec report</h1>",
           f"<p class=\"small\">store <code>{_h(report.store)}</code>, generated "
           f"{_h(report.generated_at.strftime('%Y-%m-%d %H:%M:%S UTC'))}</p>"]
    if not report.workloads:
        out.append("<p>No traffic logged yet: the store holds no requests"
                   + (" matching these filters" if any(report.filters.values()) else "")
                   + ".</p></body></html>")
        return "".join(out)
    out.append(_html_table(
        ["workload", "requests", "tokens", "α", "k in force", "speedup", "verdict"],
        [[_label(w, 40), str(w.traffic.requests), str(w.traffic.new_tokens),
          fmt(w.acceptance.alpha, ".3f"),
          "-" if w.policy.k_in_force is None else str(w.policy.k_in_force),
          _x(w.speedup.value) + (f" ({w.speedup.source})" if w.speedup.source else ""),
          w.verdict.text] for w in report.workloads]))
    for w in report.workloads:
        a, v, p, sp, t = w.acceptance, w.verification, w.policy, w.speedup, w.traffic
        ci = a.alpha_ci95
        out += [f"<h2 title=\"{_h(w.category)}\">{_h(_label(w, 120))}</h2>",
                f"<div class=\"verdict {_verdict_class(w.verdict)}\">{_h(w.verdict.text)}</div>",
                f"<p>{t.requests} requests, {t.new_tokens} new tokens, "
                f"{_h(_when(t.first_seen))} – {_h(_when(t.last_seen))} UTC. "
                f"α = {_h(fmt(a.alpha, '.3f'))}"
                + (f" [{ci[0]:.3f}, {ci[1]:.3f}] (95 % Wilson)" if ci else "")
                + f" over {a.drafted} drafted tokens; mean accepted length "
                f"{_h(fmt(a.mean_accepted_length, '.2f'))}.</p>",
                "<div class=\"plots\">", *_plots(w), "</div>"]
        out.append("<p><b>Verification</b>: "
                   + _h(("memory-bound" if v.memory_bound else "compute-bound"
                         if v.memory_bound is False else "unknown")
                        + (f" at k = {v.k}: T_t({v.k + 1}) / T_t(1) = {v.cost_ratio:.2f}"
                           if v.cost_ratio is not None else "")
                        + f"; T_d = {_ms(v.t_draft_s)} ms (c = {fmt(v.draft_ratio, '.2f')}); "
                        f"bandwidth {human_bytes(v.bandwidth_bytes_per_s, per_s=True)} of "
                        f"{human_bytes(v.bandwidth_peak_bytes_per_s, per_s=True)} peak"
                        + (f" ({v.bandwidth_utilisation:.0%})" if v.bandwidth_utilisation
                           else "")
                        + (f". Latest probe: {v.probe['verdict']}" if v.probe and
                           v.probe.get("verdict") else ""))
                   + ".</p>")
        out.append("<p><b>Speedup</b> vs plain decoding at batch 1, draft cost included:<br>"
                   + "<br>".join(_h(s) for s in _speed_line(sp)) + "</p>")
        out.append("<p><b>Policy in force</b>: "
                   + _h((", ".join(f"{n} ({c})" for n, c in p.policies.items()) or "-")
                        + f" over the latest {p.recent_requests} batch-1 requests; k in force "
                        + ("-" if p.k_in_force is None else str(p.k_in_force))) + ".</p>")
        if p.k_counts:
            total = sum(p.k_counts.values()) or 1
            out.append(_html_table(["k", *map(str, sorted(p.k_counts))],
                                   [["iterations", *(str(p.k_counts[k])
                                                     for k in sorted(p.k_counts))],
                                    ["share", *(f"{p.k_counts[k] / total:.1%}"
                                                for k in sorted(p.k_counts))]]))
        if p.tuned:
            tu = p.tuned
            out.append(_html_table(
                ["tuned (latest)", "family", "params", "simulated tok/s", "untuned tok/s",
                 "gain", "held-out gain", "provenance"],
                [[f"#{tu.id} {_when(tu.created_at)}", tu.family,
                  json.dumps(tu.params, sort_keys=True), f"{tu.tokens_per_s:.1f}",
                  fmt(tu.baseline_tokens_per_s, ".1f"), _x(tu.gain),
                  _x(tu.holdout_gain) + (f" ({tu.holdout_traces} traces)"
                                         if tu.holdout_traces else ""),
                  json.dumps({k: tu.provenance[k] for k in ("study", "trial", "window",
                                                             "hardware")
                              if k in tu.provenance}, sort_keys=True, default=str)]]))
        else:
            out.append("<p class=\"small\">No <code>autospec tune</code> result for this "
                       "workload.</p>")
        if w.batch is not None:
            out += _batch_html(w.batch)
    out.append("<p class=\"small\">α = accepted / drafted. Measured speedup = speculative ÷ "
               "plain tokens/s (Σ tokens / Σ wall seconds) of requests of the same workload. "
               "Estimated S(k) = E[N]·T_t(1) / (k·T_d + T_t(k+1)) from α by position and the "
               "measured T_t(n), T_d.</p></body></html>")
    return "".join(out)


# -- command line -------------------------------------------------------------------------------

def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``autospec report`` on an argparse subparsers object."""
    p = subparsers.add_parser(
        "report", help="per workload: acceptance, memory-bound or not, speedup, verdict",
        description="Reads the store (safe while servers keep writing) and answers, per "
                    "category × model pair × hardware: how well the draft matches, whether "
                    "verification is memory-bound, and the speedup over plain decoding "
                    "(measured where plain runs exist, else estimated by the cost model).")
    p.add_argument("--db", metavar="URL", help="store URL or SQLite file (default: "
                                               "autospec.db in the cache directory)")
    p.add_argument("--format", choices=("text", "html", "json"), default="text")
    p.add_argument("--out", metavar="DIR", help="write report.{txt,html,json} into DIR "
                                                "(default: text/json to stdout, html to "
                                                "./autospec-report.html)")
    p.add_argument("--category", help="only this category")
    p.add_argument("--pair-id", type=int, help="only this model pair (see `autospec stats "
                                               "--json`)")
    p.set_defaults(run=lambda args, parser=None: run(args), parser=p)
    return p


_EXT = {"text": "txt", "html": "html", "json": "json"}


def run(args) -> int:
    from autospec.store import StoreError, open_store

    try:
        store = open_store(args.db)
    except StoreError as e:
        print(f"autospec: error: {e}", file=sys.stderr)
        return 2
    with store:
        report = build_report(store, category=args.category, pair_id=args.pair_id)
    body = {"text": render_text, "html": render_html, "json": render_json}[args.format](report)
    if args.out is None and args.format != "html":
        sys.stdout.write(body)
        return 0
    path = (Path(args.out) / f"report.{_EXT[args.format]}" if args.out
            else Path("autospec-report.html"))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body, encoding="utf-8")
    except OSError as e:
        print(f"autospec: error: cannot write {path}: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({len(report.workloads)} workload"
          f"{'s' if len(report.workloads) != 1 else ''})")
    return 0
