"""``autospec explain``: why the policy chose each kept iteration's k and proposer — the
candidates it weighed and each one's expected seconds per token — from a request's decision
records in the store (``autospec.policies.explain``; the report reads the same).

Reads only the store (no torch import), so it runs beside a serving process.
"""

from __future__ import annotations

import json
import math
import sys
import textwrap

from autospec.cli.common import die, open_store_or_die, row_id, skipped_said
from autospec.textfmt import table

HOW_TO_KEEP = ("a request keeps its decision records when it runs with the store on (a sample: "
               "the first 4 iterations and every 16th) or with generate(..., explain=True) "
               "(every iteration)")


def register(sub, parents) -> None:
    p = sub.add_parser(
        "explain", help="why the policy ran each k: the candidates and their seconds per token",
        description="Prints a request's decision records: for each kept iteration the k and "
                    "proposer chosen, the rule that chose them, and every candidate weighed "
                    "with its expected seconds per token and where its acceptance and costs "
                    f"came from. {HOW_TO_KEEP[0].upper()}{HOW_TO_KEEP[1:]}.")
    p.add_argument("--db", metavar="URL", help="store URL or SQLite file (default: "
                                               "autospec.db in the cache directory)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--request", metavar="ID", type=row_id, help="the request's id")
    which.add_argument("--last", action="store_true",
                       help="the latest request with decision records")
    p.add_argument("--category", help="with --last: the latest of this category; with "
                                      "--request: check that it is of this category")
    p.add_argument("--json", action="store_true", help="print the records as JSON")
    p.set_defaults(run=run, parser=p)


def run(args, parser) -> int:
    with skipped_said():
        return _run(args)


def _run(args) -> int:
    from autospec.store import queries

    store = open_store_or_die(args.db, read_only=True)
    with store, store.session() as s:
        if args.last:
            row = queries.latest_decisions(s, category=args.category)
            if row is None:
                where = f" of category {args.category!r}" if args.category is not None else ""
                latest = queries.recent_requests(s, category=args.category, limit=1)
                what = ("no request" if not latest else
                        f"no request{where} has decision records (the latest, "
                        f"{latest[0].id}, has none)")
                die(f"{what}{where if not latest else ''} in {store.url}: {HOW_TO_KEEP}")
        else:
            row = queries.request_decisions(s, args.request)
            if row is None:
                latest = queries.recent_requests(s, limit=1)
                die(f"no request {args.request} in {store.url}" + (
                    f" (request ids run 1 … {latest[0].id}; `autospec explain --last` shows "
                    "the latest with decision records)" if latest else ": it holds no request"))
            if args.category is not None and row.category != args.category:
                die(f"request {row.id} is of category {row.category!r}, not {args.category!r}")
            if row.decisions is None:
                die(f"request {row.id} has no decision records (logged by an autospec before "
                    f"they were kept, or with the store off): {HOW_TO_KEEP}")
    if args.json:
        json.dump(_finite(_as_dict(row)), sys.stdout, indent=2, ensure_ascii=False,
                  default=str)
        print()
        return 0
    print("\n".join(render(row)))
    return 0


