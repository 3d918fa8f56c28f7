"""The GPU benchmark (issue 6): real-size random models, costs, bandwidth, speedups, batch.

    python scripts/gpu_bench.py                 # one GPU: 7B-shaped target, 0.5B-shaped drafts
    python scripts/gpu_bench.py --tiny          # the same end to end on the CPU in seconds

Sections, each printed as a table (and all of it in --json):
1. cost curve: the target's T_t(n) for n = 1…16 and the draft's T_d on the static cache with
   CUDA graphs (and transformers' eager path for comparison, via autospec.probe); achieved
   memory bandwidth against the device's peak (NVML).
2. end to end, per draft: plain decoding (autospec k = 0 on graphs, the fast baseline),
   transformers' plain and assisted generate (eager), autospec at each k and under "auto";
   tokens/s, speedup against both plains (paired, same prompt and repeat), α read from the
   acceptance traces, and S(k) that the cost model predicts from the measured α and costs.
   Drafts: controlled pairs (autospec.testing.controlled) at each α, whose acceptance is set while
   every layer runs at full cost, and a plain random draft (α ≈ 0: "auto" should switch off).
3. batch: the target's verification cost T_t(n)/T_t(1) at batch 1…64, where it stops being
   memory bound, and the k the cost model would choose there.
Medians of interleaved repeats; greedy outputs checked equal to plain decoding's. A time
budget (--budget-s) skips what would not fit, saying so.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
from functools import partial

import torch

from autospec.controller import Controller
from autospec.costs.price import best_k, speedup
from autospec.engine.runners import StaticRunner, graph_report
from autospec.telemetry import (
    NvmlSampler,
    hardware_name,
    kv_bytes_per_token,
    param_bytes,
    peak_bandwidth,
)
from autospec.testing.controlled import build_model, controlled_pair, qwen2_config
from autospec.textfmt import fmt, human_bytes, table
from autospec.traces import UNOBSERVED

log = logging.getLogger("gpu_bench")

PROFILES = {
    "gpu": dict(target="7b", draft="0.5b", target_layers=None, dtype="bfloat16", context=128,
                new_tokens=128, prompts=1, repeats=3, ks=(1, 2, 3, 4, 6, 8),
                alphas=(0.5, 0.8, 0.9), batches=(1, 2, 4, 8, 16, 32, 64), curve_n=16,
                reps=20, budget_s=420),
    "tiny": dict(target="tiny", draft="tiny", target_layers=4, dtype="float32", context=24,
                 new_tokens=24, prompts=1, repeats=2, ks=(1, 2, 4), alphas=(0.5, 0.8, 0.9),
                 batches=(1, 2, 4), curve_n=6, reps=3, budget_s=120),
}
BATCH_N = (1, 2, 3, 5, 9, 17)  # k + 1 for k = 0, 1, 2, 4, 8, 16
COMPUTE_BOUND = 2.0  # T_t(5) / T_t(1) past which verification is clearly compute bound


class Bench:
    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.graphs = "cuda" if self.cuda else "emulate"  # emulate: the same bookkeeping
        self.dtype = getattr(torch, args.dtype)
        self.t_start = time.perf_counter()
        self.out: dict = {"sections": {}, "skipped": []}

    # -- helpers ----------------------------------------------------------------------------
    def left(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.t_start)

    def skip(self, what: str) -> None:
        print(f"\n[skipped: {what} — time budget of {self.args.budget_s:.0f} s]")
        self.out["skipped"].append(what)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def timed(self, fn):
        self.sync()
        t0 = time.perf_counter()
        res = fn()
        self.sync()
        return time.perf_counter() - t0, res

    def time_reps(self, fn, reps: int, between=None) -> float:
        """Median seconds of ``fn`` over reps: CUDA events on a GPU (read once at the end),
        perf_counter on the CPU; ``between`` runs outside the timed spans."""
        times, events = [], []
        for _ in range(reps):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                events.append((a, b))
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            if between is not None:
                between()
        if self.cuda:
            self.sync()
            times = [a.elapsed_time(b) / 1e3 for a, b in events]
        return statistics.median(times)

    def cost(self, runner, extra, n: int, ctx: int) -> float:
        """Seconds ``runner`` takes to score n tokens on a context of ctx: one run first (it
        captures that size's graph), then the median over the reps, cropping back between."""
        runner.run(extra[:, :n], n)
        runner.crop(ctx)
        return self.time_reps(partial(runner.run, extra[:, :n], n), self.args.reps,
                              between=partial(runner.crop, ctx))

    def copy_bandwidth(self, nbytes: int = 2 << 30) -> float:
        src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=self.device)
        dst = torch.empty_like(src)
        dst.copy_(src)
        best = self.time_reps(partial(dst.copy_, src), 5)
        return 2 * nbytes / best

    # -- models -----------------------------------------------------------------------------
    def build(self) -> None:
        a = self.args
        t_over = {"num_hidden_layers": a.target_layers} if a.target_layers else {}
        t_cfg = qwen2_config(a.target, **t_over)
        d_cfg = qwen2_config(a.draft, num_hidden_layers=1) if a.draft == "tiny" else qwen2_config(a.draft)
        self.drafts: dict[str, object] = {}
        self.info: dict[str, dict] = {}
        t0 = time.perf_counter()
        target = None
        for alpha in a.alphas:
            target, draft, info = controlled_pair(t_cfg, d_cfg, alpha, dtype=self.dtype,
                                                  device=self.device, seed=a.seed, target=target)
            self.drafts[f"a={alpha:g}"] = draft
            self.info[f"a={alpha:g}"] = {"alpha": alpha, "exact_alpha": info["exact_alpha"]}
        self.drafts["random"] = build_model(d_cfg, dtype=self.dtype, device=self.device)
        self.info["random"] = {"alpha": None, "exact_alpha": None}
        self.target = target
        self.sync()
        self.vocab = t_cfg.vocab_size
        self.t_bytes, self.kv_tok = param_bytes(target), kv_bytes_per_token(target)
        self.d_bytes = param_bytes(next(iter(self.drafts.values())))
        self.peak, self.peak_source = peak_bandwidth(self.device), "NVML"
        if self.cuda:  # what a plain copy achieves, for scale (and the peak without NVML)
            self.copy_bw = self.copy_bandwidth()
            print(f"device copy bandwidth (read + write): {human_bytes(self.copy_bw, per_s=True)}"
                  f"; NVML peak: {human_bytes(self.peak, per_s=True)}")
            if self.peak is None:
                self.peak, self.peak_source = self.copy_bw, "measured copy (no NVML)"
        self.out["peak"] = {"bytes_per_s": self.peak, "source": self.peak_source}
        gen = torch.Generator().manual_seed(a.seed)
        self.prompts = [torch.randint(0, self.vocab, (1, a.context), generator=gen).to(self.device)
                        for _ in range(a.prompts)]
        print(f"models built in {time.perf_counter() - t0:.1f} s: target {a.target} "
              f"({human_bytes(self.t_bytes)}), drafts {a.draft} ({human_bytes(self.d_bytes)} "
              f"each): {', '.join(self.drafts)}")
        if self.cuda:
            print(f"GPU memory allocated: {human_bytes(torch.cuda.memory_allocated(self.device))}")

    # -- 1. cost curve ----------------------------------------------------------------------
    def curve(self) -> None:
        a = self.args
        ctx = a.context
        runner = StaticRunner(self.target, ctx + 64, graphs=self.graphs)
        d_runner = StaticRunner(self.drafts["random"], ctx + 64, graphs=self.graphs)
        ids = self.prompts[0]
        extra = torch.randint(0, self.vocab, (1, a.curve_n + 1), device=self.device)
        with torch.inference_mode():
            for r in (runner, d_runner):
                r.run(ids, 1)  # the context, prefilled once (eager)
            curve = {n: self.cost(runner, extra, n, ctx) for n in range(1, a.curve_n + 1)}
            t_d = {n: self.cost(d_runner, extra, n, ctx) for n in (1, 2)}
        self.t_curve, self.t_draft = curve, t_d[1]
        bw = (self.t_bytes + self.kv_tok * ctx) / curve[1]
        rows = [[str(n), fmt(t * 1e3, ".3f"), fmt(t / curve[1], ".2f")] for n, t in curve.items()]
        print(f"\n1. Cost curve on the static cache with {self.graphs} graphs, context {ctx} "
              f"({hardware_name(self.device)}, {a.dtype})")
        print(table(["n scored", "T_t(n) ms", "T_t(n)/T_t(1)"], rows))
        util = bw / self.peak if self.peak else None
        print(f"T_d (draft, 1 token): {t_d[1] * 1e3:.3f} ms, 2 tokens {t_d[2] * 1e3:.3f} ms; "
              f"c = T_d/T_t(1) = {t_d[1] / curve[1]:.3f}")
        print(f"achieved bandwidth of T_t(1): {human_bytes(bw, per_s=True)} of peak "
              f"{human_bytes(self.peak, per_s=True)} ({fmt(util and util * 100, '.0f')} %)")
        mem = {n: b for n, b in runner.graph_memory().items()}
        known = [b for b in mem.values() if b is not None]
        print(f"graphs: {len(mem)} for the target, pool {human_bytes(sum(known)) if known else '-'}"
              f"; KV cache {human_bytes(runner.kv_bytes())}; capture {runner.capture_s:.1f} s "
              f"(target) + {d_runner.capture_s:.1f} s (draft)")
        self.out["sections"]["curve"] = {
            "context": ctx, "target_s_by_n": curve, "draft_s": t_d, "achieved_bytes_per_s": bw,
            "peak_bytes_per_s": self.peak, "utilisation": util, "graph_bytes": mem,
            "kv_bytes": runner.kv_bytes(), "capture_s": runner.capture_s}
        runner = d_runner = None  # free the caches and graphs
        if self.left() > 30 or not self.cuda:
            from autospec.probe import probe

            res = probe(self.target, self.drafts["random"], context=ctx,
                        max_n=min(5, a.curve_n), repeats=3)
            self.eager_costs = (res.draft_s, res.target_s_by_n)
            print(f"transformers' eager path (autospec.probe): T_t(1) "
                  f"{res.target_s_by_n[1] * 1e3:.2f} ms, T_d {res.draft_s * 1e3:.2f} ms, "
                  f"bandwidth {fmt(res.utilisation and res.utilisation * 100, '.0f')} % of peak")
            self.out["sections"]["curve"]["eager_probe"] = res.to_dict()

    # -- 2. end to end ------------------------------------------------------------------------
    def end_to_end(self, which: str) -> None:
        """which: "main" (α = 0.8, with transformers' modes) or "others" (the other drafts)."""
        main = "a=0.8" if "a=0.8" in self.drafts else next(iter(self.drafts))
        results = self.out["sections"].setdefault("end_to_end", {})
        sampler = NvmlSampler(self.device)
        for name in ([main] if which == "main" else [n for n in self.drafts if n != main]):
            if which != "main" and self.left() < (60 if self.cuda else 0):
                self.skip(f"end to end with draft {name}")
                continue
            results[name] = self._modes(name, self.drafts[name], hf=name == main,
                                        sampler=sampler)
        sampler.close()

    def _modes(self, name, draft, *, hf: bool, sampler) -> list[dict]:
        a = self.args
        opts = dict(store=False, k_max=16, static_cache=True, cuda_graphs=self.graphs)
        fast, auto = Controller(self.target, draft, **opts), Controller(self.target, draft, **opts)
        modes = {"plain": (fast, 0)}
        if hf:
            modes["hf-plain"] = ("hf", None)
            modes["hf-assisted"] = ("hf", draft)
            modes["eager:4"] = (Controller(self.target, draft, store=False, k_max=16), 4)
        modes.update({f"k={k}": (fast, k) for k in a.ks})
        modes["auto"] = (auto, None)
        generate = type(self.target).generate.__get__(self.target)
        kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

        def run(mode, ids, new_tokens=a.new_tokens):
            ctrl, k = modes[mode]
            mask = torch.ones_like(ids)
            if ctrl == "hf":
                extra = {"assistant_model": k} if k is not None else {}
                out = generate(ids, attention_mask=mask, max_new_tokens=new_tokens, **kw, **extra)
                return out, None
            out = ctrl.generate(ids, attention_mask=mask, k=k, max_new_tokens=new_tokens, **kw)
            return out, ctrl.last_stats

        names = list(modes)
        for mode in names:  # warm-up: graphs for every size a mode uses, first-call costs
            eager = modes[mode][0] == "hf" or mode.startswith("eager")
            run(mode, self.prompts[0], 8 if eager else a.new_tokens)
        recs = []
        for rep in range(a.repeats):
            for i, ids in enumerate(self.prompts):
                shift = (rep + i) % len(names)
                for mode in names[shift:] + names[:shift]:
                    t0 = time.time()
                    wall, (out, stats) = self.timed(partial(run, mode, ids))
                    recs.append(dict(mode=mode, rep=rep, prompt=i, wall=wall, t0=t0,
                                     tokens=out[0, ids.shape[1]:].tolist(), stats=stats))
        return self._report(name, names, recs, sampler)

    def _report(self, name, names, recs, sampler) -> list[dict]:
        a = self.args
        base = {(r["rep"], r["prompt"]): r for r in recs if r["mode"] == "plain"}
        hfb = {(r["rep"], r["prompt"]): r for r in recs if r["mode"] == "hf-plain"}
        rows, out = [], []
        for mode in names:
            rs = [r for r in recs if r["mode"] == mode]
            tps = statistics.median(len(r["tokens"]) / r["wall"] for r in rs)
            sp = statistics.median(base[(r["rep"], r["prompt"])]["wall"] / r["wall"] for r in rs)
            sp_hf = (statistics.median(hfb[(r["rep"], r["prompt"])]["wall"] / r["wall"] for r in rs)
                     if hfb else None)
            same = all(r["tokens"] == base[(r["rep"], r["prompt"])]["tokens"] for r in rs)
            bits = [b for r in rs if r["stats"] for b in r["stats"].trace if b != UNOBSERVED]
            alpha = sum(bits) / len(bits) if bits else None
            ks = [k for r in rs if r["stats"] for k in r["stats"].k_schedule]
            mean_k = statistics.fmean(ks) if ks else None
            k = int(mode.split("=")[1]) if mode.startswith("k=") else 4 if mode == "eager:4" else None
            costs = (getattr(self, "eager_costs", None) if mode == "eager:4"
                     else (self.t_draft, self.t_curve))
            pred = (speedup(k, alpha, *costs) if k is not None and alpha is not None
                    and costs is not None else None)
            windows = [sampler.window(r["t0"], r["t0"] + r["wall"]) for r in rs]
            busy = [w[0] for w in windows if w[0] is not None]
            bw = None
            if mode == "plain":  # bytes a plain step reads ÷ time per token
                bw = (self.t_bytes + self.kv_tok * (a.context + a.new_tokens / 2)) * tps
            path = next((r["stats"].path for r in rs if r["stats"]), "transformers")
            row = dict(draft=name, mode=mode, tokens_per_s=tps, speedup=sp, speedup_vs_hf=sp_hf,
                       identical=same, alpha=alpha, mean_k=mean_k, predicted_speedup=pred,
                       nvml_mem_busy=statistics.fmean(busy) if busy else None,
                       bandwidth=bw, path=path)
            out.append(row)
            rows.append([mode, path, fmt(tps, ".1f"), fmt(sp, ".2f"), fmt(sp_hf, ".2f"),
                         fmt(alpha, ".3f"), fmt(mean_k, ".1f"), fmt(pred, ".2f"),
                         fmt(row["nvml_mem_busy"], ".0f"), "yes" if same else "NO"])
        exact = self.info[name]["exact_alpha"]
        print(f"\n2. End to end, draft {name} (constructed α {fmt(exact, '.3f')}), "
              f"{a.new_tokens} new tokens, context {a.context}, {a.repeats} repeats × "
              f"{len(self.prompts)} prompts; speedups paired against plain (k = 0, same path)")
        print(table(["mode", "path", "tok/s", "×plain", "×hf-plain", "α (trace)", "mean k",
                     "S(k) model", "mem-busy %", "= plain"], rows))
        plain = next(r for r in out if r["mode"] == "plain")
        if plain["bandwidth"] is not None:
            util = plain["bandwidth"] / self.peak if self.peak else None
            print(f"plain decoding reads {human_bytes(plain['bandwidth'], per_s=True)}"
                  f" = {fmt(util and util * 100, '.0f')} % of peak (goal ≥ 70 %)")
            plain["utilisation"] = util
        return out

    # -- 3. batch -----------------------------------------------------------------------------
    def batch(self) -> None:
        a = self.args
        ctx = a.context
        rows, res = [], []
        ns = [n for n in BATCH_N if n <= a.curve_n + 1]
        for B in a.batches:
            if self.left() < (20 if self.cuda else 0):
                self.skip(f"batch sweep from batch {B}")
                break
            t_run = StaticRunner(self.target, ctx + 32, graphs=self.graphs, batch_size=B)
            d_run = StaticRunner(self.drafts["random"], ctx + 32, graphs=self.graphs,
                                 batch_size=B)
            ids = torch.randint(0, self.vocab, (B, ctx), device=self.device)
            extra = torch.randint(0, self.vocab, (B, max(ns)), device=self.device)
            with torch.inference_mode():
                t_run.run(ids, 1)
                d_run.run(ids, 1)
                curve = {n: self.cost(t_run, extra, n, ctx) for n in ns}
                t_d = self.cost(d_run, extra, 1, ctx)
            t_run = d_run = ids = extra = None  # free the caches and graphs before the next
            if self.cuda:
                torch.cuda.empty_cache()
            choice = {al: best_k(al, t_d, curve, 16) for al in a.alphas}
            res.append(dict(batch=B, target_s_by_n=curve, draft_s=t_d,
                            best_k={str(al): kc for al, kc in choice.items()}))
            rel = {n: curve[n] / curve[1] for n in ns}
            rows.append([str(B), fmt(curve[1] * 1e3, ".2f")]
                        + [fmt(rel[n], ".2f") for n in ns[1:]]
                        + [fmt(t_d / curve[1], ".2f")]
                        + [f"{kc[0]} ({kc[1]:.2f}×)" for kc in choice.values()])
            # --tiny checks that every section runs: timing noise must not cut the sweep
            if rel.get(5, 0) > COMPUTE_BOUND and not a.tiny:
                print(f"(stopping at batch {B}: T_t(5)/T_t(1) = {rel[5]:.2f}, compute bound)")
                break
        print("\n3. Verification cost against batch size (static cache, graphs): T_t(n)/T_t(1), "
              "and the cost model's k* (S(k*)) at each α")
        print(table(["batch", "T_t(1) ms"] + [f"n={n}" for n in ns[1:]] + ["c"]
                    + [f"k* α={al:g}" for al in a.alphas], rows))
        self.out["sections"]["batch"] = res

    # -- the goals ------------------------------------------------------------------------------
    def goals(self) -> None:
        e2e = self.out["sections"].get("end_to_end", {})
        main = e2e.get("a=0.8")
        if not main:
            return
        plain = next(r for r in main if r["mode"] == "plain")
        best = max((r for r in main if r["mode"].startswith("k=")), key=lambda r: r["speedup"])
        auto = next(r for r in main if r["mode"] == "auto")
        util = plain.get("utilisation")
        lines = [
            f"plain decoding bandwidth: {fmt(util and util * 100, '.0f')} % of peak "
            f"(goal ≥ 70 %: {'met' if util and util >= 0.7 else 'NOT met'})",
            f"α = 0.8, batch 1: best fixed {best['mode']} {best['speedup']:.2f}× plain "
            f"(graphs), auto {auto['speedup']:.2f}× (goal ≥ 2×: "
            f"{'met' if max(best['speedup'], auto['speedup']) >= 2 else 'NOT met'}); against "
            f"transformers' plain generate {fmt(best['speedup_vs_hf'], '.2f')}×",
            f"outputs identical to plain decoding everywhere: "
            f"{all(r['identical'] for rs in e2e.values() for r in rs)}",
        ]
        print("\nGoals\n" + "\n".join("- " + line for line in lines))
        self.out["goals"] = lines


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny models on the CPU (a dry run)")
    p.add_argument("--device", default=None)
    p.add_argument("--json", default=None, help="write every figure here")
    p.add_argument("--budget-s", type=float, default=None, help="wall-clock budget")
    p.add_argument("--new-tokens", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--ks", default=None, help="comma-separated fixed k (e.g. 1,2,4)")
    p.add_argument("--alphas", default=None, help="comma-separated α for controlled drafts")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes")
    p.add_argument("--sections", default="curve,e2e,batch")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    prof = PROFILES["tiny" if args.tiny else "gpu"]
    for key, val in prof.items():
        if getattr(args, key, None) is None:
            setattr(args, key, val)
    for key, conv in (("ks", int), ("alphas", float), ("batches", int)):
        val = getattr(args, key)
        if isinstance(val, str):
            setattr(args, key, tuple(conv(x) for x in val.split(",") if x.strip()))
    if args.device is None:
        args.device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("no CUDA device here: run with --tiny for the CPU dry run")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)  # tiny models: intra-op threads only contend on a shared CPU
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, device "
          f"{hardware_name(torch.device(args.device))}, dtype {args.dtype}")
    bench = Bench(args)
    bench.out["meta"] = dict(vars(args))
    sections = args.sections.split(",")
    steps = [("build", bench.build)]
    if "curve" in sections or "e2e" in sections:
        steps.append(("curve", bench.curve))
    if "e2e" in sections:
        steps.append(("e2e", partial(bench.end_to_end, "main")))
    if "batch" in sections:
        steps.append(("batch", bench.batch))
    if "e2e" in sections:
        steps.append(("e2e", partial(bench.end_to_end, "others")))
    for _, step in steps:  # most telling first; the figures so far are saved after each
        step()
        bench.out["wall_s"] = time.perf_counter() - bench.t_start
        save(bench.out, args.json)
    bench.goals()
    bench.out["graphs"] = {"target": graph_report(bench.target)}
    save(bench.out, args.json)
    print(f"\ndone in {bench.out['wall_s']:.0f} s")
    return 0


def save(out: dict, path) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(_jsonable(out), f, indent=1)


def _jsonable(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (int, str, bool)) or obj is None:
        return obj
    return str(obj)


if __name__ == "__main__":
    sys.exit(main())
