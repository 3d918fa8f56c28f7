"""The ``autospec`` command line: one module per command, the only code in autospec that prints.

Every command module has ``register(sub, parents)``, which adds its parser to the
subcommands (``parents``: the shared option groups of ``autospec.cli.common``) and sets
``run`` (``run(args, parser) -> exit status``) as its default. Heavy imports (torch,
transformers) wait until a command runs, so ``--help`` is instant and the store-only
commands (``stats``, ``report``, ``explain``, ``tune``, ``categorize``, ``metrics``, ``export``,
``ingest``) never import torch.
"""

from __future__ import annotations

import sys
from importlib import import_module

from autospec.textfmt import VisibleStream

__all__ = ["main", "build_parser", "COMMANDS"]

# in the order ``autospec --help`` lists them
COMMANDS = ("demo", "generate", "bench", "probe", "stats", "report", "explain", "tune",
            "categorize", "metrics", "export", "ingest")


def build_parser():
    from autospec.cli.common import OneLineParser, parents

    parser = OneLineParser(
        prog="autospec", description="Exact speculative decoding for transformers' generate.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    shared = parents()
    for name in COMMANDS:
        import_module(f"autospec.cli.{name}").register(sub, shared)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "sample", True) and any(
            getattr(args, name) is not None for name in ("temperature", "top_p", "top_k", "seed")):
        args.parser.error("--temperature, --top-p, --top-k and --seed apply only with --sample")
    stdout = sys.stdout
    sys.stdout = VisibleStream(stdout)  # control characters in any output are shown, inert
    try:
        return args.run(args, args.parser)  # the subcommand's parser, for its error messages
    except Exception as e:
        _store_error_or_raise(e)
        raise
    finally:
        sys.stdout = stdout


def _store_error_or_raise(e: Exception) -> None:
    """A StoreError that reached the top (a store damaged on disk, found mid-command) is one
    ``autospec: error:`` line and status 2, like every refusal; anything else is a bug and
    keeps its traceback. A StoreError can only come from an imported ``autospec.store``, so
    nothing is imported here (``--help`` stays light)."""
    database = sys.modules.get("autospec.store.database")
    if database is not None and isinstance(e, database.StoreError):
        from autospec.cli.common import die

        die(str(e))
