"""autospec inside a real vLLM, measured on a labelled mix (the default pair in bf16, vLLM's CPU
build, greedy), one server at a time, each sent the same requests in the same order:

    plain      (a) vLLM without speculation: every other mode is paired with it per request
    ngram5     (b) vLLM's n-gram method with its defaults (k = 5, lookup min = max = 5)
    draft5     (b) vLLM's draft model at the documented k = 5
    autospec   (e) autospec's proposer as vLLM's custom_class (k per request per step, up to 8),
               its records written into the store the export read (after the export)
    exported-N (d) each distinct per-category setting `autospec export --engine vllm` writes from
               a store of autospec's own traffic on other prompts of the same categories
    ngram3, draft1, draft3   more fixed settings, so (c), the best fixed setting per category
               in hindsight, is chosen from ngram5, ngram3, draft1, draft3, draft5 and the exports

Each server first gets three unrelated prompts (untimed: vLLM's CPU build is slow on its first
requests), then the mix one request at a time (timed), then a second set of prompts from two
clients at once (the engine at batch 2). The requests' token ids are kept: (e) must equal (a).

    .venv/bin/python scripts/vllm_mix.py WORK [STEP...]
        steps (default: all, in this order): prompts train steps probe export plain autospec
        ngram5 draft5 exported ngram3 draft1 draft3 table

The store the export reads holds autospec's traffic on the training prompts (transformers, its
default policy: ``train``) and vLLM's own steps on the same prompts — through autospec's
proposer in vLLM (``steps``: its records under the one label "train-steps"), and with the
draft model at a few fixed k (``probe``: each server's scrape window ingested under the label
"train-probe") — so no measured category is learned from them, all before anything measured.
    AUTOSPEC_MIX_PROBE_K (default "0 1 3 5 7"): the k ``probe`` serves the draft model at (0:
    plain, vLLM's plain step by the same clock);
    AUTOSPEC_MIX_TOKENS (default 48), AUTOSPEC_MIX_START_S (default 600);
    AUTOSPEC_MIX_MEASURED=long: the long prompts (retrieval, long-summary) are the mix instead

A step whose results are in WORK already is skipped (delete WORK/mix.jsonl's lines to rerun).
The table goes to stdout and WORK/table.md; every request to WORK/mix.jsonl.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
TOKENS = int(os.environ.get("AUTOSPEC_MIX_TOKENS", "48"))
START_S = float(os.environ.get("AUTOSPEC_MIX_START_S", "600"))
K_AUTOSPEC = 8

# (set, category, indices): measured in this order, interleaved by category
MEASURED = [("default", "code", (0, 1)), ("default", "chat", (0, 1)),
            ("default", "translation", (0, 1)), ("copy", "code-edit", (0, 1)),
            ("copy", "qa-quote", (0, 1)), ("repeat_holdout", "sql", (0, 1, 2, 3)),
            ("repeat_holdout", "tool-call", (0, 1, 2, 3))]
if os.environ.get("AUTOSPEC_MIX_MEASURED") == "long":  # long prompts (~700 tokens), in turn
    MEASURED = [("long", "retrieval", (0, 1, 2, 3)), ("long", "long-summary", (0, 1))]
TRAIN = [("traffic", "code", (0, 1, 2)), ("traffic", "chat", (0, 1, 2)),
         ("traffic", "translation", (0, 1, 2)), ("copy", "code-edit", (2, 3, 4)),
         ("copy", "qa-quote", (2, 3, 4)), ("repeat", "sql", (0, 1, 2)),
         ("repeat", "tool-call", (0, 1, 2))]
CONCURRENT = [("holdout", "code", (0, 1)), ("holdout", "chat", (0, 1)),
              ("holdout", "translation", (0, 1)), ("holdout", "summary", (0, 1)),
              ("repeat_holdout", "support-reply", (0, 1, 2, 3))]
WARM = [("traffic", "code", (20,)), ("traffic", "chat", (20,)), ("traffic", "translation", (20,))]
FIXED = {"ngram5": {"method": "ngram", "num_speculative_tokens": 5},
         "ngram3": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                    "prompt_lookup_max": 5},
         "draft1": {"method": "draft_model", "num_speculative_tokens": 1},
         "draft3": {"method": "draft_model", "num_speculative_tokens": 3},
         "draft5": {"method": "draft_model", "num_speculative_tokens": 5}}
TRAIN_K = os.environ.get("AUTOSPEC_MIX_TRAIN_K", "auto")  # the training traffic's lookahead
# the k at which vLLM's own steps with the draft model are measured for the export (``probe``)
PROBE_K = [int(k) for k in os.environ.get("AUTOSPEC_MIX_PROBE_K", "0 1 3 5 7").split()]
STEPS = ["prompts", "train", "steps", "probe", "export", "plain", "autospec", "ngram5", "draft5", "exported",
         "ngram3", "draft1", "draft3", "plain-fp32", "autospec-fp32", "table"]


def stamp(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pair_dirs() -> tuple[str, str]:
    from autospec.pairs import PAIRS, cache_dir, load_pair

    p = PAIRS["qwen2.5-coder"]
    dirs = [str(cache_dir() / "hf" / f"{m.name}-bfloat16") for m in (p.target, p.draft)]
    if not all(os.path.isdir(d) for d in dirs):
        load_pair("qwen2.5-coder", progress=False)
    return dirs[0], dirs[1]


def _select(groups, tok) -> list[dict]:
    from autospec.bench.run import load_prompts

    sets: dict[str, list] = {}
    per: list[list[dict]] = []
    for name, category, idx in groups:
        if name not in sets:
            sets[name] = load_prompts(ROOT / "autospec" / "prompts" / f"{name}.jsonl")
        mine = [p for p in sets[name] if p.category == category]
        per.append([{"category": category, "prompt": mine[i].prompt, "chat": mine[i].chat,
                     "text": (tok.apply_chat_template(
                         [{"role": "user", "content": mine[i].prompt}], tokenize=False,
                         add_generation_prompt=True) if mine[i].chat else mine[i].prompt)}
                    for i in idx])
    out = []  # interleaved: one of each category in turn
    for j in range(max(len(g) for g in per)):
        out += [g[j] for g in per if j < len(g)]
    return out


def prompts(work: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pair_dirs()[0])
    doc = {name: _select(groups, tok) for name, groups in
           (("measured", MEASURED), ("concurrent", CONCURRENT), ("warm", WARM),
            ("train", TRAIN))}
    (work / "mix.json").write_text(json.dumps(doc, indent=1))
    with open(work / "train.jsonl", "w") as f:  # as a packaged set, for engine_loop.py mix
        for p in doc["train"]:
            f.write(json.dumps({k: p[k] for k in ("category", "prompt", "chat")}) + "\n")
    stamp(", ".join(f"{k}: {len(v)}" for k, v in doc.items()) + " prompts")


def train(work: Path) -> None:
    """autospec serves the training prompts (transformers, its default policy unless
    AUTOSPEC_MIX_TRAIN_K gives a k, labelled) and probes the pair into WORK/store.db: the
    store the export reads."""
    target, draft = pair_dirs()
    env = dict(os.environ, AUTOSPEC_LOOP_TARGET=target, AUTOSPEC_LOOP_DRAFT=draft)
    subprocess.run([PY, str(ROOT / "scripts" / "engine_loop.py"), "mix", str(work),
                    f"sqlite:///{work}/store.db", str(work / "train.jsonl"), "all", "3",
                    str(TOKENS), TRAIN_K], check=True, env=env)


def engine_steps(work: Path) -> None:
    """vLLM's own step costs for the export: autospec's proposer serves the training prompts
    in vLLM (custom_class), its records — the engine's steps, path vllm — into WORK/store.db
    under one label, "train-steps" (the costs are the pair's, pooled over categories; no
    measured category's acceptance is learned from them). Untimed."""
    from autospec.fleet.engines import vllm_python
    from autospec.testing.vllm import CUSTOM_CLASS, Server

    done = work / "steps.done"
    if done.exists():
        stamp("steps: done already, skipped")
        return
    target, _ = pair_dirs()
    doc = json.loads((work / "mix.json").read_text())
    py = vllm_python()
    spec = {"method": "custom_class", "model": CUSTOM_CLASS, "num_speculative_tokens": K_AUTOSPEC}
    with Server(py, target, work / "steps.log", spec, _proposer_env(work, py, store=True),
                start_s=START_S) as server:
        stamp(f"steps: up in {server.started_s:.0f} s")
        for p in doc["warm"] + doc["train"]:
            server.complete(p["text"], TOKENS, "train-steps", ignore_eos=False)
        time.sleep(5)  # the proposer's records, written off the hot path
    done.write_text(f"{len(doc['warm']) + len(doc['train'])} requests\n")
    stamp(f"steps: {len(doc['warm']) + len(doc['train'])} requests served")


def probe(work: Path) -> None:
    """vLLM's own steps with the draft model for the export: a server per k in PROBE_K (the
    draft model at that fixed k; 0: plain) serves the training prompts one at a time, and the window's
    scrapes go through `autospec ingest --baseline` into WORK/store.db — vLLM's seconds per
    step at that k, by its own clock, on the export's pair, under one label, "train-probe"
    (the steps are the pair's; no measured category's acceptance is learned from them).
    Untimed by this script: the engine's clock is the measurement."""
    from autospec.fleet.engines import vllm_python
    from autospec.store import open_store, queries
    from autospec.testing.vllm import Server

    target, draft = pair_dirs()
    doc = json.loads((work / "mix.json").read_text())
    py = vllm_python()
    with open_store(f"sqlite:///{work}/store.db", read_only=True) as st, st.session() as s:
        pair = next(p for p in queries.pairs(s) if p.id == _draft_pair(work))
    for k in PROBE_K:
        done = work / f"probe{k}.done"
        if done.exists():
            stamp(f"probe k = {k}: done already, skipped")
            continue
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": k} if k else None
        with Server(py, target, work / f"probe{k}.log", spec, {}, start_s=START_S) as server:
            stamp(f"probe k = {k}: up in {server.started_s:.0f} s")
            for p in doc["warm"]:
                server.complete(p["text"], TOKENS, ignore_eos=False)
            time.sleep(2)  # vLLM's API process records a step's counts after answering
            before = work / f"probe{k}.before.txt"
            before.write_text(server.metrics())
            t0 = time.perf_counter()
            for p in doc["train"]:
                server.complete(p["text"], TOKENS, ignore_eos=False)
            wall = time.perf_counter() - t0  # the client's clock, beside the engine's
            time.sleep(2)
            after = work / f"probe{k}.after.txt"
            after.write_text(server.metrics())
        said = subprocess.run(
            [str(ROOT / ".venv" / "bin" / "autospec"), "ingest", "--db",
             f"sqlite:///{work}/store.db", "--prometheus", str(after), "--baseline", str(before),
             "--category", "train-probe", "--target", pair.target, "--draft", pair.draft,
             "--dtype", pair.dtype, "--hardware", pair.hardware],
            check=True, capture_output=True, text=True).stdout
        stamp(f"probe k = {k}: {len(doc['train'])} requests in {wall:.1f} s by the client's "
              f"clock; {' '.join(said.split())}")
        done.write_text(said)


def _proposer_env(work: Path, py, *, store: bool, stats: str | None = None) -> dict:
    """The environment of a vLLM server that loads autospec's proposer (custom_class) from
    this checkout, the store's packages installed beside it; ``store``: its records go into
    WORK/store.db; ``stats``: the proposer's counters to that file."""
    from autospec.testing.vllm import store_packages

    store_packages(py, work / "site")
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(work / "site")])}
    if store:
        env["AUTOSPEC_VLLM_STORE"] = f"sqlite:///{work}/store.db"
    if stats:
        env["AUTOSPEC_VLLM_STATS"] = stats
    return env


