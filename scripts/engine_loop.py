"""The Python steps of scripts/engine_loop.sh (run by .venv's interpreter):

    engine_loop.py traffic WORK DB CATEGORY N TOKENS   autospec serves N prompts, probes the pair
    engine_loop.py send WORK PORT MODEL TOKENS         the same prompts to vLLM's completions API
    engine_loop.py pair DB CATEGORY                    the category's pair, tab-separated
    engine_loop.py spec FILE                           the --speculative-config of an export

scripts/vllm_peer.sh's steps (vLLM as a peer, side by side with autospec):

    engine_loop.py peer-prompts WORK TARGET            the default prompts as vLLM gets them
    engine_loop.py peer-send WORK PORT MODEL TOKENS ROUNDS LABEL
                                                       each prompt, one at a time, timed per
                                                       request (WORK/peer.jsonl)
    engine_loop.py conc-send WORK PORT MODEL TOKENS CONC N LABEL
                                                       N requests at concurrency CONC; vLLM's
                                                       spec-decode counters before and after
                                                       (WORK/schedule.jsonl)
    engine_loop.py peer-table WORK [BENCH.json]        tokens/s and paired speedups per mode
"""

from __future__ import annotations

import json
import os
import re
import shlex
import statistics
import sys
import threading
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


def peer_prompts(work: str, target: str) -> None:
    """The packaged default prompts as text for the completions API: the chat template applied
    client-side where a prompt has ``"chat": true`` (as autospec's bench encodes them)."""
    from transformers import AutoTokenizer

    from autospec.bench.run import default_prompts_path, load_prompts

    tok = AutoTokenizer.from_pretrained(target)
    out = []
    for p in load_prompts(default_prompts_path()):
        text = (tok.apply_chat_template([{"role": "user", "content": p.prompt}], tokenize=False,
                                        add_generation_prompt=True) if p.chat else p.prompt)
        out.append({"category": p.category, "chat": p.chat, "text": text})
    with open(f"{work}/peer_prompts.json", "w") as f:
        json.dump(out, f)
    print(f"{len(out)} prompts: " + ", ".join(p["category"] for p in out))


def _complete(port: str, model: str, prompt: str, tokens: int,
              ignore_eos: bool = False) -> tuple[int, float]:
    """One non-streaming greedy completion: (completion tokens, round-trip seconds). It stops
    at the end-of-sequence token, as autospec's bench does, unless ``ignore_eos``."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": tokens,
                       "temperature": 0, "ignore_eos": ignore_eos}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        made = json.load(r)["usage"]["completion_tokens"]
    return made, time.perf_counter() - t0


def peer_send(work: str, port: str, model: str, tokens: int, rounds: int, label: str) -> None:
    with open(f"{work}/peer_prompts.json") as f:
        prompts = json.load(f)
    # untimed: every prompt once first. vLLM's CPU build is several times slower on its first
    # requests after start (measured: 2.7–3.0 tok/s on the first two, 6.5 after)
    for p in prompts:
        _complete(port, model, p["text"], tokens)
    with open(f"{work}/peer.jsonl", "a") as out:
        for rnd in range(rounds):
            for i, p in enumerate(prompts):
                made, dt = _complete(port, model, p["text"], tokens)
                rec = {"mode": label, "category": p["category"], "prompt": i, "round": rnd,
                       "tokens": made, "wall_s": dt}
                out.write(json.dumps(rec) + "\n")
                out.flush()
                print(f"{label} {p['category']} #{i} round {rnd}: {made} tokens in {dt:.1f} s "
                      f"({made / dt:.2f} tok/s)")


_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def _spec_counters(port: str) -> dict[str, float]:
    """vLLM's spec-decode counters (vllm:spec_decode_<name>_total) from /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return _counters_of(text)


def _counters_of(text: str) -> dict[str, float]:
    out = dict.fromkeys(_COUNTERS, 0.0)
    for name in _COUNTERS:
        for m in re.finditer(rf"^vllm:spec_decode_{name}_total{{[^}}]*}} (\S+)$", text, re.M):
            out[name] += float(m.group(1))
    return out


def conc_send(work: str, port: str, model: str, tokens: int, conc: int, n: int,
              label: str) -> None:
    """N requests (the prompts in turn) from CONC client threads at once; what vLLM drafted
    meanwhile, from its counters before and after: draft tokens per draft = the k it used."""
    with open(f"{work}/peer_prompts.json") as f:
        prompts = [p["text"] for p in json.load(f)]
    todo = list(range(n))
    lock = threading.Lock()
    made: list[int] = []

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            # every request runs its TOKENS: the batch stays full until the phase ends
            m, _ = _complete(port, model, prompts[i % len(prompts)], tokens, ignore_eos=True)
            with lock:
                made.append(m)

    before = _spec_counters(port)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    after = _spec_counters(port)
    d = {k: after[k] - before[k] for k in _COUNTERS}
    rec = {"label": label, "concurrency": conc, "requests": n, "tokens": sum(made),
           "wall_s": dt, **d,
           "draft_tokens_per_draft": (d["num_draft_tokens"] / d["num_drafts"]
                                      if d["num_drafts"] else None)}
    with open(f"{work}/schedule.jsonl", "a") as out:
        out.write(json.dumps(rec) + "\n")
    per = rec["draft_tokens_per_draft"]
    print(f"{label} concurrency {conc}: {n} requests, {sum(made)} tokens in {dt:.1f} s; "
          f"drafts {d['num_drafts']:.0f}, draft tokens {d['num_draft_tokens']:.0f}, accepted "
          f"{d['num_accepted_tokens']:.0f}; draft tokens per draft "
          + (f"{per:.2f}" if per is not None else "- (no drafts)"))


