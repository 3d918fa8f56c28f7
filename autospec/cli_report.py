"""`autospec stats` and `autospec probe`: what the store knows, and what this machine costs.

``stats`` reads only the store (no torch import), so it runs beside a serving process.
"""

from __future__ import annotations

import json
import sys

from autospec.cliargs import die
from autospec.textfmt import fmt, human_bytes, table

__all__ = ["add_commands", "estimate_speedup", "batch_summary"]


def add_commands(sub, common, models) -> None:
    stats = sub.add_parser(
        "stats", help="per category and model pair: acceptance, timings, bandwidth",
        description="Reads the store's running statistics (safe while servers keep writing).")
    stats.add_argument("--db", metavar="URL", help="store URL or SQLite file (default: "
                                                    "autospec.db in the cache directory)")
    stats.add_argument("--category", help="only this category")
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")
    stats.set_defaults(run=_cmd_stats, parser=stats)

    probe = sub.add_parser(
        "probe", parents=[models, common],
        help="measure T_t(B, n) for n = 1..16 (at batch sizes B), T_d(B) and memory "
             "bandwidth on this machine",
        description="Times the target scoring n tokens per row on a cached context at each "
                    "batch size B, the draft's step, and the achieved memory bandwidth "
                    "against the device's peak: whether verification is memory- or "
                    "compute-bound here, and up to which batch size.")
    probe.add_argument("--context", type=int, default=200, help="cached tokens (default 200)")
    probe.add_argument("--max-n", type=int, default=16, help="largest n (default 16)")
    probe.add_argument("--repeats", type=int, default=5, help="timings per point (median)")
    probe.add_argument("--batch", type=_batch_sizes, default=(1,), metavar="B,B,...",
                       help="batch sizes to measure, e.g. 1,2,4,8,16,32 (default 1); larger "
                            "ones are skipped once one runs out of memory")
    probe.add_argument("--max-seconds", type=float, default=None, metavar="S",
                       help="time budget: no further batch size is started once it would "
                            "overrun this (default: none)")
    probe.add_argument("--db", metavar="URL", help="store to record the probe in")
    probe.add_argument("--no-store", action="store_true", help="do not record the probe")
    probe.add_argument("--json", action="store_true", help="print JSON instead of a table")
    probe.set_defaults(run=_cmd_probe, parser=probe)


# -- stats ------------------------------------------------------------------------------------

def estimate_speedup(summary, probe_payload: dict | None):
    """S(k) of the most used k>0 from the measured acceptance and costs (cost model), with
    T_t(n) and T_d taken as the report takes them (``autospec.report.cost_inputs``: the
    pair's latest probe, else well-measured live points). (k, S) or None."""
    from autospec.policies.costmodel import conditional_from_cumulative, speedup
    from autospec.report import cost_inputs

    curve, _, t_draft = cost_inputs(summary, probe_payload)
    ks = {k: c for k, c in summary.k_counts.items() if k > 0}
    if not ks or 1 not in curve or not t_draft or summary.alpha is None:
        return None
    k = max(ks, key=ks.get)
    alphas = conditional_from_cumulative(list(summary.acceptance_by_position))
    return k, speedup(k, alphas, t_draft, curve)


def batch_summary(summary, grid, tuned=None) -> dict:
    """The batch dimension of one (category, pair) as ``autospec report`` computes it
    (``autospec.report.batch_view``) from the pair's cost grid ``(target, draft, source)``
    (``queries.batch_costs``): where verification stops being memory-bound, the cost
    model's k and predicted speedup over plain batched decoding per batch size, and from
    which batch size it switches speculation off. JSON-ready."""
    from autospec.policies.costmodel import conditional_from_cumulative
    from autospec.report import K_MAX, _tuning, batch_view

    alphas = conditional_from_cumulative(list(summary.acceptance_by_position))
    target, draft, source = grid
    b = batch_view(alphas, target, draft, source, k_max=max([K_MAX, *summary.k_counts]),
                   tuned=_tuning(tuned))
    return {"source": b.source, "memory_bound_up_to": b.memory_bound_up_to,
            "crossover": b.crossover, "tuned_table": b.tuned,
            "k_by_batch": {str(p.batch): p.k for p in b.points},
            "speedup_by_batch": {str(p.batch): p.speedup for p in b.points},
            "note": b.note}


