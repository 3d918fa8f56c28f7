"""Building the report from the store: SQL aggregates, the cost model's view, verdicts."""

from __future__ import annotations

import contextlib
import logging
import math
from datetime import datetime, timezone
from typing import Any

from autospec.costs.grid import at_live_level, batch_grid  # noqa: F401 (re-exported)
from autospec.costs.price import (
    batch_best_k,
    best_k,
    conditional_from_cumulative,
    expected_tokens,
    interpolate_cost,
    speedup,
)
from autospec.costs.stored import batch_one, stored_costs
from autospec.costs.table import grid_draft
from autospec.report.model import (
    BATCH_FIXED_KS,
    BATCH_K_REF,
    K_MAX,
    LOSES,
    MEMORY_BOUND_RATIO,
    MIN_DRAFTED,
    MIN_FORWARDS,
    MIN_MEASURED,
    PAYS,
    PROBE_BATCH_HINT,
    RECENT,
    Acceptance,
    Batch,
    BatchPoint,
    LookupEstimate,
    PolicyInForce,
    Proposers,
    Rate,
    Report,
    SourceAcceptance,
    Speedup,
    Traffic,
    Tuning,
    Verdict,
    Verification,
    Workload,
)
from autospec.report.why import why_view
from autospec.textfmt import fmt
from autospec.traces import NO_DRAFT

log = logging.getLogger(__name__)

# -- building ---------------------------------------------------------------------------------

SPREAD_REQUESTS = 2000  # the latest requests whose forwards give the live points' spread


def cost_inputs(summary, probe_payload: dict | None
                ) -> tuple[dict[int, float], dict[int, str], float | None]:
    """The cost model's inputs for one workload (``summary``'s live timings, the probe of its
    path), by the rule every reader applies (``autospec.costs.stored.batch_one``): the probe's
    curve if there is one, else the requests' means resting on ≥ MIN_FORWARDS forwards."""
    return _shown(batch_one(probe_payload, summary.t_target_s_by_n, summary.target_count_by_n,
                            summary.t_draft_s, summary.draft_forwards))


def _shown(one) -> tuple[dict[int, float], dict[int, str], float | None]:
    """(T_t(n), n → "probe" / "requests", T_d) as the report prices with them: batch 1's costs
    (``BatchOne`` or ``StoredCosts``) as the controller and tune decide by them — without the
    live points the shape guard held out (a shape no machine shows)."""
    curve = dict(sorted(one.t_target.items()))
    return curve, dict.fromkeys(curve, "probe" if one.from_probe else "requests"), one.t_draft


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


def cost_shortfall(summary, curve: dict[int, float], t_draft: float | None) -> str | None:
    """What keeps the cost model from estimating a speedup, with the forwards the store holds
    and the forwards it needs (None: nothing missing)."""
    missing = []
    if 1 not in curve:
        missing.append(f"{summary.target_count_by_n.get(1, 0)} forwards of T_t(1) measured, "
                       f"{MIN_FORWARDS} needed")
    if not t_draft:
        missing.append(f"{summary.draft_forwards} draft forwards (T_d) measured, "
                       f"{MIN_FORWARDS} needed")
    if not missing:
        return None
    return "; ".join(missing) + " (run `autospec probe`, or serve more traffic)"


# two-sided 97.5 % quantiles of Student's t by degrees of freedom (beyond 30: the normal's)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def live_ratio_ci95(live_by_n: dict[int, tuple[float, int]], spread: dict[int, Any]
                    ) -> dict[int, tuple[float, float]]:
    """n > 1 → an ≈95 % interval of the live ratio T_t(n)/T_t(1) (the all-time means of
    ``live_by_n``): the ratio ± t·(its relative standard error from the spread of the latest
    requests' forwards, ``history.forward_spread``; delta method), t for the fewer forwards.
    Absent where either point has fewer than two forwards."""
    one, s1 = live_by_n.get(1), spread.get(1)
    out: dict[int, tuple[float, float]] = {}
    if not one or not one[0] or s1 is None or s1.sd_s is None or not s1.mean_s:
        return out
    for n, (t, _count) in live_by_n.items():
        sn = spread.get(n)
        if n == 1 or not t or sn is None or sn.sd_s is None or not sn.mean_s:
            continue
        r = t / one[0]
        rel = math.sqrt((sn.sd_s / sn.mean_s) ** 2 / sn.forwards
                        + (s1.sd_s / s1.mean_s) ** 2 / s1.forwards)
        df = min(sn.forwards, s1.forwards) - 1
        q = _T975[df - 1] if df <= len(_T975) else 1.96
        out[n] = (max(0.0, r * (1 - q * rel)), r * (1 + q * rel))
    return out


