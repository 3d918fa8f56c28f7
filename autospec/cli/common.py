"""What the commands share: argument types, the parent parsers (runtime, models, decoding),
runtime setup, model loading and opening a store — and ``die``, the one way a command
refuses input (``autospec: error: …`` on stderr, exit status 2)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import NoReturn

from autospec.policies.base import K_LIMIT  # the one limit on k (torch-free)

__all__ = ["die", "parse_when", "positive_int", "fraction", "k_value", "k_max_value",
           "seconds", "ranged", "batch_sizes",
           "OneLineParser", "Parents", "parents", "setup", "load", "gen_kwargs", "env_line",
           "open_store_or_die", "skipped_said", "row_id", "DEFAULT_PAIR", "K_LIMIT"]

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DEFAULT_PAIR = "qwen2.5-coder"


def die(message: str) -> NoReturn:
    """``autospec: error: …`` on stderr and exit status 2, as argparse does for bad input."""
    print(f"autospec: error: {message}", file=sys.stderr)
    raise SystemExit(2)


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one ``autospec: error:`` line naming the command
    and where its help is (the usage text stays behind ``--help``); subcommands inherit it."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("autospec").strip()
        where = f"{command}: " if command else ""
        die(f"{where}{message} (see `{self.prog} --help`)")


def parse_when(text: str) -> datetime | float:
    """A Unix time (seconds) or an ISO date/time; without a zone it is read as UTC."""
    try:
        return float(text)
    except ValueError:
        pass
    s = text.strip()
    if s.endswith(("Z", "z")):
        s = s[:-1] + "+00:00"
    try:
        t = datetime.fromisoformat(s)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a Unix time nor an ISO date/time (e.g. 2025-06-01 or "
            "2025-06-01T12:00:00+02:00)") from None
    return t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def integer_in(text: str, lo: int, hi: int, note: str = "") -> int:
    """An integer in lo..hi, or an argparse error saying so (``note`` follows the range)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not lo <= value <= hi:
        raise argparse.ArgumentTypeError(f"must be in {lo}..{hi}{note}, got {value}")
    return value


ROW_ID_MAX = 2**63 - 1  # the store's ids are 64-bit signed integers (BIGINT)


def row_id(text: str) -> int:
    """A store row's id (a request, a pair): an integer in 1..2^63 − 1."""
    return integer_in(text, 1, ROW_ID_MAX, " (ids fit a 64-bit signed integer)")


def k_value(text: str) -> int:
    return integer_in(text, 0, K_LIMIT, " (0 = plain decoding)")


def k_max_value(text: str) -> int:
    """The largest k a command may use: an integer in 1..K_LIMIT."""
    return integer_in(text, 1, K_LIMIT)


