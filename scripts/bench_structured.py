"""Structured output under speculation: tool calls constrained by their JSON schema.

The tool-call prompts of the repetitive sets (``repeat.jsonl``: create_ticket, and
``repeat_holdout.jsonl``: schedule_meeting), each with the JSON schema of its tool's call, on the
default pair in bf16. Four modes on the same requests, interleaved per request (the order
rotating), several repeats, in one process:

    plain          target.generate
    plain+schema   target.generate(logits_processor=[Grammar.json_schema(...)])
    auto           a wrapped controller (its default policy, suffix decoding on)
    auto+schema    another wrapped controller, constrained like plain+schema

Per request: time per token, median over repeats; then the paired ratio (plain ÷ auto and
plain+schema ÷ auto+schema) per request, the median over requests with a seeded 95 % bootstrap
interval. Every constrained output is checked to parse and validate against its schema, and
auto+schema's output against plain+schema's token for token.

    .venv/bin/python scripts/bench_structured.py --threads 2 --repeats 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import time
from importlib import resources

TICKET = {
    "type": "object",
    "properties": {
        "tool": {"const": "create_ticket"},
        "arguments": {
            "type": "object",
            "properties": {
                "project": {"type": "string"}, "title": {"type": "string"},
                "priority": {"enum": ["low", "medium", "high"]},
                "assignee": {"type": ["string", "null"]},
                "labels": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["project", "title", "priority", "assignee", "labels"],
            "additionalProperties": False,
        },
    },
    "required": ["tool", "arguments"], "additionalProperties": False,
}
MEETING = {
    "type": "object",
    "properties": {
        "tool": {"const": "schedule_meeting"},
        "arguments": {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
                "start": {"type": "string", "pattern": r"^\d{2}:\d{2}$"},
                "minutes": {"type": "integer"},
                "attendees": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["title", "date", "start", "minutes", "attendees"],
            "additionalProperties": False,
        },
    },
    "required": ["tool", "arguments"], "additionalProperties": False,
}
SCHEMAS = {"create_ticket": TICKET, "schedule_meeting": MEETING}
MODES = ("plain", "plain+schema", "auto", "auto+schema")


def validate(value, schema) -> bool:
    """The subset of JSON Schema the two schemas use."""
    if "const" in schema:
        return value == schema["const"]
    if "enum" in schema:
        return value in schema["enum"]
    kinds = schema.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    ok = {"object": isinstance(value, dict), "string": isinstance(value, str),
          "null": value is None, "array": isinstance(value, list),
          "integer": isinstance(value, int) and not isinstance(value, bool)}
    if not any(ok.get(k, False) for k in kinds):
        return False
    if isinstance(value, dict):
        props = schema.get("properties", {})
        if set(schema.get("required", [])) - set(value):
            return False
        if schema.get("additionalProperties") is False and set(value) - set(props):
            return False
        return all(validate(v, props[k]) for k, v in value.items() if k in props)
    if isinstance(value, list):
        return all(validate(v, schema.get("items", {})) for v in value)
    if isinstance(value, str) and "pattern" in schema:
        return re.search(schema["pattern"], value) is not None
    return True


def prompts() -> list[dict]:
    out = []
    for name in ("repeat.jsonl", "repeat_holdout.jsonl"):
        text = resources.files("autospec.prompts").joinpath(name).read_text()
        for line in text.splitlines():
            p = json.loads(line)
            if p["category"] == "tool-call":
                p["tool"] = next(t for t in SCHEMAS if t + "(" in p["prompt"])
                out.append(p)
    return out


def bootstrap(values: list[float], seed: int = 0, n: int = 2000) -> tuple[float, float, float]:
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return statistics.median(values), meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--limit", type=int, default=0, help="the first N prompts (0: all)")
    ap.add_argument("--json", help="write every run here")
    ap.add_argument("--report", metavar="JSON", help="print the report of an earlier --json")
    args = ap.parse_args()
    if args.report:
        from autospec.pairs import load_pair

        pair = load_pair("qwen2.5-coder", progress=False, draft=False)
        eos = pair.target.generation_config.eos_token_id
        with open(args.report) as f:
            runs = json.load(f)
        report(runs, prompts(), pair.tokenizer, set(eos if isinstance(eos, list) else [eos]))
        return

    import torch

    torch.set_num_threads(args.threads)
    import xgrammar as xgr

    import autospec
    from autospec.grammar import Grammar
    from autospec.pairs import load_pair

    pair = load_pair("qwen2.5-coder", progress=False)
    tok, target = pair.tokenizer, pair.target
    vocab = target.get_output_embeddings().weight.shape[0]
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info)
    compiled = {t: compiler.compile_json_schema(json.dumps(s), any_whitespace=False)
                for t, s in SCHEMAS.items()}
    ctrl = {m: autospec.Controller(target, pair.draft, store=False, suffix=True, tokenizer=tok)
            for m in ("auto", "auto+schema")}
    reqs = prompts()[: args.limit or None]
    eos = target.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    runs = []
    for rep in range(args.repeats):
        for i, p in enumerate(reqs):
            text = tok.apply_chat_template([{"role": "user", "content": p["prompt"]}],
                                           tokenize=False, add_generation_prompt=True)
            ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
            order = MODES[(i + rep) % 4:] + MODES[: (i + rep) % 4]
            for mode in order:
                kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
                if mode.endswith("schema"):
                    kw["logits_processor"] = [Grammar(compiled[p["tool"]])]
                fn = target.generate if mode.startswith("plain") else ctrl[mode].generate
                t0 = time.perf_counter()
                out = fn(ids, **kw)
                wall = time.perf_counter() - t0
                new = out[0, ids.shape[1]:].tolist()
                n = next((j + 1 for j, t in enumerate(new) if t in eos), len(new))
                runs.append(dict(repeat=rep, prompt=i, tool=p["tool"], mode=mode, wall_s=wall,
                                 tokens=n, out=new[:n]))
                print(f"repeat {rep} prompt {i:2d} {mode:13s} {n:3d} tokens "
                      f"{wall / n * 1000:7.1f} ms/token", flush=True)
    report(runs, reqs, tok, eos)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f)


def report(runs, reqs, tok, eos) -> None:
    """Per repeat (the first: each request sees the earlier ones' outputs; later ones: the same
    requests again, their own outputs remembered), the paired speedups; then identity and
    validity over every run."""
    per = {}
    for r in runs:
        per[(r["repeat"], r["prompt"], r["mode"])] = r
    repeats = sorted({r["repeat"] for r in runs})
    prompts_run = sorted({r["prompt"] for r in runs})
    plain = {(i, m): statistics.median(per[(rep, i, m)]["wall_s"] / per[(rep, i, m)]["tokens"]
                                       for rep in repeats)
             for i in prompts_run for m in ("plain", "plain+schema")}
    for rep in repeats:
        label = ("in order, each request after the earlier ones" if rep == 0
                 else "the same requests again (their own outputs remembered)")
        print(f"\nrepeat {rep}, {label}: speedup over plain decoding, paired per request "
              "(plain: median over repeats; median [95 % interval]):")
        for base, mode in (("plain", "auto"), ("plain+schema", "auto+schema")):
            ratios = [plain[(i, base)] / (per[(rep, i, mode)]["wall_s"]
                                          / per[(rep, i, mode)]["tokens"]) for i in prompts_run]
            med, lo, hi = bootstrap(ratios)
            print(f"  {mode:12s} vs {base:12s} {med:5.2f}x [{lo:.2f}-{hi:.2f}]  "
                  f"({len(ratios)} requests)")
    ratios = [plain[(i, "plain")] / plain[(i, "plain+schema")] for i in prompts_run]
    med, lo, hi = bootstrap(ratios)
    print(f"\nthe constraint's own cost: plain ÷ plain+schema time per token {med:.2f}x "
          f"[{lo:.2f}-{hi:.2f}]")
    same = sum(per[(rep, i, "auto+schema")]["out"] == per[(rep, i, "plain+schema")]["out"]
               for rep in repeats for i in prompts_run)
    valid = total = 0
    for (_rep, i, mode), r in per.items():
        if mode.endswith("schema"):
            total += 1
            text = tok.decode([t for t in r["out"] if t not in eos])
            try:
                valid += validate(json.loads(text), SCHEMAS[reqs[i]["tool"]])
            except ValueError:
                pass
    print(f"auto+schema identical to plain+schema: {same}/{len(repeats) * len(prompts_run)}; "
          f"constrained outputs that parse and validate: {valid}/{total}")


if __name__ == "__main__":
    main()
