"""What ``wrap(..., metrics=True)`` adds per request: ``Metrics.observe`` on a finished
request's statistics (a few dozen label lookups and increments, off the loop), timed directly.

    .venv/bin/python scripts/metrics_overhead.py [--rounds 7] [--calls 500]

Prints the median over rounds of the mean µs per call (and the spread over rounds).
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=500)
    a = ap.parse_args(argv)

    from autospec.engine.stats import LoopStats, ProposerCounts
    from autospec.fleet.metrics import Metrics

    m = Metrics()
    st = LoopStats(counts={"draft": ProposerCounts(
                       blocks=200, proposed=800, accepted=500,
                       accepted_per_position=[150, 120, 100, 80, 50],
                       proposed_per_position=[200] * 5)}, model="draft",
                   k_schedule=[4] * 250, new_tokens=700, wall_s=2.0)

    def call():
        m.observe(st, category="c", target="org/target", draft="org/draft", bandwidth=1e9,
                  peak=2e9)

    call()  # the first call creates the label children
    per_round = []
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        for _ in range(a.calls):
            call()
        per_round.append((time.perf_counter() - t0) / a.calls * 1e6)
    print(f"Metrics.observe: median {statistics.median(per_round):.1f} µs per request "
          f"(rounds {min(per_round):.1f}–{max(per_round):.1f} µs; {a.rounds} × {a.calls} "
          "calls, a request with 250 iterations and 5 draft positions)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
