"""``autospec report``: per workload, acceptance, memory-bound or not, speedup and a verdict,
from the store (``autospec.report`` builds and renders it)."""

from __future__ import annotations

import sys
from pathlib import Path

from autospec.cli.common import die, open_store_or_die, row_id, skipped_said


def register(sub, parents) -> None:
    p = sub.add_parser(
        "report", help="per workload: acceptance, memory-bound or not, speedup, verdict",
        description="Reads the store (safe while servers keep writing) and answers, per "
                    "category × model pair × hardware: how well the draft matches, whether "
                    "verification is memory-bound, and the speedup over plain decoding "
                    "(measured where plain runs exist, else estimated by the cost model).")
    p.add_argument("--db", metavar="URL", help="store URL or SQLite file (default: "
                                               "autospec.db in the cache directory)")
    p.add_argument("--format", choices=("text", "html", "json"), default="text")
    p.add_argument("--out", metavar="DIR", help="write report.txt, report.html and report.json "
                                                "into DIR (default: --format text/json to "
                                                "stdout, html to ./autospec-report.html)")
    p.add_argument("--category", help="only this category")
    p.add_argument("--pair-id", type=row_id, help="only this model pair (see `autospec stats "
                                               "--json`)")
    p.set_defaults(run=run, parser=p)


_EXT = {"text": "txt", "html": "html", "json": "json"}


def run(args, parser) -> int:
    with skipped_said() as skipped:  # the report lists them too (its "skipped" lines)
        return _run(args, skipped)


def _run(args, skipped: list[str]) -> int:
    from autospec.report import build_report, render_html, render_json, render_text

    store = open_store_or_die(args.db, read_only=True)
    with store:
        report = build_report(store, category=args.category, pair_id=args.pair_id)
    renderers = {"text": render_text, "html": render_html, "json": render_json}
    if args.out is None and args.format != "html":
        sys.stdout.write(renderers[args.format](report))
        if args.format == "text":
            skipped.clear()  # said in the text itself
        return 0
    if args.out is None:
        targets = {"html": Path("autospec-report.html")}
    else:  # a directory gets every format
        targets = {fmt: Path(args.out) / f"report.{ext}" for fmt, ext in _EXT.items()}
    for fmt, path in targets.items():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(renderers[fmt](report), encoding="utf-8")
        except OSError as e:
            die(f"cannot write {path}: {e}")
    n = len(report.workloads)
    print(f"wrote {', '.join(str(p) for p in targets.values())} "
          f"({n} workload{'s' if n != 1 else ''})")
    return 0
