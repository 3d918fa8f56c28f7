"""Replaying acceptance traces: what another k (or policy) would have seen, without models.

A greedy trace holds, per generated position, whether the draft's argmax continuing from the
target's own prefix matched the target's token. Because the output does not depend on k, the
accepted length of a block of k starting at position g is the run of 1s in trace[g : g+k]:
replay is exact. A sampled trace holds β per position (the acceptance probability); replay
gives expectations: E[accepted] = Σ_i Π_{j≤i} β_j.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from autospec.store.records import UNOBSERVED

__all__ = ["replay_greedy", "expected_accepted"]


def replay_greedy(trace: bytes | Sequence[int], k: int | Callable[[int], int],
                  max_new_tokens: int | None = None) -> list[int]:
    """Accepted count per iteration when blocks of k (or k(g) at generated position g) run
    over this request. Stops at the first block that reaches an unobserved position."""
    choose = k if callable(k) else (lambda g, _k=k: _k)
    total = len(trace) if max_new_tokens is None else min(max_new_tokens, len(trace))
    accepted: list[int] = []
    g = 0
    while g < total:
        kk = max(0, min(int(choose(g)), total - g - 1))
        m = 0
        while m < kk and trace[g + m] == 1:
            m += 1
        if m < kk and trace[g + m] == UNOBSERVED:
            break  # the block's outcome is unknown past here
        accepted.append(m)
        g += m + 1
    return accepted


def expected_accepted(betas: Sequence[float], k: int) -> float:
    """E[accepted] for a block of k with per-position acceptance probabilities betas."""
    total, run = 0.0, 1.0
    for b in betas[:k]:
        run *= b
        total += run
    return total
