"""A model pair's cost table (``CostTable``): every timing the cost model prices by, keyed by
(execution path, batch size B), in one object per controller shared by every category. No
torch (the policies read it).

Each (path, B) is a ``row.CostRow``: T_t(B, n) per tokens scored, T_d(B) (the model proposer's
seconds per proposed token), each lookup proposer's seconds per proposed token by name, and
the busy-machine guard over them. Batch 1 is the B = 1 row. The model proposer's catch-up fit
C(g) = a + b·g is the path's, in tokens the catch-up forward takes in: the batched loop runs
one forward over B × the widest row's gap, so one fit serves every B, each reading it at
B · gap (and never below its own T_d(B)). A timing measured on one path never enters
another's row or fit: the path is part of every key.

At B > 1 the table reads a batch grid (``target_cost``, ``draft_cost``), warmed from the
store's grid (``warm_grid``) and fed by the rows: a live table (a controller's) reads each
B's own live points, and elsewhere the grid's value at B calibrated by live evidence — at a
batch size with a live T_t(B, 1), that level times the grid's T_t(B, n) / T_t(B, 1)
corrected by how the loop's shape departs from the grid's (``_shapes``); elsewhere times
live / grid (``_factors``) — interpolated across batch sizes; T_t(B, 1) counts only once
``cost_settle`` live samples of B's bucket rest under it (``baseline_live``) and no point
reads below ``shape_floor`` · T_t(B, 1). A table that is not live (replay's, whose grid is
the measured truth) reads its grid as it is where it has one, its rows only where not.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Mapping

from autospec.traces import batch_bucket

from .measure import MEASURE, Measurement
from .price import interpolate_cost
from .row import CostRow
from .rules import usable

__all__ = ["CostTable", "CostRow", "grid_points", "grid_draft"]


class _Path:
    """What a table holds per execution path: its rows by B, the warm grid, the catch-up fit,
    how often the grid and the rows' live points changed, and the grid reads cached by
    those."""

    __slots__ = ("rows", "bands", "warm_t", "warm_d", "catch_up", "grid", "points", "cache")

    def __init__(self):
        self.rows: dict[int, CostRow] = {}
        self.bands: dict[int, CostRow] = {}  # batch 1 past the first context band: band → row
        self.warm_t: dict[int, dict[int, float]] = {}  # B → n → seconds (grid)
        self.warm_d: dict[int, float] = {}  # B → seconds per proposed token (grid)
        self.catch_up = [0.0] * 5  # the model's catch-up fit's discounted sums
        self.grid = self.points = 0  # bumped when the grid, a row's live points change
        self.cache: dict[int, tuple] = {}  # B → (key, grid read at B)


class CostTable:
    """One pair's costs per (path, B): see the module docstring. ``live``: a live loop's
    table (True: a controller's) or replay's (False: its grid is the truth). Thread-safe:
    one lock for the table and its rows."""

    def __init__(self, *, measure: Measurement = MEASURE, live: bool = True):
        self.measure, self.live = measure, bool(live)
        self._paths: dict[str | None, _Path] = {}
        self._lock = threading.Lock()

    def _path(self, path: str | None) -> _Path:
        got = self._paths.get(path)
        if got is None:
            got = self._paths[path] = _Path()
        return got

    def band(self, context: int) -> int:
        """The context band of a batch-1 request over ``context`` cached tokens: 0 below
        ``context_band`` (c), then 1 for [c, 2c), 2 for [2c, 4c), …"""
        return (max(0, int(context)) // self.measure.context_band).bit_length()

    def at(self, path: str | None, batch: int = 1, context: int = 0) -> CostRow:
        """The row of (``path``, ``batch``), made on first use: what the cost model reads and
        the accounting feeds for an iteration of ``batch`` rows on ``path``. At batch 1 a
        request over ``context`` tokens past the first context band reads its band's own row
        (``CostRow.band``), started from the nearest band below it (``CostRow.seed``)."""
        band = self.band(context) if batch == 1 else 0
        if band:
            return self._band(path, band)
        got = self._paths.get(path)
        row = got.rows.get(batch) if got is not None else None
        if row is None:
            batch = max(1, int(batch))
            with self._lock:
                rows = self._path(path).rows
                row = rows.get(batch)
                if row is None:
                    row = rows[batch] = CostRow(self, path, batch)
        return row

    def _band(self, path: str | None, band: int) -> CostRow:
        """Batch 1's row of context band ``band`` ≥ 1 on ``path``, made on first use from the
        nearest band below that has one (band 0: the batch-1 row)."""
        got = self._paths.get(path)
        row = got.bands.get(band) if got is not None else None
        if row is None:
            below = self.at(path, 1)
            with self._lock:
                p = self._path(path)
                row = p.bands.get(band)
                if row is None:
                    lower = [b for b in p.bands if b < band]
                    row = p.bands[band] = CostRow(self, path, 1, band=band)
                    row.seed(p.bands[max(lower)] if lower else below)
        return row

    def rows(self) -> list[CostRow]:
        """Every row made so far, by path, batch size and context band."""
        with self._lock:
            return [row for key in sorted(self._paths, key=str)
                    for row in [r for _, r in sorted(self._paths[key].rows.items())]
                    + [r for _, r in sorted(self._paths[key].bands.items())]]

    def busy(self) -> list[CostRow]:
        """The rows whose timings say the machine is busy now."""
        return [row for row in self.rows() if row.busy()]

    def copy(self) -> CostTable:
        """An independent copy (a replay that must not feed the original)."""
        new = CostTable(measure=self.measure, live=self.live)
        with self._lock:
            for key, path in self._paths.items():
                mine = new._path(key)
                mine.warm_t = {b: dict(ns) for b, ns in path.warm_t.items()}
                mine.warm_d, mine.catch_up = dict(path.warm_d), list(path.catch_up)
                mine.grid, mine.points = path.grid, path.points
                mine.rows = {b: row._copy(new) for b, row in path.rows.items()}
                mine.bands = {b: row._copy(new) for b, row in path.bands.items()}
        return new

    # -- the batch grid -----------------------------------------------------------------------
    def warm_grid(self, path: str | None, target: Mapping[int, Mapping[int, float]],
                  draft: Mapping[int, float]) -> None:
        """Seed ``path``'s grid (B → n → seconds; B → seconds per draft token); unusable
        values are skipped, live points keep precedence."""
        with self._lock:
            p = self._path(path)
            for b, row in (target or {}).items():
                for n, t in (row or {}).items():
                    if int(b) >= 1 and int(n) >= 1 and usable(t):
                        p.warm_t.setdefault(int(b), {})[int(n)] = float(t)
            for b, t in (draft or {}).items():
                if int(b) >= 1 and usable(t):
                    p.warm_d[int(b)] = float(t)
            p.grid += 1

    def grid(self, path: str | None, batch: int) -> tuple:
        """The batch grid read at ``batch`` on ``path``: (n → T_t(B, n), T_t(B, ·) optimistic
        and linear as functions of n, T_d(B)); the points are the table's, read them only."""
        with self._lock:
            return self._read(path, int(batch))

    def target_points(self, path: str | None, batch: int) -> dict[int, float]:
        """n → T_t(B, n) on ``path`` where the grid has a value at ``batch``; may be empty."""
        return dict(self.grid(path, batch)[0])

    def target_cost(self, path: str | None, batch: int, *, optimistic: bool = True):
        """T_t(B, ·) on ``path`` as a function of n (``interpolate_cost`` of
        ``target_points``), or None."""
        return self.grid(path, batch)[1 if optimistic else 2]

    def draft_cost(self, path: str | None, batch: int) -> float | None:
        """T_d(B) on ``path``: live at B, else the grid's calibrated by the live timing nearest
        in batch size, else live across batch sizes (not live: the grid's where it has one)."""
        return self.grid(path, batch)[3]

    def baseline_live(self, path: str | None, batch: int) -> bool:
        """Whether T_t(B, 1) rests on ``cost_settle`` live samples from B's bucket (always,
        unless ``live``)."""
        if not self.live:
            return True
        bucket = batch_bucket(int(batch))
        with self._lock:
            p = self._paths.get(path)
            seen = sum(len(r.t_samples.get(1, ())) for b, r in (p.rows.items() if p else ())
                       if b > 1 and batch_bucket(b) == bucket)
        return seen >= self.measure.cost_settle


    def lookup_cost(self, path: str | None, batch: int, proposer: str) -> float | None:
        """A lookup proposer's seconds per token on ``path``: the row nearest ``batch`` that
        measured it (the smaller batch size among ties), or None."""
        with self._lock:
            p = self._paths.get(path)
            got = [(abs(b - batch), b, r.t_lookup[proposer])
                   for b, r in (p.rows.items() if p else ()) if proposer in r.t_lookup]
        return min(got)[2] if got else None

    def snapshot(self, path: str | None) -> tuple[dict[int, dict[int, float]], dict[int, float]]:
        """Copies of ``path``'s grid: T_t(B, n) and T_d(B), the rows' live points over the
        grid's (neither calibrated nor interpolated)."""
        with self._lock:
            p = self._paths.get(path)
            if p is None:
                return {}, {}
            target = {b: dict(ns) for b, ns in p.warm_t.items()}
            draft = dict(p.warm_d)
            for b, r in p.rows.items():
                pts, d = r.live_points()
                if pts:
                    target.setdefault(b, {}).update(pts)
                if d is not None:
                    draft[b] = d
            return target, draft

    def _grid_key(self, p: _Path) -> tuple[int, int]:
        """What a grid read of ``p`` depends on: its grid, and its rows' live points where they
        are read (a live table's, or one without a grid: replay's grid is the truth)."""
        return p.grid, (p.points if self.live or not (p.warm_t or p.warm_d) else -1)

    def _read(self, path: str | None, batch: int) -> tuple:
        """(points, optimistic cost, linear cost, T_d) at ``batch`` on ``path``, cached until
        what they are read from changes; under the lock."""
        p = self._paths.get(path)
        if p is None:
            return {}, None, None, None
        key = self._grid_key(p)
        hit = p.cache.get(batch)
        if hit is not None and hit[0] == key:
            return hit[1]
        live_t: dict[int, dict[int, float]] = {}
        live_d: dict[int, float] = {}
        if key[1] >= 0:
            for b, r in p.rows.items():
                pts, d = r.live_points()
                if pts:
                    live_t[b] = pts
                if d is not None:
                    live_d[b] = d
        points = grid_points(p.warm_t, live_t, batch,
                             floor=self.measure.shape_floor if self.live else None)
        noise = self.measure.cost_noise
        entry = ((points, interpolate_cost(points, optimistic=True, noise=noise),
                  interpolate_cost(points, optimistic=False, noise=noise))
                 if points else ({}, None, None)) + (grid_draft(p.warm_d, live_d, batch),)
        p.cache[batch] = (key, entry)
        return entry

    def __repr__(self) -> str:
        with self._lock:
            keys = {path: sorted(p.rows) for path, p in self._paths.items()}
        return f"CostTable(rows by path {keys}, live {self.live})"


# -- the grid's reading, pure -----------------------------------------------------------------
def grid_points(warm: Mapping[int, Mapping[int, float]], live: Mapping[int, Mapping[int, float]],
                batch: int, *, floor: float | None = None) -> dict[int, float]:
    """n → T_t(B, n) at ``batch``: the live points there, the rest from the ``warm`` grid
    calibrated by the live ones (see the module docstring), else the live points across batch
    sizes; with ``floor``, none n > 1 below floor · T_t(B, 1)."""
    points = dict(live.get(batch, {}))
    ns = {n for grid in (warm, live) for row in grid.values() for n in row}
    level, warm_1 = points.get(1), _at(warm, batch, 1)
    # a live baseline at B: the grid's shape, corrected, at it; else per-n level factors
    shape = _shapes(warm, live, ns) if level is not None and warm_1 else None
    factors = _factors(warm, live, ns) if shape is None else {}
    for n in ns - set(points):
        if (w := _at(warm, batch, n)) is not None:
            points[n] = (level * w / warm_1 * shape[n] if shape is not None
                         else w * factors.get(n, 1.0))
        elif (t := _at(live, batch, n)) is not None:
            points[n] = t
    t1 = points.get(1)
    if t1 and floor is not None:
        points = {n: t if n == 1 else max(t, floor * t1) for n, t in points.items()}
    return points


def grid_draft(warm: Mapping[int, float], live: Mapping[int, float], batch: int
               ) -> float | None:
    """T_d(B) at ``batch``: live there, else the ``warm`` grid's calibrated by the live timing
    nearest in batch size, else live across batch sizes."""
    if batch in live:
        return live[batch]
    w = _across(warm, batch) if warm else None
    if w is not None:
        pairs = [(abs(b - batch), t / wb) for b, t in live.items() if (wb := _across(warm, b))]
        return w * min(pairs)[1] if pairs else w
    return _across(live, batch) if live else None


def _factors(warm, live, ns) -> dict[int, float]:
    """n → live / warm at a batch size that has both (``_per_n``)."""
    direct: dict[int, list[tuple[int, float]]] = {}
    for b, row in live.items():
        for n, t in row.items():
            w = _at(warm, b, n)
            if w:
                direct.setdefault(n, []).append((b, t / w))
    return _per_n(direct, ns) if direct else {}


def _shapes(warm, live, ns) -> dict[int, float]:
    """n → how far the loop's T_t(B', n) / T_t(B', 1) departs from the grid's (``_per_n``
    over the B' with live points at both; 1 at n = 1). A ratio within one batch size carries
    no level, so the machine's drift between repeats stays out of the shape."""
    direct: dict[int, list[tuple[int, float]]] = {1: [(0, 1.0)]}
    for b, row in live.items():
        w1 = _at(warm, b, 1)
        if 1 not in row or not w1:
            continue
        for n, t in row.items():
            w = _at(warm, b, n)
            if n != 1 and w:
                direct.setdefault(n, []).append((b, (t / row[1]) / (w / w1)))
    return _per_n(direct, ns)


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