def _verification(sm, probe, curve, source, t_draft, k, spread=None) -> Verification:
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
    live = {n: (t, sm.target_count_by_n.get(n, 0)) for n, t in sm.t_target_s_by_n.items()}
    return Verification(
        curve, source, t_draft, t_draft / t1 if t_draft and t1 else None, k, ratio, upto,
        None if ratio is None else ratio <= MEMORY_BOUND_RATIO, sm.bandwidth_bytes_per_s,
        sm.bandwidth_peak_bytes_per_s, sm.bandwidth_utilisation, sm.nvml_mem_busy_pct,
        sm.nvml_sm_util_pct, p, live, live_ratio_ci95(live, spread or {}),
        cost_shortfall(sm, curve, t_draft))


def _speedup(alphas, curve, t_draft, k, k_max, modes, fixed=None) -> Speedup:
    """The speedup view: the estimate at the k in force from the live acceptance ``alphas``
    (what ran), the S(k) curve and its best k — what a fixed k would run — from ``fixed``
    (the acceptance of a fixed-k block; None: ``alphas``)."""
    fixed = alphas if fixed is None else fixed
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
        s_curve = {j: speedup(j, fixed, t_draft, cost) for j in range(k_max + 1)}
        okb, ob = best_k(fixed, t_draft, cost, k_max)
        flat = best_k(fixed, t_draft, {1: curve[1]}, k_max)[1]
        if k is not None:
            est = speedup(k, alphas, t_draft, cost)
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


def batch_view(alphas: list[float | None], target: dict[int, dict[int, float]],
               draft: dict[int, float], source: str, *, k_max: int = K_MAX,
               tuned: Tuning | None = None, requests_by_batch: dict[int, int] | None = None,
               drafted: int = 0) -> Batch:
    """The batch dimension of one workload from the pair's cost grid (``queries.batch_costs``):
    at each grid batch size B, the cost model's k for a batch whose every row has this
    workload's acceptance ``alphas`` (``batch_best_k``: Σ E[N_i](k) / (k·T_d(B) + T_t(B, k+1))
    against B / T_t(B, 1)), its predicted speedup, the speedup at fixed k, and where
    verification stops being memory-bound and speculation is switched off. ``drafted``: the
    workload's drafted tokens, which tell "nothing measured" from "measured, but not per
    position" (an ingested SGLang scrape)."""
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
    points = []
    for b, ns in grid.items():
        cost = interpolate_cost(ns)
        t1 = cost(1)
        t_d = grid_draft(draft or {}, {}, b)  # the live rule, at a B the grid lacks
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
    if not known and drafted > 0:
        note = ("acceptance by position unknown (the traffic was ingested from an engine that "
                "does not count it per position, e.g. SGLang): k per batch size unknown")
    elif not known:
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
                       "to judge the speedup by: " + (ver.cost_note or "run `autospec probe` "
                                                      "for this pair"))
    at = f" at k = {sp.k}" if sp.k is not None else ""
    figure = f"{sp.value:.2f}×{at} ({sp.source})"
    if sp.value >= PAYS:
        return Verdict("pays", f"speculation pays here: {figure}")
    if sp.value > LOSES:
        return Verdict("break_even", f"break-even here: {figure}")
    kind, text = why_loses or ("unknown", "speculation loses here")
    return Verdict(kind, f"{text}; speculation loses: {figure}")


