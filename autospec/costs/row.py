"""One row of a pair's cost table (``table.CostTable``): the timings measured on one execution
path at one batch size B, and the busy-machine guard over them (docs/policy.md, "When the
machine is busy"). No torch.

A row holds T_t(B, n) per n tokens scored (the median of its first ``cost_settle`` samples,
then a moving average; a warm-started point averages from the start), T_d(B) (the model
proposer's seconds per proposed token) and each lookup proposer's own seconds per proposed
token by name. The guard, per row: a point n > 1 below ``shape_floor`` · T_t(B, 1) is held out
and T_t(B, 1) re-measured; recent plain steps move the level (every other point and T_d are
carried to it and replaced at their next sample); scattered timings or a move mark the row
busy for ``busy_hold`` of its iterations. ``iterations``, one tick per observation, is its
clock. At batch 1 the cost model reads a row's own points; at B > 1 they are the live
evidence the table reads its batch grid by.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Mapping

from .price import interpolate_cost
from .rules import catch_up_line, catch_up_sums, shape_guard, spread

log = logging.getLogger("autospec.costs.row")

__all__ = ["CostRow"]

NAN = float("nan")
INF = float("inf")


def settle_sample(first: list[float], old: float | None, new: float, settle: int,
                  ema: float) -> float:
    """A live cost point after one more sample: the median of its first ``settle`` samples
    (``first`` collects them), then an exponential moving average (a process's first forwards
    at a size run slow)."""
    if len(first) < settle:
        first.append(new)
        return statistics.median(first)
    return (1 - ema) * old + ema * new

class CostRow:
    """The timings of one (execution path, batch size) of a ``CostTable`` and their guard.
    Made by ``CostTable.at``; fed once per iteration by the shared accounting
    (``observe``, ``observe_catch_up``) and read by the cost model: at batch 1 from its own
    points (``cost``), at B > 1 through the table's batch grid (``cost`` reads it there). The
    ``_``-methods run under the table's lock."""

    def __init__(self, table, path: str | None, batch: int, band: int = 0):
        self._table, self._path, self._lock = table, table._path(path), table._lock
        self.path, self.batch, self.band = path, int(batch), int(band)
        self._seeded: float | None = None  # a seeded row's T_t(1) from its source (``seed``)
        self.measure = table.measure
        self.ema = self.measure.cost_ema
        self.t_draft: float | None = None  # the model proposer's seconds per proposed token
        self.t_lookup: dict[str, float] = {}  # each lookup proposer's, by name
        self.t_target: dict[int, float] = {}  # tokens scored → seconds
        self.t_samples: dict[int, list[float]] = {}  # n → its first live samples (settling)
        self.d_samples: list[float] = []  # T_d's first samples (settling, at B > 1)
        self.measured: set[int] = set()  # the n timed here (0: T_d), not only warm-started
        self.iterations = 0
        # the busy-machine guard: recent (iteration, seconds) per n, the level T_t(1) the other
        # points were measured against, the points to replace at their next sample (n; 0: T_d),
        # level moves, busy-until iteration, the last re-measure, shape samples held out
        self._recent: dict[int, deque] = {}
        self._scattered: dict[int, tuple] = {}  # n → (latest sample, window start, scattered)
        self._level_ref: float | None = None
        self._stale: set[int] = set()
        self._remeasure_at: int | None = None
        self.level_moves = self._busy_until = self.held_out = 0
        self._floor: dict[int, float] = {}  # n → a probe's T_t(n) / T_t(1) below shape_floor
        self.costs_from: str | None = None  # the warm costs' source: "probe", "store", None
        self._version = 0  # bumped on every observation and warm start of this row

    def _copy(self, table) -> CostRow:
        """An independent copy in ``table`` (``CostTable.copy``); under the lock."""
        new = CostRow(table, self.path, self.batch, self.band)
        for name in ("t_draft", "iterations", "_level_ref", "level_moves", "_busy_until",
                     "_remeasure_at", "held_out", "costs_from", "_version", "_seeded"):
            setattr(new, name, getattr(self, name))
        new.t_lookup, new.t_target, new._floor = (dict(self.t_lookup), dict(self.t_target),
                                                  dict(self._floor))
        new.t_samples = {n: list(v) for n, v in self.t_samples.items()}
        new.d_samples, new._stale = list(self.d_samples), set(self._stale)
        new.measured = set(self.measured)
        new._recent = {n: deque(v, maxlen=self.measure.recent) for n, v in self._recent.items()}
        return new

    def seed(self, source: CostRow) -> None:
        """Start a context band's row (``CostTable.at``) from ``source``'s costs, measured at a
        shorter context: T_t(1) is timed here first (plain steps until it settles: ``ready``),
        then every other point and T_d are carried to the level measured, in proportion, each
        replaced at its next sample (T_d re-timed by exploration: ``carried``). Under the
        lock."""
        self.t_target, self.t_draft = dict(source.t_target), source.t_draft
        self.t_lookup, self._floor = dict(source.t_lookup), dict(source._floor)
        self.costs_from = source.costs_from
        self._seeded = self.t_target.get(1)
        if self._seeded:
            self.t_samples[1] = []  # not settled: measured at this context first
        self._stale = self._others()
        self._version += 1

    def _others(self) -> set[int]:
        """The points a level carries (n > 1; 0: T_d)."""
        return {n for n in self.t_target if n != 1} | ({0} if self.t_draft is not None
                                                      else set())

    def _carry(self, factor: float, points: set[int]) -> None:
        """``points`` (n; 0: T_d) carried to a level ``factor`` × the one they were measured
        at, each replaced at its next sample."""
        for n in points:
            if n == 0:
                self.t_draft *= factor
            else:
                self.t_target[n] *= factor
        self._stale |= points

    def _carry_seed(self) -> None:
        """Once a seeded row's own T_t(1) has settled: the seed's points not re-timed yet
        carried from the source's level to it."""
        factor = self.t_target[1] / self._seeded
        self._carry(factor, set(self._stale))
        self._seeded, self._level_ref = None, self.t_target[1]
        log.debug("autospec: context band %d's T_t(1) settled at x%.2f its seed's: costs "
                  "carried over, re-measured", self.band, factor)

    @property
    def version(self):
        """Changes whenever what ``cost`` reads may have: at batch 1 this row (every
        observation, every warm start), at B > 1 the path's grid or its rows' live points."""
        if self.batch == 1:
            return self._version
        return self._table._grid_key(self._path)

    @property
    def catch_up(self) -> list[float]:
        """The path's catch-up fit's discounted sums (``catch_up_sums``)."""
        return self._path.catch_up

    # -- feeding --------------------------------------------------------------------------------
    def observe(self, k: int, target_s: float, draft_s: float = NAN,
                lookups: Mapping[str, float] | None = None) -> bool:
        """One iteration: the target's forward over k + 1 tokens per row took ``target_s``
        (NaN: not timed, the clock ticks alone), the model proposer drafted its k in
        ``draft_s`` (NaN: it did not), each lookup in ``lookups`` spent that many seconds per
        token it proposed. A held-out target timing holds out the draft's too; a lookup's
        time counts either way. Returns whether the target's timing was kept (None: there
        was none)."""
        with self._lock:
            if lookups:
                for name, per_token in lookups.items():
                    if per_token == per_token and per_token >= 0:
                        self.t_lookup[name] = self._avg(self.t_lookup.get(name), per_token)
            kept = self._timed(k, target_s)
            if k > 0 and kept is not False and draft_s is not None and 0 < draft_s < INF:
                self._draft(k, draft_s)
        return kept

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """The model proposer's catch-up forward over ``tokens`` tokens it had not seen (B ×
        the widest row's gap at batch B) into the path's fit; unusable ones are ignored."""
        if tokens <= 0 or not seconds == seconds or seconds <= 0:
            return
        with self._lock:
            path = self._path
            path.catch_up = catch_up_sums([(tokens, seconds)], self.measure.catch_up_discount,
                                          path.catch_up)

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.ema) * old + self.ema * new

    def _draft(self, k: int, draft_s: float) -> None:
        """A draft-model block of k proposals that took ``draft_s``: at batch 1 a moving
        average from its first sample; at B > 1 (whose first forwards run slow) the median of
        its first samples, then the average. Where the level moved, it replaces the carried
        one."""
        old = self.t_draft
        if 0 in self._stale:
            old = None
            self._stale.discard(0)
            self.d_samples = []
        self.measured.add(0)
        self._path.points += 1
        if self.batch == 1:
            self.t_draft = self._avg(old, draft_s / k)
        else:
            self.t_draft = settle_sample(self.d_samples, old, draft_s / k,
                                         self.measure.cost_settle, self.ema)

    def _timed(self, k: int, target_s: float) -> bool | None:
        """The target's forward of k + 1 tokens through the shape guard (a point below the
        floor is held out and T_t(1) re-measured, or clamped within ``remeasure_every`` of the
        last re-measure), and the iteration; False where held out, None where not timed."""
        kept = True if target_s is not None and 0 < target_s < INF else None
        if kept:
            n, it, p = k + 1, self.iterations, self.measure
            recent = self._recent.get(n)
            if recent is None:
                recent = self._recent[n] = deque(maxlen=p.recent)
            recent.append((it, float(target_s)))
            level = self.t_target.get(1)
            floor = self._floor.get(n, p.shape_floor)
            if n > 1 and level and target_s < floor * level:
                self._busy_until = it + p.busy_hold
                self.held_out += 1
                if self._remeasure_at is None or it - self._remeasure_at >= p.remeasure_every:
                    self._remeasure_at = it
                    self.t_samples[1] = []  # plain steps re-measure the level
                    log.debug("autospec: T_t(%d) = %.3f s below %.2f x T_t(1) = %.3f s at "
                              "batch %d: held out, the level is re-measured", n, target_s,
                              floor, level, self.batch)
                    kept = False
                else:
                    target_s = floor * level
            if kept:
                self.measured.add(n)
                if n > 1:
                    self._level_ref = level  # the level this point is measured against
                if n in self._stale:  # the level moved: this sample replaces the carried one
                    self._stale.discard(n)
                    self.t_samples[n] = []
                if n in self.t_target and n not in self.t_samples:  # warm-started: average
                    self.t_target[n] = self._avg(self.t_target[n], target_s)
                else:
                    self.t_target[n] = settle_sample(self.t_samples.setdefault(n, []),
                                                     self.t_target.get(n), target_s,
                                                     p.cost_settle, self.ema)
                if n == 1 and self._seeded and len(self.t_samples[1]) >= p.cost_settle:
                    self._carry_seed()
                elif n == 1:
                    self._check_level()
                self._path.points += 1
        self.iterations += 1
        self._version += 1
        return kept

    def _check_level(self) -> None:
        """After a plain step: where the last ``level_run`` plain steps' median moved from the
        level by ``level_move`` or more, it becomes T_t(1), the other points and T_d are carried
        to it (replaced at their next sample) and the row counts as busy."""
        first = self.t_samples.get(1)
        recent = self._recent.get(1) or ()
        ref, p = self._level_ref, self.measure
        if (ref is None or ref <= 0 or len(recent) < p.level_run
                or (first is not None and len(first) < p.cost_settle)):
            return
        new = statistics.median([t for _, t in recent][-p.level_run:])
        factor = new / ref
        if max(factor, 1 / factor) < p.level_move:
            return
        self.t_target[1] = new
        self._carry(factor, self._others())
        self._level_ref = new
        self.level_moves += 1
        self._busy_until = self.iterations + p.busy_hold
        log.debug("autospec: the timing level at batch %d moved x%.2f (T_t(1) %.3f s -> "
                  "%.3f s): costs carried over and re-measured", self.batch, factor, ref, new)

    def warm(self, t_target: Mapping[int, float] | None = None, t_draft: float | None = None,
             t_lookup: Mapping[str, float] | None = None, *, probe: bool = False) -> None:
        """Seed from stored costs where nothing is measured yet (``t_lookup``: each lookup
        proposer's seconds per token, by name); ``t_target`` passes ``shape_guard`` unless
        ``probe``, whose points below the floor set this row's own floor there instead."""
        floor = self.measure.shape_floor
        if t_target and not probe:
            guarded = shape_guard(t_target, floor)
            if len(guarded) < len(t_target):
                log.info("autospec: stored T_t(n) for n = %s below %.2f x T_t(1): held out, "
                         "measured again", sorted(set(map(int, t_target)) - set(guarded)),
                         floor)
            t_target = guarded
        with self._lock:
            if t_target:
                self.costs_from = "probe" if probe else "store"
            t1 = t_target.get(1) if t_target and probe else None
            for n, t in t_target.items() if t1 else ():  # a probe's points below the floor
                if int(n) > 1 and t < floor * t1:
                    self._floor[int(n)] = float(t) / t1
            if t_draft and self.t_draft is None:
                self.t_draft = float(t_draft)
            for name, t in (t_lookup or {}).items():
                if t is not None and t >= 0:
                    self.t_lookup.setdefault(name, float(t))
            for n, t in (t_target or {}).items():
                self.t_target.setdefault(int(n), float(t))
            if self._level_ref is None and self.t_target.get(1):
                self._level_ref = self.t_target[1]
            self._version += 1

    def warm_catch_up(self, points) -> None:
        """Seed the path's catch-up fit from logged catch-ups ((tokens, seconds), oldest
        first) where none was measured yet."""
        with self._lock:
            path = self._path
            if path.catch_up[0]:
                return
            path.catch_up = catch_up_sums(points, self.measure.catch_up_discount)

    # -- reading --------------------------------------------------------------------------------
    def busy(self) -> bool:
        """Whether this row's timings say the machine is busy: 3 or more of one n scatter
        within ``scatter_window``, or the level moved or a shape was held out within
        ``busy_hold``."""
        with self._lock:
            it, p = self.iterations, self.measure
            if it < self._busy_until:
                return True
            since = it - p.scatter_window
            for n, samples in self._recent.items():
                if len(samples) < 3 or samples[-1][0] < since:
                    continue
                first = next(i for i, (at, _) in enumerate(samples) if at >= since)  # window start
                if len(samples) - first < 3:
                    continue
                # the window's verdict, recomputed only when a sample came or left
                last, seen = samples[-1], self._scattered.get(n)
                if seen is None or seen[0] is not last or seen[1] != first:
                    window = [t for _, t in samples][first:]
                    seen = self._scattered[n] = (last, first, spread(window) > p.scatter)
                if seen[2]:
                    return True
        return False

    def settled(self, n: int) -> bool:
        """Whether this row's T_t(n) is warm-started or has ``cost_settle`` live samples."""
        with self._lock:
            first = self.t_samples.get(n)
            return n in self.t_target and (first is None
                                           or len(first) >= self.measure.cost_settle)

    def ready(self) -> bool:
        """Whether T_t(B, 1) can be decided by: at batch 1 settled here; at B > 1 read from
        the grid and, in a live table, resting on live samples from B's bucket
        (``CostTable.baseline_live``)."""
        if self.batch == 1:
            return self.settled(1)
        table = self._table
        return 1 in table.grid(self.path, self.batch)[0] and table.baseline_live(
            self.path, self.batch)

    def cost(self, optimistic: bool = False):
        """T_t(B, n) as a function of n (``interpolate_cost``), or None while nothing is
        measured. Batch 1: this row's points, none n > 1 below ``shape_floor`` · T_t(1) (a
        probe's own floor where lower); B > 1: the table's batch grid at B."""
        if self.batch > 1:
            return self._table.target_cost(self.path, self.batch, optimistic=optimistic)
        with self._lock:
            curve, floors = dict(self.t_target), self._floor
        if not curve:
            return None
        t1, floor = curve.get(1), self.measure.shape_floor
        if t1 and (floors or min(curve.values()) < floor * t1):  # else none is below
            curve = {n: (t if n == 1 else max(t, floors.get(n, floor) * t1))
                     for n, t in curve.items()}
        return interpolate_cost(curve, optimistic=optimistic, noise=self.measure.cost_noise)

    def draft_cost(self) -> float | None:
        """T_d(B), seconds per proposed token: batch 1's measured; B > 1 the grid's."""
        if self.batch > 1:
            return self._table.draft_cost(self.path, self.batch)
        return self.t_draft

    def live_points(self) -> tuple[dict[int, float], float | None]:
        """(n → T_t(B, n), T_d(B)) of the points timed on this row (warm-started ones left
        out): the live evidence the table's batch grid reads. Under the lock."""
        measured = self.measured
        return ({n: t for n, t in self.t_target.items() if n in measured},
                self.t_draft if 0 in measured else None)

    def widest(self) -> int:
        """The widest n with a T_t(B, n) point (0: none): at B > 1 the batch grid's at B."""
        if self.batch > 1:
            return max(self._table.grid(self.path, self.batch)[0], default=0)
        with self._lock:
            return max(self.t_target, default=0)

    def known(self) -> bool:
        """Whether T_d(B) and a second T_t(B, n) are known (else the model is explored)."""
        if self.draft_cost() is None:
            return False
        if self.batch > 1:
            return len(self._table.grid(self.path, self.batch)[0]) >= 2
        return len(self.t_target) >= 2

    def carried(self) -> bool:
        """Whether T_d is only carried over a level move since it was last timed (its next
        sample replaces it): the cost model explores the draft model to re-time it."""
        return 0 in self._stale

    def lookup_cost(self, proposer: str) -> float | None:
        """A lookup proposer's seconds per proposed token at B: this row's, else the nearest
        batch size's of the path that measured it."""
        got = self.t_lookup.get(proposer)
        return got if got is not None else self._table.lookup_cost(self.path, self.batch,
                                                                   proposer)

    def catch_up_cost(self, tokens: int) -> float | None:
        """Seconds for the model proposer to take in ``tokens`` unseen tokens (B × gap) and
        propose its first one: the path's fit (``catch_up_line``), never below T_d(B); None
        before any catch-up."""
        with self._lock:
            line = catch_up_line(self._path.catch_up, self.measure.catch_up_spread)
        return None if line is None else max(line[0] + line[1] * tokens,
                                             self.draft_cost() or 0.0)

    def across(self, batch: int, optimistic: bool = False):
        """(T_t(b, ·), T_d(b)) on this row's path at another batch size ``batch``, read from
        the grid (each None where nothing is known): a batch decision's steps as rows
        leave."""
        table = self._table
        return (table.target_cost(self.path, batch, optimistic=optimistic),
                table.draft_cost(self.path, batch))

    def cost_origin(self) -> str:
        """Where the costs came from: "live", or the warm start's source ("probe", "store"),
        "+live" once timed live; "batch" at B > 1 (the batch grid)."""
        if self.batch > 1:
            return "batch"
        origin = ("live" if self.costs_from is None
                  else self.costs_from + ("+live" if any(self.t_samples.values()) else ""))
        if self.band:
            origin += f", context ≥ {self.measure.context_band << (self.band - 1)}"
        return origin

    def __repr__(self) -> str:
        band = f", context band {self.band}" if self.band else ""
        return (f"CostRow({self.path!r}, B = {self.batch}{band}: T_t(n) at n = "
                f"{sorted(self.t_target)}"
                f", T_d {self.t_draft}, iterations {self.iterations})")
