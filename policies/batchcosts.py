"""The batch grid's former reader, kept as a name for ``autospec.report`` until it reads the
pair's cost table (``autospec.costs.table.CostTable``, which holds every cost now): T_t(B, n)
and T_d(B) of one grid, read as replay reads it (the grid as it is, interpolated across batch
sizes). No torch.
"""

from __future__ import annotations

from autospec.costs.table import CostTable

__all__ = ["BatchCosts"]


class BatchCosts:
    """One grid in a ``CostTable`` that is not live: ``warm`` it, read ``target_points``,
    ``target_cost`` and ``draft_cost`` at any batch size."""

    def __init__(self):
        self.table = CostTable(live=False)

    def warm(self, target, draft) -> None:
        self.table.warm_grid(None, target, draft)

    def target_points(self, batch: int) -> dict[int, float]:
        return self.table.target_points(None, batch)

    def target_cost(self, batch: int, *, optimistic: bool = True):
        return self.table.target_cost(None, batch, optimistic=optimistic)

    def draft_cost(self, batch: int) -> float | None:
        return self.table.draft_cost(None, batch)