def _proposer_verdict(verdict: Verdict, props: Proposers | None,
                      has_draft: bool = True) -> Verdict:
    """The headline for a workload a lookup proposer serves: where one (or the hybrid) is
    the one that pays (section 5) and traffic shows it — its live blocks, or the traces of
    more than one request — the verdict says so. The draft model's own verdict (section 3)
    stays in the text after it: judged alone, the draft of a workload served by prompt lookup
    has drafted little ("not enough traffic yet") although speculation pays there. A pair
    without a draft model (``has_draft`` False: lookups alone, as vLLM's custom_class proposer
    runs) is judged by its lookups only, paying or not."""
    unjudged = (verdict if has_draft else Verdict(
        "not_enough", "lookups only (the pair has no draft model): too few greedy batch-1 "
        "requests with their traces for section 5's estimate yet"))
    if props is None or (props.pays not in props.lookups and props.pays != "hybrid"):
        return unjudged
    lookup = props.lookups.get(props.hybrid_of if props.pays == "hybrid" else props.pays)
    if lookup is None or (lookup.live_proposed < MIN_DRAFTED and lookup.trace_requests < 2):
        return unjudged
    if props.pays == "hybrid":
        k, k2, s = props.hybrid
        how = (f"{lookup.title} at k = {k}, the draft model at k = {k2} where it has no "
               "draft")
    else:
        k, s = lookup.best
        how = f"{lookup.title} at k ≤ {k}"
    if s < PAYS and has_draft:
        return verdict
    if s < PAYS:
        return Verdict("break_even", f"{how}: {s:.2f}× (estimated, section 5): no lookup pays "
                       "on this workload's traces (the pair has no draft model)",
                       figure=(s, props.pays))
    alone = f"; the draft model alone: {verdict.text}" if has_draft else ""
    return Verdict("pays", f"speculation pays here: {how}, {s:.2f}× (estimated, section 5)"
                   + alone, figure=(s, props.pays))


def build_report(source, *, category: str | None = None, pair_id: int | None = None,
                 recent: int = RECENT, max_buckets: int = 48, store_url: str | None = None
                 ) -> Report:
    """The report's numbers, from a ``Store`` or an open ``Session`` (read-only). Rows the
    store's readers leave out (damaged ones) are listed in ``Report.skipped``."""
    from sqlalchemy.orm import Session

    from autospec.store.damage import collecting

    if isinstance(source, Session):
        cm = contextlib.nullcontext(source)
        url = store_url or str(source.get_bind().url.render_as_string(hide_password=True))
    else:
        cm, url = source.session(), store_url or source.url
    with cm as s, collecting() as skipped:
        report = _build(s, url, category, pair_id, recent, max_buckets)
    report.skipped = list(skipped)
    return report


