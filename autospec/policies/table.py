"""k by batch size, written by hand as the serving engines take it (vLLM's
``num_speculative_tokens_per_batch_size``, TensorRT-LLM's ``draft_len_schedule``):
``"table:1-2:4,3-8:2,9-:0"`` runs k = 4 at batch sizes 1–2, 2 at 3–8, plain from 9. Ranges are
``LO-HI``, ``LO`` or ``LO-`` (open) and cover every batch size ≥ 1 once. It learns nothing.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Mapping

from .base import K_LIMIT, Context, Outcome

__all__ = ["TablePolicy"]


class TablePolicy:
    """k for each batch size from ranges ``{(lo, hi or None): k}`` (None: open-ended).

    ``name`` is the canonical spec (ranges sorted, ``"table:1-2:4,3-8:2,9-:0"``), so
    ``as_policy(p.name)`` rebuilds ``p``."""

    def __init__(self, ranges: Mapping[tuple[int, int | None], int]):
        rows = []
        for key, k in ranges.items():
            try:
                lo, hi = key
            except (TypeError, ValueError):
                raise ValueError(f"table policy: a range is (lo, hi) or (lo, None), got {key!r}"
                                 ) from None
            lo, k = _int(lo, "batch size"), _int(k, "k")
            hi = None if hi is None else _int(hi, "batch size")
            if lo < 1:
                raise ValueError(f"table policy: batch sizes start at 1, got range {_fmt(lo, hi)}")
            if hi is not None and hi < lo:
                raise ValueError(f"table policy: range {lo}-{hi} is empty (its end is below "
                                 "its start)")
            if not 0 <= k <= K_LIMIT:
                raise ValueError(f"table policy: k must be in 0..{K_LIMIT}, got {k} for "
                                 f"{_fmt(lo, hi)}")
            rows.append((lo, hi, k))
        if not rows:
            raise ValueError("table policy: no ranges (e.g. 'table:1-4:3,5-:0')")
        rows.sort(key=lambda r: r[0])
        if rows[0][0] != 1:
            raise ValueError(f"table policy: {_sizes(1, rows[0][0] - 1)} not covered (the "
                             "first range must start at 1)")
        for (lo0, hi0, _), (lo1, hi1, _) in zip(rows, rows[1:]):
            if hi0 is None or lo1 <= hi0:
                raise ValueError(f"table policy: ranges {_fmt(lo0, hi0)} and {_fmt(lo1, hi1)} "
                                 "overlap")
            if lo1 > hi0 + 1:
                raise ValueError(f"table policy: {_sizes(hi0 + 1, lo1 - 1)} not covered")
        if rows[-1][1] is not None:
            raise ValueError(f"table policy: batch sizes above {rows[-1][1]} are not covered "
                             f"(end with an open range, e.g. '{rows[-1][1] + 1}-:0')")
        self.ranges: tuple[tuple[int, int | None, int], ...] = tuple(rows)
        self._starts = [lo for lo, _, _ in rows]
        self.name = "table:" + ",".join(f"{_fmt(lo, hi)}:{k}" for lo, hi, k in rows)

    @classmethod
    def parse(cls, spec: str) -> TablePolicy:
        """From ``"table:1-2:4,3-8:2,9-:0"`` (the ``table:`` prefix is optional)."""
        body = spec.strip()
        if body.lower().startswith("table:"):
            body = body[len("table:"):]
        ranges: dict[tuple[int, int | None], int] = {}
        for part in (p.strip() for p in body.split(",")):
            if not part:
                continue
            size, sep, k = part.rpartition(":")
            if not sep or not size:
                raise ValueError(f"table policy: {part!r} is not 'LO-HI:K', 'LO-:K' or 'B:K'")
            lo, dash, hi = size.partition("-")
            try:
                key = (int(lo), (int(hi) if hi.strip() else None) if dash else int(lo))
                value = int(k)
            except ValueError:
                raise ValueError(f"table policy: {part!r} is not 'LO-HI:K', 'LO-:K' or 'B:K' "
                                 "with integers") from None
            if key in ranges:
                raise ValueError(f"table policy: range {_fmt(*key)} is given twice")
            ranges[key] = value
        return cls(ranges)

    @classmethod
    def from_choices(cls, choices: Mapping[int, int]) -> TablePolicy:
        """From the k chosen at some batch sizes, ``{1: 4, 4: 2, 16: 0}``: each batch size
        starts a range that runs to the next one (the last is open, the first is extended
        down to 1); neighbouring ranges with the same k are merged."""
        if not choices:
            raise ValueError("table policy: no batch-size choices")
        points = sorted((_int(b, "batch size"), _int(k, "k")) for b, k in choices.items())
        if points[0][0] < 1:
            raise ValueError(f"table policy: batch sizes start at 1, got {points[0][0]}")
        merged = [points[0]]
        for b, k in points[1:]:
            if k != merged[-1][1]:
                merged.append((b, k))
        starts = [1] + [b for b, _ in merged[1:]]
        ends: list[int | None] = [b - 1 for b in starts[1:]] + [None]
        return cls({(lo, hi): k for lo, hi, (_, k) in zip(starts, ends, merged)})

    def k_for(self, batch_size: int) -> int:
        """The table's k at ``batch_size`` (below 1 counts as 1)."""
        i = bisect.bisect_right(self._starts, max(1, int(batch_size))) - 1
        return self.ranges[i][2]

    def choose(self, context: Context) -> int:
        return min(self.k_for(context.batch_size), context.k_max)

    def update(self, context: Context, k: int, outcome: Outcome) -> None:
        return None

    def __repr__(self) -> str:
        return f"TablePolicy({self.name!r})"


def _fmt(lo: int, hi: int | None) -> str:
    return f"{lo}-" if hi is None else (str(lo) if hi == lo else f"{lo}-{hi}")


def _sizes(lo: int, hi: int) -> str:
    return f"batch size {lo} is" if lo == hi else f"batch sizes {lo}-{hi} are"


def _int(v, what: str) -> int:
    try:
        if isinstance(v, bool):
            raise TypeError
        return operator.index(v)
    except TypeError:
        raise ValueError(f"table policy: {what} must be an integer, got {v!r}") from None
