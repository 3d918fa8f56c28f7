"""The pair's batch cost grid, T_t(B, n) and T_d(B), as every reader of the store sees it
(through ``stored.stored_costs``): the live controller's warm start, ``autospec tune``'s
replay, ``autospec report`` and ``autospec stats``, so that what the report predicts, what
tune replays and what a new process starts from are the same numbers.

The grid is the latest probe's shape at the level the loop's own forwards measured
(``at_live_level``): a probe times cached contexts of one length in every row, which can sit
well above or below what the traffic's rows cost.
"""

from __future__ import annotations

from autospec.costs import MIN_FORWARDS
from autospec.costs.rules import shape_guard, usable
from autospec.costs.table import grid_draft, grid_points

__all__ = ["MIN_FORWARDS", "at_live_level", "batch_grid"]


def at_live_level(target: dict[int, dict[int, float]], draft: dict[int, float], source: str,
                  live_target: dict[int, dict[int, float]], live_draft: dict[int, float]
                  ) -> tuple[dict[int, dict[int, float]], dict[int, float], str]:
    """A probe's grid read as the live cost model reads it: the probe gives the shape, the
    loop's own forwards (the store's live medians) the level — live points replace the probe's
    at their (B, n), the rest is scaled by live/probe at the nearest batch size measured
    (``table.grid_points``; a live point below the shape floor of its batch size's T_t(B, 1)
    held out). Other sources, and a probe without live points, come back as they are."""
    live_t = {b: ns for b, ns in live_target.items() if b > 1}  # batch 1 stays the probe's:
    live_d = {b: t for b, t in live_draft.items() if b > 1}  # its curve is batch-1 requests'
    if source != "probe" or not (live_t or live_d):
        return target, draft, source
    warm_t = {int(b): {int(n): float(t) for n, t in ns.items() if usable(t)}
              for b, ns in target.items()}
    warm_d = {int(b): float(t) for b, t in draft.items() if usable(t)}
    live_t = {b: shape_guard({n: t for n, t in ns.items() if usable(t)})
              for b, ns in live_t.items()}
    live_d = {b: t for b, t in live_d.items() if usable(t)}
    sizes = sorted({b for b in target if b > 1} | set(live_t))
    out_t = {**({1: dict(target[1])} if 1 in target else {}),
             **{b: dict(sorted(grid_points(warm_t, live_t, b).items())) for b in sizes}}
    out_d = {**({1: draft[1]} if 1 in draft else {}),
             **{b: d for b in sizes if (d := grid_draft(warm_d, live_d, b)) is not None}}
    measured = ", ".join(map(str, sorted(set(live_t) | set(live_d))))
    return out_t, out_d, f"probe at the live level (live/probe per n, batch sizes {measured})"


def batch_grid(session, pair_id: int, *, min_forwards: int = MIN_FORWARDS):
    """(T_t(B, n), T_d(B), source) for a pair: ``queries.batch_costs`` read ``at_live_level``
    of the store's live medians (``queries.live_batch_grid``)."""
    from autospec.store import queries

    return at_live_level(*queries.batch_costs(session, pair_id, min_forwards=min_forwards),
                         *queries.live_batch_grid(session, pair_id, min_forwards=min_forwards))
