"""``autospec bench``: plain decoding, transformers' assisted generation and autospec on the
same prompts, interleaved; medians and paired speedups."""

from __future__ import annotations

import textwrap

from autospec.cli.common import (
    K_LIMIT,
    batch_sizes,
    die,
    gen_kwargs,
    load,
    positive_int,
    setup,
)
from autospec.textfmt import fmt, table

__all__ = ["register", "run", "format_table", "format_batch_table"]


def register(sub, parents) -> None:
    bench = sub.add_parser(
        "bench", parents=[parents.models, parents.sampling, parents.common],
        help="plain vs transformers' assisted generation vs autospec on the same prompts",
        description="Runs every mode on the same prompts in one process, interleaved, and "
                    "prints median tokens/s, paired speedup vs plain decoding, acceptance, "
                    "timings and (greedy) whether outputs equal plain decoding's.")
    bench.add_argument("--prompts", metavar="FILE.jsonl",
                       help='one {"category", "prompt", "chat"} object per line '
                            "(default: the packaged code/chat/translation set)")
    bench.add_argument("--k", default="1,2,4,6,8", help="lookaheads for the :k modes "
                                                        "(default: 1,2,4,6,8)")
    bench.add_argument("--max-new-tokens", type=positive_int, default=64)
    bench.add_argument("--repeats", type=positive_int, default=3)
    bench.add_argument("--repeats-batch1", type=positive_int, metavar="N",
                       help="repeats at batch 1 when --batch has larger sizes too (default: "
                            "--repeats): batch 1 pairs every prompt alone, a batch of 16 pairs "
                            "once, so the larger sizes need the repeats")
    bench.add_argument("--modes", nargs="+", default=None,
                       help="plain, hf-assisted (its defaults), hf-assisted:k, hf-lookup "
                            "(transformers' prompt lookup, 10 tokens), hf-lookup:k, autospec:k "
                            "(the draft model), ngram:k (autospec's prompt lookup), suffix:k "
                            "(autospec's suffix decoding; each pass over the prompts starts "
                            "with an empty memory), "
                            "policy:NAME (e.g. policy:auto, policy:hybrid:4); :N for one k "
                            "(default: plain, hf-assisted, hf-assisted:k, autospec:k, or plain "
                            "and hf-assisted when --policies is given). With --draft none the "
                            "modes that need a draft model are reported as unsupported")
    bench.add_argument("--policies", help="k policies to compare, e.g. auto,costmodel,bandit,"
                                          "heuristic,fixed:1..8,off (adds modes)")
    bench.add_argument("--db", metavar="URL",
                       help="store for the policy: modes (warm start, tuned parameters, and "
                            "their requests are logged there); default: none")
    bench.add_argument("--batch", type=batch_sizes, default=[1], metavar="B[,B...]",
                       help="batch sizes, e.g. 1,4,16: prompts sorted by length, grouped into "
                            "left-padded batches, every mode on the same batches (default: 1, "
                            "prompt by prompt); beyond 1 the table and auto policies are added")
    bench.add_argument("--table", metavar="SPEC",
                       help="the table policy's batch size → k ranges (default when --batch "
                            "goes beyond 1: 1-2:4,3-8:2,9-:0); adds the mode policy:table:SPEC")
    bench.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    bench.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up pass")
    bench.set_defaults(run=run, parser=bench)


_TABLE_SPEC = r"table:\d+(-\d*)?:\d+(,\d+(-\d*)?:\d+)*"


def _table_mode(spec: str | None, parser) -> str:
    """policy:table:SPEC for --table (the default table without it); a spec this autospec's
    policies do not parse is kept when it has the table's form (the run reports the mode
    unsupported, with the reason), refused otherwise."""
    import re

    from autospec.bench.batch import DEFAULT_TABLE
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


