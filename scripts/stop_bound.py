"""How near perfect foresight a draft-model block comes when it stops on the draft's own
confidence: the best fixed k, confidence threshold and survival-product rule per category,
each tuned in hindsight.

Perfect foresight (``autospec.oracle``) stops each block exactly where acceptance ends. A rule
that runs live can only read what the draft knows when it proposes: its probability of each
token (its confidence, stored per position in ``request_proposers.confidence``). This script
replays a store's greedy batch-1 requests of the draft model (their acceptance traces and
confidences, every position observed) under five kinds of schedule, each priced as perfect
foresight is (``oracle.Prices`` from every greedy batch-1 request's forwards in the store;
catch-ups on neither side):

- **fixed k**: the same k every block; the best k per category in hindsight;
- **threshold**: the block ends after the first token whose confidence is below τ (that token
  kept), at most K tokens; the best (τ, K) per category in hindsight (the shape of
  ``"NAME+stop=P"``);
- **product**: the block ends after the token where q = a(c_1) · … · a(c_i), its survival
  read from each token's confidence bin, falls below τ, at most K; a(c) the category's own
  acceptance per bin over all its requests (hindsight too) — the shape of ``auto``'s stop
  rule; the best (τ, K);
- **auto's stop rule** (``policies.stopping.stop_rule``), built as live: a(c) calibrated from
  the category's counts per bin, its acceptance a at every position, bars priced at the block
  of best S by these prices, at most 16 tokens — no setting searched;
- **perfect foresight**: ``oracle.least_seconds`` over the draft model.

A token after the first rejected one in a block is priced as drafted (one more draft step, a
wider verification) and read at the confidence stored for its position — the draft's on the
target's prefix, which a real block past a rejection would not see; it only matters for
whether such a block would have stopped sooner, never for what was accepted.

It prints per category each schedule's share of perfect foresight (the oracle's seconds ÷ the
schedule's, prefill on both sides; median per request) and the hindsight setting. A share
here is the most that rule family reaches on this traffic — its setting tuned on the very
requests it is scored on — not what a live rule reaches; a richer rule could do better.

Usage: autospec bench --modes plain policy:fixed:4 --db sqlite:///bench.db (a fixed k's
requests observe every position), then python scripts/stop_bound.py sqlite:///bench.db
--policy fixed:4
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

from sqlalchemy import select

from autospec.costs.price import best_k, expected_tokens
from autospec.oracle import K_MAX, Prices, leading, least_seconds
from autospec.policies.stopping import BINS, StopRule, bin_of, calibrated, stop_rule
from autospec.store import open_store, queries
from autospec.store.tables import Request
from autospec.traces import CONFIDENCE_SCALE, UNOBSERVED

THRESHOLDS = [i / 20 for i in range(1, 20)]


def by_rule(rule: StopRule):
    """``stop`` for ``run`` from a ``StopRule``: the block's survival q read token by token
    from each one's confidence (``conf``), ending where the rule says or at its longest."""
    def stop(conf: bytes, p: int, i: int) -> bool:
        if i + 1 >= rule.longest:
            return True
        q = 1.0
        for j in range(i + 1):
            q = rule.step(j, q, conf[p + j])
        return rule.stops(i, q)
    return stop