def seconds(text: str) -> float:
    """A duration: a finite number of seconds > 0 (not 0, not negative, not nan or inf)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return value


def ranged(low: float, high: float, *, low_open: bool = True):
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


def batch_sizes(text: str) -> list[int]:
    """``1,4,16`` → [1, 4, 16] (sorted, unique, each ≥ 1)."""
    from autospec.bench.batch import parse_batch_sizes  # torch-free

    try:
        return parse_batch_sizes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# -- parent parsers ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Parents:
    """The option groups commands share, as argparse parents."""
    common: argparse.ArgumentParser  # runtime: threads, dtype, device, cache, -v
    models: argparse.ArgumentParser  # --pair or --target/--draft
    pair_only: argparse.ArgumentParser  # --pair
    sampling: argparse.ArgumentParser  # --sample, --temperature, --top-p, --top-k, --seed


def _common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("runtime")
    g.add_argument("--threads", type=positive_int, help="torch threads (default: 2 on CPU)")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="default: bf16")
    g.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, ...")
    g.add_argument("--cache", metavar="DIR", help="model cache (default: $AUTOSPEC_CACHE or "
                                                   "~/.cache/autospec)")
    g.add_argument("-v", "--verbose", action="store_true", help="INFO logging")
    return p


def _models(pair_only: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("models")
    g.add_argument("--pair", help=f"a named target/draft pair (default: {DEFAULT_PAIR})")
    if not pair_only:
        g.add_argument("--target", help="target model: local directory, .gguf file or Hub id")
        g.add_argument("--draft", help="draft model sharing the target's tokenizer; 'none': no "
                                       "draft model, prompt lookup (n-gram) drafts alone "
                                       "(generate, bench)")
    return p


def _sampling() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("decoding (greedy unless --sample)")
    g.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=ranged(0, math.inf))
    g.add_argument("--top-p", type=ranged(0, 1))
    g.add_argument("--top-k", type=positive_int)
    g.add_argument("--seed", type=int, help="seed for sampling")
    return p


def parents() -> Parents:
    return Parents(common=_common(), models=_models(), pair_only=_models(pair_only=True),
                   sampling=_sampling())


# -- runtime ----------------------------------------------------------------------------------

def setup(args) -> dict:
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
    if device.type == "cuda" and not torch.cuda.is_available():
        die(f"--device {args.device}: this torch build or machine has no CUDA device "
            "(use --device cpu, or install a CUDA build of torch)")
    if device.type == "cuda" and device.index is not None \
            and device.index >= torch.cuda.device_count():
        die(f"--device {args.device}: only {torch.cuda.device_count()} CUDA device(s) visible")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    elif device.type == "cpu":
        torch.set_num_threads(2)  # the benchmark log's setting; more threads help little on CPU
    return {"device": device, "dtype": getattr(torch, DTYPES[args.dtype]),
            "threads": torch.get_num_threads()}


NO_DRAFT = "none"  # --draft none: no draft model, the n-gram proposer alone


def load(args, parser, env, *, allow_no_draft: bool = False):
    """(target, draft, tokenizer, draft_tokenizer) on env's device; user errors exit cleanly.
    ``allow_no_draft``: ``--draft none`` gives draft None (commands that can serve with the
    n-gram proposer alone)."""
    from autospec import pairs as models

    target_path, draft_path = getattr(args, "target", None), getattr(args, "draft", None)
    no_draft = draft_path is not None and draft_path.strip().lower() == NO_DRAFT
    if no_draft and not allow_no_draft:
        parser.error("--draft none (the n-gram proposer alone) is not available here")
    if target_path and args.pair:
        parser.error("use either --pair or --target/--draft")
    if draft_path and not no_draft and args.pair:
        parser.error("use either --pair or --target/--draft (--pair P --draft none keeps "
                     "P's target alone)")
    if bool(target_path) != bool(draft_path) and not no_draft:
        parser.error("--target and --draft go together (--draft none: no draft model)")
    name = args.pair or DEFAULT_PAIR
    if not target_path and name not in models.PAIRS:
        parser.error(f"--pair: unknown pair {name!r} (known: {', '.join(sorted(models.PAIRS))})")
    try:
        draft = dtok = None
        if target_path:
            target, tok = models.load_model(target_path, dtype=env["dtype"], cache=args.cache)
            if not no_draft:
                draft, dtok = models.load_model(draft_path, dtype=env["dtype"], cache=args.cache)
        else:
            pair = models.load_pair(name, dtype=env["dtype"], cache=args.cache,
                                    draft=not no_draft)
            target, draft, tok = pair.target, pair.draft, pair.tokenizer
    except (OSError, ValueError, RuntimeError) as e:
        die(f"cannot load the models: {e}")
    return (target.to(env["device"]), None if draft is None else draft.to(env["device"]),
            tok, dtok)


def gen_kwargs(args) -> dict:
    kw = {"max_new_tokens": args.max_new_tokens, "do_sample": bool(getattr(args, "sample", False))}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(args, name, None) is not None:
            kw[name] = getattr(args, name)
    return kw


def env_line(env) -> str:
    return (f"device {env['device']}, dtype {str(env['dtype']).removeprefix('torch.')}, "
            f"{env['threads']} threads")


@contextlib.contextmanager
def skipped_said():
    """Collect what the store's readers leave out in the block (damaged rows:
    ``autospec.store.damage``) and say each one after it, one ``autospec: warning: skipped``
    line on stderr (stdout may carry JSON or an export). Yields the list: a command that shows
    the notes itself empties it."""
    from autospec.store.damage import collecting  # no SQLAlchemy
    from autospec.textfmt import visible

    with collecting() as notes:
        try:
            yield notes
        finally:
            for note in notes:
                print(visible(f"autospec: warning: skipped {note}"), file=sys.stderr)


def open_store_or_die(url: str | None, *, read_only: bool = False):
    """The store at ``url`` (default: autospec.db in the cache directory), or ``die`` with
    the store's own message. ``read_only``: for commands that only read — nothing is created
    or migrated (see ``autospec.store.open_store``); what such a view cannot show (the
    store's ``stale``) is one ``autospec: warning:`` line, printed here instead of logged."""
    from autospec.store import StoreError, open_store

    if not read_only:
        try:
            return open_store(url)
        except StoreError as e:
            die(str(e))
    opening = logging.getLogger("autospec.store.database")
    propagate, opening.propagate = opening.propagate, False  # the line below says it once
    quiet = logging.NullHandler()
    opening.addHandler(quiet)
    try:
        store = open_store(url, read_only=True)
    except StoreError as e:
        die(str(e))
    finally:
        opening.removeHandler(quiet)
        opening.propagate = propagate
    if store.stale is not None:
        print(f"autospec: warning: {store.stale}", file=sys.stderr)
    return store
