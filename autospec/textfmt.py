"""Plain-text tables and numbers for people reading a terminal (the CLI's output only)."""

from __future__ import annotations

import re

__all__ = ["table", "fmt", "human_bytes", "visible", "VisibleStream", "clip", "named"]

# shown by name; every other control character as \xNN / \uNNNN
_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}
# C0 controls and DEL, C1 controls, the bidi embeddings/overrides/isolates and marks, and the
# line/paragraph separators: what a terminal acts on (or reorders text by) instead of showing
_INVISIBLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e"
                        "\u2066-\u2069]")
# the same without newline and tab: for a whole output rather than one name
_INVISIBLE_IN_LINES = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028"
                                 "\u2029\u202a-\u202e\u2066-\u2069]")


def _escape(m: re.Match) -> str:
    c = m.group(0)
    if c in _NAMED:
        return _NAMED[c]
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def visible(text: object, *, lines: bool = False) -> str:
    """``str(text)`` safe to write to a terminal: control characters (C0 with ``\\n`` and
    ``\\t``, DEL, C1) and bidi overrides shown as escapes (ESC as the four characters
    ``\\x1b``, U+202E as ``\\u202e``) instead of acting on the terminal. Everything else,
    backslashes included, is left as it is, so ``visible(visible(x)) == visible(x)``.
    ``lines``: keep newlines and tabs (a whole output, not one name)."""
    return (_INVISIBLE_IN_LINES if lines else _INVISIBLE).sub(_escape, str(text))


class VisibleStream:
    """A text stream that writes through ``visible(..., lines=True)``: what the command
    line prints to standard output cannot act on the terminal, whatever a stored string
    or a model's output holds."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def write(self, s: str) -> int:
        self.stream.write(visible(s, lines=True))
        return len(s)

    def __getattr__(self, name: str):  # flush, isatty, encoding, fileno, ...
        return getattr(self.stream, name)


def clip(text: object, n: int) -> str:
    """``str(text)`` in at most ``n`` characters: cut with "…" where longer."""
    text = str(text)
    return text if len(text) <= n else text[: n - 1] + "…"


def named(text: object, n: int = 60) -> str:
    """A stored or scraped name (a category, a label's value) inside a message: quoted,
    control characters escaped (``repr``), at most ``n`` characters of it."""
    return repr(clip(text, n))


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
    cells = [[visible(c) for c in row] for row in (header, *rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i < left else c.rjust(w)
                       for i, (c, w) in enumerate(zip(cell, widths, strict=True))).rstrip()
             for cell in cells]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(lines)