def run(n: int, trace: bytes, prices, stop) -> float:
    """Seconds to emit positions 1 … n − 1 drafting blocks that end where ``stop(p, i)``
    says: after token i + 1 of the block from position p, that token kept (the live rule's
    way: a token's confidence comes with its draft step); each block priced k · T_d +
    T_t(k + 1), advancing past its accepted tokens and the target's own."""
    p, seconds = 1, 0.0
    while p < n:
        k = 0
        while True:
            k += 1
            if p + k - 1 >= len(trace) or stop(p, k - 1):
                break
        k = min(k, max(1, n - p))
        seconds += k * prices.t_draft + prices(k + 1)
        p += leading(trace, p, k) + 1  # its accepted tokens, as perfect foresight reads them
    return seconds


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url", help="the bench's store (SQLAlchemy URL or SQLite file)")
    ap.add_argument("--policy", default=None,
                    help="only requests run under this policy (default: every greedy batch-1 "
                         "request whose draft trace observed every position)")
    ap.add_argument("--min-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    with open_store(args.url, read_only=True) as store, store.session() as s:
        stmt = select(Request).where(Request.greedy, Request.batch_size == 1,
                                     Request.new_tokens >= args.min_tokens)
        every = list(s.scalars(stmt.order_by(Request.id)))
        s.expunge_all()
        rows = [r for r in every if args.policy in (None, r.policy)]
        props = queries.request_proposers(s, [r.id for r in rows])
    prices = Prices.of(every, min_count=3)  # every request's forwards: the same machine state
    if prices is None or prices.t_draft == float("inf"):
        raise SystemExit("the store holds too few forwards: run the bench with --db first")
    reqs = []
    for r in rows:
        d = props.get(r.id, {}).get("draft")
        if d is None or not d.trace or not d.confidence:
            continue
        n = r.new_tokens
        trace, conf = bytes(d.trace[:n]), bytes(d.confidence[:n])
        if len(trace) < n or UNOBSERVED in trace[1:n - 1] or UNOBSERVED in conf[1:n - 1]:
            continue  # a position the draft never saw (the last one may be: the request's end)
        reqs.append((r.category, n, r.prefill_s, trace, conf))
    if not reqs:
        raise SystemExit("no greedy batch-1 request with a complete draft trace and its "
                         "confidences (fixed-k runs have them: --policies fixed:2 …)")
    by_cat: dict[str, list] = defaultdict(list)
    for req in reqs:
        by_cat[req[0]].append(req)
    print(f"T_t(1) {prices(1) * 1e3:.0f} ms, T_t(2) {prices(2) * 1e3:.0f} ms, T_t(9) "
          f"{prices(9) * 1e3:.0f} ms, T_d {prices.t_draft * 1e3:.1f} ms; {len(reqs)} requests "
          f"of {len(rows)}")
    print(f"{'category':14s} {'requests':>8s}  share of perfect foresight (median per request) "
          "and the hindsight setting")
    print(f"{'':24s} {'fixed k':>14s} {'threshold':>20s} {'product':>20s} "
          f"{'auto stop rule':>20s}")
    for cat, rs in sorted(by_cat.items()):
        best = [p + least_seconds(n, {"draft": t}, {"draft"}, prices, model="draft")
                for _, n, p, t, _ in rs]
        # the category's acceptance per confidence bin, over its requests (hindsight)
        hits, seen = [0] * BINS, [0] * BINS
        for _, n, _, t, c in rs:
            for p in range(1, n):
                hits[bin_of(c[p])] += t[p] == 1
                seen[bin_of(c[p])] += 1
        accept = [h / s if s else 0.0 for h, s in zip(hits, seen)]

        def share(stop, rs=rs, best=best) -> float:
            return statistics.median(b / (p + run(n, t, prices, lambda at, i, c=c: stop(c, at, i)))
                                     for b, (_, n, p, t, c) in zip(best, rs))

        fixed = max((share(lambda c, p, i, k=k: i + 1 >= k), k) for k in range(1, K_MAX + 1))
        thresh = max((share(lambda c, p, i, k=k, tau=tau: i + 1 >= k
                            or c[p + i] < tau * CONFIDENCE_SCALE), (tau, k))
                     for k in range(1, K_MAX + 1) for tau in THRESHOLDS)
        # the survival product at a flat bar τ over at most K tokens (a rule of auto's shape)
        prod = max((share(by_rule(StopRule(tuple(accept), (tau,) * (k - 1)))), (tau, k))
                   for k in range(1, K_MAX + 1) for tau in THRESHOLDS)
        # auto's own rule, built as live from the category's acceptance (hindsight) and the
        # store's prices: its bars priced at the block of best S over 1 … K_MAX
        a = sum(hits) / max(1, sum(seen))
        curve = [a] * K_MAX
        k_star, _ = best_k(curve, prices.t_draft, prices, K_MAX)
        tokens = expected_tokens(curve, k_star)
        rule = stop_rule(calibrated(hits, seen), curve, prices.t_draft, prices,
                         (k_star * prices.t_draft + prices(k_star + 1)) / tokens, K_MAX)

        live = share(by_rule(rule))
        print(f"{cat:14s} {len(rs):8d}  {fixed[0]:6.0%} k = {fixed[1]:<3d} "
              f"{thresh[0]:6.0%} τ {thresh[1][0]:.2f}, K {thresh[1][1]:<3d} "
              f"{prod[0]:6.0%} τ {prod[1][0]:.2f}, K {prod[1][1]:<3d} "
              f"{live:6.0%} bars {', '.join(f'{b:.2f}' for b in rule.bars[:4])}")


if __name__ == "__main__":
    main()
