"""Probe vs live: does ``autospec probe`` measure what the loop measures?

On a model pair (default: the default pair, bf16), interleaves rounds of

- the probe (``autospec.probe.probe``: the loop's step through the loop's runner) at a context
  near the live requests' mean cached length, n = 1 … max_n, and
- live greedy requests through ``Controller.generate`` at a fixed k for every k in 0 … max_n − 1
  on the prompts of a prompts file (the loop's own T_t(k + 1) and T_d timings),

alternating which goes first, then prints per n the probe's median, the live median over every
forward, their ratio, and the same for T_d. The machine may be shared: medians over rounds,
never single times.

    .venv/bin/python scripts/probe_vs_live.py --rounds 3 --threads 2 --max-n 8 \
        --max-new-tokens 16 --limit 3 --repeats 2 --out probe_vs_live.json
    # finer interleaving on a busy machine: a probe (one timing per n) every 2 live requests
    .venv/bin/python scripts/probe_vs_live.py --rounds 3 --max-new-tokens 12 --probe-every 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="qwen2.5-coder")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--prompts", default=None, help="prompts file (default: the package's)")
    ap.add_argument("--limit", type=int, default=3, help="prompts used (rotated over k)")
    ap.add_argument("--per-k", type=int, default=1, help="requests per k per round")
    ap.add_argument("--repeats", type=int, default=3, help="probe timings per point per round")
    ap.add_argument("--probe-every", type=int, default=0, metavar="R",
                    help="interleave finer: a probe (one timing per n) after every R live "
                         "requests instead of one probe of --repeats per round")
    ap.add_argument("--out", default=None, help="write every timing as JSON here")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    import autospec
    from autospec.bench.run import default_prompts_path, encode_prompt, load_prompts
    from autospec.pairs import load_pair
    from autospec.probe import probe

    pair = load_pair(args.pair, progress=False)
    target, draft, tok = pair.target, pair.draft, pair.tokenizer
    prompts = load_prompts(args.prompts or default_prompts_path())[: args.limit]
    ids = [encode_prompt(tok, p) for p in prompts]
    lengths = [int(x.shape[1]) for x in ids]
    context = int(statistics.median(lengths)) + args.max_new_tokens // 2
    spec = autospec.Controller(target, draft, tokenizer=tok, store=False)
    ks = list(range(args.max_n))  # live n = k + 1 for k = 0 … max_n − 1

    probe_t: dict[int, list[float]] = {n: [] for n in range(1, args.max_n + 1)}
    probe_d: list[float] = []
    live_t: dict[int, list[float]] = {n: [] for n in range(1, args.max_n + 1)}
    live_round: dict[int, list[float]] = {n: [] for n in range(1, args.max_n + 1)}
    live_d: list[float] = []  # per request: draft seconds per proposed token
    live_d_round: list[float] = []
    cached: list[int] = []
    rounds = []

    def run_probe(r: int, repeats: int | None = None) -> None:
        t0 = time.perf_counter()
        res = probe(target, draft, context=context, max_n=args.max_n,
                    repeats=repeats or args.repeats)
        for n, t in res.target_s_by_n.items():
            probe_t[n].append(t)
        probe_d.append(res.draft_s)
        rounds[r].setdefault("probe", []).append(
            {"target_s_by_n": res.target_s_by_n, "draft_s": res.draft_s, "path": res.path,
             "seconds": time.perf_counter() - t0})

    def run_live(r: int) -> None:
        t0 = time.perf_counter()
        here: dict[int, list[float]] = {n: [] for n in live_t}
        d_here: list[float] = []
        for i, k in enumerate(ks):  # one prompt per k, rotating over the prompts and rounds
            for x in [ids[(i + r) % len(ids)]] * args.per_k:
                spec.generate(x, max_new_tokens=args.max_new_tokens, do_sample=False, k=k,
                              eos_token_id=None, pad_token_id=tok.eos_token_id)
                st = spec.last_stats
                assert st.path == "eager"
                for n, ts in st.target_s_by_n.items():
                    if n in here:
                        here[n].extend(ts)
                cached.extend(c for c, _ in st.target_forwards)
                if st.draft_forwards:
                    d_here.append(st.draft_s / st.draft_forwards)
            if args.probe_every and (i + 1) % args.probe_every == 0:
                run_probe(r, repeats=1)
        for n, ts in here.items():
            live_t[n].extend(ts)
            if ts:
                live_round[n].append(statistics.median(ts))
        live_d.extend(d_here)
        live_d_round.append(statistics.median(d_here))
        rounds[r]["live"] = {"target_s_by_n": here, "draft_s_per_token": d_here,
                             "seconds": time.perf_counter() - t0}

    print(f"pair {args.pair}, {args.threads} threads, prompts {lengths} tokens, probe context "
          f"{context}, {args.rounds} rounds", file=sys.stderr)
    for r in range(args.rounds):
        rounds.append({"load": os.getloadavg()})
        if args.probe_every:
            run_live(r)
        else:
            order = (run_probe, run_live) if r % 2 == 0 else (run_live, run_probe)
            for fn in order:
                fn(r)
        print(f"round {r + 1}/{args.rounds} done (load {rounds[-1]['load'][0]:.1f})",
              file=sys.stderr)

    def med(xs):
        return statistics.median(xs) if xs else float("nan")

    rows = []
    print(f"\n{'n':>3} {'probe ms':>9} {'live ms':>9} {'live/probe':>10} {'live fwd':>8}  "
          f"{'probe rounds ms':<24} {'live rounds ms':<24}")
    p1, l1 = med(probe_t[1]), med(live_t[1])
    for n in range(1, args.max_n + 1):
        p, v = med(probe_t[n]), med(live_t[n])
        rows.append({"n": n, "probe_s": p, "live_s": v, "ratio": v / p,
                     "live_forwards": len(live_t[n]), "probe_rel": p / p1, "live_rel": v / l1})
        print(f"{n:>3} {p * 1e3:>9.1f} {v * 1e3:>9.1f} {v / p:>10.2f} {len(live_t[n]):>8}  "
              f"{' '.join(f'{t * 1e3:.0f}' for t in probe_t[n]):<24} "
              f"{' '.join(f'{t * 1e3:.0f}' for t in live_round[n]):<24}")
    pd, ld = med(probe_d), med(live_d)
    print(f"T_d {pd * 1e3:>9.1f} {ld * 1e3:>9.1f} {ld / pd:>10.2f} {len(live_d):>8}  "
          f"{' '.join(f'{t * 1e3:.0f}' for t in probe_d):<24} "
          f"{' '.join(f'{t * 1e3:.0f}' for t in live_d_round):<24}")
    print("\nratios to T_t(1):  n: probe / live")
    for row in rows:
        print(f"  {row['n']}: {row['probe_rel']:.2f} / {row['live_rel']:.2f}")
    print(f"c = T_d / T_t(1): probe {pd / p1:.3f}, live {ld / l1:.3f}")
    print(f"live cached length: median {med(cached):.0f} (probe context {context})")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"args": vars(args), "context": context, "prompt_tokens": lengths,
                       "rows": rows, "draft": {"probe_s": pd, "live_s": ld},
                       "rounds": rounds}, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
