"""A pair's costs as the store holds them, built by ONE function (``stored_costs``) for every
reader: the live controller's warm start, ``autospec tune``'s replay, ``autospec report``
(and ``autospec export``, which exports the report's plan) and ``autospec stats``. What the
report predicts, what tune replays and what a new process starts from are the same numbers.

Batch 1's T_t(n) and T_d come from ONE execution path and ONE source (``batch_one``): the
latest ``autospec probe`` of that path, else the live means that rest on ≥ ``MIN_FORWARDS``
forwards, through the shape guard — the pair's (``pair_costs``: every category's requests on
that path pooled), whichever category asks: costs are the pair's, acceptance the category's. Beside them: the draft model's catch-up
(``queries.catch_up_source``), the lookup proposers' host seconds per proposed token and the
batch grid T_t(B, n), T_d(B) (``grid.batch_grid``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import autospec.costs
from autospec.costs import MIN_FORWARDS

__all__ = ["MIN_FORWARDS", "PARTS", "SERVING", "SOURCES", "BatchOne", "StoredCosts",
           "batch_one", "stored_costs"]

SOURCES = ("auto", "probe", "live")
# what ``stored_costs`` can read; a reader asks for the parts it uses
PARTS = frozenset({"batch1", "catch_up", "lookups", "grid"})


class _Serving:
    def __repr__(self) -> str:
        return "SERVING"


SERVING: Any = _Serving()  # ``stored_costs``' default path: the one the traffic ran on


class BatchOne(NamedTuple):
    """Batch 1's costs from one source (``batch_one``)."""

    t_draft: float | None  # T_d per proposed token (None: not measured well enough)
    t_target: dict[int, float]  # n → T_t(n), the points the cost model uses
    held_out: dict[int, float]  # live points the shape guard held out (not in t_target)
    from_probe: bool  # the probe's curve (else the live means)


def batch_one(probe_payload: Mapping | None, live_t_target: Mapping[int, float],
              live_counts: Mapping[int, int], live_t_draft: float | None,
              live_draft_forwards: int, *, min_forwards: int | None = None) -> BatchOne:
    """The rule for batch 1's costs, applied by every reader: the probe's T_t(n) curve and T_d
    where ``probe_payload`` holds one, else the live means (``live_t_target``: n → mean
    seconds over ``live_counts[n]`` forwards; T_d over ``live_draft_forwards``) where each
    rests on at least ``min_forwards`` forwards (None: ``autospec.costs.MIN_FORWARDS``),
    through ``costs.rules.shape_guard``.

    Never a mix: a quiet probe's T_t(1) beside a busy server's T_t(k+1) invents a step in
    the curve. The probe first: it times every n back to back through the loop's own runner,
    whereas live T_t(n) for different n come from different iterations at different load."""
    pl = probe_payload or {}
    curve = {int(n): float(t) for n, t in (pl.get("target_s_by_n") or {}).items()
             if t is not None and float(t) > 0}
    if curve:
        return BatchOne(pl.get("draft_s") or None, dict(sorted(curve.items())), {}, True)
    from autospec.costs.rules import shape_guard

    min_forwards = _forwards(min_forwards)
    curve = {n: t for n, t in sorted(live_t_target.items())
             if t and t > 0 and live_counts.get(n, 0) >= min_forwards}
    guarded = shape_guard(curve)
    held = {n: t for n, t in curve.items() if n not in guarded}
    t_draft = live_t_draft if live_draft_forwards >= min_forwards else None
    return BatchOne(t_draft, guarded, held, False)


@dataclass(frozen=True)
class StoredCosts:
    """One pair's costs on one execution path, as ``stored_costs`` read them. Parts not asked
    for are left empty (their source "not read")."""

    pair_id: int
    path: str | None  # batch 1's execution path (None: none known, or unknown: before 0005)
    # batch 1 (part "batch1"): T_d, T_t(n), where they came from
    t_draft: float | None = None
    t_target: dict[int, float] = field(default_factory=dict)
    source: str = "not read"  # "probe #3 (eager)", "live traffic (eager)", ...
    probe: Any = None  # the ProbeRow batch 1's costs came from (None: live, or none)
    held_out: dict[int, float] = field(default_factory=dict)  # live points the guard held out
    # the draft model's catch-up (part "catch_up"): (tokens, seconds) points, the T_d they
    # stand beside, "logged" / "probe" / "none"
    catch_up: list[tuple[int, float]] = field(default_factory=list)
    catch_up_t_draft: float | None = None
    catch_up_source: str = "not read"
    # each lookup proposer's host seconds per proposed token, by name (part "lookups"; a
    # proposer that never proposed a token is absent)
    t_lookup: dict[str, float] = field(default_factory=dict)
    # batch > 1 (part "grid"): T_t(B, n), T_d(B) on the batched loop's path, and their source
    grid: dict[int, dict[int, float]] = field(default_factory=dict)
    draft_grid: dict[int, float] = field(default_factory=dict)
    grid_source: str = "not read"

    @property
    def from_probe(self) -> bool:
        """Batch 1's costs are a probe's (exempt from the live shape guard)."""
        return self.probe is not None


def _forwards(min_forwards: int | None) -> int:
    return autospec.costs.MIN_FORWARDS if min_forwards is None else int(min_forwards)