def _build(s, url, category, pair_id, recent, max_buckets) -> Report:
    from autospec.store import history, queries
    from autospec.store.write import category_key

    report = Report(url, datetime.now(timezone.utc),
                    {"category": category, "pair_id": pair_id})
    summaries = queries.category_summaries(s, category=category, pair_id=pair_id)
    if not summaries:
        return report
    modes = history.plain_vs_speculative(s, category=category, pair_id=pair_id, by_path=True)
    tuned = {(t.category, t.pair_id): t
             for t in queries.tuned_params(s, category=category, pair_id=pair_id)}
    by_batch = requests_by_batch(s, category=category, pair_id=pair_id)
    served = _served_paths(s)
    grids: dict[int, Any] = {}
    for sm in summaries:
        pid = sm.pair.id
        if pid not in grids:  # the pair's batch grid, once
            grids[pid] = stored_costs(s, pid, parts={"grid"})
        profiles = _lookup_profiles(s, sm.category, pid, recent)
        # batch 1 on the path the summary's costs are on (its probe, else its live points)
        costs = stored_costs(s, pid, sm.category, summary=sm, parts={"batch1", "lookups"})
        probe = costs.probe
        curve, src, t_draft = _shown(costs)
        recent_act = history.recent_activity(s, sm.category, pid, limit=recent)
        k_in_force = recent_act.k_mode
        # the k the ratio and the estimate are taken at: in force, else the most used k > 0
        k_ref = (k_in_force if k_in_force else
                 _mode(recent_act.k_counts, positive=True) or _mode(sm.k_counts, positive=True))
        k_max = max([K_MAX, *sm.k_counts])
        alphas = conditional_from_cumulative(list(sm.acceptance_by_position))
        acc = Acceptance(sm.drafted, sm.accepted, sm.alpha, sm.alpha_ci95,
                         list(sm.acceptance_by_position), list(sm.drafted_per_position),
                         alphas, sm.mean_accepted_length, list(sm.accepted_per_position),
                         [queries.wilson_interval(a, d) for a, d in
                          zip(sm.accepted_per_position, sm.drafted_per_position)],
                         by_source(sm, history.ingested_acceptance(s, sm.category, pid)),
                         fixed_block(s, sm.category, pid, recent))
        fixed = acc.fixed_k  # what a fixed k is priced at
        sp = _speedup(alphas, curve, t_draft, k_ref, k_max,
                      modes.get((category_key(sm.category), pid, sm.path)), fixed)
        if k_ref is None and sp.oracle_k:  # nothing ever drafted: judge at the oracle's k
            k_ref = sp.oracle_k
        # the cost ratio needs some k even before anything was drafted: k = 4 then
        spread = history.forward_spread(s, sm.category, pid, limit=SPREAD_REQUESTS)
        ver = _verification(sm, probe, curve, src, t_draft, k_ref or 4, spread)
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
        g = grids[pid]
        batch = batch_view(fixed, g.grid, g.draft_grid, g.grid_source, k_max=k_max,
                           tuned=pol.tuned,
                           requests_by_batch=by_batch.get((category_key(sm.category), pid)),
                           drafted=sm.drafted)
        props = proposers_view(sm, profiles, fixed, curve, t_draft, k_max=k_max,
                               t_lookup=costs.t_lookup)
        verdict = _proposer_verdict(_verdict(acc, ver, pol, sp), props,
                                    has_draft=sm.pair.draft != NO_DRAFT)
        why = why_view(queries.category_decisions(s, sm.category, pid, limit=recent))
        report.workloads.append(Workload(sm.category, pair, traffic, acc, ver, pol, sp,
                                         bucket_s, hist, verdict, batch, props, why,
                                         foresight_view(s, sm.category, pid, recent),
                                         served.get((category_key(sm.category), pid))))
    return report


def _served_paths(s) -> dict[tuple[str, int], str]:
    """(category key, pair id) → the execution path that served most of its requests, any
    batch size ("vllm": a vLLM server's; ties: the latest path)."""
    from sqlalchemy import func, select

    from autospec.store.tables import Request

    stmt = (select(Request.category_key, Request.pair_id, Request.path, func.count(),
                   func.max(Request.id))
            .where(Request.path.is_not(None))
            .group_by(Request.category_key, Request.pair_id, Request.path))
    best: dict[tuple[str, int], tuple[int, int, str]] = {}
    for key, pid, path, n, last in s.execute(stmt):
        best[(key, pid)] = max(best.get((key, pid), (0, 0, path)), (n, last, path))
    return {k: v[2] for k, v in best.items()}


