"""``autospec stats``: what the store knows, per category and model pair.

Reads only the store (no torch import), so it runs beside a serving process.
"""

from __future__ import annotations

import json
import sys

from autospec.cli.common import open_store_or_die, skipped_said
from autospec.textfmt import clip, fmt, human_bytes, table


def register(sub, parents) -> None:
    stats = sub.add_parser(
        "stats", help="per category and model pair: acceptance, timings, bandwidth",
        description="Reads the store's running statistics (safe while servers keep writing).")
    stats.add_argument("--db", metavar="URL", help="store URL or SQLite file (default: "
                                                    "autospec.db in the cache directory)")
    stats.add_argument("--category", help="only this category")
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")
    stats.set_defaults(run=run, parser=stats)


def run(args, parser) -> int:
    with skipped_said() as skipped:
        return _run(args, skipped)


def _run(args, skipped: list[str]) -> int:
    from autospec.costs.stored import stored_costs
    from autospec.report import batch_summary, estimate_speedup
    from autospec.report.build import fixed_block
    from autospec.store import history, queries

    store = open_store_or_die(args.db, read_only=True)
    with store, store.session() as s:
        summaries = queries.category_summaries(s, category=args.category)
        # batch 1 on the path the summary's costs are on; the pair's grid, once
        costs = {(sm.category, sm.pair.id): stored_costs(s, sm.pair.id, sm.category, summary=sm,
                                                         parts={"batch1"})
                 for sm in summaries}
        grids = {pid: stored_costs(s, pid, parts={"grid"}) for pid in {p for _, p in costs}}
        tuned = {(t.category, t.pair_id): t
                 for t in queries.tuned_params(s, category=args.category)}
        # the k a workload runs is batch 1's (at batch > 1 the batch's mix sets it: third
        # table); the summary's all-time k counts include every batch size's iterations
        k_at_1 = {(sm.category, sm.pair.id): history.recent_activity(
            s, sm.category, sm.pair.id, batch_size=1).k_mode for sm in summaries}
        fixed = {(sm.category, sm.pair.id): fixed_block(s, sm.category, sm.pair.id)
                 for sm in summaries}
    out = []
    for sm in summaries:
        est = estimate_speedup(sm, costs[sm.category, sm.pair.id])
        d = sm.to_dict()
        d["speedup_estimate"] = None if est is None else {"k": est[0], "speedup": est[1]}
        g = grids[sm.pair.id]
        d["batch"] = batch_summary(sm, (g.grid, g.draft_grid, g.grid_source),
                                   tuned.get((sm.category, sm.pair.id)),
                                   fixed[sm.category, sm.pair.id])
        d["k_batch_1"] = k_at_1.get((sm.category, sm.pair.id))
        out.append(d)
    if args.json:
        json.dump(out, sys.stdout, indent=2, default=str)
        print()
        return 0
    if not summaries:
        print(f"no statistics to show in {store.url}: what it holds was left out (skipped)"
              if skipped else f"no requests logged in {store.url} yet")
        return 0
    acc, costs, batch, pairs = [], [], [], {}
    for sm, d in zip(summaries, out):
        ci = sm.alpha_ci95
        per_pos = " ".join(_rate(a) for a in sm.acceptance_by_position[:4])
        k_used = k_at_1.get((sm.category, sm.pair.id))
        t_k1 = sm.t_target_s_by_n.get(k_used + 1) if k_used is not None else None
        est = d["speedup_estimate"]
        pairs[sm.pair.id] = sm.pair
        cat, pid = clip(sm.category, 21), str(sm.pair.id)
        acc.append([cat, pid, str(sm.requests), str(sm.new_tokens),
                    fmt(sm.alpha, ".3f") + (f" [{ci[0]:.2f},{ci[1]:.2f}]" if ci else ""),
                    per_pos or "-", _lookups_cell(sm),
                    fmt(sm.mean_accepted_length, ".2f"), "-" if k_used is None else str(k_used)])
        costs.append([cat, pid, sm.path or "unknown", fmt(_ms(sm.t_target_s_by_n.get(1)), ".0f"),
                      fmt(_ms(t_k1), ".0f"), fmt(_ms(sm.t_draft_s), ".0f"),
                      human_bytes(sm.bandwidth_bytes_per_s, per_s=True)
                      + (f" ({sm.bandwidth_utilisation:.0%})" if sm.bandwidth_utilisation
                         else ""),
                      "-" if est is None else f"{est['speedup']:.2f}x @k={est['k']}"])
        batch.append([cat, pid, _batch_cell(d["batch"]), _off_cell(d["batch"])])
    print(table(["category", "pair", "reqs", "tokens", "alpha [95% CI]", "by position",
                 "lookups a", "len", "k"], acc, left=2))
    print()
    print(table(["category", "pair", "path", "Tt(1) ms", "Tt(k+1) ms", "Td ms",
                 "bandwidth (of peak)", "S(k) est."], costs, left=3))
    print()
    print(table(["category", "pair", "mem-bound to B", "k by B (off from)"], batch, left=2))
    print()
    for pid, pair in pairs.items():  # full names once, not in every row
        print(f"pair {pid}:\n  target {pair.target}\n  draft  {pair.draft}\n"
              f"  on     {pair.dtype}, {pair.hardware}")
    print(_wrap(
        f"store {store.url}. alpha = accepted / drafted (Wilson interval); by position: alpha "
        "at the first four draft positions; lookups a = each lookup proposer's accepted / "
        "drafted (ngram: prompt lookup, suffix: suffix decoding), its blocks counted apart "
        "from the draft model's (- if none drafted); len = mean accepted length, counting "
        "the bonus token; k = the k run "
        "most often by the latest 200 requests at batch 1 (- if none ran at batch 1); "
        "costs are the path's (execution path the requests ran on); S(k) = cost-model speedup "
        "incl. the draft's cost (T_t(1) from a probe when requests never ran k = 0: run "
        "`autospec probe`); mem-bound to B = largest batch size with T_t(B, 4) / T_t(B, 1) "
        "<= 1.25; k by B = the cost model's k at each probed batch size for the category's "
        "acceptance (off from: the batch size from which it decodes plainly)"))
    if any(not d["batch"]["k_by_batch"] for d in out):
        from autospec.report import PROBE_BATCH_HINT
        print(f"no batch cost grid for some pairs: run `{PROBE_BATCH_HINT}`")
    return 0


def _batch_cell(b: dict) -> str:
    if not b["k_by_batch"]:
        return "-"
    return "none" if b["memory_bound_up_to"] is None else str(b["memory_bound_up_to"])


def _off_cell(b: dict) -> str:
    if not b["k_by_batch"]:
        return "-"
    ks = " ".join(f"{bs}:{'-' if k is None else k}" for bs, k in b["k_by_batch"].items())
    return ks + (f" (off from {b['crossover']})" if b["crossover"] is not None else "")


def _lookups_cell(sm) -> str:
    """Each lookup proposer's acceptance that drafted, by name ("ngram 0.41 suffix 0.62")."""
    cells = [f"{name} {p.alpha:.2f}" for name, p in sorted(sm.proposers.items())
             if p.kind == "lookup" and p.alpha is not None]
    return " ".join(cells) or "-"


def _rate(a: float | None) -> str:
    """A rate in [0, 1] in four columns at most: ".85", "1.00", "-"."""
    text = fmt(a, ".2f")
    return text[1:] if text.startswith("0.") else text


def _wrap(text: str, width: int = 100) -> str:
    import textwrap

    return textwrap.fill(text, width, break_on_hyphens=False, break_long_words=False)


def _ms(s):
    return None if s is None else s * 1e3
