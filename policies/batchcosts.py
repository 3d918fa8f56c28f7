"""The cost model's timings at batch > 1: T_t(B, n), the target's time to score n tokens in
each of B rows, and T_d(B), the draft's time per proposed token for B rows — for one model
pair on one machine (no torch here).

Points come from two sources: ``warm`` (the probe's grid, or the store's live medians) and
``observe`` (this process's forwards). A live point replaces the warm value at its (B, n) on
first sight and is then an exponential moving average. Readers get, at any B:

- the points measured at B itself;
- for the n that B lacks, the value interpolated linearly in B between the nearest batch sizes
  measured at that n, or extended along the nearest two beyond them (upward: never below the
  last; downward: between proportional-to-B and flat) — with fewer than two batch sizes at
  that n on that side, no value;
- T_t(B, ·) over n as ``costmodel.interpolate_cost`` of those points (optimistic or linear).

Thread-safe: one object serves every request of a controller.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Mapping

from .costmodel import interpolate_cost

__all__ = ["BatchCosts"]


def _ok(x) -> bool:
    """A usable timing: a positive finite number (NaN, None, ≤ 0 are unread or broken)."""
    try:
        return x is not None and 0 < float(x) < float("inf")
    except (TypeError, ValueError):
        return False


def _across(points: Mapping[int, float], batch: int) -> float | None:
    """The value at ``batch`` from values at other batch sizes (``points``: B → seconds)."""
    if batch in points:
        return points[batch]
    bs = sorted(points)
    i = bisect.bisect_left(bs, batch)
    if 0 < i < len(bs):  # between two measured batch sizes: linear
        b0, b1 = bs[i - 1], bs[i]
        t0, t1 = points[b0], points[b1]
        return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)
    if i == len(bs) and len(bs) >= 2:  # beyond the largest: along the last two, never less
        b0, b1 = bs[-2], bs[-1]
        t0, t1 = points[b0], points[b1]
        return t1 + max(0.0, (t1 - t0) / (b1 - b0)) * (batch - b1)
    if i == 0 and len(bs) >= 2:  # below the smallest: along the first two, within
        b0, b1 = bs[0], bs[1]  # [proportional to B, flat] (a smaller batch costs no more)
        t0, t1 = points[b0], points[b1]
        linear = t0 - (t1 - t0) * (b0 - batch) / (b1 - b0)
        return min(t0, max(t0 * batch / b0, linear))
    return None


class BatchCosts:
    """T_t(B, n) and T_d(B) for one pair on one machine. Thread-safe; EMA of live points;
    warmed from the probe grid (live observations replace warm values)."""

    def __init__(self, *, ema: float = 0.2):
        if not 0 < ema <= 1:
            raise ValueError(f"ema must be in (0, 1], got {ema}")
        self.ema = ema
        self.version = 0  # bumped on every change
        self._target: dict[int, dict[int, float]] = {}  # B → n → seconds
        self._draft: dict[int, float] = {}  # B → seconds per proposed token
        self._live_target: set[tuple[int, int]] = set()  # (B, n) with a live point
        self._live_draft: set[int] = set()
        self._cache: dict[int, tuple[int, tuple]] = {}  # B → (version, _cached entry)
        self._lock = threading.Lock()

    # -- feeding ------------------------------------------------------------------------------
    def observe(self, batch: int, scored: int, target_s: float,
                draft_s_per_token: float | None = None) -> None:
        """One forward of the target scoring ``scored`` tokens in each of ``batch`` rows took
        ``target_s``; the draft took ``draft_s_per_token`` per proposed token, if read.
        Unusable timings (NaN, None, ≤ 0) are ignored."""
        batch, scored = int(batch), int(scored)
        if batch < 1:
            return
        with self._lock:
            changed = False
            if scored >= 1 and _ok(target_s):
                row = self._target.setdefault(batch, {})
                key = (batch, scored)
                if key in self._live_target:
                    row[scored] = (1 - self.ema) * row[scored] + self.ema * float(target_s)
                else:  # the first live point replaces the warm value
                    row[scored] = float(target_s)
                    self._live_target.add(key)
                changed = True
            if _ok(draft_s_per_token):
                if batch in self._live_draft:
                    self._draft[batch] = ((1 - self.ema) * self._draft[batch]
                                          + self.ema * float(draft_s_per_token))
                else:
                    self._draft[batch] = float(draft_s_per_token)
                    self._live_draft.add(batch)
                changed = True
            if changed:
                self.version += 1

    def warm(self, target: Mapping[int, Mapping[int, float]],
             draft: Mapping[int, float]) -> None:
        """Seed from a grid (B → n → seconds; B → seconds per draft token), e.g. the probe's.
        Points already observed live keep their live value; unusable values are skipped."""
        with self._lock:
            for b, row in (target or {}).items():
                for n, t in (row or {}).items():
                    b_, n_ = int(b), int(n)
                    if b_ >= 1 and n_ >= 1 and _ok(t) and (b_, n_) not in self._live_target:
                        self._target.setdefault(b_, {})[n_] = float(t)
            for b, t in (draft or {}).items():
                if int(b) >= 1 and _ok(t) and int(b) not in self._live_draft:
                    self._draft[int(b)] = float(t)
            self.version += 1

    # -- reading ------------------------------------------------------------------------------
    def target_points(self, batch: int) -> dict[int, float]:
        """n → T_t(B, n) at the n where B has a value: measured at B, else from other batch
        sizes (see the module docstring). Empty when nothing is usable."""
        with self._lock:
            return dict(self._cached(int(batch))[0])

    def target_cost(self, batch: int, *,
                    optimistic: bool = True) -> Callable[[int], float] | None:
        """T_t(B, ·) as a function of n (``costmodel.interpolate_cost`` of ``target_points``),
        or None if nothing usable."""
        with self._lock:
            return self._cached(int(batch))[1 if optimistic else 2]

    def _cached(self, batch: int) -> tuple:
        """(points, optimistic cost, linear cost) at ``batch``, recomputed when the version
        moved (the policy reads them every iteration)."""
        hit = self._cache.get(batch)
        if hit is not None and hit[0] == self.version:
            return hit[1]
        points = dict(self._target.get(batch, {}))
        for n in {n for row in self._target.values() for n in row} - set(points):
            t = _across({b: row[n] for b, row in self._target.items() if n in row}, batch)
            if t is not None and t > 0:
                points[n] = t
        entry = ((points, interpolate_cost(points, optimistic=True),
                  interpolate_cost(points, optimistic=False)) if points else ({}, None, None))
        self._cache[batch] = (self.version, entry)
        return entry

    def draft_cost(self, batch: int) -> float | None:
        """Seconds per proposed token at batch B (measured, else across batch sizes)."""
        with self._lock:
            return _across(self._draft, int(batch)) if self._draft else None

    def snapshot(self) -> tuple[dict[int, dict[int, float]], dict[int, float]]:
        """Copies of the points held (warm and live, not interpolated)."""
        with self._lock:
            return ({b: dict(row) for b, row in self._target.items()}, dict(self._draft))

    def __repr__(self) -> str:
        with self._lock:
            return (f"BatchCosts(batch sizes {sorted(self._target)}, draft at "
                    f"{sorted(self._draft)}, version {self.version})")