def foresight_view(s, category: str, pair_id: int, recent: int) -> dict[str, dict]:
    """Per policy, the median over the category's latest ``recent`` greedy batch-1 requests of
    perfect foresight's time over the proposers the policy may use (``autospec.oracle``, from
    each request's own traces, plus its prefill) ÷ the request's time ("share"), and ÷ the
    schedule it ran priced the same way ("choices": ``oracle.scheduled_seconds``) — priced by
    those requests' forwards, pooled."""
    import statistics

    from sqlalchemy import select

    from autospec.oracle import Prices, least_seconds, may_use, scheduled_seconds
    from autospec.store import queries
    from autospec.store.tables import Request
    from autospec.store.write import category_key

    stmt = (select(Request.id, Request.policy, Request.new_tokens, Request.wall_s,
                   Request.prefill_s, Request.target_s_by_n, Request.draft_s,
                   Request.draft_forwards)
            .where(Request.category_key == category_key(category), Request.pair_id == pair_id,
                   Request.greedy, Request.batch_size == 1, Request.new_tokens >= 2,
                   Request.wall_s > 0)
            .order_by(Request.id.desc()).limit(recent))
    rows = list(s.execute(stmt))
    prices = Prices.of(rows)
    if prices is None:
        return {}
    props = queries.request_proposers(s, [r.id for r in rows])
    shares: dict[str, list[float]] = {}
    choices: dict[str, list[float]] = {}
    used: dict[str, set[str]] = {}
    for r in rows:
        mine = props.get(r.id, {})
        traces = {n: p.trace for n, p in mine.items() if p.trace}
        model = next((n for n, p in mine.items() if p.kind == "model"), None)
        allowed = may_use(r.policy, mine, model)
        if not allowed or not allowed <= set(traces):
            continue  # a proposer it may use left no trace
        best = r.prefill_s + least_seconds(r.new_tokens, traces, allowed, prices, model=model)
        ran = r.prefill_s + scheduled_seconds(
            r.target_s_by_n or {}, r.draft_forwards or 0,
            sum(p.blocks for p in mine.values() if p.kind == "lookup"), prices)
        shares.setdefault(r.policy, []).append(best / r.wall_s)
        if ran > 0:  # a forward's timing was lost: its share stands, its choices do not
            choices.setdefault(r.policy, []).append(best / ran)
        used.setdefault(r.policy, set()).update(allowed)
    return {pol: {"requests": len(v), "share": statistics.median(v),
                  "choices": statistics.median(choices[pol]) if pol in choices else None,
                  "proposers": sorted(used[pol])} for pol, v in shares.items()}


def by_source(sm, ingested) -> list[SourceAcceptance]:
    """The workload's draft-model acceptance split by source: autospec's own requests (the
    summary less the ingested records; left out where there are none) first, then each engine
    whose scrapes were ingested; [] where nothing was ingested."""
    if not ingested:
        return []

    def source(name, records, drafts, drafted, accepted, acc_pos, dr_pos) -> SourceAcceptance:
        return SourceAcceptance(
            name, records, drafts, drafted, accepted, accepted / drafted if drafted else None,
            1 + accepted / drafts if drafts else None,
            [a / d if d else None for a, d in zip(acc_pos, dr_pos)], list(acc_pos),
            list(dr_pos))

    def minus(total, parts) -> list[int]:
        out = list(total)
        for part in parts:
            for i, v in enumerate(part):
                if i < len(out):
                    out[i] -= v
        while out and out[-1] <= 0:  # positions only the engines drafted
            out.pop()
        return out

    dr_pos = minus(sm.drafted_per_position, [e.drafted_per_position for e in ingested])
    acc_pos = minus(sm.accepted_per_position, [e.accepted_per_position for e in ingested])
    acc_pos = (acc_pos + [0] * len(dr_pos))[:len(dr_pos)]
    own = source("autospec", sm.requests - sum(e.records for e in ingested),
                 sm.drafts - sum(e.drafts for e in ingested),
                 sm.drafted - sum(e.drafted for e in ingested),
                 sm.accepted - sum(e.accepted for e in ingested), acc_pos, dr_pos)
    engines = [source(e.source, e.records, e.drafts, e.drafted, e.accepted,
                      e.accepted_per_position, e.drafted_per_position) for e in ingested]
    return [own, *engines] if own.records > 0 else engines  # no own requests: no own row


def fixed_block(s, category: str, pair_id: int, recent: int = RECENT) -> list[float | None]:
    """The draft model's acceptance by position in a fixed-k block, from the latest
    ``recent`` greedy batch-1 requests' traces; [] where none has an observed position."""
    from autospec.store import history, queries

    rows = list(queries.traces(s, category, pair_id, limit=4 * recent, newest=True))
    got = history.fixed_block_acceptance(rows, limit=recent)
    return got if any(a is not None for a in got) else []


