"""`autospec categorize fit|show|forget`: train the traffic categoriser on logged requests,
inspect the stored versions with the data and metrics they were fitted with, and clear
stored prompt features.

Reads only the store and its prompt features (no torch import, no model load).
"""

from __future__ import annotations

import json
import sys
from datetime import datetime

from autospec.cli.common import fraction as _fraction
from autospec.cli.common import open_store_or_die, parse_when, row_id
from autospec.cli.common import positive_int as _positive_int
from autospec.textfmt import fmt, table

__all__ = ["register", "run_fit", "run_show", "run_forget"]


def register(sub, parents) -> None:
    """``categorize`` with its actions ``fit`` and ``show``."""
    cat = sub.add_parser(
        "categorize", help="fit / inspect the model that categorises unlabelled requests",
        description="Requests served without category= are categorised before generation by "
                    "a model fitted on logged requests that carried one (hashed prompt-token "
                    "n-grams; no text), which also forecasts each prompt's acceptance so a new "
                    "request starts from a good k.")
    sub = cat.add_subparsers(dest="categorize_command", metavar="ACTION", required=True)
    db_help = "store URL or SQLite file (default: autospec.db in the cache directory)"

    fit = sub.add_parser(
        "fit", help="train on logged requests and store the model as a new version",
        description="Fits a classifier on the requests whose category the caller gave (with "
                    "fewer than two labels, or --clusters, k-means clusters on every request "
                    "with features), scores it on the newest --test-fraction of the window "
                    "(default 20%) after fitting on the older rows, refits on all rows and stores it with its window and "
                    "metrics.")
    fit.add_argument("--db", metavar="URL", help=db_help)
    fit.add_argument("--name", default="default", help="categoriser name (default: default)")
    fit.add_argument("--pair-id", type=row_id, help="only requests of this model pair (see "
                                                 "`autospec stats --json`)")
    fit.add_argument("--since", type=parse_when, metavar="WHEN",
                     help="only requests from WHEN on (ISO date/time, UTC unless a zone is "
                          "given, or Unix time)")
    fit.add_argument("--until", type=parse_when, metavar="WHEN",
                     help="only requests before WHEN")
    fit.add_argument("--clusters", type=_positive_int, metavar="N",
                     help="cluster into N categories instead of learning the given labels")
    fit.add_argument("--test-fraction", type=_fraction, default=0.2,
                     help="newest share of the rows held out for the metrics (default 0.2)")
    fit.add_argument("--min-rows", type=_positive_int, default=20,
                     help="refuse to fit on fewer rows (default 20)")
    fit.add_argument("--seed", type=int, default=0)
    fit.add_argument("--dry-run", action="store_true", help="fit and report, store nothing")
    fit.add_argument("--json", action="store_true", help="print JSON instead of a table")
    fit.set_defaults(run=run_fit, parser=fit)

    show = sub.add_parser(
        "show", help="list stored categoriser versions, their window and metrics",
        description="Without --version: one line per stored version (newest first). With "
                    "--version: that version's metrics in full.")
    show.add_argument("--db", metavar="URL", help=db_help)
    show.add_argument("--name", help="only this categoriser (default: all)")
    show.add_argument("--version", type=_positive_int, help="details of one version")
    show.add_argument("--json", action="store_true", help="print JSON instead of a table")
    show.set_defaults(run=run_show, parser=show)

    forget = sub.add_parser(
        "forget", help="clear stored prompt features (unkeyed ones, or --all)",
        description="Clears the prompt features of requests logged before features were "
                    "keyed (format 1: they can be read back into the prompt's tokens), or "
                    "with --all every request's (after the feature key leaked; rotate it too). "
                    "Everything else a request recorded stays.")
    forget.add_argument("--db", metavar="URL", help=db_help)
    forget.add_argument("--all", action="store_true", dest="every",
                        help="clear every request's features, keyed or not")
    forget.set_defaults(run=run_forget, parser=forget)


def run_fit(args, parser=None) -> int:
    from autospec.categorize.categorizer import fit_from_store

    store = open_store_or_die(args.db)
    with store:
        if args.since is not None and args.until is not None and _ts(args.until) <= _ts(args.since):
            print("autospec: error: --until must be later than --since", file=sys.stderr)
            return 2
        try:
            cat, report = fit_from_store(
                store, name=args.name, pair_id=args.pair_id, since=args.since,
                until=args.until, clusters=args.clusters, test_fraction=args.test_fraction,
                min_rows=args.min_rows, seed=args.seed, save=not args.dry_run)
        except ValueError as e:
            print(f"autospec: error: {e}", file=sys.stderr)
            return 1
        url = store.url
    if args.json:
        json.dump({"name": cat.name, "version": report.version, "kind": cat.kind,
                   "classes": cat.classes, "columns": int(cat.columns.size),
                   "report": report.to_dict(), "meta": cat.meta}, sys.stdout, indent=2,
                  default=str)
        print()
        return 0
    saved = (f"stored as {cat.name!r} version {report.version} in {url}" if report.version
             else "not stored (--dry-run)")
    print(f"categoriser: {cat.kind}, {len(cat.classes)} categories, "
          f"{cat.columns.size} feature columns; {saved}")
    print(_describe(report))
    return 0


