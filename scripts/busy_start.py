"""``autospec demo`` from an empty store, with or without a neighbour that keeps every core busy
for the demo's first seconds, and what the store it leaves says (issue "One objective a reader
can predict", done-when (b)).

    .venv/bin/python scripts/busy_start.py --neighbour 90 --out /tmp/busy   # busy first 90 s
    .venv/bin/python scripts/busy_start.py --neighbour 0 --out /tmp/quiet   # no neighbour

The demo runs in a fresh cache directory whose model folders link to the cache that holds the
default pair (``--models``, default: $AUTOSPEC_CACHE or ~/.cache/autospec), so its store starts
empty. The neighbour is one busy-looping process per core (``--cores``, default: all), started
with the demo and stopped after ``--neighbour`` seconds. Printed afterwards, from the demo's
own output and from its store:

- the demo's lines (plain and speculative medians, the speedup per prompt, its busy note);
- per category: the draft model's acceptance, its blocks, its longest block, and its blocks
  with k >= 8 (flagged where the category's acceptance is below 0.3);
- per category: the least T_t(n) / T_t(1) over n > 2 of the stored live timings (the raw
  means the requests logged) and of what a new process reads back (``stored_costs``, the
  guarded curve), flagged below 0.7.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path


def _burn(until: float) -> None:
    x = 0
    while time.time() < until:
        x += 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--neighbour", type=float, default=90.0,
                    help="seconds the neighbour keeps the cores busy (0: none)")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--models", default=None, help="the cache directory holding the pair")
    ap.add_argument("--out", required=True, help="a new directory: the demo's cache and log")
    ap.add_argument("demo_args", nargs="*", help="passed to autospec demo (after --)")
    args = ap.parse_args()

    from autospec.store.database import cache_dir

    models = Path(args.models).expanduser() if args.models else cache_dir()
    out = Path(args.out).expanduser()
    if out.exists() and any(out.iterdir()):
        ap.error(f"{out} is not empty: give a new directory (the store must start empty)")
    out.mkdir(parents=True, exist_ok=True)
    for entry in models.iterdir():
        if entry.is_dir():
            (out / entry.name).symlink_to(entry.resolve())
    env = dict(os.environ, AUTOSPEC_CACHE=str(out))
    autospec = Path(sys.executable).with_name("autospec")
    burners = []
    if args.neighbour > 0:
        until = time.time() + args.neighbour
        burners = [multiprocessing.Process(target=_burn, args=(until,), daemon=True)
                   for _ in range(args.cores)]
        for p in burners:
            p.start()
    t0 = time.time()
    proc = subprocess.run([str(autospec), "demo", *args.demo_args], env=env,
                          capture_output=True, text=True)
    for p in burners:
        p.terminate()
    (out / "demo.log").write_text(proc.stdout + proc.stderr)
    print(f"demo: {time.time() - t0:.0f} s, exit {proc.returncode}; neighbour "
          f"{args.neighbour:g} s on {args.cores if burners else 0} cores")
    print(proc.stdout)
    if proc.returncode:
        print(proc.stderr[-3000:], file=sys.stderr)
        return proc.returncode
    report(f"sqlite:///{out / 'autospec.db'}")
    return 0


def report(url: str) -> None:
    from sqlalchemy import select

    from autospec.costs.stored import stored_costs
    from autospec.store import open_store
    from autospec.store.tables import Request

    store = open_store(url)
    with store.session() as s:
        rows = s.execute(select(Request.category, Request.k_schedule, Request.proposer_schedule,
                                Request.drafted, Request.accepted, Request.target_s_by_n,
                                Request.pair_id, Request.path)).all()
        by_cat: dict[str, dict] = {}
        for cat, ks, props, drafted, accepted, by_n, pair_id, path in rows:
            c = by_cat.setdefault(cat, {"drafted": 0, "accepted": 0, "blocks": 0, "long": 0,
                                        "kmax": 0, "sums": {}, "pair": pair_id, "path": path})
            c["drafted"] += drafted
            c["accepted"] += accepted
            for i, k in enumerate(bytes(ks)):
                if k and (props is None or i >= len(props) or props[i] == 0):  # the draft's
                    c["blocks"] += 1
                    c["kmax"] = max(c["kmax"], k)
                    c["long"] += k >= 8
            for n, ts in (by_n or {}).items():
                acc = c["sums"].setdefault(int(n), [0.0, 0])
                acc[0] += sum(ts)
                acc[1] += len(ts)
        print(f"{'category':14} {'alpha':>6} {'blocks':>6} {'k max':>5} {'k>=8':>5}  "
              f"{'raw min T(n>2)/T(1)':>20} {'read back':>10}")
        for cat, c in sorted(by_cat.items()):
            alpha = c["accepted"] / c["drafted"] if c["drafted"] else float("nan")
            flag = " <- k>=8 below alpha 0.3" if c["long"] and not alpha >= 0.3 else ""
            means = {n: t / m for n, (t, m) in c["sums"].items() if m}
            raw = _least(means)
            costs = stored_costs(s, c["pair"], cat, path=c["path"], parts={"batch1"})
            back = _least(getattr(costs, "t_target", None) or {})
            cells = [f"{x:.2f}" + (" <-" if x < 0.7 else "") if x is not None else "-"
                     for x in (raw, back)]
            print(f"{cat:14} {alpha:6.2f} {c['blocks']:6d} {c['kmax']:5d} {c['long']:5d}  "
                  f"{cells[0]:>20} {cells[1]:>10}{flag}")


def _least(curve: dict) -> float | None:
    """min over n > 2 of T_t(n) / T_t(1); None without T_t(1) or any n > 2."""
    t1 = curve.get(1)
    ratios = [t / t1 for n, t in curve.items() if int(n) > 2 and t1]
    return min(ratios) if ratios else None


if __name__ == "__main__":
    sys.exit(main())
