"""Tiny inline SVG charts for self-contained HTML reports: bars and lines, no dependencies.

Every function returns one ``<svg>`` element as a string, for inline use in HTML (so no
``xmlns``); all text is escaped, nothing is fetched (no fonts, scripts or stylesheets:
styling is in attributes). Values may be None (a gap: no bar, a break in the line).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape

__all__ = ["Series", "Marker", "bar_chart", "line_chart", "placeholder", "PALETTE",
           "text_width", "FONT_SIZE"]

PALETTE = ("#3366cc", "#dc3912", "#109618", "#ff9900", "#990099", "#0099c6")
FONT_SIZE = 11
_FONT = f'font-family="sans-serif" font-size="{FONT_SIZE}"'
_EM = 0.64  # a generous mean advance of a character in em (DejaVu Sans digits: 0.636)


def text_width(text: str, size: float = FONT_SIZE) -> float:
    """Estimated width in px of ``text`` at ``size`` px (no font metrics here): enough to
    keep labels inside the picture."""
    return _EM * size * len(text)


def _anchored(x: float, label: str, lo: float, hi: float, size: float = FONT_SIZE
              ) -> tuple[float, str]:
    """(x, text-anchor) for a label centred on x, moved to start at ``lo`` or end at ``hi``
    where centring would put part of it outside [lo, hi]."""
    half = text_width(label, size) / 2
    if x - half < lo:
        return lo, "start"
    if x + half > hi:
        return hi, "end"
    return x, "middle"
_M_LEFT, _M_RIGHT, _M_TOP, _M_BOTTOM = 48, 14, 26, 40


@dataclass(frozen=True)
class Series:
    name: str
    points: Sequence[tuple[float, float | None]]  # (x, y); y None breaks the line
    color: str = PALETTE[0]
    dashed: bool = False
    dots: bool = True
    stroke: float = 1.8  # line width
    labels: Sequence[str] | None = None  # written above each point (same order), or None
    marker: str = "circle"  # the points' shape: circle, square or diamond
    intervals: Sequence[tuple[float, float] | None] | None = None  # whiskers, per point
    hollow: Sequence[bool] | None = None  # per point: drawn as an outline only (weak points)
    line: bool = True  # join the points


@dataclass(frozen=True)
class Marker:
    x: float
    y: float
    label: str
    color: str = PALETTE[1]


def _t(s: object) -> str:
    return escape(str(s), quote=True)


def _n(v: float) -> str:
    return f"{v:.1f}"


def nice_max(v: float) -> float:
    """A round upper bound ≥ v whose quarters (the y axis' gridlines) are round too:
    1, 1.2, 1.6, 2, 3, 4, 6, 8 × 10^n (quarters 0.25, 0.3, 0.4, 0.5, 0.75, 1, 1.5, 2)."""
    if v <= 0 or not math.isfinite(v):
        return 1.0
    e = 10 ** math.floor(math.log10(v))
    for m in (1, 1.2, 1.6, 2, 3, 4, 6, 8, 10):
        if m * e >= v * (1 - 1e-9):
            return m * e
    return 10 * e


_nice_max = nice_max


def _frame(width: int, height: int, title: str, y_label: str, x_label: str) -> list[str]:
    out = [f'<svg width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{_t(title)}">',
           f'<title>{_t(title)}</title>',
           f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
           f'<text x="{width / 2:.1f}" y="15" text-anchor="middle" {_FONT} '
           f'font-weight="bold">{_t(title)}</text>']
    if y_label:
        out.append(f'<text x="11" y="{height / 2:.1f}" text-anchor="middle" {_FONT} '
                   f'transform="rotate(-90 11 {height / 2:.1f})">{_t(y_label)}</text>')
    if x_label:
        x, anchor = _anchored((width + _M_LEFT) / 2, x_label, 2, width - 2)
        out.append(f'<text x="{x:.1f}" y="{height - 4}" '
                   f'text-anchor="{anchor}" {_FONT}>{_t(x_label)}</text>')
    return out


def _y_axis(out: list[str], y0: float, y1: float, sy: Callable[[float], float], width: int,
            fmt: str) -> None:
    for i in range(5):
        v = y0 + (y1 - y0) * i / 4
        y = sy(v)
        out.append(f'<line x1="{_M_LEFT}" x2="{width - _M_RIGHT}" y1="{_n(y)}" y2="{_n(y)}" '
                   f'stroke="#e0e0e0"/>')
        out.append(f'<text x="{_M_LEFT - 4}" y="{_n(y + 4)}" text-anchor="end" {_FONT}>'
                   f'{_t(format(v, fmt))}</text>')


def _fold(text: str, room: float) -> list[str]:
    """``text`` in lines of at most ``room`` px (estimated), broken between words."""
    lines: list[str] = []
    for word in text.split(" "):
        if lines and text_width(f"{lines[-1]} {word}") <= room:
            lines[-1] = f"{lines[-1]} {word}"
        else:
            lines.append(word)
    return lines or [""]


def _symbol(shape: str, cx: float, cy: float, color: str, hollow: bool) -> str:
    paint = (f'fill="#ffffff" stroke="{_t(color)}" stroke-width="1.5"' if hollow else
             f'fill="{_t(color)}"')
    if shape == "square":
        return f'<rect x="{_n(cx - 3.5)}" y="{_n(cy - 3.5)}" width="7" height="7" {paint}/>'
    if shape == "diamond":
        return (f'<path d="M{_n(cx)},{_n(cy - 4.5)} L{_n(cx + 4.5)},{_n(cy)} '
                f'L{_n(cx)},{_n(cy + 4.5)} L{_n(cx - 4.5)},{_n(cy)} Z" {paint}/>')
    return f'<circle cx="{_n(cx)}" cy="{_n(cy)}" r="{3.5 if hollow else 2.5}" {paint}/>'


def placeholder(title: str, message: str, width: int = 360, height: int = 220) -> str:
    """An empty chart that says why it is empty."""
    out = _frame(width, height, title, "", "")
    lines = _fold(message, width - 16)  # folded between words, so that it stays inside
    y0 = height / 2 - 13 * (len(lines) - 1) / 2
    out += [f'<text x="{width / 2:.1f}" y="{y0 + 13 * i:.1f}" text-anchor="middle" '
            f'{_FONT} fill="#777777">{_t(line)}</text>' for i, line in enumerate(lines)]
    out.append("</svg>")
    return "".join(out)


def bar_chart(labels: Sequence[str], values: Sequence[float | None], *, title: str,
              x_label: str = "", y_label: str = "", y_max: float | None = None,
              value_fmt: str = ".2f", width: int = 360, height: int = 220,
              color: str = PALETTE[0], empty: str = "no data", y_fmt: str = ".2g",
              intervals: Sequence[tuple[float, float] | None] | None = None,
              notes: Sequence[str] | None = None, faint: Sequence[bool] | None = None,
              tips: Sequence[str] | None = None, margin_top: int = _M_TOP) -> str:
    """Vertical bars with their values written above them. Per bar, optionally: an interval
    drawn as a whisker (the value then written above the whisker), a note written under its
    label (e.g. its count), ``faint`` (drawn pale with a dashed outline: thin evidence), and
    the tooltip ``tips``."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not labels or not vals:
        return placeholder(title, empty, width, height)
    top = y_max if y_max is not None else _nice_max(max(max(vals), 0.0))
    plot_w, plot_h = width - _M_LEFT - _M_RIGHT, height - margin_top - _M_BOTTOM

    def sy(v: float) -> float:
        return margin_top + plot_h * (1 - min(max(v, 0.0), top) / top)

    out = _frame(width, height, title, y_label, x_label)
    _y_axis(out, 0.0, top, sy, width, y_fmt)
    slot = plot_w / len(labels)
    bar_w = max(1.0, slot * 0.7)
    def at(seq, i):
        return seq[i] if seq is not None and i < len(seq) else None

    for i, (lab, v) in enumerate(zip(labels, values)):
        cx = _M_LEFT + slot * (i + 0.5)
        if v is not None and math.isfinite(v):
            y = sy(v)
            pale = bool(at(faint, i))
            paint = (f'fill="{_t(color)}" fill-opacity="0.3" stroke="{_t(color)}" '
                     f'stroke-dasharray="3 2"' if pale else f'fill="{_t(color)}"')
            tip = at(tips, i) or f"{lab}: {format(v, value_fmt)}"
            out.append(f'<rect x="{_n(cx - bar_w / 2)}" y="{_n(y)}" width="{_n(bar_w)}" '
                       f'height="{_n(margin_top + plot_h - y)}" {paint}>'
                       f'<title>{_t(tip)}</title></rect>')
            label_y = y
            iv = at(intervals, i)
            if iv is not None:
                y_lo, y_hi = sy(iv[0]), sy(iv[1])
                w = min(8.0, bar_w / 2)
                out.append(f'<path d="M{_n(cx)},{_n(y_lo)} V{_n(y_hi)} M{_n(cx - w / 2)},'
                           f'{_n(y_lo)} H{_n(cx + w / 2)} M{_n(cx - w / 2)},{_n(y_hi)} '
                           f'H{_n(cx + w / 2)}" stroke="#222222" stroke-width="1.2" '
                           f'fill="none"><title>{_t(tip)}</title></path>')
                label_y = min(y, y_hi)
            if slot >= 22:
                out.append(f'<text x="{_n(cx)}" y="{_n(label_y - 3)}" text-anchor="middle" '
                           f'{_FONT}>{_t(format(v, value_fmt))}</text>')
        out.append(f'<text x="{_n(cx)}" y="{_n(margin_top + plot_h + 13)}" text-anchor="middle" '
                   f'{_FONT}>{_t(lab)}</text>')
        note = at(notes, i)
        if note and slot >= text_width(note, 10) + 2:
            out.append(f'<text x="{_n(cx)}" y="{_n(margin_top + plot_h + 25)}" '
                       f'text-anchor="middle" font-family="sans-serif" font-size="10" '
                       f'fill="#555555">{_t(note)}</text>')
    out.append(f'<line x1="{_M_LEFT}" x2="{width - _M_RIGHT}" y1="{_n(margin_top + plot_h)}" '
               f'y2="{_n(margin_top + plot_h)}" stroke="#333333"/></svg>')
    return "".join(out)


def line_chart(series: Sequence[Series], *, title: str, x_label: str = "", y_label: str = "",
               markers: Sequence[Marker] = (), hlines: Sequence[tuple[float, str]] = (),
               x_ticks: Sequence[tuple[float, str]] | None = None, y_min: float | None = 0.0,
               y_max: float | None = None, y_fmt: str = ".2g", width: int = 360,
               height: int = 220, empty: str = "no data",
               vlines: Sequence[tuple[float, str]] = (), legend_width: int = 0,
               x_pad: float = 0.0, x_range: tuple[float, float] | None = None) -> str:
    """Lines (with dots) over a shared x axis, optional labelled markers and horizontal
    and vertical reference lines. ``x_ticks``: (x, label) pairs; default: the series'
    distinct x. ``legend_width`` > 0: the series' names go in a column of that width right
    of the plot instead of over its top-left corner. ``x_pad``: room (in x units) left and
    right of the data, so that points and their labels stay clear of the axis. ``x_range``:
    the x axis' ends (default: the data's), e.g. a time range the data fills only part of."""
    pts = [(x, y) for s in series for x, y in s.points if y is not None and math.isfinite(y)]
    pts += [(m.x, m.y) for m in markers if math.isfinite(m.y)]
    if not pts:
        return placeholder(title, empty, width, height)
    xs = [x for x, _ in pts] + [x for x, _ in vlines] + list(x_range or ())
    ys = [y for _, y in pts] + [y for y, _ in hlines]
    x0, x1 = min(xs), max(xs)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    x0, x1 = x0 - x_pad, x1 + x_pad
    lo = min(ys) if y_min is None else min(y_min, min(ys))
    hi = _nice_max(max(ys)) if y_max is None else y_max
    if hi <= lo:
        hi = lo + 1.0
    right = width - _M_RIGHT - legend_width  # the plot's right edge
    plot_w, plot_h = right - _M_LEFT, height - _M_TOP - _M_BOTTOM

    def sx(x: float) -> float:
        return _M_LEFT + plot_w * (x - x0) / (x1 - x0)

    def sy(y: float) -> float:
        return _M_TOP + plot_h * (1 - (min(max(y, lo), hi) - lo) / (hi - lo))

    out = _frame(width, height, title, y_label, x_label)
    _y_axis(out, lo, hi, sy, right + _M_RIGHT, y_fmt)
    ticks = x_ticks if x_ticks is not None else [
        (x, format(x, "g")) for x in sorted({x for s in series for x, _ in s.points})]
    for x, lab in ticks:  # inside the picture: the end ones anchored at its edges
        tx, anchor = _anchored(sx(x), str(lab), 2, width - 2)
        out.append(f'<text x="{_n(tx)}" y="{_n(_M_TOP + plot_h + 13)}" '
                   f'text-anchor="{anchor}" {_FONT}>{_t(lab)}</text>')
    for y, lab in hlines:
        out.append(f'<line x1="{_M_LEFT}" x2="{right}" y1="{_n(sy(y))}" '
                   f'y2="{_n(sy(y))}" stroke="#888888" stroke-dasharray="2 3"/>')
        if lab:
            out.append(f'<text x="{right - 2}" y="{_n(sy(y) - 3)}" '
                       f'text-anchor="end" {_FONT} fill="#666666">{_t(lab)}</text>')
    for i, (x, lab) in enumerate(vlines):  # labels one line apart, so that they never meet
        out.append(f'<line x1="{_n(sx(x))}" x2="{_n(sx(x))}" y1="{_M_TOP}" '
                   f'y2="{_n(_M_TOP + plot_h)}" stroke="#555555" stroke-dasharray="4 3"/>')
        if lab:
            fits = sx(x) + 4 + 6.2 * len(lab) <= right  # ~6.2 px a character at 11 px
            anchor, dx = ("start", 4) if fits else ("end", -4)
            out.append(f'<text x="{_n(sx(x) + dx)}" y="{_M_TOP + 10 + 13 * i}" '
                       f'text-anchor="{anchor}" {_FONT} fill="#333333">{_t(lab)}</text>')
    legend_x = _M_LEFT + 6 if legend_width <= 0 else right + 10
    legend_y = _M_TOP + 10
    for s in series:
        runs: list[list[tuple[float, float]]] = [[]]
        for x, y in s.points:
            if y is None or not math.isfinite(y):
                runs.append([])
            else:
                runs[-1].append((sx(x), sy(y)))
        dash = ' stroke-dasharray="5 3"' if s.dashed else ""
        for run in runs:
            if len(run) > 1 and s.line:
                path = " ".join(f"{_n(a)},{_n(b)}" for a, b in run)
                out.append(f'<polyline points="{path}" fill="none" stroke="{_t(s.color)}" '
                           f'stroke-width="{s.stroke:g}"{dash}/>')
        for i, (x, y) in enumerate(s.points):
            iv = s.intervals[i] if s.intervals is not None and i < len(s.intervals) else None
            if iv is None or y is None or not all(map(math.isfinite, iv)):
                continue
            cx, y_lo, y_hi = sx(x), sy(iv[0]), sy(iv[1])
            out.append(f'<path d="M{_n(cx)},{_n(y_lo)} V{_n(y_hi)} M{_n(cx - 4)},{_n(y_lo)} '
                       f'H{_n(cx + 4)} M{_n(cx - 4)},{_n(y_hi)} H{_n(cx + 4)}" '
                       f'stroke="{_t(s.color)}" stroke-width="1" fill="none"/>')
        if s.dots or any(len(run) == 1 for run in runs) or not s.line:
            for i, (x, y) in enumerate(s.points):
                if y is None or not math.isfinite(y):
                    continue
                hollow = s.hollow is not None and i < len(s.hollow) and s.hollow[i]
                out.append(_symbol(s.marker, sx(x), sy(y), s.color, hollow))
        if s.labels is not None:
            placed: list[tuple[float, float, float]] = []  # (left, right, baseline) drawn
            for i, ((x, y), lab) in enumerate(zip(s.points, s.labels)):
                if lab and y is not None and math.isfinite(y):
                    iv = (s.intervals[i] if s.intervals is not None and i < len(s.intervals)
                          else None)
                    ly = (min(sy(y), sy(iv[1])) if iv is not None else sy(y)) - 6
                    half = text_width(lab) / 2
                    while any(a < sx(x) + half and sx(x) - half < b and abs(ly - base) < 12
                              for a, b, base in placed):  # clear of the labels drawn
                        ly -= 12
                    placed.append((sx(x) - half, sx(x) + half, ly))
                    out.append(f'<text x="{_n(sx(x))}" y="{_n(ly)}" '
                               f'text-anchor="middle" {_FONT} fill="{_t(s.color)}">'
                               f'{_t(lab)}</text>')
        if s.name:
            shift = 0
            if legend_width > 0:
                out.append(f'<line x1="{legend_x}" x2="{legend_x + 14}" y1="{legend_y - 4}" '
                           f'y2="{legend_y - 4}" stroke="{_t(s.color)}" '
                           f'stroke-width="{s.stroke:g}"{dash}/>')
                shift = 18
            elif s.marker != "circle" or not s.line:  # the shape says which series a point is
                out.append(_symbol(s.marker, legend_x + 4, legend_y - 4, s.color, False))
                shift = 12
            for line in _fold(s.name, width - 2 - legend_x - shift):
                out.append(f'<text x="{legend_x + shift}" '
                           f'y="{legend_y}" {_FONT} fill="{_t(s.color)}">{_t(line)}</text>')
                legend_y += 13
    for m in markers:  # a diamond at the point, its label in the legend (labels beside
        cx, cy = sx(m.x), sy(m.y)  # the points ran into each other and into the curve)
        out.append(f'<path d="M{_n(cx)},{_n(cy - 6)} L{_n(cx + 6)},{_n(cy)} '
                   f'L{_n(cx)},{_n(cy + 6)} L{_n(cx - 6)},{_n(cy)} Z" fill="{_t(m.color)}">'
                   f'<title>{_t(m.label)}</title></path>')
        out.append(_symbol("diamond", legend_x + 4, legend_y - 4, m.color, False))
        for line in _fold(m.label, width - 2 - legend_x - 12):
            out.append(f'<text x="{legend_x + 12}" y="{legend_y}" {_FONT} '
                       f'fill="{_t(m.color)}">{_t(line)}</text>')
            legend_y += 13
    out.append(f'<line x1="{_M_LEFT}" x2="{right}" y1="{_n(_M_TOP + plot_h)}" '
               f'y2="{_n(_M_TOP + plot_h)}" stroke="#333333"/></svg>')
    return "".join(out)
