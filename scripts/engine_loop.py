"""The Python steps of scripts/engine_loop.sh (run by .venv's interpreter):

    engine_loop.py mix WORK DB SET CATEGORIES N TOKENS [K]
                                   autospec serves the first N prompts of each category of a
                                   packaged prompt set (SET: its name, e.g. default, or a file;
                                   CATEGORIES: comma-separated, or "all"), each labelled with
                                   its category, at lookahead K (default 3; "auto": its
                                   default policy), and probes the pair (WORK/loop.json)
    engine_loop.py groups WORK CATEGORY...
                                   the categories' exports (WORK/vllm-CATEGORY.sh) grouped by
                                   their --speculative-config: one line per distinct setting,
                                   "SPEC<TAB>CATEGORY ...", one server each
    engine_loop.py scrape PORT FILE
                                   vLLM's /metrics into FILE once its spec-decode counters
                                   stop moving (the last step's counts can land after the
                                   response)
    engine_loop.py send-category WORK PORT MODEL TOKENS CATEGORY
                                   the category's prompts to vLLM's completions API, one at
                                   a time
    engine_loop.py verify DB CATEGORY BEFORE AFTER
                                   the scrapes' difference (read here by its own pattern) next
                                   to the record `autospec ingest` wrote for the category; exit
                                   status 1 where they differ
    engine_loop.py traffic WORK DB CATEGORY N TOKENS   the first N default prompts, all under
                                   one CATEGORY (scripts/vllm_peer.sh)
    engine_loop.py send WORK PORT MODEL TOKENS         all of loop.json's prompts to vLLM
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

from autospec.testing.vllm import SPEC_COUNTERS as _COUNTERS
from autospec.testing.vllm import spec_counters as _counters_of


def _pair(work: str):
    """(target, draft, tokenizer, names, small): the loop's pair, loaded (AUTOSPEC_LOOP_*)."""
    import autospec

    target_dir = os.environ.get("AUTOSPEC_LOOP_TARGET")
    draft_dir = os.environ.get("AUTOSPEC_LOOP_DRAFT")
    small = os.environ.get("AUTOSPEC_LOOP_PAIR", "default") == "small"
    if small and not target_dir:
        from autospec.testing.small_pair import save_small_pair

        target_dir, draft_dir = save_small_pair(work)
    elif not target_dir:  # the default pair, built into the cache where missing
        from autospec.pairs import PAIRS, cache_dir, load_pair

        load_pair("qwen2.5-coder", progress=False)
        spec_ = PAIRS["qwen2.5-coder"]
        target_dir, draft_dir = (str(cache_dir() / "hf" / f"{m.name}-bfloat16")
                                 for m in (spec_.target, spec_.draft))
    target, tok = autospec.load_model(target_dir, progress=False)
    draft, _ = autospec.load_model(draft_dir, progress=False)
    return target, draft, tok, (target_dir, draft_dir), small


def _as_text(p, tok, small: bool) -> str:
    """A packaged prompt as the completions API gets it: the chat template applied here where
    it asks for one (as autospec's bench encodes it); the small pair's words for the small
    pair."""
    if small:
        from autospec.testing.small_pair import small_prompt_of

        return small_prompt_of(p.prompt)
    if p.chat:
        return tok.apply_chat_template([{"role": "user", "content": p.prompt}], tokenize=False,
                                       add_generation_prompt=True)
    return p.prompt


def _prompt_set(name: str) -> str:
    from importlib import resources

    if os.path.exists(name):
        return name
    path = str(resources.files("autospec") / "prompts" / f"{name}.jsonl")
    if not os.path.exists(path):
        names = sorted(f[:-6] for f in os.listdir(os.path.dirname(path)) if f.endswith(".jsonl"))
        sys.exit(f"no prompt set {name!r}: a file, or one of {', '.join(names)}")
    return path