def run(args, parser) -> int:
    from autospec.bench import run as bench

    # check everything a user typed before spending minutes on loading models
    try:
        ks = bench.parse_ks(args.k, K_LIMIT)
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
    env = setup(args)
    target, draft, tok, dtok = load(args, parser, env, allow_no_draft=True)
    try:
        result = bench.run_bench(
            target, draft, tok, prompts, ks=ks, modes=modes, max_new_tokens=args.max_new_tokens,
            repeats=args.repeats, sample=args.sample, seed=args.seed or 0,
            sampling={k: v for k, v in gen_kwargs(args).items()
                      if k in ("temperature", "top_p", "top_k")},
            warmup=not args.no_warmup, draft_tokenizer=dtok, store=args.db,
            batch_sizes=args.batch, repeats_batch1=args.repeats_batch1)
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
    ("foresight", "foresight", ".0%"), ("choices", "choices", ".0%"),
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
        rows.append([str(r["batch"]), r["mode"], fmt(r["tokens_per_s"], ".2f"),
                     fmt(r["speedup"], ".2f"), fmt(r["acceptance"], ".3f"),
                     _k_share(r["k_counts"]),
                     "n/a" if r["peak_kv_bytes"] is None else human_bytes(r["peak_kv_bytes"]),
                     same, r["status"]])
    lines = [table(list(_BATCH_COLUMNS), rows, left=2), "",
             "tok/s: new tokens of every row (each up to its own EOS) per second, median over "
             "repeats; speedup: vs plain batched decoding on the same batch and repeat, median; "
             "identical: rows equal to plain batched decoding's / rows"]
    notes = dict.fromkeys(f"{r['mode']} at batch {r['batch']}: {r['status']} ({r['reason']})"
                          for r in result.batches if r["status"] != "ok")
    return "\n".join([*lines, *notes,
                      *_divergence_notes(result.batches, result.meta.get("dtype"))])


def _divergence_notes(batches, dtype: str | None) -> list[str]:
    """Per batch size and mode whose rows differ from plain's: how many, and whether each first
    parts at a rounding near-tie (the target's top-2 logit margin there below NEAR_TIE, in
    bf16/fp16) or not (worth a report)."""
    from autospec.bench.run import NEAR_TIE

    low = {"bfloat16": "bf16", "float16": "fp16"}.get(dtype or "")
    out = []
    for r in batches:
        if r["rows"] is None or r["batch"] == 1 or r["identical_rows"] == r["rows"]:
            continue
        diff = r["rows"] - r["identical_rows"]
        margins = r.get("diverged_margins") or []
        ties = sum(m < NEAR_TIE for m in margins) if low else 0
        head = (f"{r['mode']} at batch {r['batch']}: {diff} row"
                f"{'s differ' if diff != 1 else ' differs'} from plain batched decoding's")
        stops = diff - len(margins)
        tail = f"; {stops} stop{'s' if stops == 1 else ''} at another length" if stops else ""
        if not margins:
            out.append(f"{head}: each stops at another length")
        elif ties == len(margins):
            out.append(f"{head}: where {'each' if len(margins) > 1 else 'it'} first parts, the "
                       f"target's top two logits are at most {max(margins):.3f} apart, a "
                       f"near-tie {low} rounding of the same sums taken in another order can "
                       f"flip (--dtype fp32 is token-exact){tail}")
        else:
            out.append(f"{head}; {len(margins) - ties} first part where the target's top two "
                       f"logits are {max(margins):.3f} apart, not a rounding near-tie: please "
                       f"report it with these prompts (greedy output should equal plain's){tail}")
    return out


