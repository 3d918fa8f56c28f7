"""The report as plain text for a terminal (and ``render_json``)."""

from __future__ import annotations

import json
import textwrap
from datetime import datetime

from autospec.report.model import (
    BATCH_FIXED_KS,
    BATCH_K_REF,
    MEMORY_BOUND_RATIO,
    MIN_POSITION_DRAFTED,
    Acceptance,
    Batch,
    Proposers,
    Rate,
    Report,
    Speedup,
    Verification,
    Workload,
    served_by,
)
from autospec.textfmt import clip, fmt, human_bytes, table, visible

# -- text ---------------------------------------------------------------------------------------

def _short(name: str, n: int = 36) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1][:n]


def _label(w: Workload, n: int = 60) -> str:
    """One line naming the workload (the HTML's headings)."""
    cat = visible(w.category)
    cat = cat if len(cat) <= n else cat[: n - 1] + "…"
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


def _speed_line(sp: Speedup, cost_note: str | None = None) -> list[str]:
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
        out.append("estimated: - (needs T_t(1), T_d and acceptance: "
                   + (cost_note or "run `autospec probe`") + ")")
    out.append(f"used for the verdict: {sp.source or '-'} {_x(sp.value)}")
    return out


def _batch_headline(b: Batch) -> str:
    """Where verification stops being memory-bound and where the cost model stops drafting."""
    mem, off = _batch_headline_parts(b)
    return f"{mem}; {off}" if off else mem


def _batch_headline_parts(b: Batch) -> tuple[str, str | None]:
    if not b.points:
        return b.note or "no batch cost grid", None
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
    return mem, off