def _live(session, pair_id: int, path: str | None, summary=None
          ) -> tuple[dict[int, float], dict[int, int], float | None, int]:
    """The pair's live batch-1 timings on ``path`` (its ``pair_costs`` row: every category's
    requests pooled; ``summary``'s where one was read, which carries the same): (n → mean
    T_t(n), n → forwards, T_d, draft forwards)."""
    if summary is not None:
        sm = summary
        return sm.t_target_s_by_n, sm.target_count_by_n, sm.t_draft_s, sm.draft_forwards
    from autospec.store import queries

    row = queries.path_costs(session, pair_id).get((pair_id, path)) if path else None
    if row is None:
        return {}, {}, None, 0
    seconds = {int(n): float(t) for n, t in (row.target_s_sum_by_n or {}).items()}
    count = {int(n): int(c) for n, c in (row.target_count_by_n or {}).items()}
    forwards = int(row.draft_forwards or 0)
    return ({n: seconds[n] / count[n] for n in sorted(seconds) if count.get(n)}, count,
            row.draft_s / forwards if forwards else None, forwards)


def stored_costs(session, pair_id: int, category: str | None = None, *, path=SERVING,
                 source: str = "auto", min_forwards: int | None = None, summary=None,
                 parts: Collection[str] = PARTS) -> StoredCosts:
    """The pair's costs from the store, for ``category``'s traffic (None: all categories'):

    - ``"batch1"``: T_t(n) and T_d on ONE execution path (``path``: "eager", "static", ...;
      None: requests and probes of unknown path, logged before 0005; default: the path the
      traffic ran on, ``queries.serving_path``) from ONE source (``source``: "probe", the
      latest probe of that path; "live", the means of the pair's traffic on it, every
      category's pooled (``pair_costs``); "auto", the probe if there is one, else live), by
      ``batch_one``. Timings of another path are never read: a
      static-cache step and an eager one measure different things. ``summary``: the
      category's ``queries.CategorySummary`` already read, whose path and live timings are
      then used (the report's and stats' per-workload reads);
    - ``"catch_up"``: the draft model's catch-up on that path (``queries.catch_up_source``:
      logged, else the probe's; any path's where none is known);
    - ``"lookups"``: each lookup proposer's host seconds per proposed token, by name
      (``queries.lookup_seconds_per_token``: the category's proposer rows, or the pair's);
    - ``"grid"``: T_t(B, n), T_d(B) on the batched loop's path: "auto" as every reader sees it
      (``grid.batch_grid``: the probe's shape at the live level), "live" the live medians
      alone (``queries.live_batch_grid``), "probe" the probe's grid alone
      (``queries.batch_costs``; empty where no probe has one).

    ``min_forwards``: the forwards a live point needs, every part following it (None:
    ``autospec.costs.MIN_FORWARDS``, read at the call)."""
    from autospec.costs.grid import batch_grid
    from autospec.store import queries

    if source not in SOURCES:
        raise ValueError(f"cost source must be 'auto', 'probe' or 'live', got {source!r}")
    min_forwards = _forwards(min_forwards)
    unknown = set(parts) - PARTS
    if unknown:
        raise ValueError(f"unknown cost parts {sorted(unknown)}; known: {sorted(PARTS)}")
    out: dict[str, Any] = {}
    if summary is not None:
        path = summary.path
    elif path is SERVING:
        path = (queries.serving_path(session, pair_id, category)
                if {"batch1", "catch_up"} & set(parts) else None)
        if path is None and "batch1" in parts:
            out["source"] = "none (no timings of a known execution path)"
    if "batch1" in parts and "source" not in out:
        probe = queries.latest_probe(session, pair_id, path) if source != "live" else None
        one = batch_one(probe.payload if probe is not None else None, {}, {}, None, 0)
        if one.from_probe:
            out.update(t_draft=one.t_draft, t_target=one.t_target, probe=probe,
                       source=f"probe #{probe.id} ({path})")
        elif source == "probe":
            out["source"] = f"probe (none stored for {path})"
        else:
            one = batch_one(None, *_live(session, pair_id, path, summary),
                            min_forwards=min_forwards)
            held = sorted(one.held_out)
            out.update(t_draft=one.t_draft, t_target=one.t_target, held_out=one.held_out,
                       source=f"live traffic ({path})" if not held else
                       f"live traffic ({path}; n = {held} held out: below the shape floor)")
    if "catch_up" in parts:
        points, t_d, src = queries.catch_up_source(session, pair_id, path=path,
                                                   min_forwards=min_forwards)
        out.update(catch_up=points, catch_up_t_draft=t_d, catch_up_source=src)
    if "lookups" in parts:
        out["t_lookup"] = queries.lookup_seconds_per_token(session, pair_id, category)
    if "grid" in parts:
        if source == "auto":
            out.update(zip(("grid", "draft_grid", "grid_source"),
                           batch_grid(session, pair_id, min_forwards=min_forwards)))
        elif source == "live":
            out.update(zip(("grid", "draft_grid"),
                           queries.live_batch_grid(session, pair_id, min_forwards=min_forwards)))
            out["grid_source"] = "live"
        else:
            grid, draft_grid, src = queries.batch_costs(session, pair_id,
                                                        min_forwards=min_forwards)
            if src != "probe":  # one source, as asked: the probe's grid alone
                grid, draft_grid, src = {}, {}, "none (no probe with a batch grid)"
            out.update(grid=grid, draft_grid=draft_grid, grid_source=src)
    return StoredCosts(pair_id, path, **out)
