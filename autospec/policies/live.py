"""What has been measured live of one category (``LiveStats``): acceptance per proposer and
draft position (discounted Beta counts, by name) and the rate the category runs at. Costs are
the pair's, kept apart in its cost table (``autospec.costs.table.CostTable``): acceptance is
never shared between categories, timings are never a category's. Thread-safe.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Mapping, Sequence

from autospec.costs.price import conditional_from_cumulative
from autospec.traces import K_LIMIT, MATCH_BUCKETS, NGRAM_TRACE_K

from .params import CONSTANTS, DEFAULTS, Parameters
from .stopping import BINS, bin_of, calibrated

__all__ = ["LiveStats", "copy_lives", "MATCH_BUCKETS", "match_bucket"]

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


def copy_lives(lives: Mapping[str, LiveStats]) -> dict[str, LiveStats]:
    """Independent copies of a controller's category statistics (a replay that must not feed
    them)."""
    return {cat: live.copy() for cat, live in lives.items()}


class _Acceptance:
    """One proposer's discounted acceptance counts in one category: position i (0-based) is
    reached when the proposer proposed it and every earlier one was accepted; accepted[i] /
    reached[i] is the conditional acceptance. Pooled, and (lookups) per match-length bucket;
    its blocks ever (stored included, undiscounted); decision points [without, with] a match
    (lookups); a version bumped on every change."""

    __slots__ = ("accepted", "reached", "by_match", "blocks", "match_points", "version",
                 "by_confidence")

    def __init__(self, positions: int):
        self.accepted, self.reached = [0.0] * positions, [0.0] * positions
        self.by_match: dict[int, tuple[list[float], list[float]]] = {}
        self.blocks = 0.0
        self.match_points = [0.0, 0.0]
        self.version = 0
        # the model proposer's tokens per confidence bin: [accepted, proposed]
        self.by_confidence = ([0.0] * BINS, [0.0] * BINS)

    def copy(self) -> _Acceptance:
        new = _Acceptance(0)
        new.accepted, new.reached = list(self.accepted), list(self.reached)
        new.by_match = {n: (list(a), list(r)) for n, (a, r) in self.by_match.items()}
        new.blocks, new.match_points = self.blocks, list(self.match_points)
        new.by_confidence = (list(self.by_confidence[0]), list(self.by_confidence[1]))
        return new


class LiveStats:
    """Discounted counts of one category's acceptance, per proposer by name, and the rate it
    runs at (``spent``): no cost (the pair's, in its ``CostTable``). A request's own
    statistics are one too."""

    def __init__(self, *, discount: float | None = None,
                 prior: tuple[float, float] | None = None, max_positions: int = K_LIMIT,
                 params: Parameters = DEFAULTS):
        discount = params.acceptance_discount if discount is None else discount
        if not 0 < discount <= 1:
            raise ValueError("discount must be in (0, 1]")
        self.params = params
        self.discount = discount
        self.prior = CONSTANTS.prior if prior is None else prior
        self.positions = max_positions
        self.by_proposer: dict[str, _Acceptance] = {}  # name → its acceptance counts
        self.spent = [0.0, 0.0]  # [seconds, tokens] past prefill, discounted: the rate
        self.iterations = 0  # observations of an iteration (its blocks and plain steps)
        self.bandwidth_utilisation: float | None = None
        # (new tokens, stopped at its cap?) of the category's latest ended requests
        self.lengths: deque[tuple[int, bool]] = deque(maxlen=int(CONSTANTS.lengths_kept))
        self._lock = threading.Lock()
        self._version = 0  # bumped on every change of the acceptance

    @property
    def version(self) -> int:
        """Bumped on every change of the acceptance or the rate."""
        return self._version

    def _of(self, name: str) -> _Acceptance:
        """A proposer's counts, made on first use; under the lock (or before sharing). The
        feeding methods read ``by_proposer`` first and come here only for a new name."""
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
        or a plain step (k = 0, which discounts the model's counts): its counts, and its time
        (the draft's ``draft_s`` and the target's) into the rate."""
        with self._lock:
            if proposer is not None:
                acc = self.by_proposer.get(proposer) or self._of(proposer)
                self._count(acc.accepted, acc.reached, k, accepted)
                if k > 0:
                    acc.blocks += 1
                acc.version += 1
            self.iterations += 1
            self._spend(draft_s if k else 0.0, target_s, accepted + 1)
            self._version += 1

    def _spend(self, draft_s: float, target_s: float, tokens: int) -> None:
        """An iteration's time and tokens into the rate (not prefill's); under the lock."""
        if not (target_s == target_s and target_s > 0 and draft_s == draft_s):
            return
        self.spent[0] = self.spent[0] * self.discount + draft_s + target_s
        self.spent[1] = self.spent[1] * self.discount + tokens

    def observe_length(self, tokens: int, capped: bool) -> None:
        """A request of the category ended after ``tokens`` new tokens; ``capped``: stopped by
        its ``max_new_tokens`` (it might have run on)."""
        with self._lock:
            self.lengths.append((int(tokens), bool(capped)))

    def expected_left(self, generated: int, left: int) -> float:
        """Tokens a row of the category that has generated ``generated`` and may generate
        ``left`` more is expected to generate: the mean, over the latest ended requests that
        ran past ``generated``, of how many more they generated, at most ``left`` (one stopped
        at its cap: ``left``); ``left`` while fewer than ``CONSTANTS.lengths_min`` did."""
        with self._lock:
            past = [left if capped else min(n - generated, left)
                    for n, capped in self.lengths if n > generated]
        if len(past) < CONSTANTS.lengths_min:
            return float(left)
        return max(1.0, sum(past) / len(past))

    def seconds_per_token(self) -> float | None:
        """The rate this category runs at, everything counted (None before ``CONSTANTS.rate_tokens``)."""
        with self._lock:
            seconds, tokens = self.spent
        return seconds / tokens if tokens >= CONSTANTS.rate_tokens else None

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

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """A catch-up forward over ``tokens`` unseen tokens that took ``seconds``: time the
        category spent, for no token of its own (the fit is the pair's cost table's)."""
        if tokens <= 0 or not seconds == seconds or seconds <= 0:
            return
        with self._lock:
            self.spent[0] += float(seconds)
            self._version += 1

    def observe_match(self, matched: bool, *, proposer: str) -> None:
        """A decision point: did the lookup ``proposer`` have a match there?"""
        with self._lock:
            points = (self.by_proposer.get(proposer) or self._of(proposer)).match_points
            points[0] *= self.discount
            points[1] *= self.discount
            points[1 if matched else 0] += 1
            self._version += 1

    def unmatched_share(self, proposer: str) -> float:
        """The share of decision points without a match of the lookup ``proposer``
        (``CONSTANTS.unmatched_prior`` points without one to start)."""
        prior = CONSTANTS.unmatched_prior
        with self._lock:
            got = self.by_proposer.get(proposer)
            without, with_ = got.match_points if got is not None else (0.0, 0.0)
        return (without + prior) / (without + with_ + prior)

    def observe_lookup(self, proposer: str, k: int, accepted: int, lookup_s: float,
                       target_s: float, *, match: int = 0) -> None:
        """One iteration drafted by a lookup proposer: its acceptance counts, pooled and
        under its match length (``match``, 0: unknown), and its time (its host time and the
        target's) into the rate."""
        with self._lock:
            self._count_lookup(proposer, k, accepted, match)
            self.iterations += 1
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
        acc = self.by_proposer.get(proposer) or self._of(proposer)
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
            acc = self.by_proposer.get(proposer) or self._of(proposer)
            if 0 <= depth < len(acc.reached):
                acc.reached[depth] += 1
                acc.accepted[depth] += min(1.0, max(0.0, float(value)))
                acc.version += 1
                self._version += 1

    def observe_confidence(self, proposer: str, pairs: Sequence[tuple[int, float]]) -> None:
        """Tokens a model proposer proposed on the target's prefix: (its confidence byte, the
        token's acceptance) each, counted in the token's confidence bin
        (``policies.stopping``) with the acceptance counts' discount per call."""
        if not pairs:
            return
        with self._lock:
            acc = self.by_proposer.get(proposer) or self._of(proposer)
            hits, seen = acc.by_confidence
            d = self.discount
            if d < 1:
                for i in range(BINS):
                    hits[i] *= d
                    seen[i] *= d
            for c, value in pairs:
                b = bin_of(c)
                hits[b] += min(1.0, max(0.0, float(value)))
                seen[b] += 1.0
            acc.version += 1
            self._version += 1

    def calibration(self, proposer: str) -> tuple[float, ...]:
        """A model proposer's acceptance per confidence bin (``policies.stopping.calibrated``)."""
        with self._lock:
            acc = self.by_proposer.get(proposer)
            counts = acc.by_confidence if acc is not None else ([0.0] * BINS, [0.0] * BINS)
            return calibrated(*counts, prior=CONSTANTS.calibration_prior)

    def seed_from(self, others, weight: float | None = None) -> float:
        """A new category's start from what the pair already knows: every proposer's counts
        (and the model proposer's by confidence) pooled over ``others`` (the pair's other
        categories' statistics) and scaled to at most ``weight`` blocks (``cold_start``), so
        that the category's own evidence outweighs them as it comes in. Returns the most
        blocks seeded for one proposer (0: the others know nothing)."""
        weight = self.params.cold_start if weight is None else weight
        pooled: dict[str, list] = {}  # name → [accepted, reached, (hits, seen) by confidence]
        for other in others:
            if other is self:
                continue
            with other._lock:
                for name, acc in other.by_proposer.items():
                    got = pooled.setdefault(name, [[0.0] * self.positions,
                                                   [0.0] * self.positions,
                                                   [0.0] * BINS, [0.0] * BINS])
                    for into, values in zip(got, (acc.accepted, acc.reached,
                                                  *acc.by_confidence)):
                        for i, v in enumerate(values[:len(into)]):
                            into[i] += v
        most = 0.0
        with self._lock:
            for name, (accepted, reached, hits, seen) in pooled.items():
                if reached[0] <= 0 or weight <= 0:
                    continue
                scale = min(1.0, weight / reached[0])
                acc = self.by_proposer.get(name) or self._of(name)
                for i in range(min(len(acc.reached), len(reached))):
                    acc.accepted[i] += scale * accepted[i]
                    acc.reached[i] += scale * reached[i]
                for i in range(BINS):
                    acc.by_confidence[0][i] += scale * hits[i]
                    acc.by_confidence[1][i] += scale * seen[i]
                acc.blocks += scale * reached[0]
                acc.version += 1
                most = max(most, scale * reached[0])
            self._version += 1
        return most

    def warm_start(self, per_proposer: Mapping[str, tuple[Sequence[float], Sequence[float]]],
                   *, weight: float | None = None,
                   bandwidth_utilisation: float | None = None) -> None:
        """Seed from stored history: per proposer by name, vLLM-style cumulative counts per
        position (accepted, drafted; lookups' pooled over match lengths), scaled to at most
        ``weight`` blocks (the pair's costs warm its ``CostTable``)."""
        weight = self.params.stored_weight if weight is None else weight
        with self._lock:
            for name, (accepted_pp, drafted_pp) in per_proposer.items():
                acc = self.by_proposer.get(name) or self._of(name)
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

    def curve(self, proposer: str, k_max: int, *, match: int = 0) -> list[float]:
        """Posterior means of a proposer's acceptance at positions 0 … k_max−1: position 0 is Beta(prior) updated by its counts;
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
                posts = self._posteriors(k_max, accepted, reached, spread=False)
            else:
                pooled = self._posteriors(1, accepted, reached, spread=False)[0][0]
                # position 0's estimate after a match in each bucket seen (else the pooled one)
                firsts = {b: self._posteriors(1, a, r, centres=[pooled], spread=False)[0][0]
                          for b, (a, r) in acc.by_match.items()}
                a_, r_ = acc.by_match.get(match_bucket(match), ((), ()))
                # position 0: the pooled prior (its own counts are then added, once)
                centres = [pooled] + [firsts.get(match_bucket(match + i), pooled)
                                      for i in range(1, k_max)]
                posts = self._posteriors(k_max, a_, r_, centres=centres, spread=False)
        return [mean for mean, _ in posts]

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

    def copy(self) -> LiveStats:
        """An independent copy."""
        new = LiveStats(discount=self.discount, prior=self.prior, max_positions=self.positions,
                        params=self.params)
        with self._lock:
            new.by_proposer = {n: acc.copy() for n, acc in self.by_proposer.items()}
            new.spent, new.iterations = list(self.spent), self.iterations
            new.bandwidth_utilisation = self.bandwidth_utilisation
            new.lengths.extend(self.lengths)
        return new
