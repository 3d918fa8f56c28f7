"""The ``autospec`` command: ``demo``, ``generate`` and ``bench``.

This is the one module that prints (tables and text for people); everything it calls logs.
Heavy imports (torch, transformers) wait until a command runs, so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time

from autospec.cliargs import die
from autospec.cliargs import positive_int as _positive
from autospec.textfmt import fmt as _fmt
from autospec.textfmt import table

__all__ = ["main", "build_parser", "format_table"]

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_DEFAULT_PAIR = "qwen2.5-coder"
_K_LIMIT = 64  # autospec.controller.K_LIMIT, repeated so that --help needs no torch


# -- arguments ----------------------------------------------------------------------------
def _k_value(text: str) -> int:
    try:
        k = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= k <= _K_LIMIT:
        raise argparse.ArgumentTypeError(f"must be in 0..{_K_LIMIT} (0 = plain decoding)")
    return k


def _ranged(low: float, high: float, *, low_open: bool = True):
    """A float option in (low, high] (or [low, high] when not low_open)."""
    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (low < x if low_open else low <= x) or x > high:
            raise argparse.ArgumentTypeError(
                f"must be in {'(' if low_open else '['}{low:g}, {high:g}]")
        return x
    return parse


def _common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("runtime")
    g.add_argument("--threads", type=_positive, help="torch threads (default: 2 on CPU)")
    g.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="default: bf16")
    g.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, ...")
    g.add_argument("--cache", metavar="DIR", help="model cache (default: $AUTOSPEC_CACHE or "
                                                   "~/.cache/autospec)")
    g.add_argument("-v", "--verbose", action="store_true", help="INFO logging")
    return p


def _models(pair_only: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("models")
    g.add_argument("--pair", help=f"a named target/draft pair (default: {_DEFAULT_PAIR})")
    if not pair_only:
        g.add_argument("--target", help="target model: local directory, .gguf file or Hub id")
        g.add_argument("--draft", help="draft model sharing the target's tokenizer")
    return p


def _sampling() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("decoding (greedy unless --sample)")
    g.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=_ranged(0, math.inf))
    g.add_argument("--top-p", type=_ranged(0, 1))
    g.add_argument("--top-k", type=_positive)
    g.add_argument("--seed", type=int, help="seed for sampling")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autospec", description="Exact speculative decoding for transformers' generate.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    common, models = _common(), _models()

    demo = sub.add_parser("demo", parents=[_models(pair_only=True), common],
                          help="a few prompts, speculative vs plain decoding side by side")
    demo.add_argument("--k", type=_k_value, default=None,
                      help="a fixed lookahead (default: the 'auto' policy chooses k)")
    demo.add_argument("--policy", default="auto", help="k policy (default: auto)")
    demo.add_argument("--max-new-tokens", type=_positive, default=64)
    demo.set_defaults(run=_cmd_demo, parser=demo)

    gen = sub.add_parser("generate", parents=[models, _sampling(), common],
                         help="generate text for one prompt")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    gen.add_argument("--k", type=_k_value, default=4, help="lookahead (default: 4; 0 = off)")
    gen.add_argument("--max-new-tokens", type=_positive, default=128)
    gen.add_argument("--stream", action="store_true", help="print tokens as they are accepted")
    gen.set_defaults(run=_cmd_generate, parser=gen)

    bench = sub.add_parser(
        "bench", parents=[models, _sampling(), common],
        help="plain vs transformers' assisted generation vs autospec on the same prompts",
        description="Runs every mode on the same prompts in one process, interleaved, and "
                    "prints median tokens/s, paired speedup vs plain decoding, acceptance, "
                    "timings and (greedy) whether outputs equal plain decoding's.")
    bench.add_argument("--prompts", metavar="FILE.jsonl",
                       help='one {"category", "prompt", "chat"} object per line '
                            "(default: the packaged code/chat/translation set)")
    bench.add_argument("--k", default="1,2,4,6,8", help="lookaheads for the :k modes "
                                                        "(default: 1,2,4,6,8)")
    bench.add_argument("--max-new-tokens", type=_positive, default=64)
    bench.add_argument("--repeats", type=_positive, default=3)
    bench.add_argument("--modes", nargs="+", default=None,
                       help="plain, hf-assisted (its defaults), hf-assisted:k, autospec:k, "
                            "policy:NAME; :N for one k (default: all but policy:, or plain and "
                            "hf-assisted when --policies is given)")
    bench.add_argument("--policies", help="k policies to compare, e.g. auto,costmodel,bandit,"
                                          "heuristic,fixed:1..8,off (adds modes)")
    bench.add_argument("--db", metavar="URL",
                       help="store for the policy: modes (warm start, tuned parameters, and "
                            "their requests are logged there); default: none")
    bench.add_argument("--batch", type=_batch_sizes, default=[1], metavar="B[,B...]",
                       help="batch sizes, e.g. 1,4,16: prompts sorted by length, grouped into "
                            "left-padded batches, every mode on the same batches (default: 1, "
                            "prompt by prompt); beyond 1 the table and auto policies are added")
    bench.add_argument("--table", metavar="SPEC",
                       help="the table policy's batch size → k ranges (default when --batch "
                            "goes beyond 1: 1-2:4,3-8:2,9-:0); adds the mode policy:table:SPEC")
    bench.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    bench.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up pass")
    bench.set_defaults(run=_cmd_bench, parser=bench)

    from autospec import cli_categorize, cli_report, cli_tune, report

    cli_report.add_commands(sub, common, models)
    cli_tune.add_commands(sub)
    cli_categorize.add_parser(sub)
    report.add_parser(sub)
    return parser


# -- shared setup -------------------------------------------------------------------------
def _setup(args) -> dict:
    """Logging, device, dtype and threads; returns what was used, for the output."""
    import torch

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:  # generate's config warnings drown the output; -v shows them
        import transformers

        transformers.logging.set_verbosity_error()
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except RuntimeError as e:
        die(f"--device: {e}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    elif device.type == "cpu":
        torch.set_num_threads(2)  # the figures in DESIGN.md; more threads help little on CPU
    return {"device": device, "dtype": getattr(torch, _DTYPES[args.dtype]),
            "threads": torch.get_num_threads()}


def _load(args, parser, env):
    """(target, draft, tokenizer, draft_tokenizer) on env's device; user errors exit cleanly."""
    from autospec import models

    target_path, draft_path = getattr(args, "target", None), getattr(args, "draft", None)
    if (target_path or draft_path) and args.pair:
        parser.error("use either --pair or --target/--draft")
    if bool(target_path) != bool(draft_path):
        parser.error("--target and --draft go together")
    name = args.pair or _DEFAULT_PAIR
    if not target_path and name not in models.PAIRS:
        parser.error(f"--pair: unknown pair {name!r} (known: {', '.join(sorted(models.PAIRS))})")
    try:
        if target_path:
            target, tok = models.load_model(target_path, dtype=env["dtype"], cache=args.cache)
            draft, dtok = models.load_model(draft_path, dtype=env["dtype"], cache=args.cache)
        else:
            pair = models.load_pair(name, dtype=env["dtype"], cache=args.cache)
            target, draft, tok, dtok = pair.target, pair.draft, pair.tokenizer, None
    except (OSError, ValueError, RuntimeError) as e:
        die(f"cannot load the models: {e}")
    return target.to(env["device"]), draft.to(env["device"]), tok, dtok


