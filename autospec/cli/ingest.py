"""``autospec ingest``: a vLLM or SGLang metrics scrape's spec-decode counters into the store as one
category's statistics (``autospec.fleet.ingest``), so ``report`` and ``export`` cover engine traffic."""

from __future__ import annotations

import argparse


def _label(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def register(sub, parents) -> None:
    from autospec.cli.common import k_max_value
    from autospec.fleet.ingest import (  # torch-free
        ENGINES,
        MAX_NAME,
        MAX_POSITIONS,
        MAX_SCRAPE_BYTES,
    )

    p = sub.add_parser(
        "ingest", help="record a vLLM or SGLang metrics scrape's acceptance counters in the "
                       "store",
        description="Reads a vLLM or SGLang /metrics scrape (a file or an http(s) URL, "
                    "Prometheus text format) and records its spec-decode counters — drafts, "
                    "draft tokens, accepted tokens, accepted tokens per position (vLLM; "
                    "SGLang counts none per position: unknown, not guessed) — as one record "
                    "of the category's statistics (no traces). Counters are cumulative: "
                    "ingest an "
                    "engine once, or pass --baseline (an earlier scrape) to add only the "
                    "traffic since. Refused, with nothing written: a scrape over "
                    f"{MAX_SCRAPE_BYTES / 2**20:g} MiB, a series listed twice, a counter "
                    "that is NaN, infinite, negative or fractional, a model_name over "
                    f"{MAX_NAME} characters, a per-position sample beyond position "
                    f"{MAX_POSITIONS - 1} or beyond what the scrape's draft counters allow, "
                    "and counters that contradict each other (more accepted than drafted, "
                    "a position accepted more often than there were drafts or than the "
                    "position before it, positions that do not sum to the accepted tokens). "
                    "A vLLM window (--baseline) that ran one request at a time at a fixed k "
                    "also records vLLM's own seconds per step with its draft model (its "
                    "request decode time over its steps), which `autospec export --engine "
                    "vllm` lists beside its price of the draft model's k (and prices it by "
                    "where the store has no steps of autospec's custom_class proposer).")
    p.add_argument("--db", metavar="URL", help="store URL or SQLite file (default: "
                                               "autospec.db in the cache directory)")
    p.add_argument("--prometheus", required=True, metavar="FILE|URL", help="the scrape")
    p.add_argument("--category", required=True, help="the category the traffic belongs to")
    p.add_argument("--baseline", metavar="FILE|URL", help="an earlier scrape of the same "
                                                          "engine: ingest only the difference")
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="whose metrics: vllm (vllm:spec_decode_*), sglang "
                        "(sglang:spec_verify_calls_total and the token counters), or auto: "
                        "vLLM's where present, else SGLang's")
    p.add_argument("--k", type=k_max_value, metavar="K",
                   help="SGLang: the draft length it ran (--speculative-num-steps of a chain), "
                        "where the scrape has no sglang:spec_num_draft_tokens gauge (1.."
                        f"{MAX_POSITIONS})")
    p.add_argument("--model", help="the model_name label to read (default: the only one)")
    p.add_argument("--label", type=_label, action="append", default=[], metavar="NAME=VALUE",
                   help="only samples with this label (repeatable), e.g. engine=0")
    p.add_argument("--target", help="target name for the store (default: the model_name)")
    p.add_argument("--draft", default="unknown", help="draft name for the store")
    p.add_argument("--dtype", default="unknown")
    p.add_argument("--hardware", default="unknown", help="e.g. 'cuda: NVIDIA H200' (as "
                                                         "autospec names it, to pair the "
                                                         "counters with a probe)")
    p.set_defaults(run=run, parser=p)


def run(args, parser) -> int:
    from autospec.cli.common import die, open_store_or_die
    from autospec.fleet.engine_costs import ENGINE_STEP_PATHS
    from autospec.fleet.ingest import (
        IngestError,
        engine_step,
        parse_scrape,
        read_scrape,
        to_record,
    )
    from autospec.store import write_records
    from autospec.store.record import PairInfo
    from autospec.store.write import add_engine_steps, get_or_create_pair
    from autospec.textfmt import clip, named

    labels = dict(args.label)
    try:
        text = read_scrape(args.prometheus)
        counters = parse_scrape(text, args.model, labels, engine=args.engine, k=args.k)
        if args.baseline is not None:
            before = parse_scrape(read_scrape(args.baseline), counters.model, labels,
                                  engine=counters.engine, k=args.k)
            counters = counters.minus(before)
        if not args.category.strip():
            die("--category must not be empty")
        step, no_step = engine_step(counters) if args.baseline is not None else (
            None, "a step time needs a window: pass --baseline")
        # a plain window (no drafts) carries vLLM's plain step alone: no acceptance to record
        if counters.drafts == 0 and args.baseline is not None and step is None:
            die(f"the window counts no drafts and gives no step time: {no_step} (nothing "
                "was written)")
        record = None if counters.drafts == 0 and step is not None else to_record(
            counters, category=args.category, target=args.target, draft=args.draft,
            dtype=args.dtype, hardware=args.hardware)
    except IngestError as e:
        die(str(e))
    except (OSError, UnicodeDecodeError) as e:
        die(f"cannot read {args.prometheus}: {e}")
    pair = PairInfo(target=args.target or counters.model, draft=args.draft, dtype=args.dtype,
                    hardware=args.hardware)
    store = open_store_or_die(args.db)
    with store:
        try:
            with store.begin() as s:
                pair_id = (write_records(s, [record])[record.pair] if record is not None
                           else get_or_create_pair(s, pair))
                if step is not None:
                    add_engine_steps(s, pair_id, ENGINE_STEP_PATHS[counters.engine], step.n,
                                     step.seconds, step.steps,
                                     record.created_at if record is not None else None)
        except ValueError as e:
            die(f"cannot record the scrape: {e}")
    if record is not None:
        _, m = record.model()  # the engine's drafter: the model proposer's row
        acc = m.accepted / m.proposed if m.proposed else float("nan")
        where = (f"over {len(m.accepted_per_position)} positions" if counters.engine == "vllm"
                 else f"at k = {counters.k}, per position unknown (SGLang does not count it)")
        print(f"ingested {clip(counters.model, 80)} ({counters.engine}): {m.blocks} drafts, "
              f"{m.proposed} draft tokens, {m.accepted} accepted ({acc:.1%}) {where} as "
              f"category {named(args.category)}")
    if step is not None:
        what = (f"with the draft model at k = {step.k}" if step.k else
                "plain (no drafts in the window)")
        print(f"{counters.engine}'s own steps {what}: {step.step_s * 1e3:.1f} ms per step "
              f"over {step.steps} decode steps ({step.per_step:.2f} "
              f"{'drafts' if step.k else 'tokens'} per step), for pair #{pair_id}")
    elif counters.engine == "vllm":
        print(f"no step time recorded: {no_step}")
    return 0
