"""``autospec demo``: one prompt of each kind, speculative vs plain decoding side by side,
alternated over a few rounds, with medians and a note where the machine was busy."""

from __future__ import annotations

import os
import statistics
import time

from autospec.cli.common import (
    DEFAULT_PAIR,
    env_line,
    gen_kwargs,
    integer_in,
    k_value,
    load,
    positive_int,
    setup,
)
from autospec.textfmt import fmt

# plain runs of one prompt whose seconds per token differ by more than this share of their
# median across rounds: the machine's load changed under the demo (quiet runs of one prompt
# differ by a few percent), so a speedup from them would measure the load, not autospec
PLAIN_SCATTER = 0.15
# the load average (1 min) beyond the demo's own threads, as a share of the cores, from
# which the machine counts as busy
LOAD_SHARE = 0.5
BENCH_LINE = ("For a real measurement: autospec bench (every mode on the same prompts, "
              "interleaved over repeats: median tokens/s and paired speedups with intervals).")


def register(sub, parents) -> None:
    demo = sub.add_parser("demo", parents=[parents.pair_only, parents.common],
                          help="a few prompts, speculative vs plain decoding side by side")
    demo.add_argument("--k", type=k_value, default=None,
                      help="a fixed lookahead (default: the 'auto' policy chooses k)")
    demo.add_argument("--policy", default="auto", help="k policy (default: auto)")
    demo.add_argument("--max-new-tokens", type=positive_int, default=64)
    demo.add_argument("--rounds", type=_rounds,
                      default=2, help="plain and speculative runs per prompt, alternated "
                      "(default 2, at least 2): medians over the rounds")
    demo.set_defaults(run=run, parser=demo)


def _rounds(text: str) -> int:
    return integer_in(text, 2, 100)


def run(args, parser) -> int:
    import torch

    import autospec
    from autospec.bench.run import (
        default_prompts_path,
        encode_prompt,
        load_prompts,
    )

    env = setup(args)
    target, draft, tok, _ = load(args, parser, env)
    policy = args.k if args.k is not None else args.policy
    try:
        ctrl = autospec.wrap(target, draft, tokenizer=tok, policy=policy,
                             k_max=max(16, args.k or 0))
    except ValueError as e:
        parser.error(str(e))
    plain_generate = type(target).generate.__get__(target)  # transformers' own, unwrapped
    by_category: dict = {}
    for p in load_prompts(default_prompts_path()):
        by_category.setdefault(p.category, p)  # one prompt of each kind
    kw = gen_kwargs(args)

    def timed(fn, ids, **extra):
        t0 = time.perf_counter()
        out = fn(input_ids=ids, attention_mask=torch.ones_like(ids), **{**kw, **extra})
        return out[0, ids.shape[1]:], time.perf_counter() - t0

    first = encode_prompt(tok, next(iter(by_category.values()))).to(env["device"])
    for fn in (plain_generate, target.generate):  # warm-up: first calls pay for setup
        timed(fn, first, max_new_tokens=8)
    cores = os.cpu_count() or 1
    threads = env["threads"] if env["device"].type == "cpu" else 0  # its own load
    load_before = _load()
    print(f"autospec demo: {args.pair or DEFAULT_PAIR}, policy {ctrl.policy.name}; "
          f"{env_line(env)}; {args.rounds} rounds per prompt, plain and autospec alternated")
    scattered = []
    for i, (category, prompt) in enumerate(by_category.items()):
        ids = encode_prompt(tok, prompt).to(env["device"])
        plain_runs, spec_runs, summaries = [], [], []
        for r in range(args.rounds):
            # alternate which runs first, so neither always meets a warm cache
            for which in (("plain", "spec") if (i + r) % 2 else ("spec", "plain")):
                if which == "plain":
                    plain_runs.append(timed(plain_generate, ids))
                else:
                    # wrapped: autospec, learning per category as the prompts are labelled
                    spec_runs.append(timed(target.generate, ids, category=category))
                    summaries.append(ctrl.last_stats)
        spec_out, plain_out = spec_runs[-1][0], plain_runs[-1][0]
        print(f"\n=== {category}{' (chat)' if prompt.chat else ''} ===\n{prompt.prompt}"
              "\n--- output ---")
        print(tok.decode(spec_out, skip_special_tokens=True).strip())
        s = summaries[-1]
        how = ("served by transformers' generate (-v says why)" if s is None else
               _drafting_summary(s))
        spec_tps, plain_tps = _median_rate(spec_runs), _median_rate(plain_runs)
        same = all(torch.equal(o, plain_out) for o, _ in spec_runs + plain_runs)
        print(f"--- autospec: {spec_tps:.1f} tok/s (median of {len(spec_runs)}), last run: "
              f"{how}, {len(spec_out)} tokens")
        scatter = plain_scatter(plain_runs)
        if scatter > PLAIN_SCATTER:
            scattered.append(category)
            verdict = (f"no speedup stated: plain runs differ by {scatter:.0%} across rounds "
                       "(the machine's load changed)")
        else:
            verdict = (f"speedup {statistics.median(paired_speedups(plain_runs, spec_runs)):.2f}x"
                       f" (median of {min(len(plain_runs), len(spec_runs))} pairs)")
        print(f"--- plain:    {plain_tps:.1f} tok/s (median of {len(plain_runs)})  ->  "
              f"{verdict}, identical to plain: {'yes' if same else 'NO'}")
        for line in divergences(target, ids, plain_out, spec_runs, plain_runs, env["dtype"]):
            print(f"    ({line})")
    busy_costs = [f"{row.path}, batch {row.batch}" + (f", context band {row.band}" if row.band
                                                       else "") for row in ctrl.costs.busy()]
    note = busy_note(load_before, _load(), cores, threads, scattered, busy_costs)
    print()
    if note:
        print(f"Note: {note}")
    print(BENCH_LINE)
    return 0


