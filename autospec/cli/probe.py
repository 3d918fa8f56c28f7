"""``autospec probe``: what verification and drafting cost on this machine, per batch size."""

from __future__ import annotations

import argparse
import json
import sys

from autospec.cli.common import (
    batch_sizes,
    load,
    open_store_or_die,
    positive_int,
    seconds,
    setup,
)
from autospec.textfmt import fmt, human_bytes, table

DEFAULT_CONTEXT = 200  # cached tokens per row when neither a number nor logged traffic says


def register(sub, parents) -> None:
    probe = sub.add_parser(
        "probe", parents=[parents.models, parents.common],
        help="measure T_t(B, n) for n = 1..16 (at batch sizes B), T_d(B) and memory "
             "bandwidth on this machine",
        description="Times the target scoring n tokens per row on a cached context at each "
                    "batch size B, the draft's step, and the achieved memory bandwidth "
                    "against the device's peak: whether verification is memory- or "
                    "compute-bound here, and up to which batch size.")
    probe.add_argument("--context", type=_context, default="traffic", metavar="N|traffic",
                       help="cached tokens per row. Default 'traffic': the median context of "
                            "the pair's logged requests (prompt + half the new tokens), so "
                            "that the grid is timed where the traffic runs (attention at "
                            f"batch > 1 grows with it); {DEFAULT_CONTEXT} without logged "
                            "requests")
    probe.add_argument("--max-n", type=int, default=16, help="largest n (default 16)")
    probe.add_argument("--repeats", type=positive_int, default=5, help="timings per point (median)")
    probe.add_argument("--batch", type=batch_sizes, default=(1,), metavar="B,B,...",
                       help="batch sizes to measure, e.g. 1,2,4,8,16,32 (default 1); larger "
                            "ones are skipped once one runs out of memory")
    probe.add_argument("--max-seconds", type=seconds, default=None, metavar="S",
                       help="time budget: no further batch size is started once it would "
                            "overrun this (default: none)")
    probe.add_argument("--db", metavar="URL", help="store to record the probe in")
    probe.add_argument("--no-store", action="store_true", help="do not record the probe")
    probe.add_argument("--json", action="store_true", help="print JSON instead of a table")
    probe.set_defaults(run=run, parser=probe)


def run(args, parser) -> int:
    from tqdm import tqdm

    from autospec.probe import probe
    from autospec.store import add_probe
    from autospec.telemetry import RequestTelemetry

    env = setup(args)
    if not 1 <= args.max_n <= 64:
        parser.error("--max-n must be in 1..64")
    store = None
    if not args.no_store:
        store = open_store_or_die(args.db)
    target, draft, _, _ = load(args, parser, env)
    pair = RequestTelemetry(target, draft, measure_peak=False).pair
    context, context_from = _resolve_context(args.context, store, pair)
    def progress(i: int, n: int) -> None:
        bar.total = n
        bar.update(i - bar.n)

    with tqdm(desc="probe", unit="timing", file=sys.stderr) as bar:
        res = probe(target, draft, context=context, max_n=args.max_n,
                    repeats=args.repeats, progress=progress, batches=args.batch,
                    max_seconds=args.max_seconds)
    if store is not None:
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
    line = res.catch_up_line
    if line is not None:  # what resuming the draft model costs: its forward over g tokens
        sizes = ", ".join(f"{g}: {c * 1e3:.0f}" for g, c in res.draft_catch_up)
        print(f"draft catch-up over g unseen tokens: C(g) = {line[0] * 1e3:.1f} ms + "
              f"{line[1] * 1e3:.2f} ms × g   (g: ms  {sizes})")
    print(f"bandwidth of the target's 1-token step: {human_bytes(res.achieved_bytes_per_s, True)}"
          f" of {human_bytes(res.peak_bytes_per_s, True)} peak"
          + (f" ({res.utilisation:.0%})" if res.utilisation else "")
          + f"  [weights {human_bytes(res.target_param_bytes)}, KV {human_bytes(res.kv_bytes)}]")
    print(f"{res.hardware}, {res.dtype}, context {res.context} tokens ({context_from}), "
          f"{res.threads} threads, "
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


def _context(text: str):
    """--context: a positive number of tokens, or 'traffic'."""
    if text.strip().lower() == "traffic":
        return "traffic"
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"expected a number of tokens >= 1 or 'traffic', got {text!r}")
    return value


def _resolve_context(context, store, pair) -> tuple[int, str]:
    """(tokens, where the number came from): a number as given, else the traffic's median
    context in the store (``queries.traffic_context``), else DEFAULT_CONTEXT."""
    if context != "traffic":
        return context, "as given"
    if store is not None:
        from autospec.store import queries

        with store.session() as s:
            pid = queries.pair_id(s, pair)
            found = queries.traffic_context(s, pid) if pid is not None else None
        if found is not None:
            return found, "the median context of this pair's logged requests"
    return DEFAULT_CONTEXT, "no logged requests for this pair: the default"


def _ms(s):
    return None if s is None else s * 1e3
