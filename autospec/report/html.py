"""The report as one self-contained HTML page with inline SVG plots."""

from __future__ import annotations

import json
import math
from html import escape

from autospec.report.model import (
    BATCH_FIXED_KS,
    BATCH_K_REF,
    MEMORY_BOUND_RATIO,
    MIN_POSITION_DRAFTED,
    Batch,
    Report,
    Verdict,
    Verification,
    Workload,
    served_by,
)
from autospec.report.svg import (
    PALETTE,
    Marker,
    Series,
    bar_chart,
    line_chart,
    nice_max,
    placeholder,
)
from autospec.report.text import (
    FORESIGHT_HEAD,
    FORESIGHT_NOTE,
    _batch_headline,
    _bucket_name,
    _choices,
    _ms,
    _speed_line,
    _summary_speedup,
    _when,
    _x,
    cost_points,
    estimates,
    foresight_rows,
    lookup_lines,
    proposer_rows,
    proposers_headline,
    source_rows,
)
from autospec.textfmt import clip, fmt, human_bytes, visible

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


def _pair_html(p: dict) -> str:
    """The pair's full names, once: target ← draft (dtype, hardware)."""
    return (f"target <code>{_h(visible(p['target']))}</code> ← draft "
            f"<code>{_h(visible(p['draft']))}</code> "
            f"({_h(visible(p['dtype']))}, {_h(visible(p['hardware']))})")


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["<table><tr>", *(f"<th>{_h(c)}</th>" for c in header), "</tr>"]
    for r in rows:
        out += ["<tr>", *(f"<td>{_h(c)}</td>" for c in r), "</tr>"]
    out.append("</table>")
    return "".join(out)


def _measured_label(sp) -> str:
    """The measured speedup with the requests behind it (speculative vs plain)."""
    return (f"measured {sp.measured:.2f}× ({sp.speculative.requests} vs "
            f"{sp.plain.requests} req.)")


def _plots(w: Workload) -> list[str]:
    a, sp, v = w.acceptance, w.speedup, w.verification
    counts = [(a.accepted_by_position[i] if i < len(a.accepted_by_position) else None, d)
              for i, d in enumerate(a.drafted_by_position)]
    cis = [a.by_position_ci95[i] if i < len(a.by_position_ci95) else None
           for i in range(len(a.by_position))]
    plots = [bar_chart(
        [str(i + 1) for i in range(len(a.by_position))], a.by_position,
        title="acceptance by draft position",
        x_label=f"position · whiskers: 95 % Wilson · pale: < {MIN_POSITION_DRAFTED} drafted",
        y_label="accepted rate", y_max=1.0, empty="nothing drafted yet", intervals=cis,
        notes=[f"n={d}" for _, d in counts], faint=[d < MIN_POSITION_DRAFTED for _, d in counts],
        tips=[f"position {i + 1}: {'-' if acc is None else acc}/{d} accepted"
              + ("" if ci is None else f", 95 % [{ci[0]:.2f}, {ci[1]:.2f}]")
              for i, ((acc, d), ci) in enumerate(zip(counts, cis))],
        width=420, margin_top=34)]
    if sp.curve:
        series = [Series("S(k), cost model", sorted(sp.curve.items()), PALETTE[0])]
        markers = []
        k = w.policy.k_in_force if w.policy.k_in_force is not None else sp.k
        if k is not None and k in sp.curve:
            markers.append(Marker(k, sp.curve[k], f"k in force = {k}", PALETTE[1]))
        if sp.measured is not None and k is not None:
            markers.append(Marker(k, sp.measured, _measured_label(sp), PALETTE[2]))
        top = max([1.0, *sp.curve.values(), *(m.y for m in markers)])
        plots.append(line_chart(series, title="speedup vs k (draft cost included)",
                                x_label="k", y_label="speedup ×", markers=markers,
                                hlines=[(1.0, "plain")], width=540, legend_width=190,
                                y_max=nice_max(top * 1.1), x_pad=0.3, y_fmt=".3g"))
    elif sp.measured is not None:
        k = w.policy.k_in_force or 0
        plots.append(line_chart([], title="speedup vs k (draft cost included)", x_label="k",
                                y_label="speedup ×", x_ticks=[(k, str(k))],
                                markers=[Marker(k, sp.measured, _measured_label(sp),
                                                PALETTE[2])], hlines=[(1.0, "plain")]))
    else:
        plots.append(placeholder("speedup vs k", "no costs measured: run `autospec probe`"
                                 if v.cost_note is None else v.cost_note))
    hist = [(b["start"].timestamp(), b["alpha"]) for b in w.history]
    if any(y is not None for _, y in hist):
        x0, x1 = hist[0][0], hist[-1][0]
        ticks = [(x0, _when(w.history[0]["start"]))]
        if x1 > x0:
            ticks.append((x1, _when(w.history[-1]["start"])))
        plots.append(line_chart(
            [Series(f"α per {_bucket_name(w.history_bucket_s)}; hollow: < "
                    f"{MIN_POSITION_DRAFTED} drafted", hist, PALETTE[0], dots=len(hist) <= 60,
                    hollow=[b["drafted"] < MIN_POSITION_DRAFTED for b in w.history])],
            title="acceptance α over time (UTC)", y_label="α", x_ticks=ticks, y_max=1.0,
            width=420))
    else:
        plots.append(placeholder("acceptance α over time", "nothing drafted yet"))
    plots.append(_cost_plot(v))
    return plots


