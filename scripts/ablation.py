"""Ablation by replay: each mechanism of ``auto`` switched off alone, over logged traffic.

The store's logged batch-1 requests of one pair (the newest, or ``--pair``), oldest first
(``--interleave``: each category's in order, the categories round-robin — mixed arrival),
replayed under ``auto`` and under ``auto`` with one mechanism off, each from cold — one
policy, one cost table and one set of category statistics carried from request to request,
as a serving controller carries them (so a category arriving among others starts from them)
— priced by the pair's costs as ``autospec tune`` builds them
(``autospec.tune.study.replay_costs``, over all the pair's traffic). Per request the time
ratio, mechanism off ÷ ``auto`` (above 1: the mechanism pays there); per category and overall
the median and a 95 % bootstrap interval over requests.

Replay prices every iteration by one cost table, so the busy-machine guard (which reads the
scatter and level of live timings) has nothing to act on here: its row says so rather than
measuring it; it is judged by runs under load (``scripts/busy_start.py``).

``--sensitivity``: each of the policy's parameters alone at a lower and a higher value than its
default (``SENSITIVITY``) in place of each mechanism off: docs/parameters.md's sensitivity.

Usage: python scripts/ablation.py sqlite:///bench.db [--json OUT] [--greedy-only] [--sensitivity]
(log the traffic first: ``autospec bench --modes plain --policies auto --db URL ...``)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict

from autospec.bench.stats import median_interval
from autospec.costs.measure import MEASURE
from autospec.policies import CostModelPolicy
from autospec.store import open_store, queries
from autospec.tune.replay import batch_size_of, simulate
from autospec.tune.study import replay_costs

# mechanism → the parameters that switch it off (and nothing else); "measure": the cost
# table's settings (autospec.costs.measure) instead of the policy's
MECHANISMS = {
    "stop rule (the draft's confidence ends its block)": {"stop_rule": False},
    "new category's start (pooled seed, exploration, forecast)": {"cold_start": 0.0},
    "optimism about unmeasured T_t(n)": {"optimistic": False},
    "suffix decoding's whole draft": {"suffix_whole": False},
    "the request's own rate (not only its category's)": {"request_prior_tokens": 1e12},
    "the request's own lookup blocks": {"request_prior_blocks": 1e12},
    "busy-machine guard (no load in replay)": {"measure": {"scatter": 1e9, "level_move": 1e9,
                                                           "shape_floor": 0.0}},
}

# --sensitivity: each parameter alone at a lower and a higher value than its default
SENSITIVITY = {
    "k_cap": (4, 8), "min_gain": (0.05, 0.1), "optimistic": (False,), "suffix_whole": (False,),
    "stop_rule": (False,), "initial_k": (1, 6), "acceptance_discount": (0.98, 0.999),
    "cold_start": (2.0, 32.0), "stored_weight": (50.0, 800.0),
    "request_prior_tokens": (4.0, 64.0), "request_prior_blocks": (1.0, 16.0),
}


def per_request_seconds(rows, costs, overrides: dict) -> list[float]:
    """Each request's replayed seconds, in the order given, under ``auto`` with
    ``overrides`` (its key "measure": the cost table's settings): one policy, one cost table
    and one set of category statistics carried from request to request (a category that
    arrives late starts from the others')."""
    overrides = dict(overrides)
    measure = MEASURE.but(**overrides.pop("measure", {}))
    policy = CostModelPolicy(name="auto", **overrides)
    lives: dict = {}
    table = costs.table(measure)
    out = []
    for row in rows:
        res = simulate([row], policy, costs, k_max=16, category=_category, live=lives,
                       table=table, batched=False)
        out.append(res.seconds)
    return out


def _category(row) -> str:
    return row.category or "default"


def interleaved(rows: list) -> list:
    """The same requests, each category's in its logged order, taken round-robin across the
    categories (mixed arrival: every category's first request early, among the others')."""
    by_cat: dict[str, list] = defaultdict(list)
    for r in rows:
        by_cat[_category(r)].append(r)
    queues = list(by_cat.values())
    out = []
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url")
    ap.add_argument("--pair", type=int, default=None, help="pair id (default: the newest)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--greedy-only", action="store_true", help="leave sampled requests out")
    ap.add_argument("--sensitivity", action="store_true",
                    help="each parameter alone at a lower and a higher value (SENSITIVITY) "
                         "instead of each mechanism off")
    ap.add_argument("--interleave", action="store_true",
                    help="replay the categories' requests round-robin (mixed arrival) instead "
                         "of in logged order")
    args = ap.parse_args(argv)
    store = open_store(args.url)
    with store.session() as s:
        pairs = {p.id: p for p in queries.pairs(s)}
        pid = args.pair if args.pair is not None else max(pairs, default=None)
        rows = [] if pid not in pairs else [
            r for r in queries.traces(s, pair_id=pid) if batch_size_of(r) == 1]
        if args.greedy_only:
            rows = [r for r in rows if r.trace_kind == "greedy"]
        if not rows:
            print("no batch-1 requests logged: run the bench with --db first", file=sys.stderr)
            return 1
        pair = pairs[pid]
        # the pair's costs over all its categories' traffic: one table, as a controller keeps
        got = replay_costs(s, pid, None, pair)
    if isinstance(got, str):
        print(got, file=sys.stderr)
        return 1
    costs = got[0]
    if args.interleave:
        rows = interleaved(rows)
    base = per_request_seconds(rows, costs, {})
    plain: dict[str, float] = defaultdict(float)
    spent: dict[str, float] = defaultdict(float)
    for r, b in zip(rows, base):
        plain[_category(r)] += simulate([r], CostModelPolicy(), costs,
                                        batched=False).plain_seconds
        spent[_category(r)] += b
    speedup = {c: plain[c] / spent[c] for c in plain if spent[c] > 0}
    table: dict[str, dict[str, list[float]]] = {}
    variants = MECHANISMS if not args.sensitivity else {
        f"{name} = {value!r}": {name: value}
        for name, values in SENSITIVITY.items() for value in values}
    for name, overrides in variants.items():
        off = per_request_seconds(rows, costs, overrides)
        per_cat = table.setdefault(name, {})
        for r, o, b in zip(rows, off, base):
            if b > 0:
                per_cat.setdefault(_category(r), []).append(o / b)
    cats = sorted(speedup)
    print(f"{len(rows)} requests, {len(cats)} categories; replayed auto over plain: "
          + ", ".join(f"{c} {speedup[c]:.2f}x" for c in cats))
    what = "parameter at" if args.sensitivity else "mechanism off"
    print(f"time with the {what} ÷ auto's, per request: median [95 % interval] "
          "(above 1: the default pays)")
    head = f"{what:52}" + "".join(f"{c:>22}" for c in [*cats, "all"])
    print(head)
    out = {"requests": len(rows), "speedup_over_plain": speedup, "mechanisms": {}}
    for name, per_cat in table.items():
        cells, every = [], []
        out["mechanisms"][name] = {}
        for c in cats:
            x = per_cat.get(c, [])
            every += x
            if x:
                lo, hi = median_interval(x)
                med = statistics.median(x)
                cells.append(f"{med:.3f} [{lo:.2f}-{hi:.2f}]")
                out["mechanisms"][name][c] = {"median": med, "interval": [lo, hi], "n": len(x)}
            else:
                cells.append("-")
        lo, hi = median_interval(every)
        med = statistics.median(every)
        out["mechanisms"][name]["all"] = {"median": med, "interval": [lo, hi], "n": len(every)}
        cells.append(f"{med:.3f} [{lo:.2f}-{hi:.2f}]")
        print(f"{name[:52]:52}" + "".join(f"{c:>22}" for c in cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
