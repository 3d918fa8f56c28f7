"""``autospec generate``: one prompt through the wrapped target, text out."""

from __future__ import annotations

import sys
import time

from autospec.cli.common import (
    die,
    env_line,
    gen_kwargs,
    k_value,
    load,
    positive_int,
    setup,
)
from autospec.textfmt import fmt


def register(sub, parents) -> None:
    gen = sub.add_parser("generate", parents=[parents.models, parents.sampling, parents.common],
                         help="generate text for one prompt")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    gen.add_argument("--k", type=k_value, default=4, help="lookahead (default: 4; 0 = off)")
    gen.add_argument("--max-new-tokens", type=positive_int, default=128)
    gen.add_argument("--stream", action="store_true", help="print tokens as they are accepted")
    gen.set_defaults(run=run, parser=gen)


def run(args, parser) -> int:
    import torch
    from transformers import TextStreamer

    import autospec
    from autospec.bench.run import Prompt, encode_prompt

    if not args.prompt:
        parser.error("--prompt is empty: give the text to continue")
    env = setup(args)
    target, draft, tok, dtok = load(args, parser, env, allow_no_draft=True)
    try:  # a draft that cannot serve the target, a chat prompt without a template
        # without a draft model, k is prompt lookup's (a fixed k names the draft model)
        policy = args.k if draft is not None or args.k == 0 else f"ngram:{args.k}"
        ctrl = autospec.wrap(target, draft, tokenizer=tok, draft_tokenizer=dtok, policy=policy,
                             k_max=max(16, args.k))
        ids = encode_prompt(tok, Prompt("cli", args.prompt, args.chat)).to(env["device"])
    except ValueError as e:
        die(str(e))
    if ids.shape[1] == 0:
        die(f"--prompt {args.prompt!r} encodes to no tokens; give some text")
    gen = None
    if args.sample and args.seed is not None:
        gen = torch.Generator(env["device"]).manual_seed(args.seed)
    streamer = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True) if args.stream else None
    t0 = time.perf_counter()
    try:
        out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generator=gen,
                              streamer=streamer, **gen_kwargs(args))
    except ValueError as e:  # e.g. a prompt longer than the target's context
        die(str(e))
    wall = time.perf_counter() - t0
    new = out.shape[1] - ids.shape[1]
    if not args.stream:
        print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    s = ctrl.last_stats
    if s is None:
        how = "served by transformers' generate (run with -v for why)"
    elif draft is None:
        from autospec.engine.proposers import registered

        known = registered()  # the lookups the call had, by their titles ("prompt lookup")
        by = ", ".join(known[n].label() if n in known else n for n in s.by_proposer)
        blocks = sum(c.blocks for c in s.counts.values())
        proposed = sum(c.proposed for c in s.counts.values())
        rate = sum(c.accepted for c in s.counts.values()) / proposed if proposed else float("nan")
        how = (f"k={args.k} by {by or 'lookups'} (no draft model): {blocks} of {s.iterations} "
               f"steps found a match, acceptance {fmt(rate, '.2f')}")
    else:
        how = (f"k={args.k}, acceptance {fmt(s.acceptance, '.2f')}, mean accepted length "
               f"{s.mean_accepted_length:.2f}")
    print(f"[autospec] {new} new tokens in {wall:.2f} s ({new / wall:.1f} tok/s); {how}; "
          f"{env_line(env)}", file=sys.stderr)
    return 0