def _gen_kwargs(args) -> dict:
    kw = {"max_new_tokens": args.max_new_tokens, "do_sample": bool(getattr(args, "sample", False))}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(args, name, None) is not None:
            kw[name] = getattr(args, name)
    return kw


def _env_line(env) -> str:
    return (f"device {env['device']}, dtype {str(env['dtype']).removeprefix('torch.')}, "
            f"{env['threads']} threads")


# -- commands -----------------------------------------------------------------------------
def _cmd_generate(args, parser) -> int:
    import torch
    from transformers import TextStreamer

    import autospec
    from autospec.bench import Prompt, encode_prompt

    env = _setup(args)
    target, draft, tok, dtok = _load(args, parser, env)
    try:  # a draft that cannot serve the target, a chat prompt without a template
        ctrl = autospec.wrap(target, draft, tokenizer=tok, draft_tokenizer=dtok, policy=args.k,
                             k_max=max(16, args.k))
        ids = encode_prompt(tok, Prompt("cli", args.prompt, args.chat)).to(env["device"])
    except ValueError as e:
        die(str(e))
    gen = None
    if args.sample and args.seed is not None:
        gen = torch.Generator(env["device"]).manual_seed(args.seed)
    streamer = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True) if args.stream else None
    t0 = time.perf_counter()
    try:
        out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generator=gen,
                              streamer=streamer, **_gen_kwargs(args))
    except ValueError as e:  # e.g. a prompt longer than the target's context
        die(str(e))
    wall = time.perf_counter() - t0
    new = out.shape[1] - ids.shape[1]
    if not args.stream:
        print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    s = ctrl.last_stats
    how = (f"k={args.k}, acceptance {_fmt(s.acceptance, '.2f')}, mean accepted length "
           f"{s.mean_accepted_length:.2f}" if s is not None
           else "served by transformers' generate (run with -v for why)")
    print(f"[autospec] {new} new tokens in {wall:.2f} s ({new / wall:.1f} tok/s); {how}; "
          f"{_env_line(env)}", file=sys.stderr)
    return 0