def _cmd_stats(args, parser) -> int:
    from autospec.report import batch_grid
    from autospec.store import StoreError, open_store, queries

    try:
        store = open_store(args.db)
    except StoreError as e:
        die(str(e))
    with store, store.session() as s:
        summaries = queries.category_summaries(s, category=args.category)
        probes = {(sm.pair.id, sm.path): queries.latest_probe(s, sm.pair.id, sm.path)
                  for sm in summaries}  # the probe of the path the summary's costs are on
        grids = {pid: batch_grid(s, pid) for pid, _ in probes}
        tuned = {(t.category, t.pair_id): t
                 for t in queries.tuned_params(s, category=args.category)}
    out = []
    for sm in summaries:
        p = probes.get((sm.pair.id, sm.path))
        est = estimate_speedup(sm, p.payload if p else None)
        d = sm.to_dict()
        d["speedup_estimate"] = None if est is None else {"k": est[0], "speedup": est[1]}
        d["batch"] = batch_summary(sm, grids[sm.pair.id], tuned.get((sm.category, sm.pair.id)))
        out.append(d)
    if args.json:
        json.dump(out, sys.stdout, indent=2, default=str)
        print()
        return 0
    if not summaries:
        print(f"no requests logged in {store.url} yet")
        return 0
    rows = []
    for sm, d in zip(summaries, out):
        ci = sm.alpha_ci95
        per_pos = " ".join(fmt(a, ".2f") for a in sm.acceptance_by_position[:6])
        k_used = max((k for k in sm.k_counts), key=lambda k: sm.k_counts[k], default=None)
        t_k1 = sm.t_target_s_by_n.get(k_used + 1) if k_used is not None else None
        est = d["speedup_estimate"]
        rows.append([
            sm.category[:40], f"{_short(sm.pair.target)} <- {_short(sm.pair.draft)}",
            str(sm.requests), str(sm.new_tokens),
            fmt(sm.alpha, ".3f") + (f" [{ci[0]:.2f},{ci[1]:.2f}]" if ci else ""),
            per_pos or "-", fmt(sm.mean_accepted_length, ".2f"),
            "-" if k_used is None else str(k_used),
            fmt(_ms(sm.t_target_s_by_n.get(1)), ".0f"), fmt(_ms(t_k1), ".0f"),
            fmt(_ms(sm.t_draft_s), ".0f"),
            human_bytes(sm.bandwidth_bytes_per_s, per_s=True)
            + (f" ({sm.bandwidth_utilisation:.0%})" if sm.bandwidth_utilisation else ""),
            "-" if est is None else f"{est['speedup']:.2f}x @k={est['k']}",
            _batch_cell(d["batch"]), _off_cell(d["batch"]),
        ])
    print(table(["category", "pair", "requests", "tokens", "alpha [95% CI]", "alpha by position",
                 "mean len", "k", "Tt(1) ms", "Tt(k+1) ms", "Td ms", "bandwidth (of peak)",
                 "S(k) est.", "mem-bound to B", "k by B (off from)"], rows, left=2))
    print(f"\nstore {store.url}. alpha = accepted / drafted (Wilson interval); mean len counts "
          "the bonus token; k = most used; S(k) = cost-model speedup incl. the draft's cost "
          "(T_t(1) from a probe when requests never ran k = 0: run `autospec probe`); "
          "mem-bound to B = largest batch size with T_t(B, 4) / T_t(B, 1) <= 1.25; "
          "k by B = the cost model's k at each probed batch size for the category's acceptance "
          "(off from: the batch size from which it decodes plainly)")
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


def _short(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1][:36]


def _ms(s):
    return None if s is None else s * 1e3


# -- probe ------------------------------------------------------------------------------------

def _batch_sizes(text: str) -> tuple[int, ...]:
    import argparse

    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected batch sizes like 1,2,4,8, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive, got {text!r}")
    return tuple(sorted(set(sizes)))


