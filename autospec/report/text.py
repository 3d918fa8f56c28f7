"""The report as plain text for a terminal (and ``render_json``)."""

from __future__ import annotations

import json
from datetime import datetime

from autospec.report.model import (
    BATCH_FIXED_KS,
    BATCH_K_REF,
    MEMORY_BOUND_RATIO,
    Batch,
    Rate,
    Report,
    Speedup,
    Verification,
    Workload,
)
from autospec.textfmt import fmt, human_bytes, table

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


def _live(v: Verification, n: int) -> str:
    t, count = v.live_by_n.get(n, (None, 0))
    return "-" if t is None else f"{_ms(t)} ({count})"



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