def _serve(work: str, db: str, groups: dict[str, list[str]], tokens: int, target, draft, tok,
           names, k: int | None = 3) -> None:
    """autospec serves each category's prompts under its label (greedy, at lookahead ``k``;
    None: its default policy chooses), then probes the pair; WORK/loop.json keeps the pair and
    the prompts per category."""
    import autospec
    from autospec.probe import probe
    from autospec.store import add_probe, open_store
    from autospec.telemetry import RequestTelemetry

    spec = autospec.Controller(target, draft, store=db, names=names)
    for category, prompts in groups.items():
        start, made = time.perf_counter(), 0
        for p in prompts:
            ids = tok(p, return_tensors="pt", add_special_tokens=False)
            out = spec.generate(**ids, max_new_tokens=tokens, do_sample=False, k=k,
                                category=category, eos_token_id=None)
            made += out.shape[1] - ids["input_ids"].shape[1]
        dt = time.perf_counter() - start
        print(f"autospec: category {category!r}: {len(prompts)} requests, {made} tokens in "
              f"{dt:.1f} s ({made / dt:.1f} tok/s)")
    spec.close()
    res = probe(target, draft, context=64, max_n=6, repeats=2, cache_dir=work)
    with open_store(db) as st, st.begin() as s:
        add_probe(s, RequestTelemetry(target, draft, names=names, measure_peak=False).pair,
                  res.to_dict())
    with open(f"{work}/loop.json", "w") as f:
        json.dump({"target": names[0], "draft": names[1], "categories": groups,
                   "prompts": [p for ps in groups.values() for p in ps]}, f)
    print(f"probe stored; target {names[0]}, draft {names[1]}")


def mix(work: str, db: str, prompt_set: str, categories: str, n: int, tokens: int,
        k: int | None = 3) -> None:
    import torch

    from autospec.bench.run import load_prompts

    torch.set_num_threads(2)
    target, draft, tok, names, small = _pair(work)
    groups: dict[str, list[str]] = {}
    for p in load_prompts(_prompt_set(prompt_set)):
        if categories == "all" or p.category in categories.split(","):
            if len(groups.setdefault(p.category, [])) < n:
                groups[p.category].append(_as_text(p, tok, small))
    missing = [c for c in categories.split(",") if c not in groups] if categories != "all" else []
    if missing or not groups:
        sys.exit(f"prompt set {prompt_set!r} has no category {', '.join(missing) or '(none)'}")
    print(f"labelled mix from prompt set {prompt_set!r}: "
          + ", ".join(f"{c} ({len(ps)})" for c, ps in groups.items()))
    _serve(work, db, groups, tokens, target, draft, tok, names, k)


def traffic(work: str, db: str, category: str, n: int, tokens: int) -> None:
    import torch

    from autospec.bench.run import default_prompts_path, load_prompts

    torch.set_num_threads(2)
    target, draft, tok, names, small = _pair(work)
    if small:
        from autospec.testing.small_pair import small_prompts

        prompts = small_prompts(n)
    else:
        prompts = [_as_text(p, tok, small) for p in load_prompts(default_prompts_path())[:n]]
    _serve(work, db, {category: prompts}, tokens, target, draft, tok, names)


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


def send_category(work: str, port: str, model: str, tokens: int, category: str) -> None:
    with open(f"{work}/loop.json") as f:
        prompts = json.load(f)["categories"][category]
    start, made = time.perf_counter(), 0
    for p in prompts:
        m, _ = _complete(port, model, p, tokens, ignore_eos=True)
        made += m
    dt = time.perf_counter() - start
    print(f"vLLM served category {category!r}: {len(prompts)} requests, {made} tokens in "
          f"{dt:.1f} s ({made / dt:.1f} tok/s, one at a time)")


def groups(work: str, *categories: str) -> None:
    """One line per distinct exported --speculative-config: the setting and its categories
    (in order); categories whose export serves without speculation are named on stderr."""
    by_spec: dict[str, list[str]] = {}
    for c in categories:
        spec_ = _spec_of(f"{work}/vllm-{c}.sh")
        if spec_ is None:
            print(f"category {c!r}: the export serves without speculation: not sent to vLLM "
                  f"(nothing to compare)", file=sys.stderr)
        else:
            by_spec.setdefault(spec_, []).append(c)
    for spec_, cats in by_spec.items():
        print(f"{spec_}\t{' '.join(cats)}")


def scrape(port: str, path: str, settle_s: float = 1.0, limit_s: float = 30.0) -> None:
    """/metrics into ``path`` once two reads ``settle_s`` apart give the same spec-decode
    counters: vLLM's API process records an engine step's stats after handing out its outputs,
    so a scrape right after a response can miss the last step's counts."""
    t0 = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    while time.perf_counter() - t0 < limit_s:
        time.sleep(settle_s)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            again = r.read().decode()
        same = _full_counters(again) == _full_counters(text)
        text = again
        if same:
            break
    else:
        sys.exit(f"vLLM's spec-decode counters still moved after {limit_s:.0f} s")
    with open(path, "w") as f:
        f.write(text)


