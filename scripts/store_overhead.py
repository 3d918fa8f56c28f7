"""Per-request overhead the store adds to generate(): the work on the request's own thread
(building the record, queueing it) timed directly, and the end-to-end median with the store
on vs off, interleaved on the same prompts.

    .venv/bin/python scripts/store_overhead.py            # tiny random model (seconds)
    .venv/bin/python scripts/store_overhead.py --pair     # the default real pair (minutes)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


def tiny_pair():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    target = LlamaForCausalLM(cfg).eval()
    return target, target, [torch.randint(0, 1000, (1, 32)) for _ in range(4)]


def real_pair():
    from autospec.pairs import load_pair

    p = load_pair("qwen2.5-coder")
    texts = ["def quicksort(xs):", "The capital of France is", "SELECT name FROM users WHERE",
             "Once upon a time"]
    return p.target, p.draft, [p.tokenizer(t, return_tensors="pt").input_ids for t in texts]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", action="store_true", help="the default real pair")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import autospec

    target, draft, prompts = real_pair() if args.pair else tiny_pair()
    with tempfile.TemporaryDirectory() as tmp:
        on = autospec.Controller(target, draft, store=f"sqlite:///{tmp}/o.db", k_max=8)
        off = autospec.Controller(target, draft, store=False, k_max=8)
        kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False, k=3)
        for c in (on, off):
            c.generate(prompts[0], **kw)  # warm-up
        walls = {"on": [], "off": []}
        direct = []
        for r in range(args.repeats):
            for i, ids in enumerate(prompts):
                order = (("on", on), ("off", off)) if (r + i) % 2 else (("off", off), ("on", on))
                for name, c in order:
                    t0 = time.perf_counter()
                    c.generate(ids, **kw)
                    walls[name].append(time.perf_counter() - t0)
                # the store's own work on the request path, timed alone
                t0 = time.perf_counter()
                rec = on.telemetry.record(on.last_stats, category="x", policy="fixed:3",
                                          greedy=True)
                on.writer.submit(rec)
                direct.append(time.perf_counter() - t0)
        writer = on.writer
        on.close()
        med = {k: statistics.median(v) for k, v in walls.items()}
        print(f"{'real pair' if args.pair else 'tiny model'}, {args.threads} threads, "
              f"{len(direct)} requests each, {args.max_new_tokens} new tokens, k=3")
        print(f"store work on the request path (record + submit): median "
              f"{statistics.median(direct) * 1e6:.0f} us, p90 "
              f"{sorted(direct)[int(0.9 * len(direct))] * 1e6:.0f} us")
        print(f"end to end: median {med['on'] * 1e3:.2f} ms with the store, "
              f"{med['off'] * 1e3:.2f} ms without (ratio {med['on'] / med['off']:.3f})")
        print(f"writer: {writer.written} written, {writer.dropped} dropped, "
              f"{writer.failures} failures")


if __name__ == "__main__":
    main()
