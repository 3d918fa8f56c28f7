"""transformers' assisted-generation schedule, kept for comparison: +2 after a fully accepted
block (at batch > 1: every row accepted all k), −1 (not below 1) otherwise. Its state persists
across requests, as in transformers, but lives here rather than in the model's config."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from .base import Context, Outcome


@dataclass
class Heuristic:
    start: int = 20
    name: str = "heuristic"
    _k: dict[str, int] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def choose(self, context: Context) -> int:
        with self._lock:
            return min(self._k.get(context.category, self.start), context.k_max)

    def update(self, context: Context, k: int, outcome: Outcome) -> None:
        if k == 0:
            return
        rows = getattr(outcome, "accepted_rows", ()) or ()
        full = (min(rows) if rows else outcome.accepted) == k
        with self._lock:
            cur = self._k.get(context.category, self.start)
            self._k[context.category] = cur + 2 if full else max(1, cur - 1)
