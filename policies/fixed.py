"""Fixed lookahead: always k (k = 0 is plain decoding, "off")."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Context, Outcome


@dataclass(frozen=True)
class FixedK:
    k: int

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError(f"k must be >= 0, got {self.k}")

    @property
    def name(self) -> str:
        return "off" if self.k == 0 else f"fixed:{self.k}"

    def choose(self, context: Context) -> int:
        return min(self.k, context.k_max)

    def update(self, context: Context, k: int, outcome: Outcome) -> None:
        return None
