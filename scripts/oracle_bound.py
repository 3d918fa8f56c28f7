"""How much any per-iteration choice of proposer could have gained, from a bench's store.

``autospec bench --modes plain --policies auto+suffix,auto:draft,auto:ngram --db URL`` logs
every request three times (greedy, one output): the ``auto:draft`` run's acceptance trace says
at every position whether the draft model, continuing from the target's prefix, would have
produced that token; the ``auto+suffix`` run's suffix trace what suffix decoding's draft held
there and how far it agreed; the n-gram trace the same for prompt lookup. With those, a
dynamic programme over positions finds, per request, the least time any schedule could take
that chooses at each iteration plain decoding, a draft-model block of any k, or a lookup
block — knowing every outcome in advance (an *oracle*: it stops each block exactly where
acceptance ends), priced by the run's own forwards (median T_t(n) over the store's requests,
T_d = draft seconds / draft forwards; catch-ups not charged, lookups at 0.5 ms). With
``hybrid`` it may also continue a lookup's draft with the draft model (the draft takes the
suffix tokens in at its first forward).

It prints per category the speedup over plain decoding (modelled: (N − 1) · T_t(1) after the
same prefill) of what ran, and of the oracle over each proposer set; the ``auto:draft`` run's
wall time over each oracle's (no per-iteration choice among those proposers can beat the
draft-only run by more than that, whatever its policy); and the oracle over every proposer
against the draft model's own oracle (what choosing adds where both choose equally well).

Usage: python scripts/oracle_bound.py sqlite:///bench.db
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

from sqlalchemy import select

from autospec.oracle import Prices, least_seconds
from autospec.store import open_store, queries
from autospec.store.tables import Request

SETS = {"draft": {"draft"}, "suffix": {"suffix"}, "ngram": {"ngram"},
        "all": {"draft", "suffix", "ngram"}, "all+hybrid": {"draft", "suffix", "ngram", "hybrid"}}


class Cost(Prices):
    """T_t(n) (median per n over requests with at least three forwards of n tokens, linear
    between measured n) and T_d of the store's requests."""

    def __init__(self, rows):
        got = Prices.of(rows, min_count=3)
        if got is None or got.t_draft == float("inf"):
            raise SystemExit("the store holds too few forwards: run the bench with --db first")
        super().__init__(got.t, got.t_draft)


def oracle(n: int, draft, suffix, ngram, allowed: set[str], cost) -> float:
    """Least seconds to emit generated positions 1 … n − 1 (position 0: the prefill)."""
    traces = {"draft": draft, "suffix": suffix, "ngram": ngram}
    return least_seconds(n, traces, allowed - {"hybrid"}, cost, model="draft",
                         hybrid="hybrid" in allowed)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url", help="the bench's store (SQLAlchemy URL or SQLite file)")
    ap.add_argument("--min-tokens", type=int, default=16,
                    help="skip shorter requests (the bench's warm-up call)")
    ap.add_argument("--draft-ratio", type=float, default=None, metavar="C",
                    help="price a draft-model step at C · T_t(1) instead of the measured T_d "
                         "(what the same traffic would allow where the draft costs more or "
                         "less of a target forward: on a GPU a 0.5B draft step costs far "
                         "more of a 1.5B forward than on this CPU); the oracles only, the "
                         "runs stay as measured")
    args = ap.parse_args(argv)
    with open_store(args.url, read_only=True) as store, store.session() as s:
        rows = list(s.scalars(select(Request).where(Request.greedy).order_by(Request.id)))
        s.expunge_all()
        # each request's proposers' traces, by name (``request_proposers``)
        traces = {i: {n: p.trace for n, p in got.items()}
                  for i, got in queries.request_proposers(s, [r.id for r in rows]).items()}
    cost = Cost(rows)
    measured_draft = cost.t_draft
    if args.draft_ratio is not None:
        cost.t_draft = args.draft_ratio * cost(1)
    runs: dict[str, list] = defaultdict(list)
    for r in rows:
        if r.new_tokens >= args.min_tokens:
            runs[r.policy + ("+suffix" if traces.get(r.id, {}).get("suffix") else "")].append(r)
    draft_runs, suffix_runs, ngram_runs = (runs.get(name, []) for name in
                                           ("auto:draft", "auto+suffix", "auto:ngram"))
    if not (draft_runs and len(draft_runs) == len(suffix_runs) == len(ngram_runs)):
        raise SystemExit("expected the same requests under auto:draft, auto+suffix (auto with "
                         f"suffix traces) and auto:ngram; found {dict((k, len(v)) for k, v in runs.items())}")
    print(f"T_t(1) {cost(1) * 1e3:.0f} ms, T_t(9) {cost(9) * 1e3:.0f} ms, "
          f"T_d {measured_draft * 1e3:.0f} ms, from {len(rows)} requests"
          + ("" if args.draft_ratio is None else
             f"; the oracles price T_d at {args.draft_ratio} T_t(1) = {cost.t_draft * 1e3:.0f} ms"))
    by_cat: dict[str, list[dict]] = defaultdict(list)
    for d, x, g in zip(draft_runs, suffix_runs, ngram_runs):
        if not d.category == x.category == g.category:
            raise SystemExit(f"request order differs: {d.category}, {x.category}, {g.category}")
        n = min(d.new_tokens, x.new_tokens, g.new_tokens)
        prefill = statistics.median([d.prefill_s, x.prefill_s, g.prefill_s])
        row = {"plain": prefill + (n - 1) * cost(1), "auto:draft": d.wall_s,
               "auto+suffix": x.wall_s, "auto:ngram": g.wall_s}
        for name, allowed in SETS.items():
            row[name] = row[f"oracle {name}"] = prefill + oracle(
                n, traces[d.id]["draft"], traces[x.id]["suffix"], traces[g.id]["ngram"], allowed,
                cost)
        by_cat[d.category].append(row)
    print(f"{'category':14s} {'requests':>8s}  speedup over plain (median per request) of "
          "what ran and of the oracles; auto:draft's wall ÷ each oracle's; oracle ÷ oracle")
    head = ["auto:draft", "auto+suffix", "auto:ngram", *(f"oracle {n}" for n in SETS)]
    print(" " * 24 + " ".join(f"{h:>12s}" for h in head) + "  "
          + " ".join(f"{n:>10s}" for n in SETS) + "  " + " ".join(
              f"{n + ' ÷ draft':>10s}" for n in ("all", "all+hybrid")))
    for cat, rs in by_cat.items():
        def med(f, rs=rs):
            return statistics.median(f(r) for r in rs)

        ran = [med(lambda r, m=m: r["plain"] / r[m]) for m in ("auto:draft", "auto+suffix",
                                                                 "auto:ngram")]
        orc = [med(lambda r, n=n: r["plain"] / r[n]) for n in SETS]
        vs = [med(lambda r, n=n: r["auto:draft"] / r[n]) for n in SETS]
        mix = [med(lambda r, n=n: r["oracle draft"] / r[n]) for n in ("all", "all+hybrid")]
        print(f"{cat:14s} {len(rs):8d}" + " ".join(f"{v:12.2f}" for v in ran + orc) + "  "
              + " ".join(f"{v:10.2f}" for v in vs) + "  " + " ".join(f"{v:10.2f}" for v in mix))


if __name__ == "__main__":
    main()