def _finite(x):
    """Strict JSON: an infinite or NaN figure (a block expected to emit nothing) as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def _as_dict(row) -> dict:
    from autospec.report.why import RULES

    return {"request": {"id": row.id, "created_at": row.created_at.isoformat(),
                        "category": row.category, "pair_id": row.pair_id,
                        "policy": row.policy, "batch_size": row.batch_size,
                        "iterations": row.iterations, "new_tokens": row.new_tokens,
                        "k_schedule": list(row.k_schedule)},
            "rules": {r: RULES[r] for r in sorted({d.get("rule") for d in row.decisions})
                      if r in RULES},
            "decisions": row.decisions}


def render(row) -> list[str]:
    """The request's records as text: a header, the rules used (a legend), then per kept
    iteration what was chosen and the table of candidates."""
    from autospec.report.why import CANDIDATE_HEADER, RULES, candidate_rows, choice_name, ms

    recs = row.decisions
    kept = (f"all {len(recs)} iterations" if len(recs) >= row.iterations else
            f"{len(recs)} of {row.iterations} iterations")
    out = [f"request {row.id}  {row.created_at:%Y-%m-%d %H:%M:%S} UTC  category {row.category!r}"
           f"  pair {row.pair_id}  policy {row.policy}  batch {row.batch_size}",
           f"{row.new_tokens} tokens in {row.iterations} iterations; decision records kept "
           f"for {kept}", "rules:"]
    for rule in sorted({d.get("rule") for d in recs}, key=str):
        out += textwrap.wrap(f"{rule}: {RULES.get(rule, '(unknown rule)')}", 100,
                             initial_indent="  ", subsequent_indent="    ")
    out.append("")
    if any(d.get("candidates") for d in recs):
        out += textwrap.wrap(
            "* marks the chosen candidate; E[N] = tokens the block is expected to emit (at "
            "batch B over its rows as the call's end counts them: plain decoding's is B, a "
            "row that then waits for the last counts less); "
            "block = its seconds (k · T_propose + T_t(k + 1)); +/tok = seconds more per "
            "emitted token (the draft's catch-up; at batch B it is in E[N]); ms/tok = (block + E[N] · +/tok) / E[N], its "
            "expected seconds per emitted token; S = its speedup over plain decoding as the "
            "rule read it; saved = what it saves against plain steps; a_1..a_k = the "
            "acceptance used, from 'a from'; costs = where its costs came from; times in ms",
            100)
    for rec in recs:
        i = rec.get("iteration")
        ran = row.k_schedule[i] if isinstance(i, int) and i < len(row.k_schedule) else None
        head = (f"iteration {i}: {choice_name(rec.get('proposer', 'plain'), rec.get('k', 0))}"
                f"  (rule {rec.get('rule')}")
        if rec.get("policy"):
            head += f", policy {rec['policy']}"
        head += ")"
        if ran is not None and ran != rec.get("k"):
            head += f"  ran k={ran}" + _why_ran(rec, ran)
        rows = candidate_rows(rec)
        if not rows:  # the policy's answer alone: one line
            out.append(head)
            continue
        out += ["", head]
        facts = [f"batch {rec.get('batch', 1)}"]
        if rec.get("t_plain") is not None:
            facts.append(f"T_t(1) {ms(rec['t_plain'])} ms")
        if rec.get("value") is not None:
            facts.append(f"a token past the first worth {ms(rec['value'])} ms")
        if rec.get("min_gain"):
            facts.append(f"min_gain {rec['min_gain']:.2f}")
        if rec.get("busy"):
            facts.append("busy machine")
        out.append("  " + ", ".join(facts))
        out += ["  " + line for line in table(CANDIDATE_HEADER, rows).splitlines()]
        stop = rec.get("stop")
        if stop:
            out += textwrap.wrap(
                f"then up to {rec.get('k')} tokens while the next pays: drafting stops after "
                f"token i where the draft's confidence puts the block under bar i "
                f"({' '.join(f'{b:.2f}' for b in stop.get('bars', ()))}; a token worth "
                f"{ms(stop.get('worth_s'))} ms, the priced block's ms/tok)", 100,
                initial_indent="  ", subsequent_indent="    ")
    return out


def _why_ran(rec: dict, ran: int) -> str:
    """Why the block ran shorter than chosen, where the record says: the engine's clamps."""
    k_run = rec.get("k_run")
    if k_run is not None and ran == k_run < rec.get("k", 0):
        return " (clamped to the tokens left or the context)"
    if rec.get("stop") and ran < (k_run if k_run is not None else rec.get("k", 0)):
        return " (stopped where the next token stopped paying)"
    return ""