def _cost_plot(v: Verification) -> str:
    """T_t(n) / T_t(1), each point from its own source: the probe's medians (squares, joined),
    the requests' means (circles; hollow where fewer than ``min_forwards`` forwards stand
    behind them, so the cost model ignores them) with their ≈95 % interval and forward count."""
    pts = cost_points(v)
    probe = [(p["n"], p["probe_ratio"]) for p in pts if p["probe_ratio"] is not None]
    live = [p for p in pts if p["live_ratio"] is not None]
    series = []
    if probe:
        series.append(Series("probe (median)" + (", used" if "probe" in v.source_by_n.values()
                                                  else ""), probe, PALETTE[3], marker="square"))
    dodge = 0.2 if probe else 0.0  # live beside the probe's point at the same n, not under it
    if live:
        used = "requests" in v.source_by_n.values()
        series.append(Series(
            f"live mean (label: forwards; hollow: < {v.min_forwards})"
            + (", used" if used else ""),
            [(p["n"] + dodge, p["live_ratio"]) for p in live], PALETTE[0], line=used,
            intervals=[p["live_ci95"] for p in live], hollow=[p["thin"] for p in live],
            labels=[str(p["forwards"]) for p in live]))
    unscaled = [p["n"] for p in pts if p["live_s"] is not None and p["live_ratio"] is None]
    if unscaled:  # live means at n > 1 but no live T_t(1) to scale them by: say so
        series.append(Series(f"live at n = {', '.join(map(str, unscaled))}: no live T_t(1) "
                             "to scale by", [], PALETTE[0]))
    if not any(s.points for s in series):
        return placeholder("cost of scoring n tokens", v.cost_note or "T_t(1) not measured")
    series.append(Series(f"dotted: memory-bound below {MEMORY_BOUND_RATIO}×", [], "#666666"))
    top = max([MEMORY_BOUND_RATIO, *(y for s in series for _, y in s.points),
               *(iv[1] for p in live if (iv := p["live_ci95"]) is not None)])
    y_max = nice_max(top / 0.7)  # room above the data for the legend
    return line_chart(series, title="cost of scoring n tokens (× T_t(1) of each source)",
                      x_label="n scored", y_label="× one token", y_min=0.0,
                      y_max=y_max, y_fmt=".3g",
                      hlines=[(1.0, ""), (MEMORY_BOUND_RATIO, "")],
                      x_ticks=[(p["n"], str(p["n"])) for p in pts],
                      width=420, height=240, x_pad=0.5)


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
                                x_ticks=ticks, vlines=vlines, y_max=nice_max(top * 1.1),
                                y_fmt=".3g", width=600, height=300, legend_width=120,
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


