"""`autospec tune`: Optuna studies over policy parameters, replayed on logged traffic."""

from __future__ import annotations

import json
import sys

from autospec.cli.common import (
    K_LIMIT,
    die,
    k_max_value,
    open_store_or_die,
    parse_when,
    row_id,
    seconds,
    skipped_said,
)
from autospec.cli.common import fraction as _fraction
from autospec.cli.common import positive_int as _positive_int
from autospec.textfmt import fmt, table

__all__ = ["register", "run"]


def register(sub, parents) -> None:
    p = sub.add_parser(
        "tune",
        help="tune the policy per category on logged traffic (Optuna, simulated replay)",
        description="Per category and model pair: an Optuna study over policy families and "
                    "their parameters, scored by the throughput the simulator replays from "
                    "the stored acceptance traces and measured costs. The study lives in the "
                    "store's database, so several workers (--workers, or several processes "
                    "with one --study on one URL) share it. The best parameters go to the "
                    "store, where the live 'tuned' policy picks them up. Traces logged at "
                    "batch B > 1 replay in batches of B with the measured T_t(B, n); there "
                    "the 'table' family (k per batch-size bucket 1, 2-3, 4-7, 8-15, 16+) is "
                    "searched too.")
    p.add_argument("--db", metavar="URL", help="store URL or SQLite file (default: "
                                                "autospec.db in the cache directory)")
    p.add_argument("--category", help="only this category (default: every category)")
    p.add_argument("--pair-id", type=row_id, help="only this model pair (see `autospec stats`)")
    p.add_argument("--trials", type=_positive_int, default=100, help="trials per study, all workers "
                                                           "together (default 100)")
    p.add_argument("--timeout", type=seconds, help="seconds per study and worker (> 0)")
    p.add_argument("--workers", type=_positive_int, default=1, help="worker processes (default 1)")
    p.add_argument("--study", help="join or create this study (needs --category); a "
                                   "joining process replays the study's pinned window")
    p.add_argument("--since", type=parse_when, metavar="WHEN",
                   help="traffic from (ISO date/time, UTC unless it says, or Unix time)")
    p.add_argument("--until", type=parse_when, metavar="WHEN", help="traffic before")
    p.add_argument("--max-traces", type=_positive_int, default=1000,
                   help="newest traces per category in the window (default 1000)")
    p.add_argument("--holdout", type=_fraction, default=0.25,
                   help="newest fraction held back for evaluation (default 0.25)")
    p.add_argument("--min-traces", type=_positive_int, default=20,
                   help="refuse categories with fewer traces to tune on (default 20)")
    p.add_argument("--min-positions", type=_positive_int, default=200,
                   help="… or fewer observed positions (default 200)")
    p.add_argument("--families", default="costmodel,bandit,fixed,table",
                   help="policy families to search (default costmodel,bandit,fixed,table; "
                        "table only where the costs have batch sizes > 1)")
    p.add_argument("--costs", choices=("auto", "probe", "live"), default="auto",
                   help="T_d and T_t(n) (and T_t(B, n), T_d(B) at batch > 1) from the latest "
                        "`autospec probe` or from live traffic (default auto: the probe if one "
                        "is stored)")
    p.add_argument("--k-max", type=k_max_value, default=16,
                   help=f"largest k searched, 1..{K_LIMIT} (default 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="do not write the results")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("-v", "--verbose", action="store_true", help="INFO logging")
    p.set_defaults(run=run, parser=p)


def run(args, parser) -> int:
    import logging

    from tqdm import tqdm

    from autospec.tune.study import TuneError, tune

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    store = open_store_or_die(args.db)
    bars: dict[str, tqdm] = {}

    def progress(category: str, done: int, total: int) -> None:
        bar = bars.get(category)
        if bar is None:
            bar = bars[category] = tqdm(total=total, desc=f"tune {category[:30]}",
                                        unit="trial", file=sys.stderr, leave=True)
        bar.update(min(done, total) - bar.n)

    families = [f.strip() for f in args.families.split(",") if f.strip()]
    try:
        with store, skipped_said():
            results = tune(store, category=args.category, pair_id=args.pair_id,
                           trials=args.trials, timeout=args.timeout, workers=args.workers,
                           min_traces=args.min_traces, min_positions=args.min_positions,
                           holdout=args.holdout, max_traces=args.max_traces,
                           since=args.since, until=args.until, study=args.study,
                           families=families, k_max=args.k_max, seed=args.seed,
                           progress=progress, write=not args.dry_run, costs_from=args.costs)
    except TuneError as e:
        die(str(e))
    finally:
        for bar in bars.values():
            bar.close()
    if args.json:
        json.dump([r.to_dict() for r in results], sys.stdout, indent=2, default=str)
        print()
        return 0
    rows, notes = [], []
    for r in results:
        if r.status != "tuned":
            rows.append([r.category[:30], str(r.pair_id), str(r.traces), "skipped", "-", "-",
                         "-", "-"])
            notes.append(f"{r.category[:30]}: skipped, {r.reason}")
            continue
        params = ", ".join(f"{k}={_short(v)}" for k, v in (r.params or {}).items())
        gain = _ratio(r.holdout_tokens_per_s, r.baseline_holdout_tokens_per_s)
        rows.append([
            r.category[:30], str(r.pair_id), f"{r.traces - r.holdout_traces}+{r.holdout_traces}",
            f"{r.family} (trial {r.best_trial} of {r.trials})",
            f"{fmt(r.train_tokens_per_s, '.2f')} vs {fmt(r.baseline_train_tokens_per_s, '.2f')}",
            f"{fmt(r.holdout_tokens_per_s, '.2f')} vs {fmt(r.baseline_holdout_tokens_per_s, '.2f')}",
            fmt(gain, ".3f") + "x" if gain else "-",
            f"{fmt(r.plain_holdout_tokens_per_s, '.2f')}"])
        notes.append(f"{r.category[:30]}: {r.family} {params}  (study {r.study})"
                     + (f"\n  proposer: {r.proposer} (searched: "
                        f"{', '.join(r.proposers_searched)}; share of drafted tokens in the "
                        f"replay: {_shares(r.shares)})"
                        if len(r.proposers_searched) > 1 else "")
                     + (f"\n  k by batch size: {_k_by_batch(r.k_by_batch)}"
                        if r.k_by_batch and max(r.k_by_batch) > 1 else "")
                     + (f"\n  {r.note}" if r.note else "")
                     + ("" if r.early_stop_searched else
                        "\n  early-stop threshold not searched: these traces carry no draft "
                        "confidence (logged before store schema 0003)"))
    print(table(["category", "pair", "traces (tune+held)", "best", "tok/s tuned vs auto",
                 "held-back tuned vs auto", "held-back gain", "plain tok/s"], rows, left=3))
    print("\n" + "\n".join(notes))
    tuned = [r for r in results if r.status == "tuned"]
    where = "not written (--dry-run)" if args.dry_run else f"written to {store.url}"
    print(f"\n{len(tuned)} of {len(results)} workloads tuned, {where}. Throughput is "
          "simulated: the stored acceptance traces replayed under each policy with the "
          "measured costs (T_d, T_t(n); at the logged batch sizes B, T_d(B) and T_t(B, n) "
          "against plain batched decoding); 'auto' is the untuned default policy.")
    return 0


def _k_by_batch(k_by_bucket: dict) -> str:
    """"1:4, 4-7:2, 16+:0" from {bucket: k} (buckets named by their smallest batch size)."""
    names = {1: "1", 2: "2-3", 4: "4-7", 8: "8-15", 16: "16-31", 32: "32+"}
    return ", ".join(f"{names.get(int(b), b)}:{k}" for b, k in sorted(
        (int(b), k) for b, k in k_by_bucket.items()))


def _short(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _ratio(a, b):
    return a / b if a and b else None


def _shares(shares: dict) -> str:
    """Each proposer's share of the tokens drafted, "name 40%" joined."""
    return ", ".join(f"{name} {fmt(share, '.0%')}" for name, share in shares.items()) or "-"
