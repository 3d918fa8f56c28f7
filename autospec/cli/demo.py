"""``autospec demo``: one prompt of each kind, speculative vs plain decoding side by side."""

from __future__ import annotations

import time

from autospec.cli.common import (
    DEFAULT_PAIR,
    env_line,
    gen_kwargs,
    k_value,
    load,
    positive_int,
    setup,
)
from autospec.textfmt import fmt


def register(sub, parents) -> None:
    demo = sub.add_parser("demo", parents=[parents.pair_only, parents.common],
                          help="a few prompts, speculative vs plain decoding side by side")
    demo.add_argument("--k", type=k_value, default=None,
                      help="a fixed lookahead (default: the 'auto' policy chooses k)")
    demo.add_argument("--policy", default="auto", help="k policy (default: auto)")
    demo.add_argument("--max-new-tokens", type=positive_int, default=64)
    demo.set_defaults(run=run, parser=demo)


def run(args, parser) -> int:
    import torch

    import autospec
    from autospec.bench.run import (
        default_prompts_path,
        encode_prompt,
        explain_divergence,
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
    print(f"autospec demo: {args.pair or DEFAULT_PAIR}, policy {ctrl.policy.name}; "
          f"{env_line(env)}")
    for i, (category, prompt) in enumerate(by_category.items()):
        ids = encode_prompt(tok, prompt).to(env["device"])
        if i % 2:  # alternate which runs first, so neither always meets a warm cache
            plain_out, plain_s = timed(plain_generate, ids)
        spec_out, spec_s = timed(target.generate, ids)  # wrapped: autospec
        if not i % 2:
            plain_out, plain_s = timed(plain_generate, ids)
        s = ctrl.last_stats
        print(f"\n=== {category}{' (chat)' if prompt.chat else ''} ===\n{prompt.prompt}\n--- output ---")
        print(tok.decode(spec_out, skip_special_tokens=True).strip())
        spec_tps, plain_tps = len(spec_out) / spec_s, len(plain_out) / plain_s
        how = ("served by transformers' generate (-v says why)" if s is None else
               _drafting_summary(s))
        print(f"--- autospec: {spec_tps:.1f} tok/s, {how}, {len(spec_out)} tokens")
        print(f"--- plain:    {plain_tps:.1f} tok/s  ->  speedup {spec_tps / plain_tps:.2f}x, "
              f"identical to plain: {'yes' if torch.equal(spec_out, plain_out) else 'NO'}")
        why = explain_divergence(target, ids, plain_out.tolist(), spec_out.tolist(),
                                 env["dtype"])  # greedy: plain's output is the reference
        if why:
            print(f"    ({why})")
    return 0


def _drafting_summary(s) -> str:
    """What drafted and how well: the draft model's acceptance, mean accepted length and k
    schedule, and the n-gram proposer's blocks where it drafted (counted apart)."""
    draft_ks = [k for k, ng in zip(s.k_schedule, s.proposer_schedule or [0] * len(s.k_schedule))
                if not ng]
    out = (f"acceptance {fmt(s.acceptance, '.2f')}, mean accepted length "
           f"{s.mean_accepted_length:.2f}, k used {_k_summary(draft_ks)}")
    if s.ngram_drafted:
        out += (f"; n-gram: {s.ngram_drafts} blocks, acceptance "
                f"{s.ngram_accepted / s.ngram_drafted:.2f}")
    return out


def _k_summary(ks: list[int]) -> str:
    from collections import Counter

    return ", ".join(f"{k}×{n}" for k, n in sorted(Counter(ks).items()))