def _proposers_html(pr, a) -> list[str]:
    """Which proposer pays, the estimates behind it, and acceptance by position per
    proposer (the same numbers as the text's section 5)."""
    out = [f"<h3>Proposers</h3><p><b>{_h(proposers_headline(pr))}</b>."]
    out += [f" {_h(line)}." for line in lookup_lines(pr)]
    out.append("</p>")
    est = [list(e) for e in estimates(pr)]
    if est:
        out.append(_html_table(["proposer", "k", "estimated speedup"], est))
    out.append("<p class=\"small\">Acceptance by draft position, conditional on the ones "
               "before it being accepted:</p>")
    out.append(_html_table(*proposer_rows(pr, a)))
    return out


def _why_html(w, category: str) -> list[str]:
    """Why the policy ran what it ran (the text's section 6): the most frequent choice among
    the kept decision records, and one record's candidates."""
    from autospec.report.why import CANDIDATE_HEADER, candidate_rows, why_detail, why_headline

    out = [f"<h3>Why this k</h3><p><b>{_h(why_headline(w, clip(category, 60)))}</b>.</p>"]
    out += [f"<p class=\"small\">{_h(line)}</p>" for line in why_detail(w)]
    rows = candidate_rows(w.example) if w.example is not None else []
    if rows:
        out.append(_html_table(CANDIDATE_HEADER, rows))
        out.append("<p class=\"small\">* the chosen candidate; times in ms. E[N] = tokens "
                   "the block is expected to emit; ms/tok = (block + E[N] · +/tok) / E[N], its "
                   "expected seconds per emitted token; S = its speedup over plain decoding; "
                   "<code>autospec explain --request ID</code> shows every kept "
                   "iteration.</p>")
    return out


def _foresight_html(fs: dict, category: str) -> list[str]:
    """Each policy against perfect foresight (the text's section 7)."""
    pol, v = max(fs.items(), key=lambda kv: kv[1]["requests"])
    out = [f"<h3>Foresight</h3><p><b>{_h(pol)} reached {v['share']:.0%} of perfect foresight "
           f"on {_h(clip(category, 60))}</b> ({v['requests']} requests{_choices(v)}).</p>"]
    out.append(_html_table(FORESIGHT_HEAD, foresight_rows(fs)))
    out.append(f"<p class=\"small\">{_h(FORESIGHT_NOTE)}.</p>")
    return out