def _cmd_demo(args, parser) -> int:
    import torch

    import autospec
    from autospec.bench import default_prompts_path, encode_prompt, load_prompts

    env = _setup(args)
    target, draft, tok, _ = _load(args, parser, env)
    policy = args.k if args.k is not None else args.policy
    try:
        ctrl = autospec.wrap(target, draft, tokenizer=tok, policy=policy,
                             k_max=max(16, args.k or 0))
    except ValueError as e:
        parser.error(str(e))
    plain_generate = type(target).generate.__get__(target)  # transformers' own, unwrapped
    by_category: dict = {}
    for p in load_prompts(default_prompts_path()):
        by_category.setdefault(p.category, p)  # one prompt of each kind
    kw = _gen_kwargs(args)

    def timed(fn, ids, **extra):
        t0 = time.perf_counter()
        out = fn(input_ids=ids, attention_mask=torch.ones_like(ids), **{**kw, **extra})
        return out[0, ids.shape[1]:], time.perf_counter() - t0

    first = encode_prompt(tok, next(iter(by_category.values()))).to(env["device"])
    for fn in (plain_generate, target.generate):  # warm-up: first calls pay for setup
        timed(fn, first, max_new_tokens=8)
    print(f"autospec demo: {args.pair or _DEFAULT_PAIR}, policy {ctrl.policy.name}; "
          f"{_env_line(env)}")
    for i, (category, prompt) in enumerate(by_category.items()):
        ids = encode_prompt(tok, prompt).to(env["device"])
        if i % 2:  # alternate which runs first, so neither always meets a warm cache
            plain_out, plain_s = timed(plain_generate, ids)
        spec_out, spec_s = timed(target.generate, ids)  # wrapped: autospec
        if not i % 2:
            plain_out, plain_s = timed(plain_generate, ids)
        s = ctrl.last_stats
        print(f"\n=== {category}{' (chat)' if prompt.chat else ''} ===\n{prompt.prompt}\n--- output ---")
        print(tok.decode(spec_out, skip_special_tokens=True).strip())
        spec_tps, plain_tps = len(spec_out) / spec_s, len(plain_out) / plain_s
        how = ("served by transformers' generate (-v says why)" if s is None else
               f"acceptance {_fmt(s.acceptance, '.2f')}, mean accepted length "
               f"{s.mean_accepted_length:.2f}, k used {_k_summary(s.k_schedule)}")
        print(f"--- autospec: {spec_tps:.1f} tok/s, {how}, {len(spec_out)} tokens")
        print(f"--- plain:    {plain_tps:.1f} tok/s  ->  speedup {spec_tps / plain_tps:.2f}x, "
              f"identical to plain: {'yes' if torch.equal(spec_out, plain_out) else 'NO'}")
    return 0


def _k_summary(ks: list[int]) -> str:
    from collections import Counter

    return ", ".join(f"{k}×{n}" for k, n in sorted(Counter(ks).items()))


