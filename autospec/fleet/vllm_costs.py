"""What vLLM's steps cost, learned in the server: the seconds between two calls of the
``custom_class`` proposer (vLLM's scheduler, the target's forward over every running request's
token and draft, sampling, bookkeeping), per batch size B and total draft tokens D scored in
the step. vLLM packs a step's drafts flat (ragged, no padding), so D — not the longest draft —
is the width a step runs at.

Per batch size the cost is a line T_B(D) = a_B · (1 + s_B · D) fitted to the medians of the
(B, D) cells measured (each cell the latest ``window`` steps); s_B, a draft token's share of a
plain step, is what the choice of k reads (the level a_B cancels in one step's decision). A
batch size with fewer than two cells borrows s from the nearest one that has them, else the
prior: optimistic, so that speculation is tried and the line measured. Plain steps (D = 0)
anchor the line: a batch size that has speculated ``probe_every`` steps without a settled
plain cell runs the next one plain. No torch, no vLLM; thread-safe is not needed (vLLM calls
the proposer from one thread).
"""

from __future__ import annotations

import statistics
from collections import deque

__all__ = ["StepCosts"]


class StepCosts:
    """Step seconds per (batch size, total draft tokens), and the relative line per B."""

    def __init__(self, *, prior_slope: float = 0.05, window: int = 32, settle: int = 3,
                 probe_every: int = 16):
        self.prior_slope, self.window, self.settle = prior_slope, window, settle
        self.probe_every = probe_every
        self.cells: dict[tuple[int, int], deque[float]] = {}
        self._fits: dict[int, tuple[float, float] | None] = {}  # B → (a, s); None: unfit
        self._since_plain: dict[int, int] = {}  # B → speculative steps since a plain one

    def observe(self, batch: int, drafted: int, seconds: float) -> None:
        """One step of ``batch`` requests scoring ``drafted`` draft tokens took ``seconds``."""
        if not (seconds > 0 and seconds < 3600):  # NaN, negative, a stall: not a step
            return
        cell = self.cells.get((batch, drafted))
        if cell is None:
            cell = self.cells[(batch, drafted)] = deque(maxlen=self.window)
        cell.append(float(seconds))
        self._fits.pop(batch, None)

    def medians(self, batch: int) -> dict[int, float]:
        """D → median seconds of the settled cells (at least ``settle`` steps) at ``batch``."""
        return {d: statistics.median(v) for (b, d), v in self.cells.items()
                if b == batch and len(v) >= self.settle}

    def _fit(self, batch: int) -> tuple[float, float] | None:
        if batch not in self._fits:
            pts = sorted(self.medians(batch).items())
            fit = None
            if len(pts) >= 2:  # least squares over the cells' medians, slope clipped at 0
                mx = sum(d for d, _ in pts) / len(pts)
                my = sum(t for _, t in pts) / len(pts)
                sxx = sum((d - mx) ** 2 for d, _ in pts)
                slope = max(0.0, sum((d - mx) * (t - my) for d, t in pts) / sxx)
                a = my - slope * mx
                if a > 0:
                    fit = (a, slope / a)
            self._fits[batch] = fit
        return self._fits[batch]

    def slope(self, batch: int) -> tuple[float, str]:
        """(s_B: a draft token's cost as a share of a plain step at ``batch``, where from:
        "measured", "B=<n>" (borrowed from the nearest measured batch size) or "prior")."""
        fit = self._fit(batch)
        if fit is not None:
            return fit[1], "measured"
        known = sorted({b for b, _ in self.cells}, key=lambda b: (abs(b - batch), b))
        for b in known:
            other = self._fit(b)
            if other is not None:
                return other[1], f"B={b}"
        return self.prior_slope, "prior"

    def seconds(self, batch: int, drafted: int) -> float | None:
        """The fitted step seconds at (batch, drafted); None where B has no line."""
        fit = self._fit(batch)
        return None if fit is None else fit[0] * (1 + fit[1] * drafted)

    def wants_plain(self, batch: int) -> bool:
        """Whether the next step at ``batch`` should run plain to anchor its line: it has
        speculated ``probe_every`` steps since its last plain step and has no settled plain
        cell."""
        cell = self.cells.get((batch, 0))
        if cell is not None and len(cell) >= self.settle:
            return False
        return self._since_plain.get(batch, 0) >= self.probe_every

    def ran(self, batch: int, drafted: int) -> None:
        """A step was decided at ``batch`` with ``drafted`` draft tokens (for ``wants_plain``)."""
        self._since_plain[batch] = 0 if drafted == 0 else self._since_plain.get(batch, 0) + 1

    def table(self) -> dict[str, float]:
        """"B,D" → median seconds of every settled cell (for logs and tests)."""
        return {f"{b},{d}": statistics.median(v) for (b, d), v in sorted(self.cells.items())
                if len(v) >= self.settle}