def run_forget(args, parser=None) -> int:
    from autospec.store.keys import forget_features

    store = open_store_or_die(args.db)
    with store:
        cleared = forget_features(store, every=args.every)
        url = store.url
    what = "prompt features" if args.every else "unkeyed prompt features"
    print(f"cleared the {what} of {cleared} request(s) in {url}"
          + ("" if store.dialect == "sqlite" or not cleared
             else " (PostgreSQL keeps the old row versions until `VACUUM FULL requests`)"))
    return 0


def _ts(t) -> float:
    return t.timestamp() if isinstance(t, datetime) else float(t)


def _describe(report) -> str:
    """The human report of one fit (from ``fit`` or from a stored version's meta)."""
    lines = [
        f"window: {_day(report.window_first)} .. {_day(report.window_last)}, "
        f"{report.rows} requests, pair(s) {', '.join(map(str, report.pair_ids)) or '-'}"
        + (f", {report.skipped_rows} skipped ("
           + ", ".join(f"{n} {k}" for k, n in (report.skipped or {}).items()) + ")"
           if report.skipped_rows else ""),
        "labels given: " + (", ".join(f"{k} {v}" for k, v in list(report.labels.items())[:12])
                            + (" ..." if len(report.labels) > 12 else "")),
    ]
    split = ("newest" if report.split == "time" else "random") + f" {report.test_rows} rows"
    if report.kind == "classifier":
        lines.append(f"held-out accuracy: {fmt(report.accuracy, '.3f')} ({split}; fitted on "
                     f"the older {report.train_rows}, stored model refitted on all)")
        if report.per_class:
            rows = [[c, fmt(m["precision"], ".3f"), fmt(m["recall"], ".3f"),
                     fmt(m["f1"], ".3f"), str(m["support"])]
                    for c, m in report.per_class.items()]
            lines += ["", table(["category", "precision", "recall", "f1", "held out"], rows), ""]
    else:
        sizes = ", ".join(f"{k} {v}" for k, v in report.cluster_sizes.items())
        lines.append(f"clusters: {report.clusters} ({sizes}); silhouette "
                     f"{fmt(report.silhouette, '.3f')} (-1..1, higher = better separated)")
    if report.mae is not None:
        lines.append(f"acceptance forecast (pair {report.regressor_pair_id}, "
                     f"{report.regressor_rows} requests): held-out MAE "
                     f"{fmt(report.mae, '.3f')} vs {fmt(report.baseline_mae, '.3f')} predicting "
                     f"the mean, {fmt(report.category_mean_mae, '.3f')} the category's mean")
    elif report.regressor_rows:
        lines.append(f"acceptance forecast (pair {report.regressor_pair_id}, "
                     f"{report.regressor_rows} requests): no held-out rows to score it")
    else:
        lines.append(f"acceptance forecast: none ({report.regressor_note or 'not fitted'})")
    lines.append(f"fit took {report.fit_s:.2f} s")
    return "\n".join(lines)


def _day(iso: str | None) -> str:
    return "-" if not iso else iso.replace("T", " ")[:19]


def run_show(args, parser=None) -> int:
    from autospec.categorize.categorizer import FitReport
    from autospec.store import queries

    store = open_store_or_die(args.db, read_only=True)
    with store, store.session() as s:
        rows = queries.categorizers(s, name=args.name)
        url = store.url
    if args.version is not None:
        rows = [r for r in rows if r.version == args.version]
        if not rows:
            who = f"categoriser {args.name!r}" if args.name else "any categoriser"
            print(f"autospec: error: no version {args.version} of {who} in {url}",
                  file=sys.stderr)
            return 1
    if args.json:
        json.dump([{"name": r.name, "version": r.version, "kind": r.kind,
                    "created_at": r.created_at.isoformat(), "payload_bytes": len(r.payload),
                    "meta": r.meta} for r in rows], sys.stdout, indent=2, default=str)
        print()
        return 0
    if not rows:
        print(f"no categoriser stored in {url}"
              + (f" under the name {args.name!r}" if args.name else "")
              + "; fit one with `autospec categorize fit`")
        return 0
    if args.version is not None:
        for r in rows:
            rep = FitReport.from_meta(r.meta, version=r.version)
            feats = r.meta.get("features") or {}
            print(f"{r.name} version {r.version}: {r.kind}, stored {_day(r.created_at.isoformat())}"
                  f", {len(r.payload) / 1e3:.0f} KB, sklearn {r.meta.get('sklearn', '-')}, "
                  f"features v{feats.get('version', '?')}"
                  + (f" under key {feats['key_id']}" if feats.get("key_id") else ""))
            print(_describe(rep))
        return 0
    table_rows = []
    for r in rows:
        rep = FitReport.from_meta(r.meta, version=r.version)
        quality = (f"acc {fmt(rep.accuracy, '.3f')}" if r.kind == "classifier"
                   else f"silh {fmt(rep.silhouette, '.3f')}")
        table_rows.append([
            r.name, str(r.version), r.kind, _day(r.created_at.isoformat()),
            f"{_day(rep.window_first)[:10]} .. {_day(rep.window_last)[:10]}", str(rep.rows),
            str(len(rep.labels) if r.kind == "classifier" else rep.clusters or "-"), quality,
            f"{fmt(rep.mae, '.3f')} / {fmt(rep.baseline_mae, '.3f')}"])
    print(table(["name", "version", "kind", "stored", "window", "rows", "categories",
                 "held-out", "MAE / mean"], table_rows, left=3))
    print(f"\nstore {url}. held-out: accuracy on the newest requests (classifier) or "
          "silhouette (clusters); MAE: acceptance forecast vs predicting the mean. "
          "Details: --version N")
    return 0
