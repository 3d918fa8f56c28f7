"""Plain-text tables and numbers for people reading a terminal (the CLI's output only)."""

from __future__ import annotations

__all__ = ["table", "fmt", "human_bytes"]


def fmt(x, spec: str) -> str:
    return "-" if x is None or x != x else format(x, spec)  # x != x: NaN


def human_bytes(n: float | None, per_s: bool = False) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}{'/s' if per_s else ''}"
        n /= 1000
    return "-"


def table(header: list[str], rows: list[list[str]], left: int = 1) -> str:
    """Fixed-width columns: the first ``left`` left-aligned, the rest right-aligned, with a
    rule under the header."""
    cells = [header, *rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i < left else c.rjust(w)
                       for i, (c, w) in enumerate(zip(cell, widths, strict=True))).rstrip()
             for cell in cells]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(lines)