def _batch_text(b: Batch) -> list[str]:
    out = []
    if b.points:
        out.append(f"costs: {visible(b.source)}; tuned table: "
                   + (visible(b.tuned) if b.tuned else "none"))
        out.append(f"T_t = T_t(B, 1), ratio = T_t(B, {BATCH_K_REF + 1}) / T_t(B, 1), k and S: "
                   f"the cost model's k and predicted speedup, S(j): at fixed k = j")
        header = ["B", "T_t ms", "ratio", "T_d ms", "k", "S", *(f"S({j})" for j in
                                                               BATCH_FIXED_KS),
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


WIDTH = 100  # the widest line render_text writes (a terminal's width, with room to spare)
_VERDICT_SHORT = {"pays": "pays", "break_even": "break-even", "low_acceptance": "low α",
                  "compute_bound": "compute-bound", "not_enough": "too little traffic",
                  "no_drafts": "no drafts", "switched_off_but_would_pay": "off, would pay",
                  "unknown": "unknown"}


def _summary_speedup(w: Workload, short: bool = False) -> str:
    """The summary's speedup: the one the verdict rests on — the proposer that pays where
    the verdict names it (section 5's estimate), else section 3's — and where it comes from."""
    if w.verdict.figure is not None:
        value, proposer = w.verdict.figure
        return f"{_x(value)} {proposer} est." if short else f"{_x(value)} ({proposer}, estimated)"
    sp = w.speedup
    if not sp.source:
        return _x(sp.value)
    return f"{_x(sp.value)} {sp.source[:4]}." if short else f"{_x(sp.value)} ({sp.source})"


def _short_verdict(w: Workload) -> str:
    v = w.verdict
    short = _VERDICT_SHORT.get(v.kind, v.kind)
    if v.kind in ("low_acceptance", "compute_bound"):
        short = ("off: " if v.switched_off else "loses: ") + short
    return short


_NBSP = "\u00a0"  # holds a `command` together while wrapping; a space again afterwards


def _wrap(line: str, width: int = WIDTH, indent: str = "    ") -> list[str]:
    """One line as lines of at most ``width`` characters (words broken only when longer
    than a line), continuation lines indented; `quoted commands` and ``a = b`` are never
    split."""
    if len(line) <= width:
        return [line]
    lead = line[: len(line) - len(line.lstrip(" "))]
    parts = line.split("`")
    glued = "`".join(p.replace(" ", _NBSP) if i % 2 else p for i, p in enumerate(parts))
    for op in ("=", "≤", "×"):  # "n = 8" stays on one line
        glued = glued.replace(f" {op} ", f"{_NBSP}{op}{_NBSP}")
    out = textwrap.wrap(glued, width, initial_indent="", subsequent_indent=lead + indent,
                        break_on_hyphens=False, drop_whitespace=True)
    out = [line_.replace(_NBSP, " ") for line_ in out] or [line]
    return [chunk for line_ in out for chunk in
            (textwrap.wrap(line_, width, subsequent_indent=lead + indent)
             if len(line_) > width else [line_])]


def _fit(lines: list[str]) -> list[str]:
    """Every line visible (no control character reaches the terminal) and ≤ WIDTH wide."""
    return [chunk for block in lines for line in block.split("\n")
            for chunk in _wrap(visible(line))]


def _named(label: str, name: str, indent: int) -> list[str]:
    """``label name``, the name (visible) wrapped under itself if it is long."""
    name = visible(name)
    room = WIDTH - indent - len(label) - 1
    chunks = [name[i:i + room] for i in range(0, len(name), room)] or [""]
    pad = " " * indent
    return [f"{pad}{label} {chunks[0]}", *(f"{pad}{' ' * len(label)} {c}" for c in chunks[1:])]


def _pair_lines(p: dict, indent: int = 0) -> list[str]:
    return [*_named("target", p["target"], indent), *_named("draft ", p["draft"], indent),
            *_named("on    ", f"{p['dtype']}, {p['hardware']}", indent)]


def _position_rows(a: Acceptance) -> list[list[str]]:
    rows = []
    for i, (d, r, c) in enumerate(zip(a.drafted_by_position, a.by_position, a.conditional)):
        acc = a.accepted_by_position[i] if i < len(a.accepted_by_position) else None
        ci = a.by_position_ci95[i] if i < len(a.by_position_ci95) else None
        rows.append([str(i + 1), f"{'-' if acc is None else acc}/{d}", fmt(r, ".3f"),
                     "-" if ci is None else f"[{ci[0]:.2f}, {ci[1]:.2f}]", fmt(c, ".3f"),
                     f"thin: < {MIN_POSITION_DRAFTED} drafts" if d < MIN_POSITION_DRAFTED
                     else ""])
    return rows


SOURCE_POSITIONS = 6  # draft positions shown per source (text report)


def source_rows(a: Acceptance) -> tuple[list[str], list[list[str]]]:
    """(headers, rows): the draft model's acceptance per source — autospec's own requests and
    each engine's ingested scrapes — with the rate at each draft position."""
    width = min(SOURCE_POSITIONS, max((len(src.by_position) for src in a.by_source), default=0))
    header = ["source", "records", "drafts", "drafted", "accepted", "alpha", "len",
              *[f"pos {i + 1}" for i in range(width)]]
    rows = []
    for src in a.by_source:
        rates = [fmt(r, ".3f") for r in src.by_position[:width]]
        rows.append([src.source, str(src.records), str(src.drafts), str(src.drafted),
                     str(src.accepted), fmt(src.alpha, ".3f"),
                     fmt(src.mean_accepted_length, ".2f"),
                     *(rates + ["-"] * (width - len(rates)))])
    return header, rows


def cost_points(v: Verification) -> list[dict]:
    """The cost curve's points as the text and the plot show them, one per n: the probe's
    median (if a probe gave the curve), the requests' mean with its forwards and interval,
    both as × T_t(1) of their own source, and which one the cost model uses."""
    probe = {n: t for n, t in v.t_target_s_by_n.items() if v.source_by_n.get(n) == "probe"}
    p1 = probe.get(1)
    live1 = v.live_by_n.get(1, (None, 0))[0]
    out = []
    for n in sorted(set(probe) | set(v.live_by_n)):
        lt, count = v.live_by_n.get(n, (None, 0))
        out.append({
            "n": n, "probe_s": probe.get(n),
            "probe_ratio": probe[n] / p1 if n in probe and p1 else None,
            "live_s": lt, "forwards": count,
            "live_ratio": lt / live1 if lt is not None and live1 else None,
            "live_ci95": v.live_ratio_ci95.get(n),
            "thin": lt is not None and count < v.min_forwards,
            "used": v.source_by_n.get(n)})
    return out


def _cost_text(v: Verification) -> list[str]:
    pts = cost_points(v)
    if not pts:
        return []
    rows = [[str(p["n"]), _ms(p["probe_s"]), fmt(p["probe_ratio"], ".2f"), _ms(p["live_s"]),
             (f"{p['forwards']}" + ("*" if p["thin"] else "")) if p["live_s"] is not None
             else "-",
             fmt(p["live_ratio"], ".2f"),
             "-" if p["live_ci95"] is None else
             f"[{p['live_ci95'][0]:.2f}, {p['live_ci95'][1]:.2f}]",
             {"probe": "probe", "requests": "live"}.get(p["used"], "-")] for p in pts]
    out = ["T_t(n), each source as × its own T_t(1); the cost model uses one source:",
           table(["n", "probe ms", "× n=1", "live ms", "forwards", "× n=1",
                  "95 % interval", "cost model"], rows)]
    if any(p["thin"] for p in pts):
        out.append(f"* fewer than {v.min_forwards} forwards: shown, too few for the cost model"
                   " to use")
    return out


def _s_curve(curve: dict[int, float], per_row: int = 12) -> list[str]:
    ks = list(curve)
    return [table(["k", *map(str, ks[i:i + per_row])],
                  [["S(k)", *(f"{curve[k]:.2f}" for k in ks[i:i + per_row])]])
            for i in range(0, len(ks), per_row)]


def proposer_name(pr: Proposers, name: str) -> str:
    """What the report calls a proposer (or "hybrid", "plain")."""
    if name == "plain":
        return "neither (plain decoding)"
    if name == "hybrid":
        of = pr.lookups.get(pr.hybrid_of)
        return f"the hybrid ({of.title if of else 'prompt lookup'} where it has a draft, else " \
               "the draft model)"
    if name == pr.model:
        return "the draft model"
    est = pr.lookups.get(name)
    return est.title if est is not None else name


def proposers_headline(pr: Proposers) -> str:
    """Which proposer pays, and by how much, in one line."""
    head = f"{proposer_name(pr, pr.pays)} pays"
    if pr.margin is not None:
        head += f", {pr.margin:.2f}× the next best"
    return head


def lookup_lines(pr: Proposers) -> list[str]:
    """Per lookup with traces: where it had a draft, from how many requests' traces."""
    return [f"{est.title} had a draft at {est.match_rate:.0%} of generated positions "
            f"({est.trace_requests} greedy requests' traces)"
            for est in pr.lookups.values() if est.match_rate is not None]


def estimates(pr: Proposers) -> list[tuple[str, str, str]]:
    """(proposer, k, estimated speedup) per way of serving the workload (section 5)."""
    out = []
    if pr.draft is not None:
        out.append(("draft model", f"k = {pr.draft[0]}", _x(pr.draft[1])))
    for est in pr.lookups.values():
        if est.best is not None:
            out.append((f"{est.title} (plain where no draft; acceptance from its "
                        f"{est.source})", f"k ≤ {est.best[0]}", _x(est.best[1])))
    if pr.hybrid is not None and pr.hybrid[1] > 0:
        out.append(("hybrid", f"{proposer_name(pr, pr.hybrid_of)} k = {pr.hybrid[0]}, "
                    f"draft k = {pr.hybrid[1]}", _x(pr.hybrid[2])))
    return out


def proposers_text(pr: Proposers, a: Acceptance) -> list[str]:
    """Section 5: acceptance by position per proposer, and which one pays."""
    out = ["\n5. proposers: " + proposers_headline(pr)]
    out += [f"   {line}" for line in lookup_lines(pr)]
    est = [f"{who} {k}: {x}" for who, k, x in estimates(pr)]
    if est:
        out += _wrap("   estimated speedup vs plain decoding: " + "; ".join(est))
    out.append("   acceptance by draft position (conditional: given the ones before were "
               "accepted):")
    out.append(table(*proposer_rows(pr, a), left=1))
    return out


def why_text(w, category: str) -> list[str]:
    """Section 6: the choice the workload's kept decision records made most often, and one
    record's candidates with their expected seconds per token (``autospec explain``)."""
    from autospec.report.why import CANDIDATE_HEADER, candidate_rows, why_detail, why_headline

    out = ["", *_wrap("6. " + why_headline(w, clip(category, 40)))]
    for line in why_detail(w):
        out += _wrap("   " + line)
    rows = candidate_rows(w.example) if w.example is not None else []
    if rows:
        out += ["   " + line for line in table(CANDIDATE_HEADER, rows).splitlines()]
        out += _wrap("   (* chosen; times in ms; ms/tok = (block + E[N] · +/tok) / E[N], its "
                     "expected seconds per emitted token; `autospec explain --request ID` "
                     "shows every kept iteration)")
    return out


FORESIGHT_HEAD = ["policy", "requests", "share", "choices", "proposers it may use"]
FORESIGHT_NOTE = ("share = the least time any choice among those proposers could have taken, "
                  "knowing every outcome — each block stopped where acceptance ends, priced by "
                  "these requests' own forwards — ÷ the time the policy took; choices = that "
                  "least time ÷ the schedule the policy ran, priced the same way: what a better "
                  "choice could gain (the rest is the loop's time beyond its forwards' median "
                  "prices); medians per request, the latest greedy batch-1 requests")


def _choices(v: dict) -> str:
    """"; its choices N %" where the choices' share is known (section 7's headline)."""
    return f"; its choices {v['choices']:.0%}" if v.get("choices") is not None else ""


def foresight_rows(fs: dict) -> list[list[str]]:
    """Section 7's table, most requests first (text and HTML alike)."""
    return [[p, str(x["requests"]), f"{x['share']:.0%}",
             f"{x['choices']:.0%}" if x.get("choices") is not None else "-",
             ", ".join(x["proposers"])]
            for p, x in sorted(fs.items(), key=lambda kv: -kv[1]["requests"])]


def foresight_text(fs: dict, category: str) -> list[str]:
    """Section 7: each policy's distance from perfect foresight on this workload."""
    best = max(fs.items(), key=lambda kv: kv[1]["requests"])
    pol, v = best
    out = ["", *_wrap(f"7. foresight: {pol} reached {v['share']:.0%} of perfect foresight on "
                      f"{clip(category, 40)} ({v['requests']} requests){_choices(v)}")]
    out += ["   " + line for line in table(FORESIGHT_HEAD, foresight_rows(fs)).splitlines()]
    out += _wrap(f"   ({FORESIGHT_NOTE})")
    return out


def proposer_rows(pr: Proposers, a: Acceptance) -> tuple[list[str], list[list[str]]]:
    """(headers, rows): conditional acceptance by draft position per proposer — the draft
    model's live counters (or its traces' rate where it never drafted), each lookup's
    traces where it had a draft, and its live blocks if any ran."""
    width = min(8, max([len(a.conditional), 1, *(len(e.conditional) for e in
                                                  pr.lookups.values()),
                        *(len(e.live_by_position) for e in pr.lookups.values())]))

    def cells(values):
        return [fmt(values[i], ".2f") if i < len(values) else "-" for i in range(width)]

    rows = [["draft model (live)", *cells(a.conditional)]]
    if not any(v is not None for v in a.conditional) and pr.draft_trace_alpha is not None:
        rows = [["draft model (traces)", *cells([pr.draft_trace_alpha])]]
    for est in pr.lookups.values():
        if est.trace_requests:
            rows.append([f"{est.title} where it had a draft (traces)",
                         *cells(est.conditional)])
        if est.live_proposed:
            rows.append([f"{est.title} live ({est.live_proposed} proposed)",
                         *cells(est.live_by_position)])
    return ["proposer", *(str(i + 1) for i in range(width))], rows


def render_text(report: Report) -> str:
    """The report for a terminal: every line at most WIDTH characters, every stored string
    (category, model names, hardware, policies) with its control characters shown escaped."""
    lines = [f"autospec report — generated {report.generated_at.strftime('%Y-%m-%d %H:%M:%S')}"
             f" UTC", *_named("store", report.store, 0)]
    flt = ", ".join(f"{k} = {visible(repr(v))}" for k, v in report.filters.items()
                    if v is not None)
    if flt:
        lines.append(f"filters: {flt}")
    lines += [f"skipped: {visible(note)}" for note in report.skipped]
    if not report.workloads and report.skipped:
        lines.append("\nnothing to report: what the store holds was left out (skipped)")
    elif not report.workloads:
        lines.append("\nno traffic logged yet: no requests in the store"
                     + (" match these filters" if flt else ""))
    if not report.workloads:
        return "\n".join(_fit(lines)) + "\n"
    rows = [[str(i), clip(visible(w.category), 28), str(w.pair["id"]), served_by(w.path, short=True),
             str(w.traffic.requests), str(w.traffic.new_tokens), fmt(w.acceptance.alpha, ".3f"),
             "-" if w.policy.k_in_force is None else str(w.policy.k_in_force),
             _summary_speedup(w, short=True),
             _short_verdict(w)]
            for i, w in enumerate(report.workloads, 1)]
    lines += ["", table(["#", "category", "pair", "by", "requests", "tokens", "alpha", "k",
                         "speedup", "verdict"], rows, left=2)]
    pairs = {w.pair["id"]: w.pair for w in report.workloads}
    lines.append("\npairs:")
    for pid, p in pairs.items():
        lines += [f"  {pid}:", *_pair_lines(p, 4)]
    for i, w in enumerate(report.workloads, 1):
        lines += ["", "=" * 78, *_named(f"workload {i}:", w.category, 0),
                  f"pair {w.pair['id']}:", *_pair_lines(w.pair, 2),
                  f"served by {served_by(w.path)}", "=" * 78,
                  f"verdict: {w.verdict.text}"]
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
            lines.append("by draft position (accepted / drafted, rate with its 95 % Wilson "
                         "interval):")
            lines.append(table(["position", "accepted", "rate", "95 % interval",
                                "conditional", "evidence"], _position_rows(a)))
        if a.by_source:
            lines.append("by source (autospec's own requests; an engine's counters as `autospec "
                         "ingest` recorded them; records = requests or scrapes; pos i = "
                         "accepted / drafted at draft position i):")
            lines.append(table(*source_rows(a)))
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
        if v.cost_note:
            lines.append(f"costs: {v.cost_note}")
        lines.append(f"T_d = {_ms(v.t_draft_s)} ms, c = T_d / T_t(1) = "
                     f"{fmt(v.draft_ratio, '.2f')}; bandwidth "
                     f"{human_bytes(v.bandwidth_bytes_per_s, per_s=True)} of "
                     f"{human_bytes(v.bandwidth_peak_bytes_per_s, per_s=True)} peak"
                     + (f" ({v.bandwidth_utilisation:.0%})" if v.bandwidth_utilisation else "")
                     + (f"; NVML memory busy {v.nvml_mem_busy_pct:.0f} %"
                        if v.nvml_mem_busy_pct is not None else ""))
        lines += _cost_text(v)
        if v.probe:
            pr = v.probe
            lines.append(f"latest probe ({_when(pr['created_at'])}): "
                         f"{human_bytes(pr['achieved_bytes_per_s'], per_s=True)} of "
                         f"{human_bytes(pr['peak_bytes_per_s'], per_s=True)} peak"
                         + (f"; {visible(pr['verdict'])}" if pr["verdict"] else ""))
        lines.append("\npolicy in force: "
                     + (", ".join(f"{visible(name)} ({n})" for name, n in p.policies.items())
                        or "-")
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
            lines.append(f"tuned: {visible(tu.family)} {json.dumps(tu.params, sort_keys=True)} "
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
        lines += ["   " + s for s in _speed_line(sp, v.cost_note)]
        if sp.curve:
            lines += _s_curve(sp.curve)
        if w.batch is not None:
            mem, off = _batch_headline_parts(w.batch)
            lines.append("\n4. batch: " + mem + (f";\n   {off}" if off else ""))
            lines += _batch_text(w.batch)
        if w.proposers is not None:
            lines += proposers_text(w.proposers, w.acceptance)
        if w.why is not None:
            lines += why_text(w.why, w.category)
        if w.foresight:
            lines += foresight_text(w.foresight, w.category)
    lines += ["", "alpha = accepted / drafted; measured speedup = speculative ÷ plain tokens/s "
              "(Σ tokens / Σ wall s) of the same workload; estimated S(k) = "
              "E[N]·T_t(1) / (k·T_d + T_t(k+1)) from α by position and T_t(n) (requests, "
              "completed by `autospec probe`). At batch B: predicted speedup over plain "
              "batched decoding = E[N](k)·T_t(B,1) / (k·T_d(B) + T_t(B,k+1)), every row of "
              "the batch this workload (`autospec probe --batch` measures T_t(B, n), T_d(B))."]
    return "\n".join(_fit(lines)) + "\n"
