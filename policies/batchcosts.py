"""The cost model's timings at batch > 1: T_t(B, n), the target's time to score n tokens in
each of B rows, and T_d(B), the draft's time per proposed token for B rows — for one model
pair on one machine (no torch here).

Points come from two sources: ``warm`` (the probe's grid, or the store's live medians) and
``observe`` (this process's forwards). A live point replaces the warm value at its (B, n) on
first sight: the median of its first ``settle`` samples, then an exponential moving average
from there (the first forwards at a new batch size run on fresh allocations and read slow;
one of them taken as the baseline would make speculation look paying for the rest of the
batch). Readers get, at any B:

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
    warmed from the probe grid.

    Live points replace warm ones where they exist; elsewhere a warm value is *calibrated* by
    the live evidence nearest to it. At a batch size with a live T_t(B, 1): that level times
    the probe's T_t(B, n) / T_t(B, 1), times the ratio by which the loop's own
    T_t(B', n) / T_t(B', 1) departs from the probe's at the largest B' that has both
    (``_shapes``), so levels measured at other batch sizes, at other times, do not enter.
    Elsewhere: multiplied by live / warm at the nearest batch size that has both at that n
    (at the nearest n with live evidence, where that n has none). The probe
    gives the shape of the grid, live forwards its level: a probe on another context length,
    or without the padding masks the loop needs, can be far off the loop's level, and mixing
    its raw values with live ones in one S(k) would invent gains that do not exist.

    live: the costs serve a live loop, so a batch size whose bucket (``base.batch_bucket``) has
    fewer than ``settle`` live samples of T_t(B', 1) is not trusted for the baseline
    (``baseline_live``): the cost model runs plain steps there until it has them. Replay
    (``simulate``) keeps the default, False: its grid is the truth it replays.

    The shape guard holds at every batch size as at batch 1 (``LiveStats``): a live
    T_t(B, n), n > 1, timed below ``shape_floor`` · T_t(B, 1) once that is settled (a burst's
    plain step against a quiet block) is held out (``held_out`` counts them), and with
    ``live`` no point read from the grid is below that floor of the batch size's T_t(B, 1).
    """

    def __init__(self, *, ema: float = DEFAULTS.cost_ema, live: bool = False,
                 settle: int = DEFAULTS.cost_settle, shape_floor: float = DEFAULTS.shape_floor):
        if not 0 < ema <= 1:
            raise ValueError(f"ema must be in (0, 1], got {ema}")
        if settle < 1:
            raise ValueError(f"settle must be ≥ 1, got {settle}")
        self.ema, self.live, self.settle = ema, bool(live), int(settle)
        self.shape_floor, self.held_out = float(shape_floor), 0
        # (B, n) or (B,) → its first ``settle`` samples (how many it has seen, up to settle)
        self._first: dict[tuple, list[float]] = {}
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
        """One forward of the target scoring ``scored`` tokens in each of ``batch`` rows took
        ``target_s``; the draft took ``draft_s_per_token`` per proposed token, if read.
        Unusable timings (NaN, None, ≤ 0) are ignored."""
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
        """The point after one more sample (``costmodel.settle_sample``)."""
        return settle_sample(self._first.setdefault(key, []), old, new, self.settle, self.ema)

    def warm(self, target: Mapping[int, Mapping[int, float]],
             draft: Mapping[int, float]) -> None:
        """Seed from a grid (B → n → seconds; B → seconds per draft token), e.g. the probe's.
        Live points keep precedence; unusable values are skipped."""
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
        """Whether T_t(B, 1) at this batch size rests on live evidence from its bucket (always
        True for costs that do not serve a live loop)."""
        if not self.live:
            return True
        from .base import batch_bucket

        bucket = batch_bucket(int(batch))
        with self._lock:
            seen = sum(len(first) for key, first in self._first.items()
                       if len(key) == 2 and key[1] == 1 and batch_bucket(key[0]) == bucket)
            return seen >= self.settle

    def target_points(self, batch: int) -> dict[int, float]:
        """n → T_t(B, n) at the n where B has a value: live at B, else warm at B (or across
        batch sizes) calibrated by the nearest live evidence. Empty when nothing is usable."""
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
        points = dict(self._live_t.get(batch, {}))
        ns = {n for grid in (self._warm_t, self._live_t) for row in grid.values() for n in row}
        level, warm_1 = points.get(1), _at(self._warm_t, batch, 1)
        # with a live baseline at B: the probe's shape at B, corrected by the shape (not the
        # level) the loop measured, at B's own live level; else the per-n level factors
        shape = self._shapes(ns) if level is not None and warm_1 else None
        factors = self._factors(ns) if shape is None else {}
        for n in ns - set(points):
            warm = _at(self._warm_t, batch, n)
            if warm is not None:
                points[n] = (level * warm / warm_1 * shape[n] if shape is not None
                             else warm * factors.get(n, 1.0))
                continue
            live = _at(self._live_t, batch, n)
            if live is not None:
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
        """n → live / warm at the batch size (nearest on a log scale to where it is read: the
        largest-evidence rule is kept simple) that has both; n without live evidence take the
        factor of the nearest n that has one."""
        direct: dict[int, list[tuple[int, float]]] = {}
        for b, row in self._live_t.items():
            for n, t in row.items():
                w = _at(self._warm_t, b, n)
                if w:
                    direct.setdefault(n, []).append((b, t / w))
        if not direct:
            return {}
        return _per_n(direct, ns)

    def _shapes(self, ns) -> dict[int, float]:
        """n → how far the loop's T_t(B', n) / T_t(B', 1) departs from the probe's at the
        largest batch size B' with live points at both (1 at n = 1; the nearest n's where n
        has none). A ratio of two live points at one batch size carries no level: the
        machine's speed drifts between repeats, so a factor per n taken at another batch
        size, at another time, would bring that drift into the shape."""
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
        """Seconds per proposed token at batch B: live at B, else warm (or across batch
        sizes) calibrated by the live draft timing nearest in batch size, else live across."""
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
    """One factor per n from (batch size, factor) evidence: the one measured at the largest
    batch size (the freshest regime a shrinking batch has seen; batch sizes in one bucket
    agree closely anyway); an n without evidence takes the nearest n's (the smaller on a
    tie)."""
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