def _draft_pair(work: Path) -> int:
    """The store's pair with a draft model (autospec's training traffic): the export's."""
    from autospec.store import open_store, queries
    from autospec.traces import NO_DRAFT

    with open_store(f"sqlite:///{work}/store.db", read_only=True) as st, st.session() as s:
        return next(p.id for p in queries.pairs(s) if p.draft != NO_DRAFT)


def export(work: Path) -> None:
    """Each measured category's export (its --speculative-config, or none: no speculation)."""
    _, draft = pair_dirs()
    specs = {}
    pair_id = _draft_pair(work)
    for _, category, _ in MEASURED:
        out = work / f"vllm-{category}.sh"
        subprocess.run([str(ROOT / ".venv" / "bin" / "autospec"), "export", "--db",
                        f"sqlite:///{work}/store.db", "--engine", "vllm", "--category",
                        category, "--pair-id", str(pair_id), "--out", str(out)], check=True)
        spec = subprocess.run([PY, str(ROOT / "scripts" / "engine_loop.py"), "spec", str(out)],
                              check=True, capture_output=True, text=True).stdout.strip()
        specs[category] = json.loads(spec) if spec else None
        if specs[category] and specs[category].get("method") == "draft_model":
            specs[category]["model"] = draft  # the draft's local directory, as vLLM loads it
        stamp(f"export {category}: {specs[category]}")
    (work / "exported.json").write_text(json.dumps(specs, indent=1))