def _batch_sizes(text: str) -> list[int]:
    from autospec.benchbatch import parse_batch_sizes  # torch-free

    try:
        return parse_batch_sizes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_TABLE_SPEC = r"table:\d+(-\d*)?:\d+(,\d+(-\d*)?:\d+)*"


def _table_mode(spec: str | None, parser) -> str:
    """policy:table:SPEC for --table (the default table without it); a spec this autospec's
    policies do not parse is kept when it has the table's form (the run reports the mode
    unsupported, with the reason), refused otherwise."""
    import re

    from autospec.benchbatch import DEFAULT_TABLE
    from autospec.policies import as_policy

    spec = DEFAULT_TABLE if spec is None else spec.strip().replace(" ", "")
    if not spec.startswith("table:"):
        spec = f"table:{spec}"
    try:
        as_policy(spec)
    except ValueError as e:
        if not re.fullmatch(_TABLE_SPEC, spec):
            parser.error(f"--table: {e}")
    return f"policy:{spec}"


def _cmd_bench(args, parser) -> int:
    from autospec import bench

    # check everything a user typed before spending minutes on loading models
    try:
        ks = bench.parse_ks(args.k, _K_LIMIT)
    except ValueError as e:
        parser.error(f"--k: {e}")
    default = ["plain,hf-assisted"] if args.policies else [",".join(bench.DEFAULT_MODES)]
    try:
        specs = [s for arg in args.modes or default for s in arg.split(",") if s.strip()]
        modes = [m.name for m in bench.parse_modes(specs, ks)]
    except ValueError as e:
        parser.error(f"--modes: {e}")
    if args.policies:
        try:
            modes += [m for m in bench.parse_policies(args.policies) if m not in modes]
        except ValueError as e:
            parser.error(f"--policies: {e}")
    extra = ["policy:auto"] if args.batch != [1] else []  # autospec's own, and the engines'
    if args.batch != [1] or args.table is not None:
        extra.append(_table_mode(args.table, parser))
    modes += [m for m in extra if m not in modes]
    try:
        prompts = bench.load_prompts(args.prompts or bench.default_prompts_path())
    except bench.PromptFileError as e:
        parser.error(str(e))
    if args.json:
        from pathlib import Path

        if not Path(args.json).expanduser().resolve().parent.is_dir():
            parser.error(f"--json: the directory for {args.json} does not exist")
    env = _setup(args)
    target, draft, tok, dtok = _load(args, parser, env)
    try:
        result = bench.run_bench(
            target, draft, tok, prompts, ks=ks, modes=modes, max_new_tokens=args.max_new_tokens,
            repeats=args.repeats, sample=args.sample, seed=args.seed or 0,
            sampling={k: v for k, v in _gen_kwargs(args).items()
                      if k in ("temperature", "top_p", "top_k")},
            warmup=not args.no_warmup, draft_tokenizer=dtok, store=args.db,
            batch_sizes=args.batch)
    except ValueError as e:  # e.g. chat prompts without a chat template, a bad --db (StoreError)
        die(str(e))
    print(format_table(result))
    if args.json:
        result.write_json(args.json)
        print(f"wrote {args.json}")
    return 0


# -- the table ----------------------------------------------------------------------------
_COLUMNS = (  # header, row key, format
    ("category", "category", ""), ("mode", "mode", ""), ("tok/s", "tokens_per_s", ".2f"),
    ("speedup", "speedup", ".2f"), ("alpha", "acceptance", ".3f"),
    ("mean len", "mean_accepted_length", ".2f"), ("tok/fwd", "tokens_per_forward", ".2f"),
    ("Tt(1) ms", "t_target_1_ms", ".1f"),
    ("Tt(k+1) ms", "t_target_k1_ms", ".1f"), ("Td ms", "t_draft_ms", ".1f"),
    ("S(k) model", "predicted_speedup", ".2f"), ("k used", "k_settled", ""),
    ("oracle k*", "oracle_k", ""), ("oracle S", "oracle_speedup", ".2f"),
    ("identical", "identical", ""),
)


