"""Argument types shared by the CLI's commands (argparse ``type=`` callables)."""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from typing import NoReturn

__all__ = ["parse_when", "positive_int", "fraction", "die"]


def die(message: str) -> NoReturn:
    """``autospec: error: …`` on stderr and exit status 2, as argparse does for bad input."""
    print(f"autospec: error: {message}", file=sys.stderr)
    raise SystemExit(2)


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
