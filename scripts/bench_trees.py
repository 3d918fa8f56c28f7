"""Two checkouts of autospec on the same requests, interleaved: is a change any slower?

One worker process per checkout (each checkout's own interpreter, so each imports its own
autospec), both loading the default pair. The driver sends every request to one, then the
other (the order alternating), so the two never run at once and see the same machine state;
every mode runs on the same requests in each. Per mode and batch size it prints, request by
request, the paired ratio of the two checkouts' time per token (median over repeats per
request, then the median over requests with a seeded 95 % bootstrap interval), and each
checkout's speedup over plain decoding measured in the same run.

    .venv/bin/python scripts/bench_trees.py \\
        --compare before=../base/.venv/bin/python after=.venv/bin/python \\
        --threads 2 --batch 1,4 --modes fixed:1,fixed:2,fixed:3,auto --repeats 2 --json out.json

Greedy; bf16; store off (every mode's controller learns within the run, in each checkout
alike). ``--prompts`` is a packaged prompt file of the checkout the driver runs from.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path


# -- the worker (runs under each checkout's interpreter) ---------------------------------------
def worker(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    import autospec

    try:
        from autospec.pairs import load_pair
    except ImportError:  # a checkout from before the package layout
        from autospec.models import load_pair
    pair = load_pair("qwen2.5-coder", progress=False)
    tok = pair.tokenizer
    tok.padding_side = "left"
    controllers = {}
    print(json.dumps({"ready": autospec.__file__}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        texts = [_text(tok, p) for p in cmd["prompts"]]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        kw = dict(attention_mask=enc.attention_mask, max_new_tokens=cmd["max_new"],
                  do_sample=False, pad_token_id=tok.pad_token_id)
        mode = cmd["mode"]
        if mode == "plain":
            fn = pair.target.generate
        else:
            ctrl = controllers.get(mode)
            if ctrl is None:
                ctrl = controllers[mode] = autospec.Controller(
                    pair.target, pair.draft, store=False, policy=mode, tokenizer=tok)
            fn = ctrl.generate
        t0 = time.perf_counter()
        out = fn(enc.input_ids, **kw)
        wall = time.perf_counter() - t0
        width = enc.input_ids.shape[1]
        new = out[:, width:]
        tokens = sum(_length(row, tok.pad_token_id, pair) for row in new.tolist())
        print(json.dumps({"wall_s": wall, "tokens": tokens, "out": new.tolist()}), flush=True)


def _text(tok, p: dict) -> str:
    if p.get("chat"):
        return tok.apply_chat_template([{"role": "user", "content": p["prompt"]}],
                                       tokenize=False, add_generation_prompt=True)
    return p["prompt"]


def _length(row: list[int], pad: int, pair) -> int:
    """New tokens of a row: up to its EOS (included), else all."""
    eos = pair.target.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos])
    for i, t in enumerate(row):
        if t in eos:
            return i + 1
    return len(row)


# -- the driver ---------------------------------------------------------------------------------
class Worker:
    def __init__(self, label: str, python: str, threads: int):
        root = Path(python).resolve().parent.parent.parent  # checkout/.venv/bin/python
        self.label = label
        self.proc = subprocess.Popen(
            [python, str(Path(__file__).resolve()), "--worker", "--threads", str(threads)],
            cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self._read()
        print(f"{label}: autospec from {Path(ready['ready']).parent}", file=sys.stderr)

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"worker {self.label} exited")
            if line.startswith("{"):
                return json.loads(line)

    def run(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def bootstrap(values: list[float], seed: int = 0, resamples: int = 2000) -> tuple[float, float]:
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values)))
                  for _ in range(resamples))
    return meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--compare", nargs=2, metavar="LABEL=PYTHON")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--modes", default="fixed:1,fixed:2,fixed:3,auto")
    ap.add_argument("--prompts", default="default,holdout")
    ap.add_argument("--limit", type=int, default=8, help="prompts per file")
    ap.add_argument("--stride", type=int, default=1,
                    help="every S-th prompt of a file (before --limit): files sorted by "
                         "category give a few of each")
    ap.add_argument("--interleave", action="store_true",
                    help="take the files' prompts in turn (one of each, then the next of each) "
                         "rather than file after file: traffic that mixes them")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("--report", metavar="JSON", help="print the table of a saved (even partial) run")
    args = ap.parse_args()
    if args.worker:
        return worker(args.threads)
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        rows, run = saved["rows"], argparse.Namespace(**saved["args"])
        labels = list(dict.fromkeys(x["label"] for x in rows))
        sizes = sorted({x["batch"] for x in rows})
        modes = list(dict.fromkeys(["plain", *run.modes.split(",")]))
        done = {(x["rep"], x["request"], x["batch"], x["mode"]) for x in rows}
        # an interrupted run: only the repeats and requests every mode reached in both checkouts
        rows = [x for x in rows if all((x["rep"], x["request"], x["batch"], m) in done
                                       for m in modes)
                and sum(y["rep"] == x["rep"] and y["request"] == x["request"]
                        and y["batch"] == x["batch"] for y in rows) == 2 * len(modes)]
        return report(rows, labels, sizes, modes, run)
    if not args.compare:
        ap.error("--compare LABEL=PYTHON LABEL=PYTHON")
    here = Path(__file__).resolve().parent.parent / "autospec" / "prompts"
    files = []
    for name in args.prompts.split(","):
        lines = (here / f"{name}.jsonl").read_text().splitlines()[:: args.stride][: args.limit]
        files.append([json.loads(x) for x in lines if x.strip()])
    if args.interleave:
        files = [[p for p in group if p is not None]
                 for group in itertools.zip_longest(*files)]
    prompts = [p for group in files for p in group]
    sizes = [int(b) for b in args.batch.split(",")]
    requests = [(b, prompts[i : i + b]) for b in sizes
                for i in range(0, len(prompts) - b + 1, b)]
    modes = ["plain", *args.modes.split(",")]
    workers = [Worker(*item.split("=", 1), args.threads) for item in args.compare]
    labels = [w.label for w in workers]
    rows = []
    rng = random.Random(0)
    total = args.repeats * len(requests) * len(modes)
    done, t_start = 0, time.perf_counter()
    for rep in range(args.repeats):
        for r, (b, group) in enumerate(requests):
            order = modes[:]
            rng.shuffle(order)
            for mode in order:
                pair = workers if (rep + r) % 2 == 0 else workers[::-1]
                for w in pair:
                    res = w.run({"prompts": group, "mode": mode,
                                 "max_new": args.max_new_tokens})
                    rows.append({"label": w.label, "rep": rep, "request": r, "batch": b,
                                 "mode": mode, "category": "+".join(sorted(
                                     {p.get("category", "?") for p in group})), **res})
                done += 1
                if args.json:  # after every unit, so that an interrupted run keeps what it measured
                    Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}))
                left = (time.perf_counter() - t_start) / done * (total - done)
                print(f"\r{done}/{total} ({left / 60:.0f} min left)", end="", file=sys.stderr)
    print(file=sys.stderr)
    for w in workers:
        w.close()
    report(rows, labels, sizes, modes, args)


def _speedups(plain: dict, t: dict, reqs) -> dict:
    """Each checkout's median speedup over its own plain decoding on the requests ``reqs``
    (``plain``, ``t``: checkout → request → seconds per token)."""
    return {lab: statistics.median(plain[lab][r] / t[lab][r] for r in reqs) for lab in t}


def report(rows, labels, sizes, modes, args) -> None:
    a, b = labels

    def per_token(label, batch, mode):  # request → median seconds per token over repeats
        out = {}
        for r in {x["request"] for x in rows if x["batch"] == batch}:
            vals = [x["wall_s"] / x["tokens"] for x in rows if x["label"] == label
                    and x["batch"] == batch and x["mode"] == mode and x["request"] == r]
            out[r] = statistics.median(vals)
        return out

    print(f"threads {args.threads}; {args.max_new_tokens} new tokens; greedy; repeats "
          f"{args.repeats}. ratio = {a}'s time per token / {b}'s (> 1: {b} faster), paired "
          "per request; speedup = plain's time per token / the mode's, same checkout")
    print(f"{'B':>2} {'mode':9} {'ratio ' + a + '/' + b:>16} {'95% CI':>14} {'faster':>7} "
          f"{a + ' speedup':>15} {b + ' speedup':>15} {'same output':>11}")
    for batch in sizes:
        plain = {lab: per_token(lab, batch, "plain") for lab in labels}
        for mode in modes:
            t = {lab: per_token(lab, batch, mode) for lab in labels}
            ta, tb = t[a], t[b]
            ratios = [ta[r] / tb[r] for r in ta]
            lo, hi = bootstrap(ratios)
            sp = _speedups(plain, t, ta)
            outs = {(x["request"], x["rep"]): [] for x in rows}
            for x in rows:
                if x["batch"] == batch and x["mode"] == mode:
                    outs[(x["request"], x["rep"])].append(x["out"])
            same = sum(len(v) == 2 and v[0] == v[1] for v in outs.values())
            pairs = sum(len(v) == 2 for v in outs.values())
            print(f"{batch:>2} {mode:9} {statistics.median(ratios):16.3f} "
                  f"{lo:6.3f}–{hi:<6.3f} {sum(x > 1 for x in ratios):3}/{len(ratios):<3} "
                  f"{sp[a]:15.2f} {sp[b]:15.2f} {same:5}/{pairs:<5}")
            cats = {x["request"]: x.get("category", "?") for x in rows if x["batch"] == batch}
            for cat in sorted(set(cats.values())) if len(set(cats.values())) > 1 else ():
                mine = [r for r in ta if cats[r] == cat]
                cat_sp = _speedups(plain, t, mine)
                print(f"{'':>2}   {cat[:22]:22} {statistics.median(ta[r] / tb[r] for r in mine):3.3f}"
                      f" {'':14} {sum(ta[r] > tb[r] for r in mine):3}/{len(mine):<3} "
                      f"{cat_sp[a]:15.2f} {cat_sp[b]:15.2f}")


if __name__ == "__main__":
    main()