def _paired(recs: list[dict], base: dict) -> list[float]:
    """Per-request speedups over the same request (prompt, round) in the baseline mode."""
    out = []
    for r in recs:
        b = base.get((r["prompt"], r["round"]))
        if b is not None and r["tokens"] and b["tokens"]:
            out.append((r["tokens"] / r["wall_s"]) / (b["tokens"] / b["wall_s"]))
    return out


def peer_table(work: str, bench: str | None = None) -> None:
    """One markdown table: tokens/s per mode and category (total tokens / total time) and each
    mode's speedup over its own plain, paired per request (median of the per-request ratios,
    how many of N faster)."""
    recs = []
    if os.path.exists(f"{work}/peer.jsonl"):
        with open(f"{work}/peer.jsonl") as f:
            recs += [dict(json.loads(ln), engine="vLLM", base="vllm-plain") for ln in f]
    if bench:
        with open(bench) as f:
            data = json.load(f)
        for r in data["runs"]:
            if r.get("batch", 1) != 1:
                continue
            mode = "autospec-plain" if r["mode"] == "plain" else f"autospec-{r['mode']}"
            recs.append({"mode": mode, "category": r["category"], "prompt": r["prompt_index"],
                         "round": r["repeat"], "tokens": r["new_tokens"], "wall_s": r["wall_s"],
                         "engine": "transformers", "base": "autospec-plain"})
    modes = list(dict.fromkeys(r["mode"] for r in recs))
    cats = list(dict.fromkeys(r["category"] for r in recs)) + ["overall"]
    print("| mode | category | N | tokens/s | speedup over its plain: median of per-request "
          "ratios | faster |")
    print("|---|---|---|---|---|---|")
    summary = []
    for mode in modes:
        mine = [r for r in recs if r["mode"] == mode]
        base = {(r["prompt"], r["round"]): r for r in recs if r["mode"] == mine[0]["base"]}
        for cat in cats:
            sel = [r for r in mine if cat == "overall" or r["category"] == cat]
            if not sel:
                continue
            tps = sum(r["tokens"] for r in sel) / sum(r["wall_s"] for r in sel)
            ratios = [] if mode == mine[0]["base"] else _paired(sel, base)
            med = statistics.median(ratios) if ratios else None
            summary.append({"mode": mode, "category": cat, "n": len(sel), "tok_s": tps,
                            "median_ratio": med, "faster": sum(x > 1 for x in ratios),
                            "paired": len(ratios)})
            print(f"| {mode} | {cat} | {len(sel)} | {tps:.2f} | "
                  + (f"{med:.2f}× | {sum(x > 1 for x in ratios)}/{len(ratios)} |"
                     if med is not None else "1 (baseline) | - |"))
    if {"vllm-exported", "vllm-default"} <= set(modes):  # the question: exported ≥ default?
        print("\n| category | N | vllm-exported over vllm-default: median of per-request "
              "ratios | exported faster |")
        print("|---|---|---|---|")
        dflt = {(r["prompt"], r["round"]): r for r in recs if r["mode"] == "vllm-default"}
        for cat in cats:
            sel = [r for r in recs if r["mode"] == "vllm-exported"
                   and (cat == "overall" or r["category"] == cat)]
            ratios = _paired(sel, dflt)
            if ratios:
                print(f"| {cat} | {len(ratios)} | {statistics.median(ratios):.2f}× | "
                      f"{sum(x > 1 for x in ratios)}/{len(ratios)} |")
        print()
    for label in modes:
        paths = [f"{work}/{label}_{w}.txt" for w in ("before", "after")]
        if all(os.path.exists(p) for p in paths):
            b, a = (_counters_of(open(p).read()) for p in paths)
            d = {k: a[k] - b[k] for k in _COUNTERS}
            if d["num_drafts"]:
                print(f"{label}: vLLM drafted {d['num_draft_tokens']:.0f} tokens in "
                      f"{d['num_drafts']:.0f} drafts, accepted {d['num_accepted_tokens']:.0f} "
                      f"(α={d['num_accepted_tokens'] / d['num_draft_tokens']:.3f}, mean "
                      f"acceptance length {1 + d['num_accepted_tokens'] / d['num_drafts']:.2f})")
    with open(f"{work}/peer_summary.json", "w") as f:
        json.dump(summary, f, indent=1)


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
    elif cmd == "peer-prompts":
        peer_prompts(*rest)
    elif cmd == "peer-send":
        peer_send(rest[0], rest[1], rest[2], int(rest[3]), int(rest[4]), rest[5])
    elif cmd == "conc-send":
        conc_send(rest[0], rest[1], rest[2], int(rest[3]), int(rest[4]), int(rest[5]), rest[6])
    elif cmd == "peer-table":
        peer_table(*rest)
    else:
        sys.exit(f"unknown step {cmd!r}")
