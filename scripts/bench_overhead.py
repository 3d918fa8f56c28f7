"""The speculative loop's own per-iteration overhead: wall time per iteration minus the time
spent inside model forwards (CPU, where forwards are synchronous and a forward hook times them
exactly).

It measures whichever autospec the interpreter imports, so one script compares two checkouts:
``--compare`` runs it with each checkout's interpreter, alternately, ``--rounds`` times (one
process per checkout and round), and prints the medians and their ratio:

    .venv/bin/python scripts/bench_overhead.py --model tiny \
        --compare before=../base-checkout/.venv/bin/python after=.venv/bin/python
    .venv/bin/python scripts/bench_overhead.py --label after --model pair   # one checkout

Each configuration (greedy; sampled with temperature 0.8, top-k 50, top-p 0.9) runs
``--repeats`` requests of ``--max-new-tokens`` tokens at a fixed lookahead (k = 4: the same
iterations in both checkouts) and with the default "auto" policy; one JSON line per request.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


class ForwardTimer:
    """Seconds spent inside ``model.__call__`` (hooks on the top-level module): wall time, and
    the process's CPU time (all threads), which waiting for a busy machine's cores does not
    inflate."""

    def __init__(self, *models):
        self.total = self.cpu = 0.0
        self.calls = 0
        self._t0 = self._c0 = None
        for m in {id(m): m for m in models}.values():
            m.register_forward_pre_hook(self._pre)
            m.register_forward_hook(self._post)

    def _pre(self, module, args):
        self._c0 = time.process_time()
        self._t0 = time.perf_counter()

    def _post(self, module, args, out):
        self.total += time.perf_counter() - self._t0
        self.cpu += time.process_time() - self._c0
        self.calls += 1


def tiny_pair():
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=3, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    target = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(30.0)  # peaked distributions, as the tests' tiny pair
    draft = copy.deepcopy(target)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3 * p.std().clamp_min(1e-3))
    prompts = [torch.randint(4, 97, (1, 24), generator=torch.Generator().manual_seed(s))
               for s in range(4)]
    return target, draft, prompts


def real_pair():
    from autospec.pairs import load_pair

    p = load_pair("qwen2.5-coder", progress=False)
    texts = ["def quicksort(xs):", "The capital of France is", "SELECT name FROM users WHERE",
             "Once upon a time"]
    return p.target, p.draft, [p.tokenizer(t, return_tensors="pt").input_ids for t in texts]


CONFIGS = {
    "greedy": dict(do_sample=False),
    "sampled": dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9),
}


def compare(args, argv: list[str]) -> None:
    """Run this script under each ``label=python`` alternately; summarise medians."""
    import os
    import statistics
    import subprocess
    import sys

    pythons = dict(item.split("=", 1) for item in args.compare)
    rest = [a for a in argv if a not in args.compare and a != "--compare"]
    if "--metric" in rest:  # the summary's option, not the runs'
        i = rest.index("--metric")
        del rest[i : i + 2]
    rows = []
    for rnd in range(args.rounds):
        order = list(pythons.items())
        if rnd % 2:
            order.reverse()
        for label, python in order:
            root = os.path.dirname(os.path.dirname(os.path.abspath(python)))  # checkout/.venv/bin
            out = subprocess.run([python, os.path.abspath(__file__), *rest, "--label", label],
                                 cwd=os.path.dirname(root), capture_output=True, text=True,
                                 check=True).stdout
            for line in out.splitlines():
                if line.startswith("{"):
                    rows.append(json.loads(line))
                    print(line, flush=True)
    keys = sorted({(r["model"], r["mode"], r["policy"]) for r in rows})
    labels = list(pythons)
    print(f"\n{args.metric}: per-iteration overhead outside forwards, ms (median over {args.rounds} rounds x "
          f"{args.repeats} requests; {args.threads} threads; iterations per request)",
          file=sys.stderr)
    for key in keys:
        med = {}
        for label in labels:
            vals = [r[args.metric] for r in rows
                    if (r["model"], r["mode"], r["policy"]) == key and r["label"] == label]
            its = [r["iterations"] for r in rows
                   if (r["model"], r["mode"], r["policy"]) == key and r["label"] == label]
            med[label] = (statistics.median(vals), statistics.median(its))
        cells = "  ".join(f"{lab} {m:.3f} ({it:g} it)" for lab, (m, it) in med.items())
        ratio = (med[labels[-1]][0] / med[labels[0]][0]) if med[labels[0]][0] else float("nan")
        print(f"{key[0]:5} {key[1]:8} {key[2]:5} {cells}  ratio {labels[-1]}/{labels[0]} "
              f"{ratio:.2f}", file=sys.stderr)


def main() -> None:
    import sys

    ap = argparse.ArgumentParser()
    ap.add_argument("--label", help="written into every line (before/after)")
    ap.add_argument("--compare", nargs="+", metavar="LABEL=PYTHON",
                    help="run each checkout's interpreter alternately and summarise")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--metric", default="overhead_ms_per_iter",
                    choices=("overhead_ms_per_iter", "overhead_cpu_ms_per_iter"))
    ap.add_argument("--model", choices=("tiny", "pair"), default="tiny")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--policies", default="k4,auto")
    args = ap.parse_args()
    if args.compare:
        return compare(args, sys.argv[1:])
    if not args.label:
        ap.error("--label or --compare")
    torch.set_num_threads(args.threads)
    import autospec

    target, draft, prompts = real_pair() if args.model == "pair" else tiny_pair()
    timer = ForwardTimer(target, draft)
    ctrl = autospec.Controller(target, draft, store=False, k_max=8)
    ctrl.generate(prompts[0], max_new_tokens=8, do_sample=False, k=2)  # warm-up
    for rep in range(args.repeats):
        for cname, cfg in CONFIGS.items():
            for pol in args.policies.split(","):
                ids = prompts[rep % len(prompts)]
                kw = dict(cfg, max_new_tokens=args.max_new_tokens, eos_token_id=None,
                          attention_mask=torch.ones_like(ids))
                if pol.startswith("k"):
                    kw["k"] = int(pol[1:])
                gen = torch.Generator().manual_seed(rep)
                f0, c0, p0 = timer.total, timer.calls, timer.cpu
                cpu0 = time.process_time()
                t0 = time.perf_counter()
                ctrl.generate(ids, generator=gen, **kw)
                wall = time.perf_counter() - t0
                cpu = time.process_time() - cpu0
                st = ctrl.last_stats
                fwd = timer.total - f0
                print(json.dumps({
                    "label": args.label, "model": args.model, "mode": cname, "policy": pol,
                    "threads": args.threads, "rep": rep, "iterations": st.iterations,
                    "new_tokens": st.new_tokens, "forwards": timer.calls - c0,
                    "loop_wall_s": st.wall_s, "call_wall_s": wall, "forward_s": fwd,
                    "overhead_ms_per_iter": 1e3 * (st.wall_s - fwd) / st.iterations,
                    # CPU time of the whole call outside forwards (all threads)
                    "overhead_cpu_ms_per_iter": 1e3 * (cpu - (timer.cpu - p0)) / st.iterations,
                }), flush=True)


if __name__ == "__main__":
    main()