def format_table(result) -> str:
    """A fixed-width table of a BenchResult's rows, its settings, and divergences from plain;
    then, when batch sizes beyond 1 ran, the per-batch-size table."""
    # after alpha, one "NAME a" column per lookup proposer that drafted beside a policy's
    # draft model in any row: its own acceptance
    names = list(dict.fromkeys(n for row in result.rows for n in row.get("lookups") or {}))
    columns = [*_COLUMNS[:5], *((f"{n} a", ("lookups", n), ".3f") for n in names),
               *_COLUMNS[5:]]

    def cell(row: dict, key, spec: str) -> str:
        if isinstance(key, tuple):  # ("lookups", NAME)
            got = (row.get("lookups") or {}).get(key[1])
            return "-" if got is None else fmt(got["acceptance"], spec)
        if row[key] is None:
            return "-"
        return ("yes" if row[key] else "NO") if key == "identical" else fmt(row[key], spec)

    rows = [[cell(row, key, spec) for _, key, spec in columns] for row in result.rows]
    lines = [table([h for h, _, _ in columns], rows, left=2)] if rows else []
    m = result.meta
    lines += [
        "",
        f"target {m['target']}, draft {m['draft']}; device {m['device']}, dtype {m['dtype']}, "
        f"{m['threads']} threads",
        f"{m['prompts']} prompts x {_repeats(m)}, at most {m['max_new_tokens']} new "
        f"tokens, {'sampling' if m['sample'] else 'greedy'}; tok/s and speedup (vs plain, same "
        "request and repeat, per token) are medians; alpha = accepted / drafted; mean len = 1 + "
        "accepted per drafting step; tok/fwd = new tokens per target forward; a lookup's "
        "NAME:k modes (ngram:k, suffix:k …) and hf-lookup draft by that lookup alone (alpha: "
        "its proposals'); NAME a = accepted / drafted of the blocks of lookup proposer NAME "
        "in a policy mode (alpha is then the draft model's alone); foresight = the time perfect "
        "foresight would take over the proposers the mode may use (every outcome known, each "
        "block stopped where acceptance ends, priced by this run's forwards) ÷ the mode's "
        "time, median per request (greedy); choices = that time ÷ the schedule the mode ran "
        "priced the same way (what a better choice of k could gain: the rest of the distance "
        "is the loop's time beyond its forwards' median prices)",
    ]
    lines += [_head_to_head_line(h) for h in result.head_to_head if "batch" not in h]
    skipped = {b["mode"]: b["reason"] for b in result.batches
               if b.get("batch") == 1 and b.get("status") == "unsupported"}
    if skipped:
        lines.append("not run: " + "; ".join(f"{mode} ({why})" for mode, why in skipped.items()))
    for row in result.rows:
        for d in row["divergences"] if row["category"] != "overall" else ():
            lines.append(
                f"diverged: {row['category']} {row['mode']} prompt {d['prompt_index']} repeat "
                f"{d['repeat']} at new token {d['position']} (plain {d['plain_token']}, this "
                f"{d['token']}); target's top-2 logit margin there: {fmt(d['margin'], '.4f')}")
    if m.get("batch", [1]) != [1] and result.batches:
        sizes = ", ".join(f"{b} ({n} batch{'es' if n != 1 else ''})"
                          for b, n in m.get("batches", {}).items())
        lines += ["", f"batch sizes: {', '.join(map(str, m['batch']))}"
                  + (f"; prompts sorted by length, left-padded: {sizes}" if sizes else ""),
                  format_batch_table(result)]
        lines += [_head_to_head_line(h) for h in result.head_to_head if "batch" in h]
    return "\n".join(lines).lstrip("\n")  # no batch-1 rows: the settings come first


def _head_to_head_line(h: dict) -> str:
    """One policy against one baseline of the run, as people read it: over all requests,
    then per category where there are several."""
    low, high = h["interval"]
    if h["baseline"] == "best at batch":
        return (f"batch {h['batch']}: {h['mode']} against {h['against']} (the best of plain and "
                f"fixed k at this size), batch by batch: {h['median_ratio']:.2f}x by the median "
                f"(95% bootstrap interval {low:.2f}-{high:.2f}), faster on {h['faster']} of "
                f"{h['requests']}; {h['throughput_ratio']:.2f}x by throughput")
    why = ("the best fixed k here" if h["baseline"] == "fixed-k"
           else "transformers' prompt lookup" if h["against"].startswith("hf-lookup")
           else "autospec's prompt lookup alone")
    line = (f"{h['mode']} against {h['against']} ({why}), request by request: "
            f"{h['median_ratio']:.2f}x by the median (95% bootstrap interval {low:.2f}-"
            f"{high:.2f}), faster on {h['faster']} of {h['requests']}; "
            f"{h['throughput_ratio']:.2f}x by throughput")
    cats = h["by_category"]
    if len(cats) > 1:
        per = ", ".join(f"{c} {v['median_ratio']:.2f}x ({v['interval'][0]:.2f}-"
                        f"{v['interval'][1]:.2f}, {v['faster']}/{v['requests']})"
                        for c, v in cats.items())
        line += "\n" + textwrap.fill(f"by category (median, interval, faster): {per}",
                                     width=100, initial_indent="  ", subsequent_indent="    ")
    return line


def _repeats(meta: dict) -> str:
    """'3 repeats', or '1 repeat at batch 1, 3 at larger sizes' when they differ."""
    n, sizes = meta["repeats"], meta.get("batch", [1])
    single = meta.get("repeats_batch1", n)

    def count(r: int) -> str:
        return f"{r} repeat{'' if r == 1 else 's'}"
    if single == n or 1 not in sizes:
        return count(n)
    if sizes == [1]:
        return count(single)
    return f"{count(single)} at batch 1, {n} at larger sizes"