def _done(work: Path) -> set[str]:
    path = work / "mix.jsonl"
    if not path.exists():
        return set()
    return {json.loads(ln)["mode"] for ln in path.read_text().splitlines() if ln.strip()}


def serve(work: Path, mode: str, spec: dict | None, dtype: str = "bfloat16") -> None:
    """One server: warm, the mix one at a time, the concurrent set from two clients."""
    from autospec.fleet.engines import vllm_python
    from autospec.testing.vllm import Server, spec_counters

    if mode in _done(work):
        stamp(f"{mode}: in mix.jsonl already, skipped")
        return
    target, draft = pair_dirs()
    doc = json.loads((work / "mix.json").read_text())
    py = vllm_python()
    env, label = {}, False
    if spec and spec.get("method") == "draft_model":
        spec = dict(spec, model=draft)
    if spec and spec.get("method") == "custom_class":
        # bf16: the records go into the store the export read
        env = _proposer_env(work, py, store=dtype == "bfloat16",
                            stats=str(work / f"{mode}.proposer.json"))
        label = True
    stamp(f"{mode}: starting vLLM {json.dumps(spec) if spec else '(plain)'}")
    recs = []
    with Server(py, target, work / f"{mode}.log", spec, env, start_s=START_S,
                dtype=dtype) as server:
        stamp(f"{mode}: up in {server.started_s:.0f} s")
        for p in doc["warm"]:
            server.complete(p["text"], TOKENS, "warmup" if label else None, ignore_eos=False)
        measured = list(enumerate(doc["measured"]))
        before = spec_counters(server.metrics())
        for i, p in measured:
            t0 = time.perf_counter()
            ids = server.complete(p["text"], TOKENS, p["category"] if label else None,
                                  ignore_eos=False)
            recs.append({"mode": mode, "phase": "seq", "i": i, "category": p["category"],
                         "tokens": len(ids), "wall_s": time.perf_counter() - t0, "ids": ids})
        time.sleep(2)  # vLLM's API process records a step's counts after answering
        after = spec_counters(server.metrics())
        stamp(f"{mode}: {len(measured)} requests one at a time, "
              f"{sum(r['tokens'] for r in recs)} tokens in {sum(r['wall_s'] for r in recs):.0f} s;"
              f" spec-decode {({k: after[k] - before[k] for k in after})}")
        # the concurrent set, two clients
        todo = list(enumerate(doc["concurrent"]))
        lock = threading.Lock()

        def client() -> None:
            while True:
                with lock:
                    if not todo:
                        return
                    i, p = todo.pop(0)
                t0 = time.perf_counter()
                ids = server.complete(p["text"], TOKENS, p["category"] if label else None,
                                      ignore_eos=False)
                with lock:
                    recs.append({"mode": mode, "phase": "conc", "i": i,
                                 "category": p["category"], "tokens": len(ids),
                                 "wall_s": time.perf_counter() - t0, "ids": ids})
        t0 = time.perf_counter()
        threads = [threading.Thread(target=client) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        phase_s = time.perf_counter() - t0
        conc = [r for r in recs if r["phase"] == "conc"]
        stamp(f"{mode}: {len(conc)} requests from two clients, "
              f"{sum(r['tokens'] for r in conc)} tokens in {phase_s:.0f} s")
        with open(work / "phases.jsonl", "a") as f:
            f.write(json.dumps({"mode": mode, "phase": "conc", "wall_s": phase_s,
                                "tokens": sum(r["tokens"] for r in conc)}) + "\n")
        if label:
            time.sleep(5)  # the proposer's records, written off the hot path
    with open(work / "mix.jsonl", "a") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")


def _key(spec: dict) -> str:
    """A setting's identity, the draft model's directory aside."""
    return json.dumps({k: v for k, v in spec.items() if k != "model"}, sort_keys=True)


def exported_modes(specs: dict[str, dict | None]) -> dict[str, tuple[str, dict | None]]:
    """Each category's exported setting as a mode: (name, spec); the fixed mode of the same
    setting where there is one (served once; a draft model at k alone is "draftK", whether
    FIXED lists it or not, so a k any export or fixed run served is served once), else
    exported-N per distinct setting; plain where the export serves without speculation."""
    fixed = {_key(f): m for m, f in FIXED.items()}
    fixed.update({_key({"method": "draft_model", "num_speculative_tokens": k}): f"draft{k}"
                  for k in range(1, 17)})
    out: dict[str, tuple[str, dict | None]] = {}
    numbered: dict[str, str] = {}
    for category, spec in specs.items():
        key = None if spec is None else _key(spec)
        if spec is None:
            out[category] = ("plain", None)
        elif key in fixed:
            out[category] = (fixed[key], spec)
        else:
            out[category] = (numbered.setdefault(key, f"exported-{len(numbered) + 1}"), spec)
    return out


def exported(work: Path) -> None:
    specs = json.loads((work / "exported.json").read_text())
    modes = exported_modes(specs)
    for mode, spec in dict(modes.values()).items():
        cats = [c for c, (m, _) in modes.items() if m == mode]
        stamp(f"exported as {mode}: {json.dumps(spec)} for {', '.join(cats)}")
        if mode != "plain":
            serve(work, mode, spec)


def _ratio(mine: list[dict], base: dict) -> list[float]:
    """Per-request speedups (tokens/s over the same request's in the baseline)."""
    out = []
    for r in mine:
        b = base.get((r["phase"], r["i"]))
        if b and r["tokens"] and b["tokens"]:
            out.append((r["tokens"] / r["wall_s"]) / (b["tokens"] / b["wall_s"]))
    return out


def _gm(xs: list[float]) -> float:
    return statistics.geometric_mean(xs) if xs else float("nan")


def table(work: Path) -> None:
    recs = [json.loads(ln) for ln in (work / "mix.jsonl").read_text().splitlines() if ln.strip()]
    specs = json.loads((work / "exported.json").read_text()) if (
        work / "exported.json").exists() else {}
    by_mode: dict[str, dict] = {}
    for r in recs:
        by_mode.setdefault(r["mode"], {})[(r["phase"], r["i"])] = r
    plain = by_mode["plain"]
    cats = list(dict.fromkeys(r["category"] for r in recs if r["phase"] == "seq"))
    lines = []
    w = lines.append

    def cell(mode: str, cat: str | None, phase: str = "seq") -> list[float]:
        mine = [r for r in by_mode.get(mode, {}).values()
                if r["phase"] == phase and (cat is None or r["category"] == cat)]
        return [1.0] * len(mine) if mode == "plain" else _ratio(mine, plain)

    def combo(choice: dict[str, str], cat: str | None) -> list[float]:
        return [x for c in cats if cat in (None, c) for x in cell(choice[c], c)]

    # (d): each category served by its own export (plain where it exports no speculation)
    d_mode = {c: m for c, (m, _) in exported_modes(specs).items() if c in cats}
    if not specs or not all(m in by_mode for m in d_mode.values()):
        d_mode = {}  # not every export served yet
    modes = [m for m in ("ngram5", "draft5", "ngram3", "draft1", "draft3") if m in by_mode]
    modes += sorted((m for m in by_mode if m.startswith("draft") and m[5:].isdigit()
                     and m not in modes), key=lambda m: int(m[5:]))  # an export's own k
    modes += sorted((m for m in by_mode if m.startswith("exported-")),
                    key=lambda m: int(m.split("-")[1]))
    # (c): the best fixed setting per category in hindsight, plain (k = 0) included
    best = {c: max(["plain"] + modes, key=lambda m, c=c: _gm(cell(m, c))) for c in cats}
    if "autospec" in by_mode:
        modes.append("autospec")
    w("Speedup over vLLM plain (a), one request at a time: geometric mean over the category's "
      "requests of each request's tokens/s over its own in (a)")
    w("")
    head = ["category", "n"] + modes + ["(c) best fixed"] + (["(d) exported"] if d_mode else [])
    w("| " + " | ".join(head) + " |")
    w("|" + "---|" * len(head))
    for cat in cats + [None]:
        row = [cat or "**mix**", str(len(cell("plain", cat)))]
        row += [f"{_gm(cell(m, cat)):.2f}" for m in modes]
        row.append(f"{_gm(combo(best, cat)):.2f}" + (f" ({best[cat]})" if cat else ""))
        if d_mode:
            row.append(f"{_gm(combo(d_mode, cat)):.2f}" + (f" ({d_mode[cat]})" if cat else ""))
        w("| " + " | ".join(row) + " |")
    w("")
    w("Greedy output against plain vLLM of the same dtype, request by request (one at a time; "
      "two clients): requests token-identical, and where the first differs the position of "
      "its first different token")
    for m in by_mode:
        base = by_mode.get("plain-fp32" if m.endswith("-fp32") else "plain", {})
        if m.startswith("plain") or not base:
            continue
        cells = []
        for phase in ("seq", "conc"):
            same, first = 0, []
            keys = [key for key in by_mode[m] if key[0] == phase and key in base]
            for key in keys:
                a, b = by_mode[m][key]["ids"], base[key]["ids"]
                if a == b:
                    same += 1
                else:
                    first.append(next((j for j, (x, y) in enumerate(zip(a, b)) if x != y),
                                      min(len(a), len(b))))
            cells.append(f"{same}/{len(keys)}" + (f" (at {sorted(first)})" if first else ""))
        w(f"- {m}: {cells[0]}; two clients {cells[1]}")
    w("")
    if "autospec" in by_mode:
        vs = {}
        for cat in cats + [None]:
            a, b = cell("autospec", cat), cell("ngram5", cat)
            vs[cat or "mix"] = _gm(a) / _gm(b) if a and b else float("nan")
        w("(e) over (b) ngram5: " + ", ".join(f"{c} {v:.2f}" for c, v in vs.items()))
    if d_mode:
        w(f"(d) over (c) on the mix: {_gm(combo(d_mode, None)) / _gm(combo(best, None)):.2f}")
        for b in ("ngram5", "draft5"):
            if b in by_mode:
                w(f"(d) over (b) {b}: " + ", ".join(
                    f"{c} {_gm(combo(d_mode, c)) / _gm(cell(b, c)):.2f}" for c in cats))
    phases = {}
    if (work / "phases.jsonl").exists():
        for ln in (work / "phases.jsonl").read_text().splitlines():
            p = json.loads(ln)
            phases[p["mode"]] = p["tokens"] / p["wall_s"]
    if "plain" in phases:
        w("")
        w("Two clients at once (the concurrent set): tokens/s of the phase over plain's; "
          "per-request geometric mean in brackets")
        w("| mode | phase tokens/s ratio | per request |")
        w("|---|---|---|")
        for m in ["plain"] + modes:
            if m in phases:
                w(f"| {m} | {phases[m] / phases['plain']:.2f} | {_gm(cell(m, None, 'conc')):.2f} |")
    text = "\n".join(lines)
    print(text)
    (work / "table.md").write_text(text + "\n")


def main() -> None:
    from autospec.testing.vllm import CUSTOM_CLASS

    if len(sys.argv) < 2:
        sys.exit(__doc__)
    work = Path(sys.argv[1]).resolve()
    work.mkdir(parents=True, exist_ok=True)
    steps = sys.argv[2:] or STEPS
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    for step in steps:
        stamp(f"step {step}")
        if step == "prompts":
            prompts(work)
        elif step == "train":
            if not (work / "store.db").exists():
                train(work)
        elif step == "steps":
            engine_steps(work)
        elif step == "probe":
            probe(work)
        elif step == "export":
            export(work)
        elif step == "plain":
            serve(work, "plain", None)
        elif step in ("autospec", "autospec-fp32"):
            serve(work, step, {"method": "custom_class", "model": CUSTOM_CLASS,
                               "num_speculative_tokens": K_AUTOSPEC},
                  "float32" if step.endswith("fp32") else "bfloat16")
        elif step == "plain-fp32":
            serve(work, step, None, "float32")
        elif step in FIXED:
            serve(work, step, FIXED[step])
        elif step == "exported":
            exported(work)
        elif step == "table":
            table(work)
        else:
            sys.exit(f"unknown step {step!r}; steps: {' '.join(STEPS)}")


if __name__ == "__main__":
    main()
