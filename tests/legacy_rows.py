"""What a store written before schema 0011 holds: a request's and a category's per-proposer
counters, traces and settings as the columns of their own rows (``requests.drafts`` …
``suffix_trace``, ``category_stats.drafts`` … ``ngram_lookup_s``), built from a record of this
code. The tests that create an older schema write these rows into it and migrate up."""

from __future__ import annotations

from typing import Any

from autospec.store.record import RequestRecord
from autospec.traces import UNOBSERVED

CODES = {"draft": 0, "ngram": 1, "suffix": 2}  # 0010's proposer_schedule bytes
LOOKUPS = ("ngram", "suffix")


def _lookup(p) -> dict[str, Any]:
    return {**(p.settings or {}), "drafts": p.blocks, "drafted": p.proposed,
            "accepted": p.accepted, "accepted_per_position": list(p.accepted_per_position),
            "drafted_per_position": list(p.proposed_per_position), "lookup_s": p.seconds}


def request_row_0010(rec: RequestRecord, pair_id: int) -> dict[str, Any]:
    """The ``requests`` row schema 0010 kept of ``rec`` (a validated record: traces as
    bytes)."""
    from autospec.store.write import _request_row

    row = _request_row(rec, pair_id)
    row.pop("batch_id")
    row.pop("max_new_tokens")  # 0012
    d = rec.proposers.get("draft")
    row.update(drafts=d.blocks if d else 0, drafted=d.proposed if d else 0,
               accepted=d.accepted if d else 0,
               accepted_per_position=list(d.accepted_per_position) if d else [],
               drafted_per_position=list(d.proposed_per_position) if d else [],
               trace=d.trace if d and d.trace is not None else bytes([UNOBSERVED]) *
               rec.new_tokens,
               confidence=d.confidence if d else None)
    for name in LOOKUPS:
        p = rec.proposers.get(name)
        row[name] = _lookup(p) if p is not None else None
        row[f"{name}_trace"] = p.trace if p is not None else None
    row["proposer_schedule"] = (None if rec.proposer_schedule is None else
                                bytes(CODES.get(n, 0) for n in rec.proposer_schedule))
    return row


def stats_columns_0010(records) -> dict[str, Any]:
    """The per-proposer columns of the ``category_stats`` row schema 0010 folded
    ``records`` into (the draft model's sums, prompt lookup's ``ngram_*``)."""
    out: dict[str, Any] = dict(drafts=0, drafted=0, accepted=0, ngram_drafts=0,
                               ngram_drafted=0, ngram_accepted=0, ngram_lookup_s=0.0)
    lists = {n: [] for n in ("accepted_per_position", "drafted_per_position",
                             "ngram_accepted_per_position", "ngram_drafted_per_position")}

    def add(name: str, values) -> None:
        have = lists[name]
        have.extend([0] * (len(values) - len(have)))
        for i, v in enumerate(values):
            have[i] += v

    for rec in records:
        for prefix, name in (("", "draft"), ("ngram_", "ngram")):
            p = rec.proposers.get(name)
            if p is None:
                continue
            out[f"{prefix}drafts"] += p.blocks
            out[f"{prefix}drafted"] += p.proposed
            out[f"{prefix}accepted"] += p.accepted
            add(f"{prefix}accepted_per_position", p.accepted_per_position)
            add(f"{prefix}drafted_per_position", p.proposed_per_position)
            if prefix:
                out["ngram_lookup_s"] += p.seconds
    out.update(lists)
    if not out["ngram_drafted_per_position"] and not out["ngram_drafts"]:
        out["ngram_accepted_per_position"] = out["ngram_drafted_per_position"] = None
    return out