def render_html(report: Report) -> str:
    """One self-contained HTML page: inline CSS and SVG, no scripts, nothing fetched."""
    out = ["<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">",
           "<title>autospec report</title><style>", _CSS, "</style></head><body>",
           "<h1>autospec report</h1>",
           f"<p class=\"small\">store <code>{_h(report.store)}</code>, generated "
           f"{_h(report.generated_at.strftime('%Y-%m-%d %H:%M:%S UTC'))}</p>"]
    out += [f"<p class=\"small\">skipped: {_h(visible(note))}</p>" for note in report.skipped]
    if not report.workloads:
        out.append("<p>Nothing to report: what the store holds was left out (skipped).</p>"
                   if report.skipped else
                   "<p>No traffic logged yet: the store holds no requests"
                   + (" matching these filters" if any(report.filters.values()) else "")
                   + ".</p>")
        out.append("</body></html>")
        return "".join(out)
    out.append(_html_table(
        ["category", "pair", "served by", "requests", "tokens", "α", "k in force", "speedup",
         "verdict"],
        [[clip(visible(w.category), 60), str(w.pair["id"]), served_by(w.path),
          str(w.traffic.requests),
          str(w.traffic.new_tokens),
          fmt(w.acceptance.alpha, ".3f"),
          "-" if w.policy.k_in_force is None else str(w.policy.k_in_force),
          _summary_speedup(w),
          w.verdict.text] for w in report.workloads]))
    pairs = {w.pair["id"]: w.pair for w in report.workloads}
    out.append("<p class=\"small\">" + "<br>".join(
        f"pair {pid}: {_pair_html(p)}" for pid, p in pairs.items()) + "</p>")
    for w in report.workloads:
        a, v, p, sp, t = w.acceptance, w.verification, w.policy, w.speedup, w.traffic
        ci = a.alpha_ci95
        out += [f"<h2 title=\"{_h(visible(w.category))}\">{_h(clip(visible(w.category), 120))} "
                f"<span class=\"small\">pair {w.pair['id']}</span></h2>",
                f"<p class=\"small\">{_pair_html(w.pair)}</p>",
                f"<div class=\"verdict {_verdict_class(w.verdict)}\">{_h(w.verdict.text)}</div>",
                f"<p>{t.requests} requests, {t.new_tokens} new tokens, "
                f"{_h(_when(t.first_seen))} – {_h(_when(t.last_seen))} UTC. "
                f"α = {_h(fmt(a.alpha, '.3f'))}"
                + (f" [{ci[0]:.3f}, {ci[1]:.3f}] (95 % Wilson)" if ci else "")
                + f" over {a.drafted} drafted tokens; mean accepted length "
                f"{_h(fmt(a.mean_accepted_length, '.2f'))}.</p>",
                "<div class=\"plots\">", *_plots(w), "</div>"]
        if a.by_source:
            out.append("<p class=\"small\">Acceptance by source: autospec's own requests "
                       "and each engine's counters as <code>autospec ingest</code> recorded "
                       "them (records: requests or scrapes; pos i: accepted / drafted at draft "
                       "position i):</p>")
            header, rows = source_rows(a)
            out.append(_html_table(header, [[visible(r[0]), *r[1:]] for r in rows]))
        out.append("<p><b>Verification</b>: "
                   + _h(("memory-bound" if v.memory_bound else "compute-bound"
                         if v.memory_bound is False else "unknown")
                        + (f" ({v.cost_note})" if v.cost_note else "")
                        + (f" at k = {v.k}: T_t({v.k + 1}) / T_t(1) = {v.cost_ratio:.2f}"
                           if v.cost_ratio is not None else "")
                        + f"; T_d = {_ms(v.t_draft_s)} ms (c = {fmt(v.draft_ratio, '.2f')}); "
                        f"bandwidth {human_bytes(v.bandwidth_bytes_per_s, per_s=True)} of "
                        f"{human_bytes(v.bandwidth_peak_bytes_per_s, per_s=True)} peak"
                        + (f" ({v.bandwidth_utilisation:.0%})" if v.bandwidth_utilisation
                           else "")
                        + (f". Latest probe: {visible(v.probe['verdict'])}" if v.probe and
                           v.probe.get("verdict") else ""))
                   + ".</p>")
        out.append("<p><b>Speedup</b> vs plain decoding at batch 1, draft cost included:<br>"
                   + "<br>".join(_h(s) for s in _speed_line(sp, v.cost_note)) + "</p>")
        out.append("<p><b>Policy in force</b>: "
                   + _h((", ".join(f"{visible(n)} ({c})" for n, c in p.policies.items())
                         or "-")
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
                [[f"#{tu.id} {_when(tu.created_at)}", visible(tu.family),
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
        if w.proposers is not None:
            out += _proposers_html(w.proposers, w.acceptance)
        if w.why is not None:
            out += _why_html(w.why, w.category)
        if w.foresight:
            out += _foresight_html(w.foresight, w.category)
    out.append("<p class=\"small\">α = accepted / drafted. Measured speedup = speculative ÷ "
               "plain tokens/s (Σ tokens / Σ wall seconds) of requests of the same workload. "
               "Estimated S(k) = E[N]·T_t(1) / (k·T_d + T_t(k+1)) from α by position and the "
               "measured T_t(n), T_d.</p></body></html>")
    return "".join(out)


