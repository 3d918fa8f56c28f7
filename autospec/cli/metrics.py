"""``autospec metrics``: serve the store's per-category aggregates for Prometheus to scrape
(``autospec.fleet.metrics.StoreCollector``, read per scrape; the store is opened read-only), or
with ``--backfill FILE`` write the store's history as timestamped OpenMetrics text
(``autospec.fleet.metrics.backfill``) for ``promtool tsdb create-blocks-from openmetrics``."""

from __future__ import annotations

import argparse
import time


def _port(text: str) -> int:
    from autospec.cli.common import integer_in

    return integer_in(text, 0, 65535, " (0: a free port)")


def _step(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def register(sub, parents) -> None:
    p = sub.add_parser(
        "metrics", help="serve the store's per-category aggregates to Prometheus",
        description="Serves /metrics from the store, read on every scrape (any number of "
                    "writers, SQLite or PostgreSQL): vLLM's spec-decode counters per "
                    "category × model pair × hardware, acceptance by position, k in force, "
                    "speculation-off share, tokens/s, bandwidth against peak and the cost "
                    "model's speedup estimate (also per batch size). Runs until interrupted.")
    p.add_argument("--db", metavar="URL", help="store URL or SQLite file (default: "
                                               "autospec.db in the cache directory)")
    p.add_argument("--port", type=_port, default=9464, help="port to serve on (default 9464; "
                                                            "0: a free one)")
    p.add_argument("--addr", default="127.0.0.1", help="address to bind (default 127.0.0.1; "
                                                       "0.0.0.0 for every interface)")
    p.add_argument("--category", help="only this category")
    p.add_argument("--backfill", metavar="FILE",
                   help="instead of serving, write the store's history as OpenMetrics text "
                        "with timestamps to FILE ('-': stdout), for Prometheus to load: "
                        "promtool tsdb create-blocks-from openmetrics FILE DIR")
    p.add_argument("--step", type=_step, default=60.0, metavar="SECONDS",
                   help="seconds between the backfill's samples (default 60)")
    p.set_defaults(run=run, parser=p)


def run(args, parser) -> int:
    from autospec.cli.common import die, open_store_or_die
    from autospec.fleet.metrics import serve_store

    store = open_store_or_die(args.db, read_only=True)
    if args.backfill is not None:
        return _backfill(args, store, die)
    try:
        exporter = serve_store(store, args.port, args.addr, category=args.category)
    except OSError as e:
        store.close()
        die(f"cannot serve on {args.addr}:{args.port}: {e}")
    print(f"serving the store's metrics on {exporter.url} (Ctrl-C stops)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        exporter.close()
        store.close()
    return 0


def _backfill(args, store, die) -> int:
    import sys

    from autospec.cli.common import skipped_said
    from autospec.fleet.metrics import backfill

    try:
        with skipped_said():
            if args.backfill == "-":
                n = backfill(store, sys.stdout, step=args.step, category=args.category)
            else:
                with open(args.backfill, "w", encoding="utf-8") as f:
                    n = backfill(store, f, step=args.step, category=args.category)
    except OSError as e:
        die(f"cannot write {args.backfill}: {e}")
    finally:
        store.close()
    if args.backfill != "-":
        print(f"wrote {n} samples to {args.backfill}", flush=True)
    return 0