_PER_POS = re.compile(r"^vllm:spec_decode_num_accepted_tokens_per_pos_total\{([^}]*)\} (\S+)$",
                      re.M)


def _full_counters(text: str) -> dict:
    """The three spec-decode counters and accepted tokens per position, summed over the
    scrape's label sets (engine, model_name): read by this script's own patterns, not by
    autospec.fleet.ingest's parser, so the check below is a check."""
    out: dict = dict(_counters_of(text))
    per: dict[int, float] = {}
    for m in _PER_POS.finditer(text):
        pos = re.search(r'position="(\d+)"', m.group(1))
        if pos:
            per[int(pos.group(1))] = per.get(int(pos.group(1)), 0.0) + float(m.group(2))
    out["accepted_per_position"] = [per.get(i, 0.0) for i in range(max(per, default=-1) + 1)]
    return out


def _trim(xs: list) -> list[int]:
    xs = [int(x) for x in xs]
    while xs and xs[-1] == 0:
        xs.pop()
    return xs


def verify(db: str, category: str, before: str, after: str) -> None:
    from sqlalchemy import select

    from autospec.store import open_store, queries
    from autospec.store.tables import Request
    from autospec.store.write import category_key

    b, a = (_full_counters(open(p).read()) for p in (before, after))
    diff = {k: a[k] - b[k] for k in _COUNTERS}
    width = max(len(a["accepted_per_position"]), len(b["accepted_per_position"]))
    pad = lambda xs: list(xs) + [0.0] * (width - len(xs))  # noqa: E731
    diff_pos = [x - y for x, y in zip(pad(a["accepted_per_position"]),
                                      pad(b["accepted_per_position"]))]
    with open_store(db, read_only=True) as st, st.session() as s:
        rid = s.scalar(select(Request.id)
                       .where(Request.category_key == category_key(category),
                              Request.stop_reason == "ingested")
                       .order_by(Request.id.desc()).limit(1))
        rows = {} if rid is None else queries.request_proposers(s, [rid]).get(rid, {})
    if rid is None:
        sys.exit(f"category {category!r}: no ingested record in the store")
    scraped = (int(diff["num_drafts"]), int(diff["num_draft_tokens"]),
               int(diff["num_accepted_tokens"]), _trim(diff_pos))
    # the engine's counters are the draft model's row (none: nothing counted)
    m = next((p for p in rows.values() if p.kind == "model"), None)
    stored = ((m.blocks, m.proposed, m.accepted, _trim(m.accepted_per_position)) if m
              else (0, 0, 0, []))
    fmt_ = "drafts {}, draft tokens {}, accepted {}, accepted per position {}"
    print(f"category {category!r}: scrape after − before: {fmt_.format(*scraped)}")
    print(f"category {category!r}: ingested record:       {fmt_.format(*stored)}")
    if scraped != stored:
        sys.exit(f"MISMATCH in category {category!r}: the ingested counters differ from the "
                 f"scrapes' difference")
    print(f"category {category!r}: equal")


def pair(db: str, category: str) -> None:
    from autospec.store import open_store, queries

    with open_store(db, read_only=True) as st, st.session() as s:
        (sm,) = queries.category_summaries(s, category=category)
    p = sm.pair
    print("\t".join((p.target, p.draft, p.dtype, p.hardware)))


def _spec_of(path: str) -> str | None:
    with open(path) as f:
        line = [ln for ln in f if ln.strip() and not ln.startswith("#")][0]
    argv = shlex.split(line)
    if "--speculative-config" in argv:
        return argv[argv.index("--speculative-config") + 1]
    return None


def spec(path: str) -> None:
    found = _spec_of(path)
    if found is not None:
        print(found)


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




def _spec_counters(port: str) -> dict[str, float]:
    """vLLM's spec-decode counters (vllm:spec_decode_<name>_total) from /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return _counters_of(text)


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
    if cmd == "mix":
        k = rest[6] if len(rest) > 6 else "3"  # "auto": autospec's default policy
        mix(rest[0], rest[1], rest[2], rest[3], int(rest[4]), int(rest[5]),
            None if k == "auto" else int(k))
    elif cmd == "groups":
        groups(*rest)
    elif cmd == "scrape":
        scrape(*rest)
    elif cmd == "send-category":
        send_category(rest[0], rest[1], rest[2], int(rest[3]), rest[4])
    elif cmd == "verify":
        verify(*rest)
    elif cmd == "traffic":
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
