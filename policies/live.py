"""What has been measured live: per category, acceptance per draft position (``LiveStats``,
discounted Beta counts); per model pair and execution path, the cost model's timings and the
busy-machine guard over them (``PairCosts``). A controller keeps one ``PairCosts`` and one
``LiveStats`` per category referencing it: timings are the pair's, acceptance is never shared.
Thread-safe: a category's statistics and its pair's costs share one lock.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
from collections import deque
from collections.abc import Mapping, Sequence

from autospec.traces import K_LIMIT, MATCH_BUCKETS, NGRAM_TRACE_K

from .costmodel import conditional_from_cumulative, interpolate_cost, settle_sample
from .params import DEFAULTS, Parameters

log = logging.getLogger("autospec.policies.live")

__all__ = ["LiveStats", "PairCosts", "copy_lives", "MATCH_BUCKETS", "match_bucket",
           "catch_up_line", "catch_up_sums", "shape_guard", "spread"]


def shape_guard(curve: Mapping[int, float], floor: float = DEFAULTS.shape_floor
                ) -> dict[int, float]:
    """``curve`` (n → T_t(n)) without the points n > 1 below ``floor`` · T_t(1), a shape no
    machine shows (timings from different loads); held out, not clamped. Without T_t(1) the
    curve is returned as it is."""
    pts = {int(n): float(t) for n, t in curve.items() if t is not None}
    t1 = pts.get(1)
    if not t1 or t1 <= 0:
        return pts
    return {n: t for n, t in pts.items() if n == 1 or t >= floor * t1}


def spread(samples: Sequence[float]) -> float:
    """Relative spread of timings: interquartile range over the median (0 below 3 samples)."""
    if len(samples) < 3:
        return 0.0
    q1, q2, q3 = _quartiles(sorted(samples))
    return (q3 - q1) / q2 if q2 > 0 else 0.0


def _quartiles(data: Sequence[float]) -> tuple[float, float, float]:
    """The quartiles of sorted ``data`` (at least 2 values), as
    ``statistics.quantiles(data, n=4, method="inclusive")`` computes them, faster."""
    m = len(data) - 1
    a, b, c = m // 4, m // 2, 3 * m // 4
    da, db, dc = m % 4, 2 * m % 4, 3 * m % 4
    return ((data[a] * (4 - da) + data[a + 1] * da) / 4,
            (data[b] * (4 - db) + data[b + 1] * db) / 4,
            (data[c] * (4 - dc) + data[c + 1] * dc) / 4)


def catch_up_sums(points, discount: float = 1.0, sums: Sequence[float] | None = None
                  ) -> list[float]:
    """The fit's sums (Σ1, Σg, Σg², ΣC, Σg·C) over catch-ups ``points`` ((tokens, seconds),
    oldest first, discounted by ``discount`` each) added to ``sums``; unusable pairs skipped."""
    out = list(sums) if sums is not None else [0.0] * 5
    for g, c in points:
        g, c = float(g), float(c)
        if g <= 0 or not c == c or c <= 0:
            continue
        for i, v in enumerate((1.0, g, g * g, c, g * c)):
            out[i] = out[i] * discount + v
    return out


def catch_up_line(sums: Sequence[float], spread_share: float = DEFAULTS.catch_up_spread
                  ) -> tuple[float, float] | None:
    """(a, b) of the catch-up cost C(g) = a + b·g fitted to ``sums``: least squares where the
    sizes vary, else proportional to the mean (a = 0); None with no catch-up."""
    n, sg, sgg, sc, sgc = sums
    if n <= 0:
        return None
    mean_g, mean_c = sg / n, sc / n
    var = sgg / n - mean_g * mean_g
    if var > (spread_share * mean_g) ** 2 and n >= 2:
        b = max(0.0, (sgc / n - mean_g * mean_c) / var)
        return max(0.0, mean_c - b * mean_g), b
    return 0.0, mean_c / mean_g


def match_bucket(match: int) -> int:
    """The ``MATCH_BUCKETS`` bucket an n-gram match of ``match`` tokens counts in (0: none)."""
    bucket = 0
    for b in MATCH_BUCKETS:
        if match >= b:
            bucket = b
    return bucket


def _seed(accepted: list[float], reached: list[float], accepted_per_position: Sequence[float],
          drafted_per_position: Sequence[float], weight: float) -> float:
    """Stored cumulative counts into one proposer's conditional counts, at most ``weight``
    blocks; the blocks seeded."""
    cum = [a / n if n else None for a, n in zip(accepted_per_position, drafted_per_position)]
    first = drafted_per_position[0] if drafted_per_position else 0
    reach = seeded = min(float(first), weight)
    for i, a in enumerate(conditional_from_cumulative(cum)):
        if i >= len(reached) or a is None or reach <= 0:
            break
        reached[i] += reach
        accepted[i] += a * reach
        reach *= a
    return max(0.0, seeded)


class PairCosts:
    """One model pair's timings on one execution path at batch 1 (T_t(n), T_d, the lookups'
    host time, the draft's catch-up fit) and the busy-machine guard over them (docs/policy.md).
    Every ``LiveStats`` of a controller references it and shares its lock (the ``_``-methods run
    under it); ``iterations``, one tick per timed observation, is the guard's clock."""

    def __init__(self, *, ema: float | None = None, params: Parameters = DEFAULTS):
        self.params = params
        self.ema = params.cost_ema if ema is None else ema
        self.t_draft: float | None = None  # the model proposer's seconds per proposed token
        # each lookup proposer's host seconds per proposed token, by name
        self.t_lookup: dict[str, float] = {}
        self.t_target: dict[int, float] = {}  # tokens scored → seconds
        self.t_samples: dict[int, list[float]] = {}  # n → its first live samples (settling)
        self.catch_up = [0.0] * 5  # the draft's catch-up fit's discounted sums (catch_up_sums)
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
        self._lock = threading.Lock()
        self.version = 0  # bumped on every change

    def copy(self) -> PairCosts:
        """An independent copy (a replay that must not feed the original)."""
        with self._lock:
            new = PairCosts(ema=self.ema, params=self.params)
            for name in ("t_draft", "iterations", "_level_ref", "level_moves", "_busy_until",
                         "_remeasure_at", "held_out", "costs_from"):
                setattr(new, name, getattr(self, name))
            new.t_lookup = dict(self.t_lookup)
            new.t_target, new._floor = dict(self.t_target), dict(self._floor)
            new.t_samples = {n: list(v) for n, v in self.t_samples.items()}
            new.catch_up, new._stale = list(self.catch_up), set(self._stale)
            new._recent = {n: deque(v, maxlen=self.params.recent) for n, v in self._recent.items()}
        return new

    # -- feeding (under the lock) ---------------------------------------------------------------
    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.ema) * old + self.ema * new

    def _draft(self, k: int, draft_s: float) -> None:
        """A draft-model block of k proposals that took ``draft_s``; under the lock."""
        # where the level moved, this sample replaces the carried one
        old = None if 0 in self._stale else self.t_draft
        self._stale.discard(0)
        self.t_draft = self._avg(old, draft_s / k)

    def _lookup(self, proposer: str, per_token: float) -> None:
        """A lookup proposer's host seconds per proposed token; under the lock."""
        self.t_lookup[proposer] = self._avg(self.t_lookup.get(proposer), per_token)

    def _timed(self, k: int, target_s: float) -> bool:
        """The target's forward of k + 1 tokens through the shape guard (a point below the
        floor is held out and T_t(1) re-measured, or clamped within ``remeasure_every`` of the
        last re-measure), and the iteration; False where held out. Under the lock."""
        kept = True
        if target_s == target_s and target_s > 0:  # not NaN
            n, it, p = k + 1, self.iterations, self.params
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
                    log.debug("autospec: T_t(%d) = %.3f s below %.2f x T_t(1) = %.3f s: held "
                              "out, the level is re-measured", n, target_s, floor, level)
                    kept = False
                else:
                    target_s = floor * level
            if kept:
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
                if n == 1:
                    self._check_level()
        self.iterations += 1
        self.version += 1
        return kept

    def _check_level(self) -> None:
        """After a plain step: where the last ``level_run`` plain steps' median moved from the
        level by ``level_move`` or more, it becomes T_t(1), the other points and T_d are carried
        to it (replaced at their next sample) and the machine counts as busy. Under the lock."""
        first = self.t_samples.get(1)
        recent = self._recent.get(1) or ()
        ref, p = self._level_ref, self.params
        if (ref is None or ref <= 0 or len(recent) < p.level_run
                or (first is not None and len(first) < p.cost_settle)):
            return
        new = statistics.median([t for _, t in recent][-p.level_run:])
        factor = new / ref
        if max(factor, 1 / factor) < p.level_move:
            return
        self.t_target[1] = new
        for n in self.t_target:
            if n != 1:
                self.t_target[n] *= factor
                self._stale.add(n)
        if self.t_draft is not None:
            self.t_draft *= factor
            self._stale.add(0)
        self._level_ref = new
        self.level_moves += 1
        self._busy_until = self.iterations + p.busy_hold
        log.debug("autospec: the timing level moved x%.2f (T_t(1) %.3f s -> %.3f s): costs "
                  "carried over and re-measured", factor, ref, new)

    def busy(self) -> bool:
        """Whether the timings say the machine is busy: 3 or more of one n scatter within
        ``scatter_window``, or the level moved or a shape was held out within ``busy_hold``."""
        with self._lock:
            it, p = self.iterations, self.params
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

    def _catch_up(self, tokens: int, seconds: float) -> None:
        """One catch-up forward into the fit; under the lock."""
        self.catch_up = catch_up_sums([(tokens, seconds)], self.params.catch_up_discount,
                                      self.catch_up)
        self.version += 1

    def warm_catch_up(self, points) -> None:
        """Seed the catch-up fit from logged catch-ups ((tokens, seconds), oldest first) where
        none was measured yet."""
        with self._lock:
            if self.catch_up[0]:
                return
            self.catch_up = catch_up_sums(points, self.params.catch_up_discount)
            self.version += 1

    def warm(self, t_target: Mapping[int, float] | None = None, t_draft: float | None = None,
             t_lookup: Mapping[str, float] | None = None, *, probe: bool = False) -> None:
        """Seed from stored costs where nothing is measured yet (``t_lookup``: each lookup
        proposer's seconds per token, by name); ``t_target`` passes ``shape_guard`` unless
        ``probe``."""
        floor = self.params.shape_floor
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
            self.version += 1

    # -- reading --------------------------------------------------------------------------------
    def catch_up_cost(self, tokens: int) -> float | None:
        """Seconds for the draft model to take in ``tokens`` unseen tokens and propose its
        first one (``catch_up_line``'s fit, never below T_d); None before any catch-up."""
        with self._lock:
            line = catch_up_line(self.catch_up, self.params.catch_up_spread)
            t_draft = self.t_draft
        return None if line is None else max(line[0] + line[1] * tokens, t_draft or 0.0)

    def settled(self, n: int) -> bool:
        """Whether T_t(n) is warm-started or has ``cost_settle`` live samples."""
        with self._lock:
            first = self.t_samples.get(n)
            return n in self.t_target and (first is None
                                           or len(first) >= self.params.cost_settle)

    def cost(self, optimistic: bool = False):
        """T_t(n) as a function (``interpolate_cost``), or None while nothing is measured; no
        point n > 1 reads below ``shape_floor`` · T_t(1)."""
        with self._lock:
            curve, floors = dict(self.t_target), self._floor
        if not curve:
            return None
        t1, floor = curve.get(1), self.params.shape_floor
        if t1 and (floors or min(curve.values()) < floor * t1):  # else none is below
            curve = {n: (t if n == 1 else max(t, floors.get(n, floor) * t1))
                     for n, t in curve.items()}
        return interpolate_cost(curve, optimistic=optimistic, noise=self.params.cost_noise)

    def cost_origin(self) -> str:
        """Where the costs came from: "live", or the warm start's source ("probe", "store"),
        "+live" once timed live."""
        if self.costs_from is None:
            return "live"
        return self.costs_from + ("+live" if any(self.t_samples.values()) else "")

    def __repr__(self) -> str:
        return (f"PairCosts(T_t(n) at n = {sorted(self.t_target)}, T_d {self.t_draft}, "
                f"iterations {self.iterations}, version {self.version})")


