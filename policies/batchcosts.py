"""The cost model's timings at batch > 1 for one model pair on one machine (``BatchCosts``):
T_t(B, n), the target's time to score n tokens in each of B rows, and T_d(B), the draft's time
per proposed token. No torch.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Mapping

from .base import batch_bucket
from .costmodel import interpolate_cost, settle_sample
from .params import DEFAULTS

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
    if len(bs) < 2:
        return None
    i = bisect.bisect_left(bs, batch)
    j = min(max(i, 1), len(bs) - 1)  # the two measured batch sizes nearest: bs[j - 1], bs[j]
    b0, b1 = bs[j - 1], bs[j]
    t0, t1 = points[b0], points[b1]
    if i == 0:  # below the smallest: within [proportional to B, flat] (no dearer than b0)
        return min(t0, max(t0 * batch / b0, t0 - (t1 - t0) * (b0 - batch) / (b1 - b0)))
    if i == len(bs):  # beyond the largest: along the last two, never less
        return t1 + max(0.0, (t1 - t0) / (b1 - b0)) * (batch - b1)
    return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)  # between two: linear


class BatchCosts:
    """T_t(B, n) and T_d(B), warmed from a grid (the probe's, or the store's live medians), fed
    by this process's forwards, read at any B (docs/policy.md, "At batch > 1").

    Live points replace warm ones; a warm value elsewhere is calibrated by live evidence, so the
    probe gives the grid's shape and live forwards its level. At a batch size with a live
    T_t(B, 1): that level times the probe's T_t(B, n) / T_t(B, 1), corrected by how the loop's
    shape departs from the probe's (``_shapes``); elsewhere, times live / warm (``_factors``).

    ``live`` (a live loop's costs; replay keeps False, its grid is the truth): T_t(B, 1) is not
    trusted below ``settle`` live samples in its bucket (``baseline_live``), and no point reads
    below ``shape_floor`` · T_t(B, 1). A live T_t(B, n), n > 1, below that floor of a settled
    T_t(B, 1) is held out (``held_out`` counts them).
    """

    def __init__(self, *, ema: float = DEFAULTS.cost_ema, live: bool = False,
                 settle: int = DEFAULTS.cost_settle, shape_floor: float = DEFAULTS.shape_floor):
        if not 0 < ema <= 1:
            raise ValueError(f"ema must be in (0, 1], got {ema}")
        if settle < 1:
            raise ValueError(f"settle must be ≥ 1, got {settle}")
        self.ema, self.live, self.settle = ema, bool(live), int(settle)
        self.shape_floor, self.held_out = float(shape_floor), 0
        self._first: dict[tuple, list[float]] = {}  # (B, n) or (B,) → its first samples
        self.version = 0  # bumped on every change
        self._warm_t: dict[int, dict[int, float]] = {}  # B → n → seconds (probe)
        self._live_t: dict[int, dict[int, float]] = {}  # B → n → seconds (EMA of forwards)
        self._warm_d: dict[int, float] = {}  # B → seconds per proposed token
        self._live_d: dict[int, float] = {}
        self._cache: dict[int, tuple[int, tuple]] = {}  # B → (version, _cached entry)
        self._lock = threading.Lock()

    # -- feeding ------------------------------------------------------------------------------
    def observe(self, batch: int, scored: int, target_s: float,
                draft_s_per_token: float | None = None) -> None:
        """One forward scoring ``scored`` tokens in each of ``batch`` rows took ``target_s``,
        the draft ``draft_s_per_token`` per proposed token; unusable timings are ignored."""
        batch, scored = int(batch), int(scored)
        if batch < 1:
            return
        with self._lock:
            changed = False
            if scored >= 1 and _ok(target_s):
                row = self._live_t.setdefault(batch, {})
                settled = len(self._first.get((batch, 1), ())) >= self.settle
                level = row.get(1) if settled else None
                if scored > 1 and level and float(target_s) < self.shape_floor * level:
                    self.held_out += 1  # a shape no machine shows: timed at another load
                else:
                    row[scored] = self._settled((batch, scored), row.get(scored),
                                                float(target_s))
                    changed = True
            if _ok(draft_s_per_token):
                self._live_d[batch] = self._settled((batch,), self._live_d.get(batch),
                                                    float(draft_s_per_token))
                changed = True
            if changed:
                self.version += 1

    def _settled(self, key: tuple, old: float | None, new: float) -> float:
        """The point after one more sample (the first ``settle``'s median, then the EMA)."""
        return settle_sample(self._first.setdefault(key, []), old, new, self.settle, self.ema)

    def warm(self, target: Mapping[int, Mapping[int, float]],
             draft: Mapping[int, float]) -> None:
        """Seed from a grid (B → n → seconds; B → seconds per draft token); live points keep
        precedence, unusable values are skipped."""
        with self._lock:
            for b, row in (target or {}).items():
                for n, t in (row or {}).items():
                    b_, n_ = int(b), int(n)
                    if b_ >= 1 and n_ >= 1 and _ok(t):
                        self._warm_t.setdefault(b_, {})[n_] = float(t)
            for b, t in (draft or {}).items():
                if int(b) >= 1 and _ok(t):
                    self._warm_d[int(b)] = float(t)
            self.version += 1

    # -- reading ------------------------------------------------------------------------------
    def baseline_live(self, batch: int) -> bool:
        """Whether T_t(B, 1) rests on live evidence from B's bucket (always, unless ``live``)."""
        if not self.live:
            return True
        bucket = batch_bucket(int(batch))
        with self._lock:
            seen = sum(len(first) for key, first in self._first.items()
                       if len(key) == 2 and key[1] == 1 and batch_bucket(key[0]) == bucket)
            return seen >= self.settle

    def target_points(self, batch: int) -> dict[int, float]:
        """n → T_t(B, n) where B has a value (live, else calibrated warm); may be empty."""
        with self._lock:
            return dict(self._cached(int(batch))[0])

    def target_cost(self, batch: int, *,
                    optimistic: bool = True) -> Callable[[int], float] | None:
        """T_t(B, ·) as a function of n (``interpolate_cost`` of ``target_points``), or None."""
        with self._lock:
            return self._cached(int(batch))[1 if optimistic else 2]

    def _cached(self, batch: int) -> tuple:
        """(points, optimistic cost, linear cost) at ``batch``, cached per version."""
        hit = self._cache.get(batch)
        if hit is not None and hit[0] == self.version:
            return hit[1]
        points = dict(self._live_t.get(batch, {}))
        ns = {n for grid in (self._warm_t, self._live_t) for row in grid.values() for n in row}
        level, warm_1 = points.get(1), _at(self._warm_t, batch, 1)
        # a live baseline at B: the probe's shape, corrected, at it; else per-n level factors
        shape = self._shapes(ns) if level is not None and warm_1 else None
        factors = self._factors(ns) if shape is None else {}
        for n in ns - set(points):
            if (warm := _at(self._warm_t, batch, n)) is not None:
                points[n] = (level * warm / warm_1 * shape[n] if shape is not None
                             else warm * factors.get(n, 1.0))
            elif (live := _at(self._live_t, batch, n)) is not None:
                points[n] = live
        t1 = points.get(1)
        if t1 and self.live:  # the shape floor on a live loop's costs (replay's grid is truth)
            floor = self.shape_floor * t1
            points = {n: t if n == 1 else max(t, floor) for n, t in points.items()}
        entry = ((points, interpolate_cost(points, optimistic=True),
                  interpolate_cost(points, optimistic=False)) if points else ({}, None, None))
        self._cache[batch] = (self.version, entry)
        return entry

    def _factors(self, ns) -> dict[int, float]:
        """n → live / warm at a batch size that has both (``_per_n``)."""
        direct: dict[int, list[tuple[int, float]]] = {}
        for b, row in self._live_t.items():
            for n, t in row.items():
                w = _at(self._warm_t, b, n)
                if w:
                    direct.setdefault(n, []).append((b, t / w))
        return _per_n(direct, ns) if direct else {}

    def _shapes(self, ns) -> dict[int, float]:
        """n → how far the loop's T_t(B', n) / T_t(B', 1) departs from the probe's (``_per_n``
        over the B' with live points at both; 1 at n = 1). A ratio within one batch size
        carries no level, so the machine's drift between repeats stays out of the shape."""
        direct: dict[int, list[tuple[int, float]]] = {1: [(0, 1.0)]}
        for b, row in self._live_t.items():
            w1 = _at(self._warm_t, b, 1)
            if 1 not in row or not w1:
                continue
            for n, t in row.items():
                w = _at(self._warm_t, b, n)
                if n != 1 and w:
                    direct.setdefault(n, []).append((b, (t / row[1]) / (w / w1)))
        return _per_n(direct, ns)

    def draft_cost(self, batch: int) -> float | None:
        """Seconds per proposed token at B: live at B, else warm calibrated by the live timing
        nearest in batch size, else live across batch sizes."""
        batch = int(batch)
        with self._lock:
            if batch in self._live_d:
                return self._live_d[batch]
            warm = _across(self._warm_d, batch) if self._warm_d else None
            if warm is not None:
                pairs = [(abs(b - batch), t / w) for b, t in self._live_d.items()
                         if (w := _across(self._warm_d, b))]
                return warm * min(pairs)[1] if pairs else warm
            return _across(self._live_d, batch) if self._live_d else None

    def snapshot(self) -> tuple[dict[int, dict[int, float]], dict[int, float]]:
        """Copies of the points held (live over warm, neither calibrated nor interpolated)."""
        with self._lock:
            target = {b: dict(row) for b, row in self._warm_t.items()}
            for b, row in self._live_t.items():
                target.setdefault(b, {}).update(row)
            return target, {**self._warm_d, **self._live_d}

    def __repr__(self) -> str:
        with self._lock:
            return (f"BatchCosts(batch sizes warm {sorted(self._warm_t)}, live "
                    f"{sorted(self._live_t)}, version {self.version})")


def _per_n(direct: Mapping[int, list[tuple[int, float]]], ns) -> dict[int, float]:
    """One factor per n from (batch size, factor) evidence: the largest batch size's (the
    freshest a shrinking batch has seen); an n without evidence takes the nearest n's."""
    per_n = {n: max(v)[1] for n, v in direct.items()}
    known = sorted(per_n)
    return {n: per_n[n] if n in per_n else per_n[min(known, key=lambda m: (abs(m - n), m))]
            for n in ns}


def _at(grid: Mapping[int, Mapping[int, float]], batch: int, n: int) -> float | None:
    """T(B, n) from one grid: at B, else across its batch sizes at that n."""
    row = grid.get(batch)
    if row and n in row:
        return row[n]
    t = _across({b: r[n] for b, r in grid.items() if n in r}, batch)
    return t if t is not None and t > 0 else None
