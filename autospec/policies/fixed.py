"""Fixed lookahead: always k (k = 0 is plain decoding, "off"), from one proposer."""

from __future__ import annotations

from dataclasses import dataclass

from .base import HYBRID, Choice, Context, Outcome, check_k


@dataclass(frozen=True)
class FixedK:
    """k (0 … ``K_LIMIT``) from ``proposer`` every iteration: None (the model proposer, the
    draft model, as a plain int), a registered proposer's name (rows whose match has at least
    ``min_match`` tokens; the others decode plainly) or "hybrid" (prompt lookup where it
    matches at least ``min_match`` tokens, else the model)."""

    k: int
    proposer: str | None = None
    min_match: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "k", check_k(self.k))  # 0 … K_LIMIT, one limit everywhere
        if self.proposer is not None:
            Choice(0, self.proposer, self.min_match)  # validates proposer and min_match

    @property
    def name(self) -> str:
        if self.k == 0:
            return "off"
        if self.proposer is None:
            return f"fixed:{self.k}"
        if self.proposer == HYBRID or self.min_match != 1:
            return f"{self.proposer}:{self.k}:{self.min_match}"
        return f"{self.proposer}:{self.k}"

    def choose(self, context: Context) -> int:
        k = min(self.k, context.k_max)
        return k if self.proposer is None else Choice(k, self.proposer, self.min_match)

    def update(self, context: Context, k: int, outcome: Outcome) -> None:
        return None