_BATCH_COLUMNS = ("batch", "mode", "tok/s", "speedup", "alpha", "k schedule", "peak KV",
                  "identical", "status")


def _k_share(counts: dict) -> str:
    """{"2": 90, "0": 10} → "2:90% 0:10%" (most used first, at most three)."""
    total = sum(counts.values())
    top = sorted(counts.items(), key=lambda kv: -kv[1])
    text = " ".join(f"{k}:{100 * n / total:.0f}%" for k, n in top[:3])
    return text + (" …" if len(top) > 3 else "") if total else "-"


def format_batch_table(result) -> str:
    """Per batch size and mode: the batch's tokens/s, speedup vs plain batched decoding at
    that size, acceptance, the k schedule, peak KV bytes and rows identical to plain's."""
    from autospec.textfmt import human_bytes

    rows = []
    for r in result.batches:
        same = "-" if r["rows"] is None else f"{r['identical_rows']}/{r['rows']}"
        rows.append([str(r["batch"]), r["mode"], _fmt(r["tokens_per_s"], ".2f"),
                     _fmt(r["speedup"], ".2f"), _fmt(r["acceptance"], ".3f"),
                     _k_share(r["k_counts"]),
                     "n/a" if r["peak_kv_bytes"] is None else human_bytes(r["peak_kv_bytes"]),
                     same, r["status"]])
    lines = [table(list(_BATCH_COLUMNS), rows, left=2), "",
             "tok/s: new tokens of every row (each up to its own EOS) per second, median over "
             "repeats; speedup: vs plain batched decoding on the same batch and repeat, median; "
             "identical: rows equal to plain batched decoding's / rows"]
    notes = dict.fromkeys(f"{r['mode']} at batch {r['batch']}: {r['status']} ({r['reason']})"
                          for r in result.batches if r["status"] != "ok")
    return "\n".join([*lines, *notes])


def format_table(result) -> str:
    """A fixed-width table of a BenchResult's rows, its settings, and divergences from plain;
    then, when batch sizes beyond 1 ran, the per-batch-size table."""
    rows = [[("-" if row[key] is None else ("yes" if row[key] else "NO")
              if key == "identical" else _fmt(row[key], spec))
             for _, key, spec in _COLUMNS] for row in result.rows]
    lines = [table([h for h, _, _ in _COLUMNS], rows, left=2)] if rows else []
    m = result.meta
    lines += [
        "",
        f"target {m['target']}, draft {m['draft']}; device {m['device']}, dtype {m['dtype']}, "
        f"{m['threads']} threads",
        f"{m['prompts']} prompts x {m['repeats']} repeats, at most {m['max_new_tokens']} new "
        f"tokens, {'sampling' if m['sample'] else 'greedy'}; tok/s and speedup (vs plain, same "
        "request and repeat, per token) are medians; alpha = accepted / drafted; mean len = 1 + "
        "accepted per drafting step; tok/fwd = new tokens per target forward",
    ]
    for row in result.rows:
        for d in row["divergences"] if row["category"] != "overall" else ():
            lines.append(
                f"diverged: {row['category']} {row['mode']} prompt {d['prompt_index']} repeat "
                f"{d['repeat']} at new token {d['position']} (plain {d['plain_token']}, this "
                f"{d['token']}); target's top-2 logit margin there: {_fmt(d['margin'], '.4f')}")
    if m.get("batch", [1]) != [1] and result.batches:
        sizes = ", ".join(f"{b} ({n} batch{'es' if n != 1 else ''})"
                          for b, n in m.get("batches", {}).items())
        lines += ["", f"batch sizes: {', '.join(map(str, m['batch']))}"
                  + (f"; prompts sorted by length, left-padded: {sizes}" if sizes else ""),
                  format_batch_table(result)]
    return "\n".join(lines).lstrip("\n")  # no batch-1 rows: the settings come first


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "sample", True) and any(
            getattr(args, name) is not None for name in ("temperature", "top_p", "top_k", "seed")):
        args.parser.error("--temperature, --top-p, --top-k and --seed apply only with --sample")
    return args.run(args, args.parser)  # the subcommand's parser, for its error messages


if __name__ == "__main__":
    sys.exit(main())