def _delegated(name: str, doc: str) -> property:
    """A ``LiveStats`` attribute that is its pair's costs' (read and set there)."""
    return property(lambda self: getattr(self.costs, name),
                    lambda self, value: setattr(self.costs, name, value), doc=doc)


def _forwarded(name: str):
    """A ``LiveStats`` method that is its pair's costs' (``PairCosts`` does the work)."""
    def method(self, *args, **kwargs):
        return getattr(self.costs, name)(*args, **kwargs)

    method.__name__, method.__doc__ = name, getattr(PairCosts, name).__doc__
    return method


def copy_lives(lives: Mapping[str, LiveStats]) -> dict[str, LiveStats]:
    """Independent copies of a controller's category statistics (a replay that must not feed
    them): the categories that shared one ``PairCosts`` share one copy of it."""
    copies = {id(live.costs): live.costs for live in lives.values()}
    copies = {key: costs.copy() for key, costs in copies.items()}
    return {cat: live.copy(costs=copies[id(live.costs)]) for cat, live in lives.items()}


class _Acceptance:
    """One proposer's discounted acceptance counts in one category: position i (0-based) is
    reached when the proposer proposed it and every earlier one was accepted; accepted[i] /
    reached[i] is the conditional acceptance. Pooled, and (lookups) per match-length bucket;
    its blocks ever (stored included, undiscounted); decision points [without, with] a match
    (lookups); a version bumped on every change."""

    __slots__ = ("accepted", "reached", "by_match", "blocks", "match_points", "version")

    def __init__(self, positions: int):
        self.accepted, self.reached = [0.0] * positions, [0.0] * positions
        self.by_match: dict[int, tuple[list[float], list[float]]] = {}
        self.blocks = 0.0
        self.match_points = [0.0, 0.0]
        self.version = 0

    def copy(self) -> _Acceptance:
        new = _Acceptance(0)
        new.accepted, new.reached = list(self.accepted), list(self.reached)
        new.by_match = {n: (list(a), list(r)) for n, (a, r) in self.by_match.items()}
        new.blocks, new.match_points = self.blocks, list(self.match_points)
        return new


