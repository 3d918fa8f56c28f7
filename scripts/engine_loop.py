"""The Python steps of scripts/engine_loop.sh (run by .venv's interpreter):

    engine_loop.py traffic WORK DB CATEGORY N TOKENS   autospec serves N prompts, probes the pair
    engine_loop.py send WORK PORT MODEL TOKENS         the same prompts to vLLM's completions API
    engine_loop.py pair DB CATEGORY                    the category's pair, tab-separated
    engine_loop.py spec FILE                           the --speculative-config of an export
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
import urllib.request


def traffic(work: str, db: str, category: str, n: int, tokens: int) -> None:
    import torch

    import autospec
    from autospec.costs.probe import probe
    from autospec.store import add_probe, open_store
    from autospec.telemetry import RequestTelemetry

    torch.set_num_threads(2)
    target_dir = os.environ.get("AUTOSPEC_LOOP_TARGET")
    draft_dir = os.environ.get("AUTOSPEC_LOOP_DRAFT")
    small = os.environ.get("AUTOSPEC_LOOP_PAIR", "default") == "small"
    if not target_dir and not small:  # the default pair, built into the cache where missing
        from autospec.pairs import PAIRS, cache_dir, load_pair

        load_pair("qwen2.5-coder", progress=False)
        spec_ = PAIRS["qwen2.5-coder"]
        target_dir, draft_dir = (str(cache_dir() / "hf" / f"{m.name}-bfloat16")
                                 for m in (spec_.target, spec_.draft))
    if target_dir:
        target, tok = autospec.load_model(target_dir, progress=False)
        draft, _ = autospec.load_model(draft_dir, progress=False)
        from autospec.bench.run import default_prompts_path, load_prompts

        prompts = []
        for p in load_prompts(default_prompts_path())[:n]:  # as text, template applied
            prompts.append(tok.apply_chat_template([{"role": "user", "content": p.prompt}],
                                                   tokenize=False, add_generation_prompt=True)
                           if p.chat else p.prompt)
    else:
        from autospec.testing.small_pair import save_small_pair, small_prompts

        target_dir, draft_dir = save_small_pair(work)
        target, tok = autospec.load_model(target_dir, progress=False)
        draft, _ = autospec.load_model(draft_dir, progress=False)
        prompts = small_prompts(n)
    names = (target_dir, draft_dir)
    spec = autospec.Controller(target, draft, store=db, names=names)
    start = time.perf_counter()
    made = 0
    for p in prompts:
        ids = tok(p, return_tensors="pt", add_special_tokens=False)
        out = spec.generate(**ids, max_new_tokens=tokens, do_sample=False, k=3,
                            category=category, eos_token_id=None)
        made += out.shape[1] - ids["input_ids"].shape[1]
    spec.close()
    dt = time.perf_counter() - start
    print(f"autospec: {len(prompts)} requests, {made} tokens in {dt:.1f} s "
          f"({made / dt:.1f} tok/s)")
    res = probe(target, draft, context=64, max_n=6, repeats=2, cache_dir=work)
    with open_store(db) as st, st.begin() as s:
        add_probe(s, RequestTelemetry(target, draft, names=names, measure_peak=False).pair,
                  res.to_dict())
    with open(f"{work}/loop.json", "w") as f:
        json.dump({"target": target_dir, "draft": draft_dir, "prompts": prompts}, f)
    print(f"probe stored; target {target_dir}, draft {draft_dir}")


def send(work: str, port: str, model: str, tokens: int) -> None:
    with open(f"{work}/loop.json") as f:
        prompts = json.load(f)["prompts"]
    start, made = time.perf_counter(), 0
    for p in prompts:
        body = json.dumps({"model": model, "prompt": p, "max_tokens": tokens, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            made += json.load(r)["usage"]["completion_tokens"]
    dt = time.perf_counter() - start
    print(f"vLLM: {len(prompts)} requests, {made} tokens in {dt:.1f} s "
          f"({made / dt:.1f} tok/s, one at a time)")


def pair(db: str, category: str) -> None:
    from autospec.store import open_store, queries

    with open_store(db, read_only=True) as st, st.session() as s:
        (sm,) = queries.category_summaries(s, category=category)
    p = sm.pair
    print("\t".join((p.target, p.draft, p.dtype, p.hardware)))


def spec(path: str) -> None:
    with open(path) as f:
        line = [ln for ln in f if ln.strip() and not ln.startswith("#")][0]
    argv = shlex.split(line)
    if "--speculative-config" in argv:
        print(argv[argv.index("--speculative-config") + 1])


if __name__ == "__main__":
    cmd, *rest = sys.argv[1:]
    if cmd == "traffic":
        traffic(rest[0], rest[1], rest[2], int(rest[3]), int(rest[4]))
    elif cmd == "send":
        send(rest[0], rest[1], rest[2], int(rest[3]))
    elif cmd == "pair":
        pair(*rest)
    elif cmd == "spec":
        spec(*rest)
    else:
        sys.exit(f"unknown step {cmd!r}")