def _lookup_profiles(s, category: str, pair_id: int, recent: int) -> dict:
    """Each registered lookup proposer's profile (``history.LookupProfile``) over the latest
    ``recent`` greedy batch-1 requests that carry its trace, by name (those with none left
    out). Its own replay rule reads its trace (``autospec.engine.proposers``)."""
    from autospec.engine.proposers import registered
    from autospec.store import history, queries

    lookups = {n: c for n, c in registered().items() if c.kind != "model"}
    if not lookups:
        return {}
    rows = list(queries.traces(s, category, pair_id, limit=4 * recent, newest=True))
    out = {}
    for name, cls in lookups.items():
        got = history.lookup_profile(rows, name, cls.replay, limit=recent)
        if got is not None:
            out[name] = got
    return out


def proposers_view(sm, profiles: dict, alphas, curve: dict[int, float],
                   t_draft: float | None, *, k_max: int = K_MAX,
                   t_lookup: dict[str, float] | None = None) -> Proposers | None:
    """Which proposer pays for this workload (``Proposers``), or None when nothing is known of
    any lookup proposer (no trace of one, no live block). Per iteration a lookup has a draft
    with probability r (its traces' share of positions); S of a policy is E[tokens per
    iteration] · T_t(1) / E[seconds per iteration]:
    - a lookup alone (k):
      (r·E[N](k) + 1 − r) · T_t(1) / (r·(k·t + T_t(k+1)) + (1 − r)·T_t(1)),
      E[N] and the block's T_t from its traces (``LookupProfile.block``: each drafting
      position's block min(k, its draft) tokens long, accepting min(agreement, that); greedy:
      exact), or from its live blocks' acceptance by position where there are enough;
    - the hybrid (k1, k2), over the first registered lookup (prompt lookup): its block of k1
      where it has a draft, the model's of k2 where not (k2 = 0: plain there);
    - the model alone: ``best_k`` as everywhere else."""
    from autospec.engine.proposers import registered

    classes = registered()
    model = sm.model.name if sm.model is not None else None
    names = [n for n in (*profiles, *(n for n, p in sm.proposers.items()
                                      if p.kind == "lookup" and p.proposed))
             if n != model]
    names = list(dict.fromkeys(names))
    if not names:
        return None
    have_curve = 1 in curve and len(curve) >= 2
    cost = interpolate_cost(curve) if have_curve else None
    draft_trace_alpha = next((p.draft_alpha for p in profiles.values()
                              if p.draft_alpha is not None), None)
    if not alphas and draft_trace_alpha is not None:
        alphas = [draft_trace_alpha]  # nothing drafted live: the draft's traces say
    draft = best_k(alphas, t_draft, cost, k_max) if cost and t_draft and alphas else None
    lookups: dict[str, LookupEstimate] = {}
    blocks: dict[str, tuple[float, list]] = {}  # name → (r, [(k, E[N], seconds)])
    for name in names:
        profile, live = profiles.get(name), sm.proposers.get(name)
        live_proposed = live.proposed if live is not None else 0
        live_by_pos = conditional_from_cumulative(
            list(live.acceptance_by_position) if live is not None else [])
        enough = live_proposed >= MIN_DRAFTED and any(a is not None for a in live_by_pos)
        traced = profile.conditional(k_max) if profile is not None else []
        r = profile.match_rate if profile is not None else None
        t = float((t_lookup or {}).get(name) or 0.0)
        best = None
        # an estimate needs evidence of its acceptance: enough live blocks, or a draft at
        # some traced position (never plain decoding's 1.0 under the lookup's name)
        evidence = enough or any(a is not None for a in traced)
        if cost is not None and r is not None and evidence:
            t1 = cost(1)
            rows = []
            for k in range(1, k_max + 1):
                if enough:
                    e, c = expected_tokens(live_by_pos, k), cost(k + 1)
                else:
                    e, c = profile.block(k, cost)
                rows.append((k, e, k * t + c))
            blocks[name] = (r, rows)
            best = max(((k, (r * e + 1 - r) * t1 / (r * c + (1 - r) * t1))
                        for k, e, c in rows), key=lambda x: x[1])
        cls = classes.get(name)
        lookups[name] = LookupEstimate(
            name, cls.label() if cls is not None else name,
            profile.requests if profile is not None else 0, r, traced[:8], live_proposed,
            live.alpha if live is not None else None, live_by_pos[:8],
            "live blocks" if enough else "traces", best, t or None)
    hybrid_of = next((n for n, c in classes.items() if c.kind == "lookup"), None)
    hybrid = None
    if hybrid_of in blocks and cost is not None and t_draft and alphas:
        r, ng = blocks[hybrid_of]
        t1 = cost(1)
        dr = [(0, 1.0, t1)] + [(k, expected_tokens(alphas, k), k * t_draft + cost(k + 1))
                                for k in range(1, k_max + 1)]
        hybrid = max(((k1, k2, (r * e1 + (1 - r) * e2) * t1 / (r * c1 + (1 - r) * c2))
                      for k1, e1, c1 in ng for k2, e2, c2 in dr), key=lambda x: x[2])
    options = {"plain": 1.0}
    if draft is not None and model is not None:
        options[model] = draft[1]
    for name, est in lookups.items():
        if est.best is not None:
            options[name] = est.best[1]
    if hybrid is not None and hybrid[1] > 0:  # k2 = 0 is the lookup alone: not a third way
        options["hybrid"] = hybrid[2]
    ranked = sorted(options.items(), key=lambda x: -x[1])
    pays = ranked[0][0]
    margin = ranked[0][1] / ranked[1][1] if len(ranked) > 1 and ranked[1][1] > 0 else None
    return Proposers(draft, lookups, hybrid, pays, margin, draft_trace_alpha,
                     model or "draft", hybrid_of)


