"""The suffix proposer's memory over many requests of one category: resident memory (RSS)
as 1000 requests' outputs are remembered, against the bound its settings state.

Each request is a prompt of --prompt-tokens and an output of --output-tokens drawn from a
vocabulary of --vocab ids, a third of each output copied from earlier outputs (what makes
suffix decoding pay, and what keeps the index's seeds shared). RSS is read from
/proc/self/statm after every 100 requests; the bound is ``max_tokens`` × 320 bytes (the
index's 250–280 bytes per token that ``scripts/ngram_cost.py --suffix`` measures, plus the
allocator's slack).

  .venv/bin/python scripts/suffix_memory.py
  .venv/bin/python scripts/suffix_memory.py --max-tokens 65536 --requests 2000
"""

from __future__ import annotations

import argparse
import os
import random


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    from autospec.suffix import SuffixMemory, SuffixSettings

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--output-tokens", type=int, default=400)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--max-tokens", type=int, default=SuffixSettings().max_tokens)
    ap.add_argument("--bytes-per-token", type=float, default=320.0,
                    help="the bound's memory per token held: the index's 250–280 bytes "
                         "(scripts/ngram_cost.py --suffix) plus the allocator's slack")
    args = ap.parse_args()
    rng = random.Random(0)
    mem = SuffixMemory(SuffixSettings(max_tokens=args.max_tokens))
    start = rss_mb()
    bound = args.max_tokens * args.bytes_per_token / 2**20
    print(f"max_tokens {args.max_tokens}, stated bound {bound:.0f} MB above the start "
          f"({args.bytes_per_token:.0f} bytes per token); RSS at start {start:.0f} MB")
    print(f"{'requests':>9} {'outputs held':>13} {'tokens held':>12} {'RSS MB':>8} "
          f"{'above start':>12}")
    earlier: list[list[int]] = []
    peak = 0.0
    for r in range(1, args.requests + 1):
        prompt = [rng.randrange(args.vocab) for _ in range(args.prompt_tokens)]
        out: list[int] = []
        while len(out) < args.output_tokens:
            if earlier and rng.random() < 0.33:
                src = rng.choice(earlier)
                a = rng.randrange(max(1, len(src) - 32))
                out += src[a : a + rng.randint(8, 32)]
            else:
                out += [rng.randrange(args.vocab) for _ in range(rng.randint(8, 32))]
        out = out[: args.output_tokens]
        earlier = (earlier + [out])[-50:]
        mem.remember("sql", prompt, out)
        peak = max(peak, rss_mb() - start)
        if r % 100 == 0:
            held = mem.categories()["sql"]
            print(f"{r:>9} {held[0]:>13} {held[1]:>12} {rss_mb():>8.0f} {rss_mb() - start:>12.0f}")
    verdict = "within" if peak <= bound else "ABOVE"
    print(f"peak {peak:.0f} MB above the start: {verdict} the stated bound of {bound:.0f} MB")


if __name__ == "__main__":
    main()
