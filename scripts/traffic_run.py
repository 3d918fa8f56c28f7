"""Log a mixed run of traffic on the real default pair into a store (for `autospec tune`,
`autospec categorize fit` and `autospec report`).

    python scripts/traffic_run.py --db sqlite:///traffic.db [--per-category 30]

Prompts come from autospec/prompts/traffic.jsonl (code, chat, translation, 30 each) and are
served round-robin across categories, so a time-ordered split (tuning's held-back part)
holds the last prompts of every category. Greedy, bf16, `--threads` torch threads (2).
The held-back prompts can then be replayed live with
`autospec bench --prompts held.jsonl --policies auto,tuned --db COPY` (see --write-held).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from autospec.bench.run import encode_prompt, load_prompts
from autospec.controller import Controller
from autospec.pairs import load_pair

PROMPTS = Path(__file__).resolve().parents[1] / "autospec" / "prompts" / "traffic.jsonl"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", required=True, help="store URL or SQLite file to log into")
    ap.add_argument("--prompts", default=str(PROMPTS))
    ap.add_argument("--per-category", type=int, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--policy", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--holdout", type=float, default=0.25,
                    help="fraction of each category's prompts written by --write-held")
    ap.add_argument("--write-held", metavar="FILE.jsonl",
                    help="write the last --holdout of each category's prompts here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    by_cat: dict[str, list] = {}
    for p in load_prompts(args.prompts):
        by_cat.setdefault(p.category, []).append(p)
    by_cat = {c: ps[: args.per_category] for c, ps in by_cat.items()}
    order = [ps[i] for i in range(max(map(len, by_cat.values())))
             for ps in by_cat.values() if i < len(ps)]
    if args.write_held:
        with open(args.write_held, "w") as f:
            for ps in by_cat.values():
                for p in ps[len(ps) - round(len(ps) * args.holdout):]:
                    f.write(json.dumps({"category": p.category, "prompt": p.prompt,
                                        "chat": p.chat}) + "\n")
    pair = load_pair("qwen2.5-coder", dtype=torch.bfloat16)
    ctrl = Controller(pair.target, pair.draft, tokenizer=pair.tokenizer, policy=args.policy,
                      store=args.db)
    tokens, t0 = 0, time.perf_counter()
    try:
        for p in tqdm(order, desc="traffic", unit="req"):
            ids = encode_prompt(pair.tokenizer, p)
            out = ctrl.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=args.max_new_tokens, category=p.category)
            tokens += out.shape[1] - ids.shape[1]
    finally:
        ctrl.close()
    print(f"{len(order)} requests, {tokens} tokens in {time.perf_counter() - t0:.0f} s, "
          f"policy {args.policy}, {args.threads} threads; logged to {ctrl.store.url}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