def _cmd_probe(args, parser) -> int:
    from tqdm import tqdm

    from autospec.cli import _load, _setup
    from autospec.probe import probe
    from autospec.store import StoreError, add_probe, open_store
    from autospec.telemetry import RequestTelemetry

    env = _setup(args)
    if args.context < 1 or not 1 <= args.max_n <= 64:
        parser.error("--context must be >= 1 and --max-n in 1..64")
    store = None
    if not args.no_store:
        try:
            store = open_store(args.db)
        except StoreError as e:
            die(str(e))
    target, draft, _, _ = _load(args, parser, env)
    def progress(i: int, n: int) -> None:
        bar.total = n
        bar.update(i - bar.n)

    with tqdm(desc="probe", unit="timing", file=sys.stderr) as bar:
        res = probe(target, draft, context=args.context, max_n=args.max_n,
                    repeats=args.repeats, progress=progress, batches=args.batch,
                    max_seconds=args.max_seconds)
    if store is not None:
        pair = RequestTelemetry(target, draft, measure_peak=False).pair
        with store, store.begin() as s:
            add_probe(s, pair, res.to_dict())
    if args.json:
        json.dump(res.to_dict(), sys.stdout, indent=2)
        print()
        return 0
    t1 = res.target_s_by_n[1]
    rows = [[str(n), f"{t * 1e3:.1f}", f"{t / t1:.2f}", "#" * round(20 * t / t1 / 4)]
            for n, t in res.target_s_by_n.items()]
    print(table(["n scored", "T_t(n) ms", "vs n=1", ""], rows))
    print(f"\nT_d (draft, 1 token): {fmt(_ms(res.draft_s), '.1f')} ms"
          f"   c = T_d / T_t(1) = {fmt(res.draft_ratio, '.2f')}")
    print(f"bandwidth of the target's 1-token step: {human_bytes(res.achieved_bytes_per_s, True)}"
          f" of {human_bytes(res.peak_bytes_per_s, True)} peak"
          + (f" ({res.utilisation:.0%})" if res.utilisation else "")
          + f"  [weights {human_bytes(res.target_param_bytes)}, KV {human_bytes(res.kv_bytes)}]")
    print(f"{res.hardware}, {res.dtype}, context {res.context} tokens, {res.threads} threads, "
          f"median of {args.repeats}, {res.path} path (the loop's step: forward, logits "
          "processing, verification)")
    print(f"verdict: {res.verdict()}")
    if len(res.grid) > 1 or res.grid_note:
        _print_grid(res)
    return 0


def _print_grid(res) -> None:
    """T_t(B, n) / T_t(B, 1) per batch size: where it stays near 1, verifying n tokens per row
    costs what decoding one does."""
    from autospec.probe import MEMORY_BOUND_RATIO, SPARSE_N

    # the n every batch size measures (the loop's k + 1, and 12, 16); --json has them all
    ns = sorted({n for row in res.grid.values() for n in row if n > 1} & set(SPARSE_N))
    rows = []
    for b, row in sorted(res.grid.items()):
        ratios = res.batch_ratios(b)
        t_d = res.draft_grid.get(b)
        rows.append([str(b), f"{row[1] * 1e3:.1f}",
                     *(fmt(ratios.get(n), ".2f") for n in ns),
                     fmt(_ms(t_d), ".1f"), fmt(t_d / row[1] if t_d else None, ".2f")])
    print("\ncost of scoring n tokens per row at batch size B, relative to one "
          "(T_t(B, n) / T_t(B, 1)):")
    print(table(["B", "T_t(B,1) ms", *(f"n={n}" for n in ns), "T_d(B) ms", "c(B)"], rows))
    bound = res.memory_bound_batch()
    print("verification of 4 tokens per row stays within "
          f"{MEMORY_BOUND_RATIO:g}x of one token "
          + (f"up to B = {bound}" if bound is not None else "at no batch size measured")
          + "; c(B) = T_d(B) / T_t(B, 1)")
    if res.grid_note:
        print(f"note: {res.grid_note}")
