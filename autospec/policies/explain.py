"""Why a policy chose its k: the decision record (torch-free, JSON-ready).

A policy that is asked why (``Context.why`` is a list) appends one record per decision,
built by ``record`` from ``plain`` and ``candidate``; the format ("why/1", every field) is in
docs/policy.md, "The record's format".
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["FORMAT", "RULES", "SOURCES", "candidate", "plain", "record"]

FORMAT = "why/1"

# what decided the k, as ``record["rule"]`` names it
RULES = {
    "best": "of the blocks that pay (S ≥ 1 + min_gain), the one that saves the most seconds",
    "off": "no candidate paid by min_gain: a plain step",
    "baseline": "T_t(1) not measured yet: a plain step measures it",
    "explore": "the draft model's costs, or its acceptance on a row's category, not measured "
               "yet: its block with what is missing at its bound (T_d free, a thin category's "
               "acceptance perfect), at initial_k",
    # retired rules, kept so that records an earlier version stored still read
    "trial": "(an earlier version's) the draft model was never tried on this category: its "
             "block at perfect acceptance",
    "reprobe": "(an earlier version's) the draft model unused for a while: its block at "
               "perfect acceptance",
    "no-stats": "no statistics for this category: a block at initial_k",
    "policy": "a policy that records no reasons (fixed, table, bandit, …): its answer",
}

# where a candidate's acceptance came from
SOURCES = ("live", "forecast", "prior", "request", "shared", "perfect")


def candidate(proposer: str, k: int, *, tokens: float, block_s: float, extra_s: float = 0.0,
              speedup: float, saved_s: float | None = None, induced_s: float = 0.0,
              acceptance: Sequence[float] = (), acceptance_from: str = "live",
              t_propose: float = 0.0, t_verify: float = 0.0,
              costs_from: str = "live") -> dict:
    """One priced block, with its expected seconds per emitted token."""
    tokens = float(tokens)
    spt = (block_s + tokens * extra_s) / tokens if tokens > 0 else float("inf")
    return {"proposer": proposer, "k": int(k), "tokens": tokens, "block_s": float(block_s),
            "extra_s": float(extra_s), "spt": spt, "speedup": float(speedup),
            "saved_s": None if saved_s is None else float(saved_s),
            "induced_s": float(induced_s),
            "acceptance": [float(a) for a in list(acceptance)[:k]],
            "acceptance_from": acceptance_from, "t_propose": float(t_propose),
            "t_verify": float(t_verify), "costs_from": costs_from}


def plain(t_plain: float, costs_from: str = "live", rows: int = 1) -> dict:
    """Plain decoding as a candidate: a token per row (``rows``) for T_t(1)."""
    return candidate("plain", 0, tokens=float(rows), block_s=t_plain, speedup=1.0,
                     saved_s=0.0, t_verify=t_plain, costs_from=costs_from)


def record(k, rule: str, candidates: Sequence[dict] = (), *, batch: int = 1,
           t_plain: float | None = None, value: float | None = None, min_gain: float = 0.0,
           busy: bool = False, model: str | None = None, stop: dict | None = None) -> dict:
    """The decision record of one choice (``k`` an int, the ``model`` proposer's, or a
    ``Choice``); ``stop``: where its block stops before k (the ``StopRule``: per confidence
    bin the acceptance, per position the bar, and the block's cap and a token's worth)."""
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}: one of {sorted(RULES)}")
    proposer = getattr(k, "proposer", None) or model or "model"
    return {"format": FORMAT, "k": int(k), "proposer": proposer if int(k) else "plain",
            "rule": rule, "batch": int(batch), "t_plain": t_plain, "value": value,
            "min_gain": float(min_gain), "busy": bool(busy), "candidates": list(candidates),
            "stop": stop}