def requests_by_batch(s, *, category: str | None = None, pair_id: int | None = None
                      ) -> dict[tuple[str, int], dict[int, int]]:
    """Logged requests per batch size: (category_key, pair_id) → {batch size: requests}.
    One grouped query (the requests index leads with category_key, pair_id)."""
    from sqlalchemy import func, select

    from autospec.store.tables import Request
    from autospec.store.write import category_key

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


def estimate_speedup(summary, costs):
    """S(k) of the most used k>0 from the measured acceptance and costs (cost model), with
    T_t(n) and T_d taken as the report takes them: ``costs`` is batch 1's costs as read
    (``StoredCosts``), or the payload of the probe of the summary's path (``cost_inputs``:
    that probe, else well-measured live points). (k, S) or None."""
    curve, _, t_draft = (_shown(costs) if hasattr(costs, "t_target")
                         else cost_inputs(summary, costs))
    ks = {k: c for k, c in summary.k_counts.items() if k > 0}
    if not ks or 1 not in curve or not t_draft or summary.alpha is None:
        return None
    k = max(ks, key=ks.get)
    alphas = conditional_from_cumulative(list(summary.acceptance_by_position))
    return k, speedup(k, alphas, t_draft, curve)


def batch_summary(summary, grid, tuned=None, fixed=None) -> dict:
    """The batch dimension of one (category, pair) as ``autospec report`` computes it
    (``batch_view``) from the pair's cost grid ``(target, draft, source)``
    (``queries.batch_costs``): where verification stops being memory-bound, the cost
    model's k and predicted speedup over plain batched decoding per batch size, and from
    which batch size it switches speculation off; ``fixed``: the acceptance of a fixed-k
    block (``fixed_block``; None or []: the summary's live acceptance). JSON-ready."""
    alphas = fixed or conditional_from_cumulative(list(summary.acceptance_by_position))
    target, draft, source = grid
    b = batch_view(alphas, target, draft, source, k_max=max([K_MAX, *summary.k_counts]),
                   tuned=_tuning(tuned))
    return {"source": b.source, "memory_bound_up_to": b.memory_bound_up_to,
            "crossover": b.crossover, "tuned_table": b.tuned,
            "k_by_batch": {str(p.batch): p.k for p in b.points},
            "speedup_by_batch": {str(p.batch): p.speedup for p in b.points},
            "note": b.note}