def divergences(target, ids, reference, spec_runs, plain_runs, dtype) -> list[str]:
    """Why each run whose output differs from ``reference`` (the last plain run's; greedy
    decoding) differs, one line per run, naming its round: where it parts and whether that is
    a near-tie (``explain_divergence``)."""
    from autospec.bench.run import explain_divergence

    lines = []
    for what, runs in (("autospec", spec_runs), ("plain", plain_runs)):
        for r, (out, _) in enumerate(runs):
            why = explain_divergence(target, ids, reference.tolist(), out.tolist(), dtype)
            if why:
                lines.append(f"{what}, round {r + 1}: {why}")
    return lines


def _load() -> float | None:
    """The 1-minute load average, where the platform has one."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _median_rate(runs) -> float:
    """Median tokens per second of (tokens, seconds) runs."""
    return statistics.median(len(out) / max(sec, 1e-9) for out, sec in runs)


def paired_speedups(plain_runs, spec_runs) -> list[float]:
    """Per round, autospec's tokens per second over plain decoding's of the same round
    (the pairs run back to back, so a slow stretch of the machine hits both)."""
    return [(len(so) / max(ss, 1e-9)) / (len(po) / max(ps, 1e-9))
            for (po, ps), (so, ss) in zip(plain_runs, spec_runs)]


def plain_scatter(plain_runs) -> float:
    """How far the plain runs' seconds per token differ across rounds: (max − min) / median
    (0 with fewer than two runs). Plain decoding of one prompt does the same work each round,
    so what differs is the machine."""
    per_token = [sec / max(1, len(out)) for out, sec in plain_runs]
    if len(per_token) < 2:
        return 0.0
    mid = statistics.median(per_token)
    return (max(per_token) - min(per_token)) / mid if mid > 0 else 0.0


def busy_note(load_before: float | None, load_after: float | None, cores: int, threads: int,
              scattered: list[str], busy_costs: list[str]) -> str | None:
    """What says the machine was busy during the demo, as one sentence, or None: a load
    average beyond the demo's own ``threads`` of at least ``LOAD_SHARE`` of the cores, before
    or after the runs; plain runs that scatter across rounds (``scattered``: their
    categories); the cost model's own timings scattering or moving level (``busy_costs``:
    the cost table's rows that say so, ``CostTable.busy``)."""
    why = []
    loads = [v for v in (load_before, load_after) if v is not None]
    if loads and max(loads) - threads >= LOAD_SHARE * cores:
        why.append(f"load average {max(loads):.1f} on {cores} cores with {threads} threads "
                   "of its own")
    if scattered:
        why.append(f"plain runs scattered across rounds ({', '.join(scattered)})")
    if busy_costs:
        why.append(f"the cost model's timings scattered ({', '.join(busy_costs)})")
    if not why:
        return None
    return ("the machine was busy during this demo (" + "; ".join(why) + "): the tokens/s "
            "and speedups above measure the load as much as autospec.")


def _drafting_summary(s) -> str:
    """What drafted and how well: the draft model's acceptance, mean accepted length and k
    schedule, and each other proposer's blocks where it drafted (counted apart)."""
    draft_ks = [k for k, who in zip(s.k_schedule, s.proposer_schedule) if who in (None, s.model)]
    out = (f"acceptance {fmt(s.acceptance, '.2f')}, mean accepted length "
           f"{s.mean_accepted_length:.2f}, k used {_k_summary(draft_ks)}")
    for name, c in s.counts.items():
        if name != s.model and c.proposed:
            out += f"; {name}: {c.blocks} blocks, acceptance {c.acceptance:.2f}"
    return out


def _k_summary(ks: list[int]) -> str:
    from collections import Counter

    return ", ".join(f"{k}×{n}" for k, n in sorted(Counter(ks).items()))
