"""A request's decision records in the store: one zlib-compressed JSON array (schema 0009).

Each record is a policy's ``autospec.policies.explain`` record plus the engine's "iteration"
(and "policy", "k_run", "proposer_run"); ``pack`` and ``unpack`` are each other's inverse.
``check`` is what the store accepts: a list of dicts, each with an "iteration" (a
non-negative int) and a "k" (the same), at most one per iteration. Values JSON has no type for
are stored as what they stand for, so that a policy's reasons never cost its request's record:
a number type (a numpy scalar) as its float, anything else as its text.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from typing import Any

__all__ = ["pack", "unpack", "check"]


def check(records: object) -> list[dict[str, Any]] | None:
    """``records`` as the store keeps them (a JSON round trip: plain types only), or
    ValueError saying what is wrong. None stays None (no record kept)."""
    if records is None:
        return None
    if not isinstance(records, Sequence) or isinstance(records, (str, bytes)):
        raise ValueError(f"decisions must be a list of decision records, got "
                         f"{type(records).__name__}")
    seen = set()
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise ValueError(f"decisions[{i}] must be a dict, got {type(rec).__name__}")
        for name in ("iteration", "k"):
            v = rec.get(name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"decisions[{i}][{name!r}] must be a non-negative int, "
                                 f"got {v!r}")
        if rec["iteration"] in seen:
            raise ValueError(f"decisions[{i}]: a second record of iteration {rec['iteration']}")
        seen.add(rec["iteration"])
    try:
        return json.loads(json.dumps(list(records), default=_plain))
    except (TypeError, ValueError) as exc:  # e.g. a cycle, or keys that are not text
        raise ValueError(f"decisions are not JSON-ready: {exc}") from None


def _plain(value: object) -> Any:
    """What JSON cannot hold: a sequence as a list, a number as its float, else its text."""
    if isinstance(value, (tuple, set, frozenset)):
        return list(value)
    try:
        return float(value)  # numpy scalars, Decimal, Fraction
    except (TypeError, ValueError):
        return str(value)


def pack(records: list[dict[str, Any]] | None) -> bytes | None:
    if records is None:
        return None
    return zlib.compress(json.dumps(records, separators=(",", ":")).encode("utf-8"), 6)


def unpack(blob: bytes | None) -> list[dict[str, Any]] | None:
    if blob is None:
        return None
    return json.loads(zlib.decompress(blob).decode("utf-8"))