class LiveStats:
    """Discounted counts of one category's acceptance, per proposer by name, beside its pair's
    costs (``costs``), whose attributes and methods below are read, set and called through
    this object."""

    t_target = _delegated("t_target", "n → T_t(n), seconds (the pair's)")
    t_draft = _delegated("t_draft", "T_d, the model proposer's seconds per token (the pair's)")
    t_lookup = _delegated("t_lookup", "each lookup proposer's seconds per token (the pair's)")
    catch_up = _delegated("catch_up", "the model's catch-up fit's sums (the pair's)")
    iterations = _delegated("iterations", "timed observations of the pair (its clock)")
    level_moves = _delegated("level_moves", "how often the timing level moved (the pair's)")
    held_out = _delegated("held_out", "shape samples held out (the pair's)")
    costs_from = _delegated("costs_from", "where the pair's warm costs came from")
    _busy_until = _delegated("_busy_until", "until which iteration the machine is busy")
    busy = _forwarded("busy")
    settled = _forwarded("settled")
    cost = _forwarded("cost")
    cost_origin = _forwarded("cost_origin")
    catch_up_cost = _forwarded("catch_up_cost")
    warm_catch_up = _forwarded("warm_catch_up")

    def __init__(self, *, discount: float | None = None,
                 prior: tuple[float, float] | None = None, ema: float | None = None,
                 max_positions: int = K_LIMIT, params: Parameters = DEFAULTS,
                 costs: PairCosts | None = None, feed_costs: bool = True):
        """``costs``: the pair's costs to reference (None: its own). ``feed_costs`` False:
        observations feed the acceptance only (a request's statistics: its clock still ticks)."""
        discount = params.acceptance_discount if discount is None else discount
        if not 0 < discount <= 1:
            raise ValueError("discount must be in (0, 1]")
        self.params = params
        self.discount, self.ema = discount, params.cost_ema if ema is None else ema
        self.prior = (params.prior_hits, params.prior_misses) if prior is None else prior
        self.costs = PairCosts(ema=self.ema, params=params) if costs is None else costs
        self.feed_costs = bool(feed_costs)
        self._tick = costs is None and not feed_costs  # its own clock, no timings
        self.positions = max_positions
        self.by_proposer: dict[str, _Acceptance] = {}  # name → its acceptance counts
        self.spent = [0.0, 0.0]  # [seconds, tokens] past prefill, discounted: the rate
        self.bandwidth_utilisation: float | None = None
        self._lock = self.costs._lock  # one lock with the pair's costs
        self._version = 0  # bumped on every change of the acceptance

    @property
    def version(self) -> int:
        """Bumped on every change of the acceptance or of the pair's costs."""
        return self._version + self.costs.version

    def _of(self, name: str) -> _Acceptance:
        """A proposer's counts, made on first use; under the lock (or before sharing)."""
        got = self.by_proposer.get(name)
        if got is None:
            got = self.by_proposer[name] = _Acceptance(self.positions)
        return got

    def proposer_version(self, name: str) -> int:
        """Bumped on every change of a proposer's counts (0 before any)."""
        got = self.by_proposer.get(name)
        return 0 if got is None else got.version

    # -- feeding ------------------------------------------------------------------------------
    def observe(self, k: int, accepted: int, draft_s: float, target_s: float, *,
                proposer: str | None = "draft") -> None:
        """An iteration of the model proposer (``proposer``, its name — the built-in draft
        model's by default; None: the call has none — a block of k with ``accepted`` accepted)
        or a plain step (k = 0, which discounts the model's counts): its counts, its timing and
        the target's, and the rate."""
        with self._lock:
            if proposer is not None:
                acc = self._of(proposer)
                self._count(acc.accepted, acc.reached, k, accepted)
                if k > 0:
                    acc.blocks += 1
                acc.version += 1
            # a held-out target timing holds out the draft timing too
            kept = self._timed(k, target_s)
            if k > 0 and kept and draft_s == draft_s and draft_s > 0:  # not NaN
                self.costs._draft(k, draft_s)
            self._spend(draft_s if k else 0.0, target_s, accepted + 1)
            self._version += 1

    def _timed(self, k: int, target_s: float) -> bool:
        """The target's timing into the pair's costs where this one feeds them (False where
        held out or not fed); a request's statistics only tick their clock. Under the lock."""
        if self.feed_costs:
            return self.costs._timed(k, target_s)
        if self._tick:
            self.costs.iterations += 1
        return False

    def _spend(self, draft_s: float, target_s: float, tokens: int) -> None:
        """An iteration's time and tokens into the rate (not prefill's); under the lock."""
        if not (target_s == target_s and target_s > 0 and draft_s == draft_s):
            return
        self.spent[0] = self.spent[0] * self.discount + draft_s + target_s
        self.spent[1] = self.spent[1] * self.discount + tokens

    def seconds_per_token(self) -> float | None:
        """The rate this category runs at, everything counted (None before ``rate_tokens``)."""
        with self._lock:
            seconds, tokens = self.spent
        return seconds / tokens if tokens >= self.params.rate_tokens else None

    def _count(self, accepted: list[float], reached: list[float], k: int, m: int) -> None:
        """One block of k with m accepted into a proposer's counts; under the lock."""
        d = self.discount
        if d < 1:
            for i in range(len(reached)):
                if reached[i] == 0:
                    break
                reached[i] *= d
                accepted[i] *= d
        for i in range(min(k, m + 1, len(reached))):
            reached[i] += 1
            if i < m:
                accepted[i] += 1

    def observe_catch_up(self, tokens: int, seconds: float, *, fit: bool = True) -> None:
        """A catch-up forward over ``tokens`` unseen tokens that took ``seconds``: time spent,
        and (``fit``: unless another category fed it already) the pair's catch-up fit."""
        if tokens <= 0 or not seconds == seconds or seconds <= 0:
            return
        with self._lock:
            self.spent[0] += float(seconds)  # time the category spent, for no token of its own
            if self.feed_costs and fit:
                self.costs._catch_up(tokens, seconds)
            self._version += 1

    def observe_match(self, matched: bool, *, proposer: str) -> None:
        """A decision point: did the lookup ``proposer`` have a match there?"""
        with self._lock:
            points = self._of(proposer).match_points
            points[0] *= self.discount
            points[1] *= self.discount
            points[1 if matched else 0] += 1
            self._version += 1

    def unmatched_share(self, proposer: str) -> float:
        """The share of decision points without a match of the lookup ``proposer``
        (``unmatched_prior`` points without one to start)."""
        prior = self.params.unmatched_prior
        with self._lock:
            got = self.by_proposer.get(proposer)
            without, with_ = got.match_points if got is not None else (0.0, 0.0)
        return (without + prior) / (without + with_ + prior)

    def observe_lookup(self, proposer: str, k: int, accepted: int, lookup_s: float,
                       target_s: float, *, match: int = 0) -> None:
        """One iteration drafted by a lookup proposer: its acceptance counts, pooled and
        under its match length (``match``, 0: unknown), its host time per token and the
        target's timing."""
        with self._lock:
            self._count_lookup(proposer, k, accepted, match)
            if self.feed_costs and k > 0 and lookup_s == lookup_s and lookup_s >= 0:
                self.costs._lookup(proposer, lookup_s / k)  # its host time, held out or not
            self._timed(k, target_s)
            self._spend(lookup_s if k else 0.0, target_s, accepted + 1)
            self._version += 1

    def observe_shadow(self, proposer: str, match: int, agree: int, seen: int) -> None:
        """A lookup proposer's shadow in an iteration it did not draft: its match was
        ``match`` tokens and the first ``agree`` of its proposed tokens equal the ``seen``
        tokens emitted. Counted as the block that tells exactly that, over at most
        ``NGRAM_TRACE_K`` positions, as replay counts it. No iteration passes, no timing."""
        if match <= 0 or seen <= 0:
            return
        seen = min(int(seen), NGRAM_TRACE_K)
        agree = max(0, min(int(agree), seen))
        k, m = (agree + 1, agree) if agree < seen else (seen, seen)
        with self._lock:
            self._count_lookup(proposer, k, m, match)
            self._version += 1

    def _count_lookup(self, proposer: str, k: int, m: int, match: int) -> None:
        """A lookup block into the pooled counts and its match length's; under the lock."""
        acc = self._of(proposer)
        self._count(acc.accepted, acc.reached, k, m)
        match = match_bucket(match)
        if match > 0:
            size = len(acc.reached)
            by = acc.by_match.setdefault(match, ([0.0] * size, [0.0] * size))
            self._count(by[0], by[1], k, m)
        acc.version += 1

    def counts(self, proposer: str, match: int = 0) -> tuple[list[float], list[float]]:
        """(accepted, reached) per position of a proposer's blocks: all, or (``match`` > 0)
        those of that match's bucket (zeros where none)."""
        with self._lock:
            got = self.by_proposer.get(proposer)
            size = self.positions
            if got is None:
                return [0.0] * size, [0.0] * size
            if match > 0:
                a, r = got.by_match.get(match_bucket(match), ([0.0] * size, [0.0] * size))
                return list(a), list(r)
            return list(got.accepted), list(got.reached)

    def first_acceptance(self, proposer: str) -> float | None:
        """A proposer's acceptance at its first position (None before it proposed)."""
        with self._lock:
            got = self.by_proposer.get(proposer)
            if got is None or got.reached[0] <= 0:
                return None
            return got.accepted[0] / got.reached[0]

    def blocks(self, proposer: str | None) -> float:
        """A proposer's blocks ever (the store's included), undiscounted."""
        got = self.by_proposer.get(proposer) if proposer is not None else None
        return 0.0 if got is None else got.blocks

    def observed(self, proposer: str | None) -> float:
        """Discounted blocks of a proposer seen (its first position's count): how much
        evidence there is."""
        got = self.by_proposer.get(proposer) if proposer is not None else None
        return 0.0 if got is None else got.reached[0]

    def observe_evidence(self, proposer: str, depth: int, value: float) -> None:
        """Evidence of a proposer's acceptance at position ``depth`` (greedy 0/1; sampled: the
        acceptance probability), counted there without a discount step: the model's catch-up
        predicting a position it had not drafted (depth 0), or the one past a block it had
        accepted whole (depth: that block's length — what a block one longer would have met;
        a category drafting short blocks so learns whether longer ones would be accepted)."""
        with self._lock:
            acc = self._of(proposer)
            if 0 <= depth < len(acc.reached):
                acc.reached[depth] += 1
                acc.accepted[depth] += min(1.0, max(0.0, float(value)))
                acc.version += 1
                self._version += 1

    def warm_start(self, per_proposer: Mapping[str, tuple[Sequence[float], Sequence[float]]],
                   *, weight: float | None = None, t_draft: float | None = None,
                   t_target: Mapping[int, float] | None = None,
                   bandwidth_utilisation: float | None = None,
                   t_lookup: Mapping[str, float] | None = None, probe: bool = False) -> None:
        """Seed from stored history: per proposer by name, vLLM-style cumulative counts per
        position (accepted, drafted; lookups' pooled over match lengths), scaled to at most
        ``weight`` blocks; ``t_target``, ``t_draft`` and ``t_lookup`` seed the pair's costs
        (``PairCosts.warm``)."""
        weight = self.params.stored_weight if weight is None else weight
        if t_target or t_draft or t_lookup:
            self.costs.warm(t_target, t_draft, t_lookup, probe=probe)
        with self._lock:
            for name, (accepted_pp, drafted_pp) in per_proposer.items():
                acc = self._of(name)
                acc.blocks += _seed(acc.accepted, acc.reached, accepted_pp, drafted_pp, weight)
                acc.version += 1
            if bandwidth_utilisation is not None:
                self.bandwidth_utilisation = bandwidth_utilisation
            self._version += 1

    # -- reading ------------------------------------------------------------------------------
    def acceptance(self, proposer: str, i: int) -> tuple[float, float]:
        """Posterior (mean, sd) of a proposer's acceptance at position i (0-based)."""
        with self._lock:
            acc = self.by_proposer.get(proposer)
            counts = (acc.accepted, acc.reached) if acc is not None else ((), ())
            return self._posteriors(i + 1, *counts)[i]

    def curve(self, proposer: str, k_max: int, z: float = 0.0, *,
              match: int = 0) -> list[float]:
        """Posterior means (+ z standard deviations, clipped to [0, 1]) of a proposer's
        acceptance at positions 0 … k_max−1: position 0 is Beta(prior) updated by its counts;
        each later position's prior, of the same strength, is centred on the position before
        it, so a rarely reached position is pulled toward its neighbour rather than toward
        0.5. With ``match`` > 0 (a lookup), of blocks from that match's bucket: position i's
        prior is centred on position 0's estimate after a match of ``match`` + i tokens (once
        i tokens are accepted the context agrees with the source i tokens further;
        docs/proposers.md)."""
        with self._lock:
            acc = self.by_proposer.get(proposer)
            accepted, reached = (acc.accepted, acc.reached) if acc is not None else ((), ())
            if match <= 0 or acc is None:
                posts = self._posteriors(k_max, accepted, reached, spread=bool(z))
            else:
                pooled = self._posteriors(1, accepted, reached, spread=False)[0][0]
                # position 0's estimate after a match in each bucket seen (else the pooled one)
                firsts = {b: self._posteriors(1, a, r, centres=[pooled], spread=False)[0][0]
                          for b, (a, r) in acc.by_match.items()}
                a_, r_ = acc.by_match.get(match_bucket(match), ((), ()))
                # position 0: the pooled prior (its own counts are then added, once)
                centres = [pooled] + [firsts.get(match_bucket(match + i), pooled)
                                      for i in range(1, k_max)]
                posts = self._posteriors(k_max, a_, r_, centres=centres, spread=bool(z))
        return [min(1.0, max(0.0, mean + z * sd)) if z else mean for mean, sd in posts]

    def _posteriors(self, k_max: int, accepted, reached, *, centres: Sequence[float] = (),
                    spread: bool = True) -> list[tuple[float, float]]:
        """(mean, sd) per position (``curve``) of ``accepted``/``reached``, centred on
        ``centres`` where given; under the lock."""
        strength = self.prior[0] + self.prior[1]
        out: list[tuple[float, float]] = []
        mean = self.prior[0] / strength
        for i in range(k_max):
            if i < len(centres):
                mean = centres[i]
            acc, reach = (accepted[i], reached[i]) if i < len(reached) else (0, 0)
            a = mean * strength + acc
            b = (1 - mean) * strength + reach - acc
            mean = a / (a + b)
            out.append((mean, math.sqrt(a * b / ((a + b) ** 2 * (a + b + 1))) if spread else 0.0))
        return out

    def copy(self, *, discount: float | None = None,
             acceptance_from: LiveStats | None = None, proposer: str | None = None,
             costs: PairCosts | None = None) -> LiveStats:
        """A copy of the acceptance. ``costs`` None: it reads this one's ``PairCosts`` without
        feeding them; else it feeds ``costs``. ``acceptance_from``: take ``proposer``'s
        counts from there."""
        new = LiveStats(discount=self.discount if discount is None else discount,
                        prior=self.prior, ema=self.ema, max_positions=self.positions,
                        params=self.params, costs=self.costs if costs is None else costs,
                        feed_costs=costs is not None)
        with self._lock:
            new.by_proposer = {n: acc.copy() for n, acc in self.by_proposer.items()}
            new.spent = list(self.spent)
            new.bandwidth_utilisation = self.bandwidth_utilisation
        if acceptance_from is not None and proposer is not None:
            with acceptance_from._lock:
                got = acceptance_from.by_proposer.get(proposer)
                if got is not None:
                    new.by_proposer[proposer] = got.copy()
                else:
                    new.by_proposer.pop(proposer, None)
        return new
