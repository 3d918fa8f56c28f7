"""Thompson sampling over k ∈ {0 … k_max}, rewarded in tokens per second of wall time: an
iteration's (accepted + 1) / (draft + target seconds), so the draft's own cost counts and k = 0
is an arm like any other. Statistics are discounted by ``discount`` per update, so an arm out
of favour regains uncertainty as the traffic drifts. Arms are kept per (category, batch-size
bucket); a batch of several categories is its own ("a+b"), rewarded in all its rows' tokens.
Randomness comes from its own seeded ``random.Random``.
"""

from __future__ import annotations

import math
import random
import threading
from dataclasses import dataclass, field

from autospec.traces import batch_bucket

__all__ = ["ThompsonBandit"]


@dataclass
class _Arm:
    n: float = 0.0  # discounted pulls
    total: float = 0.0  # discounted reward sum
    squares: float = 0.0  # discounted reward² sum


@dataclass
class ThompsonBandit:
    k_max: int = 8
    discount: float = 0.998
    seed: int | None = 0
    min_std_fraction: float = 0.05  # floor on the reward's spread, as a fraction of its mean
    name: str = "bandit"
    _arms: dict[tuple[str, int], list[_Arm]] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.discount <= 1:
            raise ValueError("discount must be in (0, 1]")
        self._rng = random.Random(self.seed)

    def _for(self, context) -> list[_Arm]:
        key = _key(context)
        arms = self._arms.get(key)
        if arms is None:
            arms = self._arms[key] = [_Arm() for _ in range(self.k_max + 1)]
        return arms

    def choose(self, context) -> int:
        top = min(self.k_max, context.k_max)
        with self._lock:
            arms = self._for(context)[: top + 1]
            untried = [k for k, a in enumerate(arms) if a.n < 0.5]
            if untried:  # every arm once, cheapest first
                return untried[0]
            best, best_draw = 0, -math.inf
            means = [a.total / a.n for a in arms]
            scale = max(means) if means else 1.0
            for k, (a, mean) in enumerate(zip(arms, means)):
                var = max(a.squares / a.n - mean * mean, 0.0)
                std = max(math.sqrt(var), self.min_std_fraction * scale)
                draw = self._rng.gauss(mean, std / math.sqrt(a.n))
                if draw > best_draw:
                    best, best_draw = k, draw
            return best

    def update(self, context, k: int, outcome) -> None:
        seconds = (outcome.draft_time_s or 0.0) + outcome.target_time_s
        if not seconds > 0 or k > self.k_max:  # NaN (prefill, unread timings) or out of range
            return
        rows = getattr(outcome, "accepted_rows", ()) or ()
        tokens = sum(rows) + len(rows) if rows else outcome.accepted + 1
        reward = tokens / seconds
        with self._lock:
            arms = self._for(context)
            if self.discount < 1:
                for a in arms:
                    a.n *= self.discount
                    a.total *= self.discount
                    a.squares *= self.discount
            a = arms[k]
            a.n += 1
            a.total += reward
            a.squares += reward * reward


def _key(context) -> tuple[str, int]:
    """(category, batch-size bucket) the arms are kept by."""
    cats = getattr(context, "categories", ()) or ()
    category = "+".join(sorted(set(cats))) if cats else context.category
    return category, batch_bucket(getattr(context, "batch_size", 1))
