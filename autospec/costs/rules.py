"""The pure rules a cost table's rows apply (``row.CostRow``) and every reader of stored
costs shares: what is a usable timing, the shape guard, the scatter of recent timings, and
the draft model's catch-up fit C(g) = a + b·g. No torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .measure import MEASURE

__all__ = ["usable", "shape_guard", "spread", "catch_up_sums", "catch_up_line"]


def usable(x) -> bool:
    """A timing that can be a cost point: a positive finite number (NaN, None, ≤ 0 and
    infinity are unread or broken)."""
    try:
        return x is not None and 0 < float(x) < float("inf")
    except (TypeError, ValueError):
        return False


def shape_guard(curve: Mapping[int, float], floor: float = MEASURE.shape_floor
                ) -> dict[int, float]:
    """``curve`` (n → T_t(n)) without the points n > 1 below ``floor`` · T_t(1), a shape no
    machine shows (timings from different loads); held out, not clamped. Without T_t(1) the
    curve is returned as it is."""
    pts = {int(n): float(t) for n, t in curve.items() if t is not None}
    t1 = pts.get(1)
    if not t1 or t1 <= 0:
        return pts
    return {n: t for n, t in pts.items() if n == 1 or t >= floor * t1}


def spread(samples: Sequence[float]) -> float:
    """Relative spread of timings: interquartile range over the median (0 below 3 samples)."""
    if len(samples) < 3:
        return 0.0
    q1, q2, q3 = _quartiles(sorted(samples))
    return (q3 - q1) / q2 if q2 > 0 else 0.0


def _quartiles(data: Sequence[float]) -> tuple[float, float, float]:
    """The quartiles of sorted ``data`` (at least 2 values), as
    ``statistics.quantiles(data, n=4, method="inclusive")`` computes them, faster."""
    m = len(data) - 1
    a, b, c = m // 4, m // 2, 3 * m // 4
    da, db, dc = m % 4, 2 * m % 4, 3 * m % 4
    return ((data[a] * (4 - da) + data[a + 1] * da) / 4,
            (data[b] * (4 - db) + data[b + 1] * db) / 4,
            (data[c] * (4 - dc) + data[c + 1] * dc) / 4)


def catch_up_sums(points, discount: float = 1.0, sums: Sequence[float] | None = None
                  ) -> list[float]:
    """The fit's sums (Σ1, Σg, Σg², ΣC, Σg·C) over catch-ups ``points`` ((tokens, seconds),
    oldest first, discounted by ``discount`` each) added to ``sums``; unusable pairs skipped."""
    out = list(sums) if sums is not None else [0.0] * 5
    for g, c in points:
        g, c = float(g), float(c)
        if g <= 0 or not c == c or c <= 0:
            continue
        for i, v in enumerate((1.0, g, g * g, c, g * c)):
            out[i] = out[i] * discount + v
    return out


def catch_up_line(sums: Sequence[float], spread_share: float = MEASURE.catch_up_spread
                  ) -> tuple[float, float] | None:
    """(a, b) of the catch-up cost C(g) = a + b·g fitted to ``sums``: least squares where the
    sizes vary, else proportional to the mean (a = 0); None with no catch-up."""
    n, sg, sgg, sc, sgc = sums
    if n <= 0:
        return None
    mean_g, mean_c = sg / n, sc / n
    var = sgg / n - mean_g * mean_g
    if var > (spread_share * mean_g) ** 2 and n >= 2:
        b = max(0.0, (sgc / n - mean_g * mean_c) / var)
        return max(0.0, mean_c - b * mean_g), b
    return 0.0, mean_c / mean_g
